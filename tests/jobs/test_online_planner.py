"""Online planning: the pure functions of cpsr_ds.planning.online_planner and the planner's empirical cost rate."""

import math
from collections import Counter

import numpy as np
import pytest

from cpsr_ds.planning import online_planner as op
from cpsr_ds.planning import checkpoint_cost, failure_rate, fault_tolerance_cost, planner, units
from cpsr_ds.planning.calibration import END_OF_TRAINING_COS_MIN_RATIO, MEASURED_REDUCTION, PESSIMISM
from cpsr_ds.planning.fitter import AccuracyFit, LossFit, NoFit
from cpsr_ds.planning.lr_schedule import shape, warmup_cosine
from cpsr_ds.planning.planner import StageCosts


# ---------------------------------------------------------------- lambda


MIX = {"process_crash": 0.2, "node_lost": 0.8}


def total_rate(by_class, hours, prior=0.08):
    return sum(failure_rate.class_rates_per_hour(prior, MIX, Counter(by_class), hours).values())


def test_failure_rate_starts_at_the_prior_and_learns_from_the_jobs_failures():
    assert total_rate({}, 0.0) == pytest.approx(0.08)
    # No failure in 12.5 h of running halves the rate; 9 in 87.5 h gives 10 / 100 h.
    assert total_rate({}, 12.5) == pytest.approx(0.04)
    assert total_rate({None: 9}, 87.5) == pytest.approx(0.1)
    # Many hours: the job's own rate, n / H.
    assert total_rate({None: 300}, 1000.0) == pytest.approx(0.3, rel=0.01)
    for bad in (math.nan, -1.0, math.inf):
        assert total_rate({None: 2}, bad) == pytest.approx(0.24)


def test_each_class_learns_from_its_own_failures_and_unobserved_ones_split_by_the_mix():
    rates = failure_rate.class_rates_per_hour(0.08, MIX, Counter({"process_crash": 9}), 87.5)
    # The prior's one failure split 0.2 / 0.8, then 9 crashes observed: 9.2 and 0.8 failures over 100 h.
    assert rates == pytest.approx({"process_crash": 0.092, "node_lost": 0.008})
    rates = failure_rate.class_rates_per_hour(0.08, MIX, Counter({None: 4, "node_lost": 5}), 87.5)
    assert rates == pytest.approx({"process_crash": 0.2 * 5 / 100, "node_lost": (0.8 * 5 + 5) / 100})
    # Without a usable prior, the configured split of it.
    assert failure_rate.class_rates_per_hour(0.0, MIX, Counter({"node_lost": 3}), 1.0) == {"process_crash": 0.0,
                                                                                          "node_lost": 0.0}
    with pytest.raises(ValueError, match="sum to 1"):
        failure_rate.class_rates_per_hour(0.08, {"process_crash": 0.5, "node_lost": 0.8}, Counter(), 1.0)


def test_failures_are_the_starts_after_progress_by_the_class_each_restart_observed():
    counted = failure_rate.failures([(None, None), (120, "node_lost"), (None, None), (300, None), (340, "node_lost")])
    assert counted == Counter({"node_lost": 2, None: 1})


def test_a_start_after_a_clean_end_is_not_a_failure_but_a_second_one_there_is():
    # Finished at 120, restarted there (a supervisor's restart, or a longer run): not a failure; that attempt
    # failed before its first iteration, and the start after it resumed at 120 again.
    starts = [(None, None), (120, "process_crash"), (120, "process_crash"), (300, None)]
    assert sum(failure_rate.failures(starts, finished=[120]).values()) == 2
    assert sum(failure_rate.failures([(None, None), (120, None)], finished=[120, 300]).values()) == 0


def test_running_hours_leave_restart_downtime_out():
    first = [(i, 10.0 * i) for i in range(1, 101)]  # 990 s of running
    # A restart resumed at 81 (recompute) after 5 min, and one predicted on at 141 after 10 min.
    second = [(81 + i, first[-1][1] + 300 + 10.0 * i) for i in range(60)]
    third = [(141 + i, second[-1][1] + 600 + 10.0 * i) for i in range(10)]
    assert failure_rate.running_hours(first + second + third) == pytest.approx((990 + 590 + 90) / 3600)
    assert failure_rate.running_hours([]) == 0.0 and failure_rate.running_hours([(5, 1.0)]) == 0.0


