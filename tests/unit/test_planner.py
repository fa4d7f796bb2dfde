import itertools
import json
import math

import numpy as np
import pytest

from cpsr_ds.planning import fault_tolerance_cost, planner, units
from cpsr_ds.cli import main
from cpsr_ds.planning.fault_tolerance_cost import PbrParams
from cpsr_ds.planning.planner import StageCosts


def params(alpha1, tau1, excess0, alpha2=1.0, xi=1e-8, N_p=3.5e8):
    """Fitted inputs whose relative excess at t = 0, exp(-alpha2) Delta F(0), is ``excess0``."""
    tau2 = math.log(2 * excess0 * math.exp(alpha2) / (xi * N_p))
    return PbrParams(alpha1=alpha1, alpha2=alpha2, tau1=tau1, tau2=tau2, xi=xi, N_p=N_p)


def closed_over_numerical(lam, T_s, p):
    """Theorem 1's cost over the numerical optimum's, and the approximations failing at either interval."""
    def cost(T_c):
        return fault_tolerance_cost.pbr_cost_rate(T_c, lam, T_s, p)

    closed, numerical = planner.theorem1_interval(lam, T_s, p), planner.minimize_interval(cost)
    ratio = float(cost(closed) / cost(numerical))
    return ratio, (planner.theorem1_violations(lam, T_s, p, closed)
                   + planner.theorem1_violations(lam, T_s, p, numerical))


# lambda per iteration (one failure in 10^6..10^4 iterations), T_s in iterations, alpha1 per iteration,
# tau1 per checkpoint, and the relative excess of a prediction at the phase start.
GRID = list(itertools.product([1e-6, 1e-5, 1e-4], [0.05, 0.5, 5.0], [3e-5, 1e-4, 1e-3, 1e-2], [0.01, 0.1, 1.0],
                              [1e-4, 1e-2, 0.3, 3.0]))


def test_theorem1_costs_within_5_percent_of_the_numerical_optimum_where_its_approximations_hold():
    inside = []
    for lam, T_s, alpha1, tau1, excess0 in GRID:
        ratio, violations = closed_over_numerical(lam, T_s, params(alpha1, tau1, excess0))
        assert ratio >= 1 - 1e-6  # the numerical optimum is the optimum
        if not violations:
            inside.append(ratio)
    assert len(inside) >= len(GRID) // 3
    assert max(inside) <= 1.05


@pytest.mark.parametrize("lam, T_s, alpha1, tau1, excess0, violated", [
    (1e-4, 0.5, 1e-4, 0.01, 1e-4, "lambda (T_c + T_s)"),  # B = 0: the optimum lies beyond 1 / lambda
    (1e-4, 5.0, 1e-3, 0.01, 1e-4, "T_s / T_c"),  # the checkpoint costs half an interval
])
def test_theorem1_misses_the_optimum_where_its_approximations_fail(lam, T_s, alpha1, tau1, excess0, violated):
    p = params(alpha1, tau1, excess0)
    ratio, violations = closed_over_numerical(lam, T_s, p)
    assert ratio > 1.1
    assert any(v.startswith(violated) for v in violations)
    plan = planner.plan_stage(lam, StageCosts(T_s), p)
    assert plan.method == "numerical" and plan.cost_rate < plan.cost_rate_theorem1 / 1.1


def test_theorem1_solves_the_papers_first_order_condition():
    lam, T_s, p = 1e-5, 0.5, params(1e-3, 0.3, 1e-3)
    T_c, A, B = planner.theorem1_interval(lam, T_s, p), planner.theorem1_A(p), planner.theorem1_B(lam, p)
    assert A == pytest.approx(p.xi * p.N_p * p.tau1 * math.exp(p.tau2 - p.alpha2) / (2 * p.alpha1))
    # Eq. 18 with 1 - exp(-lambda (T_c + T_s)) ~ lambda T_c: T_s / (lambda T_c)^2 = A / (B T_c - tau1)^2
    assert T_s / (lam * T_c) ** 2 == pytest.approx(A / (B * T_c - p.tau1) ** 2, rel=1e-9)


def test_eq13_is_the_iterations_a_deviation_delays_the_loss_curve():
    p, T_c, t = params(2e-3, 0.1, 0.05), 40.0, 300.0
    loss = lambda i: math.exp(-p.alpha1 * i + p.alpha2)  # noqa: E731
    dF = fault_tolerance_cost.prediction_deviation(t, T_c, p)
    T_p = fault_tolerance_cost.pbr_cost(t, T_c, p)
    for s in (0.0, 50.0, 500.0):  # Eq. 12: restarted from loss(t) + dF, it trails the curve by T_p
        assert (loss(t) + dF) * math.exp(-p.alpha1 * s) == pytest.approx(loss(t + s - T_p), rel=1e-12)
    assert fault_tolerance_cost.relative_excess(t, T_c, p) == pytest.approx(dF / loss(t))
    linear = fault_tolerance_cost.pbr_cost_linear(t, T_c, p)
    assert T_p < linear < T_p * (1 + fault_tolerance_cost.relative_excess(t, T_c, p))