# ---------------------------------------------------------------- measuring


def test_slowdown_is_the_checkpoints_time_plus_the_excess_of_the_iterations_it_slowed():
    assert checkpoint_cost.slowdown(0.2, [1.5, 1.1, 1.0], 1.0) == pytest.approx(0.8)
    # Noise below the stall, even below 0, stays: a clamp would bias a run's sum upward.
    assert checkpoint_cost.slowdown(0.0, [0.9, 0.95], 1.0) == pytest.approx(-0.15)


def test_the_meter_measures_against_the_iterations_without_a_checkpoint_just_before_and_after_it():
    meter = checkpoint_cost.CostMeter()
    for t in [1.0, 1.1, 0.9, 1.0, 5.0]:
        meter.iteration(t)
    assert meter.baseline() == pytest.approx(1.0)
    meter.start(10, "global_step10", block_s=0.3)
    for t in [1.6, 1.2]:
        meter.iteration(t)
    meter.stalled(0.5)
    assert meter.baseline() == pytest.approx(1.0)  # iterations in flight are not the baseline
    meter.settle("global_step10", None)  # still persisting
    meter.iteration(1.3)
    meter.settle("global_step10", (4096, 1.7))
    assert meter.finished() == []  # persisted: its baseline waits for the iterations after it
    for t in [1.0] * (checkpoint_cost.BRACKET - 1):
        meter.iteration(t)
    assert meter.finished() == []
    meter.iteration(1.0)
    # Before it: 1.0, 1.1, 0.9, 1.0, 5.0; after it: eight of 1.0. Its window: 1.6, 1.2, 1.3.
    assert meter.finished() == [checkpoint_cost.Cost(10, 1.0, 0.5, pytest.approx(0.3 + 0.6 + 0.2 + 0.3), 1.7, 4096)]
    assert meter.finished() == [] and not meter.pending
    meter.start(20, "global_step20", 0.1)
    meter.settle("global_step20", False)
    assert not meter.pending  # given up: no cost
    meter.start(30, "global_step30", 0.1)
    meter.settle("global_step30", (0, None))
    assert not meter.pending  # wrote nothing: no cost
    meter.iteration(1.0)
    assert meter.finished() == []


def test_a_drifting_host_is_measured_against_the_iterations_next_to_the_checkpoint():
    # The host was fast long ago, slow now: the checkpoint added nothing to the slow iterations around it.
    meter = checkpoint_cost.CostMeter()
    for t in [0.5] * checkpoint_cost.BASELINE_WINDOW:
        meter.iteration(t)
    meter.start(1, "a", 0.0)
    meter.settle("a", (1, 1.0))
    for t in [1.0] * checkpoint_cost.BASELINE_WINDOW:  # clean, and past the last one's bracket
        meter.iteration(t)
    meter.finished()
    meter.start(2, "b", 0.1)
    for t in [1.0, 1.0]:
        meter.iteration(t)
    meter.settle("b", (1, 1.0))
    for t in [1.0] * checkpoint_cost.BRACKET:
        meter.iteration(t)
    (cost,) = meter.finished()
    assert cost.iteration_time_s == 1.0 and cost.slowdown_s == pytest.approx(0.1)


def test_checkpoints_whose_persists_overlap_wait_for_the_clean_iterations_after_the_stretch():
    # The host was slow, then persists overlapped for a stretch while it sped up, then one more was clean.
    meter = checkpoint_cost.CostMeter()
    for t in [2.0] * 3:
        meter.iteration(t)
    meter.start(1, "a", 0.0)
    for t in [1.5] * (checkpoint_cost.BASELINE_WINDOW + 1):
        meter.iteration(t)
    meter.settle("a", (1, 9.0))
    meter.start(2, "b", 0.0)  # a's bracket closes: the clean iterations before it are fresh
    (a,) = meter.finished()
    assert a.iteration_time_s == 2.0 and a.slowdown_s == pytest.approx(-0.5 * (checkpoint_cost.BASELINE_WINDOW + 1))
    for t in [1.1, 1.1]:
        meter.iteration(t)
    meter.settle("b", (1, 9.0))
    meter.start(3, "c", 0.0)
    assert meter.finished() == []  # b's clean iterations before it are stale: it waits for those after
    meter.iteration(1.1)
    meter.settle("c", (1, 9.0))
    for t in [1.0] * checkpoint_cost.BRACKET:
        meter.iteration(t)
    b, c = meter.finished()
    # b's baseline: three iterations of 2.0 long before it, eight of 1.0 after the stretch.
    assert b.iteration == 2 and b.iteration_time_s == 1.0 and b.slowdown_s == pytest.approx(0.2)
    assert c.iteration == 3 and c.iteration_time_s == 1.0 and c.slowdown_s == pytest.approx(0.1)