def brute_force_expectation(T_p_at, lam, points=400_000):
    t = np.linspace(0.0, 40.0 / lam, points)
    f = T_p_at(t) * lam * np.exp(-lam * t)
    return float(np.sum(np.diff(t) * (f[1:] + f[:-1])) / 2)


@pytest.mark.parametrize("T_c, excess0", [(20.0, 1e-3), (400.0, 1e-3), (20.0, 2.0), (3000.0, 0.5)])
def test_expected_recovery_cost_matches_a_direct_integral_of_eq13(T_c, excess0):
    lam, p = 1e-4, params(1e-3, 0.5, excess0)
    k = p.alpha1 - p.tau1 / T_c
    direct = brute_force_expectation(lambda t: np.logaddexp(0.0, p.log_excess0 + k * t) / p.alpha1, lam)
    assert float(fault_tolerance_cost.expected_pbr_cost(T_c, lam, p)) == pytest.approx(direct, rel=2e-3)
    linear = float(fault_tolerance_cost.expected_pbr_cost(T_c, lam, p, exact=False))
    assert linear >= direct * (1 - 2e-3)  # ln(1 + x) <= x
    if excess0 < 0.01 and k < 0:
        assert linear == pytest.approx(direct, rel=0.01)


def test_checkpoint_term_matches_eq15_summed_period_by_period():
    lam, T_s, T_c, p = 1e-3, 2.0, 30.0, params(1e-3, 0.5, 1e-3)
    period = T_c + T_s
    direct = brute_force_expectation(lambda t: np.floor(t / period) * T_s, lam, points=2_000_000)
    recovery = float(fault_tolerance_cost.expected_pbr_cost(T_c, lam, p))
    assert float(fault_tolerance_cost.pbr_cost_rate(T_c, lam, T_s, p)) == pytest.approx(lam * (direct + recovery),
                                                                                       rel=1e-3)


def test_the_storage_wait_is_charged_and_the_plan_stays_above_the_persist_floor():
    lam, T_s, p = 1e-5, 0.5, params(1e-3, 0.3, 1e-3)
    free = planner.plan_stage(lam, StageCosts(T_s), p)
    persist = 3 * free.T_c
    assert float(fault_tolerance_cost.checkpoint_wait(free.T_c, persist)) == pytest.approx(2 * free.T_c)
    # a snapshot waiting W costs as much as a checkpoint costing T_s + W
    slow = fault_tolerance_cost.pbr_cost_rate(free.T_c, lam, T_s, p, persist=persist)
    assert slow == pytest.approx(fault_tolerance_cost.pbr_cost_rate(free.T_c, lam, T_s + 2 * free.T_c, p))
    assert slow > free.cost_rate * 2
    bound = planner.plan_stage(lam, StageCosts(T_s, persist), p)
    assert bound.T_c >= persist and bound.cost_rate < slow
    shared = planner.plan_stage(lam, StageCosts(T_s, persist, in_flight=3), p)
    assert persist / 3 <= shared.T_c < bound.T_c


def test_young_and_daly_approximate_the_recompute_optimum_daly_better_when_checkpoints_are_costly():
    def excess_cost(rule, lam, T_s):
        def cost(T_c):
            return fault_tolerance_cost.recompute_cost_rate(T_c, lam, T_s)
        return float(cost(rule(lam, T_s)) / cost(planner.minimize_interval(cost)))

    assert excess_cost(planner.young_interval, 1e-5, 1.0) < 1.001
    assert excess_cost(planner.daly_interval, 1e-5, 1.0) < 1.0001
    costly = (1e-3, 100.0)  # the checkpoint takes a tenth of the time between failures
    assert excess_cost(planner.daly_interval, *costly) < 1.001 < excess_cost(planner.young_interval, *costly)
    assert planner.daly_interval(1e-3, 5000.0) == pytest.approx(1000.0)  # T_s >= 2 / lambda: one MTBF


def test_checkfreq_and_pccheck_keep_the_stall_within_budget_and_the_persists_flowing():
    iteration_s, stall_s, budget = 0.4, 0.9, 0.02
    cf = planner.checkfreq_interval(iteration_s, stall_s, persist_s=1.0, budget=budget)
    assert stall_s / (cf * iteration_s) <= budget < stall_s / ((cf - 1) * iteration_s)
    persist_s = 60.0  # slow storage: the persist time, not the budget, sets the interval
    cf = planner.checkfreq_interval(iteration_s, stall_s, persist_s, budget)
    pc = planner.pccheck_interval(iteration_s, stall_s, persist_s, in_flight=4, budget=budget)
    assert cf * iteration_s >= persist_s > (cf - 1) * iteration_s
    assert pc * iteration_s >= persist_s / 4 and pc < cf