def test_a_checkpoint_waits_for_clean_iterations_at_most_the_horizon():
    meter = checkpoint_cost.CostMeter()
    meter.iteration(1.0)
    meter.start(1, "a", 0.0)
    for t in [2.0] * (checkpoint_cost.BASELINE_WINDOW + 1):
        meter.iteration(t)
    meter.settle("a", (1, 9.0))
    for i in range(checkpoint_cost.HORIZON + 1):  # checkpoints always in flight: no clean iteration
        meter.start(2 + i, f"s{i}", 0.0)
        meter.iteration(2.0)
        meter.settle(f"s{i}", (1, 9.0))
    assert [c.iteration for c in meter.finished()] == [1]  # a, at s0's start: its clean iteration was fresh
    meter.start(3 + checkpoint_cost.HORIZON, "last", 0.0)
    (s0,) = meter.finished()  # past the horizon, on its stale baseline
    assert (s0.iteration, s0.iteration_time_s, s0.slowdown_s) == (2, 1.0, 1.0)


def test_costs_are_smoothed_over_the_newest_nine_checkpoints_and_one_outlier_sets_nothing():
    def cost(slowdown_s):
        return checkpoint_cost.Cost(0, 0.03, 0.001, slowdown_s, 0.6, 4096)

    ordinary, outlier = 0.06, 0.93  # the first plan's one-off import of scipy landed in a checkpoint's window
    assert checkpoint_cost.smoothed_costs([]) == {} and checkpoint_cost.smoothed_costs([cost(ordinary), cost(outlier)]) == {}
    smoothed = checkpoint_cost.smoothed_costs([cost(ordinary), cost(outlier), cost(ordinary)])
    assert smoothed == {"iteration_time_s": 0.03, "slowdown_s": ordinary, "persist_s": 0.6}
    assert checkpoint_cost.smoothed_costs([cost(outlier)] + [cost(0.05)] * 3)["slowdown_s"] == 0.05
    # Nine: four outliers among them leave the median, and older costs are forgotten.
    noisy = [cost(outlier)] * 4 + [cost(0.05)] * 5
    assert checkpoint_cost.smoothed_costs(noisy)["slowdown_s"] == 0.05
    assert checkpoint_cost.smoothed_costs([cost(0.05)] * 5 + [cost(outlier)] * 9)["slowdown_s"] == outlier


def test_a_window_closes_when_the_next_checkpoint_begins():
    meter = checkpoint_cost.CostMeter()
    meter.iteration(1.0)
    meter.start(1, "a", 0.0)
    meter.iteration(2.0)
    meter.start(2, "b", 0.0)
    meter.iteration(3.0)
    meter.settle("a", (1, 9.0))
    assert meter.finished() == []
    meter.start(3, "c", 0.0)
    assert [c.slowdown_s for c in meter.finished()] == [pytest.approx(1.0)]


# ---------------------------------------------------------------- inputs


def test_drift_names_the_inputs_that_moved_beyond_the_threshold():
    before = {"lambda_per_hour": 0.08, "iteration_time_s": 1.0, "slowdown_s/stage0": 2.0}
    assert op.drift(before, {"lambda_per_hour": 0.09, "iteration_time_s": 1.1, "slowdown_s/stage0": 2.2}, 0.2) == []
    moved = op.drift(before, {"lambda_per_hour": 0.08, "iteration_time_s": 1.3, "slowdown_s/stage0": 1.5}, 0.2)
    assert moved == ["iteration_time_s 1 -> 1.3", "slowdown_s/stage0 2 -> 1.5"]
    assert op.drift(before, {"iteration_time_s": math.nan}, 0.2) == []


COSINE = warmup_cosine(2000, END_OF_TRAINING_COS_MIN_RATIO)


def cosine_at(iteration: int):
    """The shape at ``iteration`` of a 2000-iteration cosine decay to 10 % (the end-of-training profile's own)."""
    return shape(COSINE[:iteration], COSINE[iteration:])


def test_in_a_run_with_a_planned_end_the_lag_per_lost_iteration_is_watched():
    def watched_at(iteration, model="empirical", predictor="trend", schedule=cosine_at):
        return op.watched(0.08, [stage()], op.place_lag(model, predictor, schedule(iteration)))

    assert watched_at(1000)["lag_per_lost_iteration"] == pytest.approx(1 - 0.615, rel=1e-3)
    # 1 - rho falls from 0.385 at 50 % of the run to 0.344 at 52.5 % (11 %) and 0.239 at 60 % (38 %).
    assert op.drift(watched_at(1000), watched_at(1050), 0.2) == []
    assert [m.split()[0] for m in op.drift(watched_at(1000), watched_at(1200), 0.2)] == ["lag_per_lost_iteration"]
    for kw in ({"model": "paper"}, {"predictor": "linear"}, {"schedule": lambda i: None},
               {"schedule": lambda i: shape([1.0] * i, [1.0] * 10)}):
        assert "lag_per_lost_iteration" not in watched_at(1000, **kw), kw


def test_a_run_with_a_planned_end_plans_for_recomputing_early_and_for_predicting_later():
    recompute = op.plan(job(mode="recompute"), [stage()])
    early = op.plan(job(iteration=500, schedule=cosine_at(500)), [stage()])
    assert early.recovery == "recompute" and early.T_c == recompute.T_c
    assert "(rho -0.34 at 25% of the planned run, 57% of its learning-rate area ahead)" in early.fallback
    assert early.inputs["schedule"] == "decay" and early.inputs["schedule_remaining"] == pytest.approx(0.566, abs=1e-3)
    middle, late = (op.plan(job(iteration=i, schedule=cosine_at(i)), [stage()]) for i in (1000, 1500))
    assert middle.recovery == late.recovery == "predict"
    assert middle.inputs["rho"] == [pytest.approx(0.615, abs=1e-3)] and late.inputs["rho"] == [0.906]
    assert recompute.T_c < middle.T_c < late.T_c


def test_a_schedule_of_unknown_shape_plans_for_recomputing_and_says_why():
    unknown = op.plan(job(schedule=shape([1.0] * 10, [1.0, 2.0])), [stage()])
    assert unknown.recovery == "recompute" and "no end-of-training estimate: the rate rises" in unknown.fallback


def test_replan_reasons():
    assert op.replan_reason(None, 0, 0, False, [], False) is None  # nothing measured
    assert op.replan_reason(None, 0, 0, True, [], False) == "first"
    assert op.replan_reason(None, 0, 0, True, [], True) == "restart"
    assert op.replan_reason({}, 2, 1, True, [], False) == "phase"
    assert op.replan_reason({}, 1, 1, True, ["T_s"], False) == "drift"
    assert op.replan_reason({}, 1, 1, True, [], False) is None


# ---------------------------------------------------------------- the plan


def test_empirical_cost_rate_at_rho_0_is_the_recompute_rate_with_its_minimum_at_youngs_interval():
    lam, T_s = 1e-5, 0.5
    T_c = np.geomspace(1, 1e5, 50)
    assert np.allclose(fault_tolerance_cost.empirical_cost_rate(T_c, lam, T_s, 0.0),
                       fault_tolerance_cost.recompute_cost_rate(T_c, lam, T_s))
    best = planner.minimize_interval(lambda x: fault_tolerance_cost.empirical_cost_rate(x, lam, T_s, 0.0))
    assert best == pytest.approx(planner.young_interval(lam, T_s), rel=0.02)
    # A prediction that saves rho of the lost work lengthens it as Young's at lambda (1 - rho).
    rho = 0.69
    plan = planner.plan_stage_empirical(lam, StageCosts(T_s), rho)
    assert plan.T_c == pytest.approx(plan.T_c_young, rel=0.02) and plan.T_c > best * 1.5