def test_job_interval_minimises_the_summed_cost_of_its_stages():
    lam = 1e-5
    small = (StageCosts(0.2), params(1e-3, 0.3, 1e-4, N_p=1e8))
    large = (StageCosts(0.8, persist=50.0), params(1e-3, 0.3, 1e-2, N_p=1e9))
    job = planner.plan_job(lam, [small, large])
    own = [s.T_c for s in job.stages]
    assert own[1] < own[0]  # more parameters to predict: a larger deviation, shorter intervals
    assert own[1] < job.T_c < own[0]

    def total(T_c):
        return sum(float(fault_tolerance_cost.pbr_cost_rate(T_c, lam, c.T_s, p, c.persist)) for c, p in (small, large))

    assert job.cost_rate == pytest.approx(total(job.T_c))
    assert all(total(job.T_c) <= total(T_c) for T_c in own + [job.T_c - 1, job.T_c + 1])


def test_minimize_interval_finds_the_minimum_of_a_dense_grid():
    lam, T_s, p = 1e-5, 0.5, params(1e-4, 0.05, 0.3)

    def cost(T_c):
        return fault_tolerance_cost.pbr_cost_rate(T_c, lam, T_s, p)

    calls = []

    def counted(T_c):
        calls.append(len(T_c))
        return cost(T_c)

    dense = np.geomspace(1.0, planner.MAX_INTERVAL, 5000)
    best = planner.minimize_interval(counted)
    assert float(cost(best)) <= float(np.min(cost(dense))) * (1 + 1e-9)
    # A plan runs inside a checkpoint's cost: few calls, each of many intervals (one at a time took 30 calls).
    assert len(calls) <= 8 and min(calls) > 1
    assert planner.minimize_interval(lambda T_c: np.full_like(T_c, np.inf)) == 1.0


def interval_functions(lam, T_s, p, persist):
    return [planner.theorem1_interval(lam, T_s, p), planner.young_interval(lam, T_s),
            planner.daly_interval(lam, T_s), planner.checkfreq_interval(1.0, T_s, persist),
            planner.pccheck_interval(1.0, T_s, persist, 2), planner.plan_stage(lam, StageCosts(T_s, persist), p).T_c]


def test_every_interval_is_finite_and_within_bounds_for_any_positive_inputs():
    rng = np.random.default_rng(7)
    for _ in range(40):
        lam, T_s, alpha1, tau1, xi, N_p, persist = 10.0 ** rng.uniform(-12, 6, size=7)
        alpha2, tau2 = rng.uniform(-50, 50, size=2)
        p = PbrParams(alpha1, alpha2, tau1, tau2, xi, N_p)
        for T_c in interval_functions(lam, T_s, p, persist):
            assert math.isfinite(T_c) and 1 <= T_c <= planner.MAX_INTERVAL, (lam, T_s, p, persist)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_bad_inputs_raise_naming_them(bad):
    p = params(1e-3, 0.3, 1e-3)
    with pytest.raises(ValueError, match="lambda"):
        planner.theorem1_interval(bad, 0.5, p)
    with pytest.raises(ValueError, match="T_s"):
        planner.young_interval(1e-5, bad)
    with pytest.raises(ValueError, match="T_c"):
        fault_tolerance_cost.pbr_cost_rate(np.array([10.0, bad]), 1e-5, 0.5, p)
    for name in ("alpha1", "tau1", "xi", "N_p"):
        with pytest.raises(ValueError, match=name):
            PbrParams(**{**p.__dict__, name: bad})
    with pytest.raises(ValueError, match="iteration_time_s"):
        planner.checkfreq_interval(bad, 0.1, 1.0)
    with pytest.raises(ValueError, match="in_flight"):
        StageCosts(0.5, 10.0, in_flight=1.5)


def test_converters_between_seconds_hours_and_iterations():
    assert units.failure_rate_per_iteration(0.08, 1.8) == pytest.approx(0.08 / 2000)
    assert units.iterations(units.seconds(37.0, 0.25), 0.25) == pytest.approx(37.0)
    assert units.iterations(3.0, 0.5) == pytest.approx(6.0)


def test_plan_command_prints_the_what_if_plan_as_json(capsys):
    argv = ["plan", "--lambda", "2e-5", "--ts", "0.5", "--alpha1", "1e-3", "--alpha2", "1.0", "--tau1", "0.3",
            "--tau2", "-12", "--xi", "1e-8", "--np", "3.5e8", "--t", "500", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    p = PbrParams(1e-3, 1.0, 0.3, -12.0, 1e-8, 3.5e8)
    assert report["T_c"] == planner.plan_stage(2e-5, StageCosts(0.5), p).T_c
    assert report["baselines"]["young"] == pytest.approx(planner.young_interval(2e-5, 0.5))
    assert report["at_t"]["T_p_eq13"] == pytest.approx(fault_tolerance_cost.pbr_cost(500.0, report["T_c"], p))
    with pytest.raises(SystemExit):
        main(argv[:2] + ["0"] + argv[3:])
    assert "lambda must be positive" in capsys.readouterr().err