def job(**kw):
    base = dict(iteration=1000, lambda_per_hour=36.0, loss=LossFit(1e-4, 1.5, 0.01, 500, 1000, 500),
                model="empirical", predictor="trend", mode="auto", max_relative_error=1.5, max_loss_excess=0.005,
                max_interval=10_000, current=50)
    return op.JobInputs(**{**base, **kw})


def stage(**kw):
    base = dict(stage=0, iteration_time_s=1.0, slowdown_s=0.5, persist_s=3.0, n_p=10_000, xi=1e-6,
                accuracy=AccuracyFit(0.3, -9.0, 50.0, 0.1, 8), relative_error=0.5)
    return op.StageInputs(**{**base, **kw})


def test_the_empirical_plan_predicts_and_checkpoints_less_often_than_recomputing():
    planned = op.plan(job(), [stage()])
    lam = units.failure_rate_per_iteration(36.0, 1.0)
    assert planned.recovery == "predict" and not planned.fallback
    rho = MEASURED_REDUCTION["trend"]
    # No loss-excess guard binds: every failure predicts, whatever its distance from the durable checkpoint.
    assert planned.inputs["d_max"] >= planned.T_c + 3
    assert planned.T_c == planner.plan_job_guarded(lam, [(StageCosts(0.5, 3.0), rho)], planned.inputs["d_max"]).T_c
    assert planned.T_c == pytest.approx(planner.plan_stage_empirical(lam, StageCosts(0.5, 3.0), rho).T_c, abs=1)
    recompute = op.plan(job(mode="recompute"), [stage()])
    assert recompute.recovery == "recompute" and recompute.fallback == "recovery.mode is recompute"
    assert recompute.T_c < planned.T_c
    for name in ("lambda_per_hour", "lambda", "iteration_time_s", "T_s", "persist", "in_flight", "alpha1", "alpha2",
                 "tau1", "tau2", "xi", "N_p"):
        assert planned.inputs[name] is not None, name
    assert planned.stages[0]["stage"] == 0 and planned.stages[0]["rho"] == rho


def test_where_recovery_would_recompute_the_phase_is_planned_for_recomputing():
    # The loss-excess guard: a lag of a few iterations leaves 1 % of loss.
    guarded = op.plan(job(), [stage()], excess_at=lambda lag: 0.01)
    assert guarded.recovery == "recompute" and "max_loss_excess" in guarded.fallback
    assert guarded.T_c == op.plan(job(mode="recompute"), [stage()]).T_c
    # A diverging predictor: recovery takes c's state at f instead (skip), which the empirical model plans with,
    # stage by stage; the paper models have no fit for skip and plan for recomputing.
    diverging = op.plan(job(), [stage(), stage(stage=1, relative_error=2.0)])
    assert diverging.recovery == "predict" and "stage 1: held-out error" in diverging.fallback, diverging
    assert [s["rho"] for s in diverging.stages] == [MEASURED_REDUCTION["trend"], MEASURED_REDUCTION["skip"]]
    assert diverging.T_c < op.plan(job(), [stage(), stage(stage=1)]).T_c
    paper = op.plan(job(model="paper"), [stage(relative_error=2.0)])
    assert paper.recovery == "recompute" and "max_relative_error" in paper.fallback, paper
    # Earlier predictions' lags leave a new one less room.
    excess = lambda lag: lag / 20_000  # noqa: E731
    assert op.plan(job(), [stage()], excess_at=excess).recovery == "predict"
    # The guard's lag is PESSIMISM * (carried + the new estimate), and excess allows at most 100.
    carrying = op.plan(job(carried_lag=97.0 / PESSIMISM), [stage()], excess_at=excess)
    assert carrying.inputs["carried_lag"] == 97.0 / PESSIMISM
    assert carrying.recovery == "predict" and carrying.T_c < op.plan(job(), [stage()], excess_at=excess).T_c
    assert op.plan(job(carried_lag=100.0 / PESSIMISM), [stage()], excess_at=excess).recovery == "recompute"
    # recovery.mode predict has no guard.
    assert op.plan(job(mode="predict"), [stage()], excess_at=lambda lag: 0.01).recovery == "predict"


def test_where_the_guard_binds_the_plan_counts_the_failures_it_would_recompute():
    lam = units.failure_rate_per_iteration(3.6, 1.0)
    costs, rho = StageCosts(0.5, 3.0), MEASURED_REDUCTION["trend"]
    recompute = op.plan(job(lambda_per_hour=3.6, mode="recompute"), [stage()])
    unguarded = op.plan(job(lambda_per_hour=3.6), [stage()])
    # The guard's excess grows with the lag: a failure predicts up to 10 iterations behind the durable checkpoint.
    bounded = op.plan(job(lambda_per_hour=3.6), [stage()], excess_at=lambda lag: lag * 1e-3)
    assert bounded.recovery == "predict" and bounded.inputs["d_max"] == 10
    assert "up to 10 iterations behind" in bounded.fallback and "max_loss_excess" in bounded.fallback
    assert bounded.T_c < unguarded.T_c
    assert bounded.T_c == planner.plan_job_guarded(lam, [(costs, rho)], 10).T_c
    assert (fault_tolerance_cost.guarded_cost_rate(bounded.T_c, lam, 0.5, rho, 10, 3.0)
            < fault_tolerance_cost.guarded_cost_rate(recompute.T_c, lam, 0.5, rho, 0, 3.0))
    # Where recovery would predict only failures closer than a persist, nothing predicts: recomputing is planned.
    tight = op.plan(job(lambda_per_hour=3.6), [stage()], excess_at=lambda lag: lag * 1e-2)
    assert tight.recovery == "recompute" and tight.T_c == recompute.T_c
    assert "costs no less than recomputing" in tight.fallback
    # Each plan says what a failure storage serves is expected to cost at its interval.
    assert bounded.stages[0]["per_failure"] == pytest.approx(
        float(fault_tolerance_cost.guarded_lost_per_failure(bounded.T_c, rho, 10, 3.0)))
    assert recompute.stages[0]["per_failure"] == pytest.approx(recompute.T_c / 2 + 3.0)


def test_a_failure_costs_its_distance_behind_the_durable_checkpoint_less_what_prediction_saves_within_the_bound():
    T_c, rho, P = 40.0, 0.75, 10.0
    # d ~ U[10, 50]: recomputing costs its mean, predicting everything (1 - rho) of it.
    assert fault_tolerance_cost.guarded_lost_per_failure(T_c, rho, 0, P) == pytest.approx(30.0)
    assert fault_tolerance_cost.guarded_lost_per_failure(T_c, rho, 1e6, P) == pytest.approx(0.25 * 30.0)
    # Predicting up to d = 30: half the failures at (1 - rho) of their mean 20, half recomputed at their mean 40.
    assert fault_tolerance_cost.guarded_lost_per_failure(T_c, rho, 30, P) == pytest.approx(0.5 * 5.0 + 0.5 * 40.0)
    with pytest.raises(ValueError, match="rho"):
        fault_tolerance_cost.guarded_lost_per_failure(T_c, 1.0, 30, P)


def test_the_guarded_cost_rate_charges_the_persist_and_the_failures_beyond_the_bound_in_full():
    lam, T_s, rho, P = 1e-3, 0.5, 0.69, 19.0
    T_c = np.array([20.0, 40.0, 60.0, 80.0])
    checkpoints = fault_tolerance_cost.guarded_cost_rate(T_c, lam, T_s, rho, 0, P) - lam * (T_c / 2 + P)
    assert np.all(checkpoints > 0)
    # Every failure predicted: (1 - rho) of the mean distance T_c / 2 + P.
    everything = fault_tolerance_cost.guarded_cost_rate(T_c, lam, T_s, rho, 1e6, P)
    assert np.allclose(everything, checkpoints + lam * (1 - rho) * (T_c / 2 + P))
    # Between: a failure at d ~ U[P, P + T_c] predicts up to d_max, recomputes beyond.
    half = fault_tolerance_cost.guarded_cost_rate(60.0, lam, T_s, rho, P + 30, P)
    lost = ((1 - rho) * ((P + 30) ** 2 - P ** 2) + (P + 60) ** 2 - (P + 30) ** 2) / (2 * 60)
    assert half == pytest.approx(float(checkpoints[2]) + lam * lost)
    bounds = [0, P, P + 10, P + 40, P + 80, 1e6]
    rates = [float(fault_tolerance_cost.guarded_cost_rate(60.0, lam, T_s, rho, b, P)) for b in bounds]
    assert rates == sorted(rates, reverse=True) and rates[0] == rates[1] > rates[2]
    # The optimum shortens as the bound tightens, since a shorter interval keeps failures within it.
    plans = [planner.plan_job_guarded(lam, [(StageCosts(T_s, P), rho)], b).T_c for b in (1e6, P + 40, P + 20)]
    assert plans[0] > plans[1] > plans[2]
    with pytest.raises(ValueError, match="d_max"):
        fault_tolerance_cost.guarded_cost_rate(60.0, lam, T_s, rho, -1, P)


def test_guard_bound_finds_the_longest_passing_interval():
    assert op.guard_bound(lambda T_c: T_c <= 37, 100) == 37
    assert op.guard_bound(lambda T_c: T_c <= 500, 100) == 100
    assert op.guard_bound(lambda T_c: False, 100) is None
    assert op.guard_bound(lambda T_c: True, 0) is None


def test_the_paper_model_plans_per_stage_and_falls_back_where_an_input_has_no_fit():
    stages = [stage(), stage(stage=1, n_p=1_000_000, slowdown_s=0.8)]
    planned = op.plan(job(model="paper"), stages)
    assert planned.recovery == "predict", planned.fallback
    assert [s["stage"] for s in planned.stages] == [0, 1] and all("T_c_theorem1" in s for s in planned.stages)
    no_fit = NoFit("flat", "losses do not fall measurably")
    fallback = op.plan(job(model="paper", loss=no_fit), stages)
    assert fallback.recovery == "recompute" and "do not fall measurably" in fallback.fallback
    assert fallback.inputs["alpha1"] is None and fallback.inputs["loss_fit"] == no_fit.reason
    no_tau = op.plan(job(model="paper-eq14"), [stage(accuracy=NoFit("too few", "2 held-out errors"))])
    assert no_tau.recovery == "recompute" and "stage 0" in no_tau.fallback and "2 held-out errors" in no_tau.fallback


@pytest.mark.parametrize("model", ["empirical", "paper"])
@pytest.mark.parametrize("inputs", [
    {"slowdown_s": 0.0}, {"slowdown_s": -0.3}, {"persist_s": 0.0}, {"slowdown_s": 1e9}, {"iteration_time_s": 1e-9},
    {"xi": 1e30, "n_p": 10**12}, {"accuracy": AccuracyFit(1e-12, 50.0, 1.0, 0.0, 3)},
    {"slowdown_s": math.nan}, {"iteration_time_s": math.inf}, {"persist_s": -1.0}, {"iteration_time_s": 0.0},
])
def test_every_plan_is_a_whole_interval_within_bounds_for_any_input(model, inputs):
    for lam_h in (36.0, 1e-9, 1e9, math.nan, 0.0):
        for loss in (job().loss, LossFit(1e-12, 80.0, 0.0, 0, 1, 2), NoFit("rising", "losses rise")):
            planned = op.plan(job(model=model, lambda_per_hour=lam_h, loss=loss, max_interval=500), [stage(**inputs)])
            assert isinstance(planned.T_c, int) and 1 <= planned.T_c <= 500, (inputs, lam_h, loss)
            bad = [k for k, v in planned.inputs.items() if isinstance(v, float) and not math.isfinite(v)]
            assert not bad


def test_a_plan_without_usable_measurements_keeps_the_current_interval_and_says_why():
    planned = op.plan(job(current=70), [stage(slowdown_s=math.nan)])
    assert planned.T_c == 70 and "T_s is nan" in planned.fallback
    assert op.plan(job(current=70, lambda_per_hour=math.inf), [stage()]).fallback.endswith("lambda is inf per hour")
