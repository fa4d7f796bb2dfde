"""The planner (Section V-C): the checkpoint interval T_c that minimises the fault-tolerance cost.

Time unit: the iteration. T_c, T_s, the persist time and t are counted in iterations,
lambda is failures per iteration, alpha1 is per iteration (Eq. 11) and tau1 per
checkpoint (Eq. 8: t / T_c counts checkpoints). ``iterations``, ``seconds`` and
``failure_rate_per_iteration`` convert measured seconds and failures per hour. t
counts iterations from the origin of the fits (the start of the phase), as in Eq. 15,
whose failure time runs from 0.

A cost rate is the expected fault-tolerance cost per unit of training time
(iterations of cost per iteration, 0.02 = 2 %): lambda * T_l, T_l being Eq. 15's
expected cost of the checkpoints taken before a failure plus that failure's recovery,
and 1 / lambda the expected time between failures.

Storage is a constraint: with ``in_flight`` checkpoints persisting at once, a snapshot
may start only every ``persist / in_flight`` iterations; at a shorter T_c it waits the
difference, and the wait is charged as checkpoint cost.

Every interval returned lies in [1, max_interval] iterations (MAX_INTERVAL unless
given): an optimum beyond max_interval, or none at all (the cost keeps falling as
T_c grows), gives max_interval, and one below 1 gives 1. Inputs that are not finite,
or not positive where the paper needs them positive, raise ValueError naming them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import partial
from typing import Callable, Optional, Sequence

import numpy as np

from cpsr_ds.checkpoint.engines.checkfreq import profiled_interval

MAX_INTERVAL = 100_000  # iterations
GRID_POINTS = 61  # log-spaced T_c candidates between 1 and max_interval, about 20 % apart
REFINE_POINTS = 21  # per round of minimize_interval's refinement: the bracket narrows tenfold
QUADRATURE_POINTS = 400  # log-spaced points of the expectation over the failure time
# Where Theorem 1's approximations are taken to hold (see theorem1_violations).
SMALL = 0.1


def _finite(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _positive(name: str, value: float) -> float:
    if _finite(name, value) <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return float(value)


def _non_negative(name: str, value: float) -> float:
    if _finite(name, value) < 0:
        raise ValueError(f"{name} must not be negative, got {value!r}")
    return float(value)


def _count(name: str, value) -> int:
    if _positive(name, value) != int(value):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return int(value)


def _max_interval(max_interval: float) -> float:
    if _positive("max_interval", max_interval) < 1:
        raise ValueError(f"max_interval must be at least 1 iteration, got {max_interval!r}")
    return float(max_interval)


def clamp_interval(T_c: float, max_interval: float = MAX_INTERVAL) -> float:
    """T_c (iterations) limited to [1, max_interval]; infinity (no finite optimum) gives max_interval."""
    if math.isnan(T_c):
        raise ValueError("T_c is NaN")
    return min(max(float(T_c), 1.0), _max_interval(max_interval))


def iterations(seconds_: float, iteration_time_s: float) -> float:
    """A duration in seconds as iterations of ``iteration_time_s`` seconds."""
    return _non_negative("seconds", seconds_) / _positive("iteration_time_s", iteration_time_s)


def seconds(iterations_: float, iteration_time_s: float) -> float:
    """A duration in iterations as seconds."""
    return _non_negative("iterations", iterations_) * _positive("iteration_time_s", iteration_time_s)


def failure_rate_per_iteration(failures_per_hour: float, iteration_time_s: float) -> float:
    """lambda per iteration from failures per hour (the paper's 0.08 / h: one failure in 12.5 h)."""
    return _positive("failures_per_hour", failures_per_hour) * _positive("iteration_time_s", iteration_time_s) / 3600


@dataclass(frozen=True)
class PbrParams:
    """The fitted inputs of the PB-R cost of one stage in one phase.

    alpha1 (per iteration), alpha2: the loss curve exp(-alpha1 t + alpha2) (Eq. 11);
    tau1 (per checkpoint), tau2: the predictor's error exp(-tau1 t / T_c + tau2) (Eq. 8);
    xi: the curvature estimate (Eq. 7); N_p: parameters of the stage being predicted.
    """

    alpha1: float
    alpha2: float
    tau1: float
    tau2: float
    xi: float
    N_p: float

    def __post_init__(self):
        for name in ("alpha1", "tau1", "xi", "N_p"):
            _positive(name, getattr(self, name))
        for name in ("alpha2", "tau2"):
            _finite(name, getattr(self, name))

    @property
    def log_excess0(self) -> float:
        """ln of exp(-alpha2) * Delta F at t = 0: the relative loss excess of a prediction at the phase start."""
        return math.log(self.xi) + math.log(self.N_p) + self.tau2 - self.alpha2 - math.log(2.0)


def prediction_deviation(t: float, T_c: float, p: PbrParams) -> float:
    """Delta F (Eq. 10): xi N_p exp(-tau1 t / T_c + tau2) / 2, in loss units, at iteration t."""
    exponent = -p.tau1 * _non_negative("t", t) / _positive("T_c", T_c) + p.tau2
    return p.xi * p.N_p * math.exp(min(exponent, 700.0)) / 2


def _intervals(T_c) -> np.ndarray:
    T_c = np.asarray(T_c, dtype=float)
    if not (np.isfinite(T_c) & (T_c > 0)).all():
        raise ValueError(f"T_c must be positive and finite, got {T_c!r}")
    return T_c


def _excess0(p: PbrParams) -> float:
    return math.exp(min(p.log_excess0, 700.0))  # capped: beyond it every cost is astronomically large anyway


def _growth(T_c, lam: float, p: PbrParams) -> np.ndarray:
    """r = (alpha1 - tau1 / T_c) / lambda: the excess grows as exp(r lambda t)."""
    return (p.alpha1 - p.tau1 / _intervals(T_c)) / _positive("lambda", lam)


def relative_excess(t: float, T_c: float, p: PbrParams) -> float:
    """exp(alpha1 t - alpha2) * Delta F: the deviation relative to the loss at t (Eq. 13's term)."""
    t = _non_negative("t", t)
    return math.exp(min(p.alpha1 * t - p.tau1 * t / _positive("T_c", T_c) + p.log_excess0, 700.0))


def pbr_cost(t: float, T_c: float, p: PbrParams) -> float:
    """T_p (Eq. 13), iterations: ln(1 + exp(alpha1 t - alpha2) Delta F) / alpha1, for a failure at t."""
    return math.log1p(relative_excess(t, T_c, p)) / p.alpha1


def pbr_cost_linear(t: float, T_c: float, p: PbrParams) -> float:
    """T_p (Eq. 14), iterations: Eq. 13 with ln(1 + x) ~ x, valid where x is small."""
    return relative_excess(t, T_c, p) / p.alpha1


def checkpoint_wait(T_c, persist: float = 0.0, in_flight: int = 1) -> np.ndarray:
    """Iterations a snapshot waits for a free persist slot: max(0, persist / in_flight - T_c)."""
    slot = _non_negative("persist", persist) / _count("in_flight", in_flight)
    return np.maximum(0.0, slot - _intervals(T_c))


def _period_costs(T_c, lam, T_s, persist, in_flight):
    """lambda, T_s' = T_s + the wait, and the period T_c + T_s' between checkpoints."""
    T_s_eff = _positive("T_s", T_s) + checkpoint_wait(T_c, persist, in_flight)
    return _positive("lambda", lam), T_s_eff, _intervals(T_c) + T_s_eff


def expected_excess(T_c, lam: float, p: PbrParams) -> np.ndarray:
    """E[exp(alpha1 t - alpha2) Delta F] over failure times t ~ lambda exp(-lambda t): the relative
    excess that Eq. 14 linearises, on average; infinite where it grows faster than failures come."""
    r = _growth(T_c, lam, p)
    with np.errstate(divide="ignore", over="ignore"):
        return np.where(r < 1.0, _excess0(p) / (1.0 - r), np.inf)


def expected_pbr_cost(T_c, lam: float, p: PbrParams, exact: bool = True) -> np.ndarray:
    """E[T_p] over a failure time t ~ lambda exp(-lambda t) (Eq. 15's recovery term), iterations.

    exact: T_p by Eq. 13, integrated numerically (trapezoid on a log grid of u = lambda t,
    which resolves both the decay over 1 / lambda and the faster one over T_c / tau1; 0.1 %
    accurate). Otherwise T_p by Eq. 14 in closed form (Eq. 17's second term), expected_excess
    / alpha1 = lambda C T_c / (tau1 - B T_c), C = exp(-alpha2) Delta F(0) / alpha1: infinite where
    theta = alpha1 - tau1 / T_c - lambda >= 0.
    """
    if not exact:
        return expected_excess(T_c, lam, p) / p.alpha1
    r = _growth(T_c, lam, p)
    u_min = 1e-4 / np.maximum(1.0, np.abs(r))[..., None]
    u = u_min * (60.0 / u_min) ** np.linspace(0.0, 1.0, QUADRATURE_POINTS)
    u = np.concatenate([np.zeros_like(u[..., :1]), u], axis=-1)
    f = np.logaddexp(0.0, p.log_excess0 + r[..., None] * u) * np.exp(-u)
    return np.sum(np.diff(u, axis=-1) * (f[..., 1:] + f[..., :-1]), axis=-1) / (2 * p.alpha1)


def pbr_cost_rate(T_c, lam: float, T_s: float, p: PbrParams, persist: float = 0.0, in_flight: int = 1,
                  exact: bool = True) -> np.ndarray:
    """The cost rate of predicting-based recovery at interval T_c (Eq. 15, summed and integrated).

    lambda (sum_i i T_s' P(failure in period i) + E[T_p]), periods of P = T_c + T_s' iterations,
    T_s' = T_s + checkpoint_wait; the sum is T_s' / (exp(lambda P) - 1). Eq. 17 writes it
    T_s' / (1 - exp(-lambda P)), charging the checkpoint under way at the failure too: T_s' more,
    which moves no optimum. exact: as in expected_pbr_cost.
    """
    lam, T_s_eff, period = _period_costs(T_c, lam, T_s, persist, in_flight)
    with np.errstate(over="ignore"):  # exp(lambda P) = inf: no checkpoint completes before a failure
        checkpoints = lam * T_s_eff / np.expm1(lam * period)
    return checkpoints + lam * expected_pbr_cost(T_c, lam, p, exact)


def _checkpoint_and_lost(T_c, lam, T_s, persist, in_flight):
    """Eq. 15's two terms under recomputing: lambda T_s' / (exp(lambda P) - 1), the checkpoints, and
    1 - lambda P / (exp(lambda P) - 1), the work lost since the last one (P = T_c + T_s')."""
    lam, T_s_eff, period = _period_costs(T_c, lam, T_s, persist, in_flight)
    with np.errstate(over="ignore"):  # exp(lambda P) = inf: no checkpoint completes before a failure
        growth = np.expm1(lam * period)
        return lam * T_s_eff / growth, 1.0 - lam * period / growth


def recompute_cost_rate(T_c, lam: float, T_s: float, persist: float = 0.0, in_flight: int = 1) -> np.ndarray:
    """The cost rate of recomputing-based recovery at interval T_c (Eq. 15 with T_r = t - i P).

    Checkpoints plus the work lost since the last one: 1 - lambda T_c / (exp(lambda P) - 1),
    P = T_c + T_s'. Young's and Daly's intervals approximate its minimum.
    """
    return empirical_cost_rate(T_c, lam, T_s, 0.0, persist, in_flight)


def empirical_cost_rate(T_c, lam: float, T_s: float, rho: float, persist: float = 0.0,
                        in_flight: int = 1) -> np.ndarray:
    """The cost rate under the empirical recovery model T_p = (1 - rho) d: recompute_cost_rate's
    checkpoint term plus (1 - rho) times its lost-work term. rho = 0 is recompute_cost_rate; its
    minimum lies near Young's interval for lambda (1 - rho), sqrt(2 T_s / ((1 - rho) lambda)).
    """
    if not 0 <= _finite("rho", rho) < 1:
        raise ValueError(f"rho must be in [0, 1), got {rho!r}")
    checkpoints, lost = _checkpoint_and_lost(T_c, lam, T_s, persist, in_flight)
    return checkpoints + (1.0 - rho) * lost


def guarded_cost_rate(T_c, lam: float, T_s: float, rho: float, d_max: float, persist: float = 0.0,
                      in_flight: int = 1) -> np.ndarray:
    """The cost rate under the empirical model where recovery predicts only the failures at most ``d_max``
    iterations behind the newest durable checkpoint (the loss-excess guard's bound) and recomputes the rest.

    A checkpoint counts once it has persisted, P = ``persist`` iterations after it began, so a
    failure lies d ~ U[P, P + T_c] behind the newest durable one, not U[0, T_c]: at P = 19 and
    T_c = 60, d reaches 79, and a guard that passes at d = T_c / 2 refuses every failure beyond
    its bound. A failure costs (1 - rho) d up to d_max and d beyond it. The checkpoints' term is
    recompute_cost_rate's; the failures' is lambda E[cost(d)], first order in lambda as Young's.
    d_max <= P recomputes every failure: lambda (T_c / 2 + P).
    """
    if not 0 <= _finite("rho", rho) < 1:
        raise ValueError(f"rho must be in [0, 1), got {rho!r}")
    T = _intervals(T_c)
    lo = _non_negative("persist", persist)
    hi = lo + T
    bound = np.clip(_non_negative("d_max", d_max), lo, hi)
    checkpoints, _ = _checkpoint_and_lost(T_c, lam, T_s, persist, in_flight)
    failure = ((1.0 - rho) * (bound ** 2 - lo ** 2) + hi ** 2 - bound ** 2) / (2 * T)
    return checkpoints + lam * failure


def minimize_interval(cost: Callable, max_interval: float = MAX_INTERVAL) -> float:
    """The T_c in [1, max_interval] with the lowest cost(T_c): a log-spaced grid, then finer grids around the best.

    ``cost`` maps an array of intervals to an array of costs (inf allowed). Each round evaluates
    REFINE_POINTS intervals between the best one's neighbours in one call, ten times closer than the
    round before, until the neighbours lie within 1e-6 of each other (relative): a cost evaluates many
    intervals in about the time of one, and a plan is made inside a checkpoint's measured cost (a
    golden section, one interval per call, took 2 ms per minimum). Where every cost is infinite it gives 1.
    """
    grid = np.geomspace(1.0, _max_interval(max_interval), GRID_POINTS)
    best_T, best_value = 1.0, math.inf
    while True:
        values = np.asarray(cost(grid), dtype=float)
        values = np.where(np.isfinite(values), values, np.inf)
        i = int(np.argmin(values))
        if values[i] < best_value:
            best_T, best_value = float(grid[i]), float(values[i])
        elif not math.isfinite(best_value):
            return 1.0
        lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
        if hi - lo <= 1e-6 * hi:
            return best_T
        grid = np.linspace(lo, hi, REFINE_POINTS)


def theorem1_A(p: PbrParams) -> float:
    """A = xi N_p tau1 exp(tau2 - alpha2) / (2 alpha1) (Theorem 1), iterations."""
    return p.tau1 * _excess0(p) / p.alpha1


def theorem1_B(lam: float, p: PbrParams) -> float:
    """B = alpha1 - lambda (Theorem 1), per iteration."""
    return p.alpha1 - _positive("lambda", lam)


def theorem1_interval(lam: float, T_s: float, p: PbrParams, max_interval: float = MAX_INTERVAL) -> float:
    """T_c = tau1 / (B + lambda sqrt(A / T_s)) (Theorem 1, Eq. 16), iterations.

    The root of Eq. 18 after 1 - exp(-lambda (T_c + T_s)) ~ lambda (T_c + T_s) and
    T_c + T_s ~ T_c, with T_p by Eq. 14. Where these hold (theorem1_violations empty at
    this T_c and at the numerical optimum: lambda (T_c + T_s) <= 0.1, T_s <= 0.1 T_c, the
    relative excess expected over failure times <= 0.1) its cost is within 5 % of the
    numerical optimum of pbr_cost_rate (2.4 % at worst on the grid of tests/unit/test_planner.py).
    Where they do not, it can be far off (same grid):
    - failures within a few intervals (the optimum at lambda T_c ~ 1, e.g. alpha1 = lambda,
      B = 0, a cheap recovery): up to 2.8 times the optimum's cost;
    - T_s comparable to T_c: the dropped T_s makes the interval too short (13 % more);
    - the excess growing faster than failures come (theta >= 0 near the optimum): Eq. 14's
      cost is infinite there while Eq. 13's is not, and the interval stops short of
      tau1 / B (up to 9 % more).
    A denominator <= 0 (no finite optimum) gives max_interval. Ignores the storage wait:
    plan_stage raises the interval to the storage floor.
    """
    _positive("T_s", T_s)
    denominator = theorem1_B(lam, p) + lam * math.sqrt(theorem1_A(p) / T_s)
    return clamp_interval(p.tau1 / denominator if denominator > 0 else math.inf, max_interval)


def theorem1_violations(lam: float, T_s: float, p: PbrParams, T_c: float) -> list[str]:
    """The approximations of Theorem 1 that do not hold at T_c (empty: it applies there)."""
    problems = []
    if lam * (T_c + T_s) > SMALL:
        problems.append(f"lambda (T_c + T_s) = {lam * (T_c + T_s):.3g} is not << 1")
    if T_s > SMALL * T_c:
        problems.append(f"T_s / T_c = {T_s / T_c:.3g} is not << 1")
    excess = float(expected_excess(T_c, lam, p))
    if excess > SMALL:
        problems.append(f"the expected relative excess exp(alpha1 t - alpha2) Delta F = {excess:.3g} is not << 1")
    return problems


def young_interval(lam: float, T_s: float, max_interval: float = MAX_INTERVAL) -> float:
    """Young's interval for recomputing-based recovery: sqrt(2 T_s / lambda), iterations."""
    return clamp_interval(math.sqrt(2 * _positive("T_s", T_s) / _positive("lambda", lam)), max_interval)


def daly_interval(lam: float, T_s: float, max_interval: float = MAX_INTERVAL) -> float:
    """Daly's higher-order interval (FGCS 2006), iterations, M = 1 / lambda:

    sqrt(2 T_s M) (1 + sqrt(T_s / 2M) / 3 + T_s / 18M) - T_s for T_s < 2M, else M.
    """
    M, delta = 1 / _positive("lambda", lam), _positive("T_s", T_s)
    if delta >= 2 * M:
        return clamp_interval(M, max_interval)
    x = delta / (2 * M)
    return clamp_interval(math.sqrt(2 * delta * M) * (1 + math.sqrt(x) / 3 + x / 9) - delta, max_interval)


def _profiled(iteration_time_s, stall_s, persist_s, budget, in_flight, storage_s, max_interval) -> float:
    _positive("iteration_time_s", iteration_time_s)
    _non_negative("stall_s", stall_s)
    _non_negative("persist_s", persist_s)
    _non_negative("storage_s", storage_s)
    if not 0 < _finite("budget", budget) <= 1:
        raise ValueError(f"budget must be in (0, 1], got {budget!r}")
    return clamp_interval(profiled_interval(iteration_time_s, stall_s, persist_s, budget, in_flight, storage_s),
                          max_interval)


def checkfreq_interval(iteration_time_s: float, stall_s: float, persist_s: float, budget: float = 0.02,
                       max_interval: float = MAX_INTERVAL) -> float:
    """CheckFreq's rule, iterations: the stall within ``budget`` of compute, one checkpoint persisting."""
    return _profiled(iteration_time_s, stall_s, persist_s, budget, 1, 0.0, max_interval)


def pccheck_interval(iteration_time_s: float, stall_s: float, persist_s: float, in_flight: int,
                     budget: float = 0.02, max_interval: float = MAX_INTERVAL, storage_s: float = 0.0) -> float:
    """PCcheck's rule, iterations: the stall within ``budget``, ``in_flight`` checkpoints persisting at once,
    none more often than storage's bandwidth writes one (``storage_s``, seconds; 0: not the limit)."""
    return _profiled(iteration_time_s, stall_s, persist_s, budget, _count("in_flight", in_flight), storage_s,
                     max_interval)


@dataclass(frozen=True)
class StageCosts:
    """One stage's measured costs, iterations: T_s the slowdown per checkpoint, persist its write time."""

    T_s: float
    persist: float = 0.0
    in_flight: int = 1

    def __post_init__(self):
        _positive("T_s", self.T_s)
        _non_negative("persist", self.persist)
        _count("in_flight", self.in_flight)


@dataclass(frozen=True)
class Plan:
    """A planned interval and how it was chosen; intervals in iterations, cost rates per iteration."""

    T_c: int
    method: str  # "theorem1", or "numerical" where Theorem 1's approximations fail
    T_c_theorem1: float
    T_c_numerical: float
    cost_rate: float
    cost_rate_theorem1: float
    cost_rate_numerical: float
    A: float
    B: float
    violations: tuple[str, ...]  # Theorem 1's approximations that fail at either interval

    def to_dict(self) -> dict:
        return asdict(self)


def _whole(T_c: float, cost: Callable, max_interval: float) -> int:
    """The better of the whole numbers of iterations either side of T_c."""
    candidates = sorted({max(1, math.floor(T_c)), min(math.ceil(T_c), max(1, math.floor(max_interval)))})
    costs = cost(np.array(candidates, dtype=float))
    return int(candidates[int(np.argmin(costs))])


def plan_stage(lam: float, costs: StageCosts, p: PbrParams, max_interval: float = MAX_INTERVAL) -> Plan:
    """The interval of one stage: Theorem 1 raised to the storage floor persist / in_flight where its
    approximations hold (at that interval and at the numerical optimum), else the numerical minimum
    of pbr_cost_rate (exact); rounded to the better whole number of iterations."""
    def cost(T_c):
        return pbr_cost_rate(T_c, lam, costs.T_s, p, costs.persist, costs.in_flight)

    floor = min(costs.persist / costs.in_flight, _max_interval(max_interval))
    closed = max(theorem1_interval(lam, costs.T_s, p, max_interval), floor)
    numerical = minimize_interval(cost, max_interval)
    violations = tuple(dict.fromkeys(theorem1_violations(lam, costs.T_s, p, closed)
                                     + theorem1_violations(lam, costs.T_s, p, numerical)))
    method, best = ("numerical", numerical) if violations else ("theorem1", closed)
    T_c = _whole(best, cost, max_interval)
    cost_T_c, cost_closed, cost_numerical = (float(c) for c in cost(np.array([T_c, closed, numerical])))
    return Plan(T_c=T_c, method=method, T_c_theorem1=closed, T_c_numerical=numerical, cost_rate=cost_T_c,
                cost_rate_theorem1=cost_closed, cost_rate_numerical=cost_numerical, A=theorem1_A(p),
                B=theorem1_B(lam, p), violations=violations)


@dataclass(frozen=True)
class EmpiricalPlan:
    """One stage's interval under the empirical model (rho: the predictor's measured reduction,
    0 for recomputing); T_c_young: Young's interval at lambda (1 - rho), for comparison."""

    T_c: int
    method: str  # "empirical", or "recompute" where rho = 0
    rho: float
    T_c_young: float
    cost_rate: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class JobPlan:
    """Each stage's own plan, and the one interval the job checkpoints at (iterations)."""

    T_c: int
    cost_rate: float
    stages: tuple  # Plan per stage (plan_job) or EmpiricalPlan (plan_job_empirical)


def _job(costs: Sequence[Callable], stages: tuple, max_interval: float) -> JobPlan:
    """The job-wide T_c minimising the summed cost rates ``costs`` of its stages."""
    if not costs:
        raise ValueError("stages is empty: a job has at least one stage")
    if len(costs) == 1 and isinstance(stages[0], EmpiricalPlan):
        # The one stage's plan minimised this very cost (plan_stage's may be Theorem 1's instead).
        return JobPlan(T_c=stages[0].T_c, cost_rate=stages[0].cost_rate, stages=stages)

    def cost(T_c):
        return sum(c(T_c) for c in costs)

    T_c = _whole(minimize_interval(cost, max_interval), cost, max_interval)
    return JobPlan(T_c=T_c, cost_rate=float(cost(np.array([T_c]))[0]), stages=stages)


def plan_job(lam: float, stages: Sequence[tuple[StageCosts, PbrParams]],
             max_interval: float = MAX_INTERVAL) -> JobPlan:
    """Per task (Section III-D): every stage's optimal interval from its own N_p and costs, and the
    job-wide T_c minimising the summed cost rate. ``lam``: failures per iteration of one stage."""
    costs = [partial(_pbr_rate, lam=lam, c=c, p=p) for c, p in stages]
    return _job(costs, tuple(plan_stage(lam, c, p, max_interval) for c, p in stages), max_interval)


def _pbr_rate(T_c, lam, c: StageCosts, p: PbrParams):
    return pbr_cost_rate(T_c, lam, c.T_s, p, c.persist, c.in_flight)


def _empirical_rate(T_c, lam, c: StageCosts, rho: float):
    return empirical_cost_rate(T_c, lam, c.T_s, rho, c.persist, c.in_flight)


def _minimum(cost: Callable, lam: float, costs: StageCosts, rho: float, predicts: bool,
             max_interval: float) -> EmpiricalPlan:
    T_c = _whole(minimize_interval(cost, max_interval), cost, max_interval)
    young = young_interval((1.0 - rho) * _positive("lambda", lam), costs.T_s, max_interval)
    return EmpiricalPlan(T_c=T_c, method="empirical" if predicts else "recompute", rho=rho, T_c_young=young,
                         cost_rate=float(cost(np.array([T_c]))[0]))


def plan_stage_empirical(lam: float, costs: StageCosts, rho: float, max_interval: float = MAX_INTERVAL) -> EmpiricalPlan:
    """One stage's numerical minimum of empirical_cost_rate, rounded to the better whole number."""
    return _minimum(partial(_empirical_rate, lam=lam, c=costs, rho=rho), lam, costs, rho, bool(rho), max_interval)


def plan_job_empirical(lam: float, stages: Sequence[tuple[StageCosts, float]],
                       max_interval: float = MAX_INTERVAL) -> JobPlan:
    """plan_job under the empirical model: (costs, rho) per stage; rho = 0 plans for recomputing."""
    costs = [partial(_empirical_rate, lam=lam, c=c, rho=rho) for c, rho in stages]
    return _job(costs, tuple(plan_stage_empirical(lam, c, rho, max_interval) for c, rho in stages), max_interval)


def _guarded_rate(T_c, lam, c: StageCosts, rho: float, d_max: float):
    return guarded_cost_rate(T_c, lam, c.T_s, rho, d_max, c.persist, c.in_flight)


def plan_job_guarded(lam: float, stages: Sequence[tuple[StageCosts, float]], d_max: float,
                     max_interval: float = MAX_INTERVAL) -> JobPlan:
    """plan_job_empirical where recovery predicts only up to ``d_max`` iterations behind the newest durable
    checkpoint (guarded_cost_rate; one bound for the job: where any stage would recompute, every stage does)."""
    costs = [partial(_guarded_rate, lam=lam, c=c, rho=rho, d_max=d_max) for c, rho in stages]
    plans = tuple(_minimum(cost, lam, c, rho, bool(rho) and d_max > c.persist, max_interval)
                  for cost, (c, rho) in zip(costs, stages))
    return _job(costs, plans, max_interval)


def what_if(lam: float, T_s: float, p: PbrParams, t: Optional[float] = None, persist: float = 0.0,
            in_flight: int = 1, budget: float = 0.02, pccheck_in_flight: int = 2,
            max_interval: float = MAX_INTERVAL) -> dict:
    """A plan for given inputs (iterations, lambda per iteration) beside the baselines' intervals.

    ``baselines``: Young and Daly (recomputing-based recovery), CheckFreq and PCcheck (their
    overhead ``budget``, T_s as the stall, ``pccheck_in_flight`` checkpoints persisting). With
    ``t``: Delta F and T_p (Eq. 10, 13, 14) for a failure at iteration t at the planned T_c.
    """
    plan = plan_stage(lam, StageCosts(T_s, persist, in_flight), p, max_interval)
    report = {**plan.to_dict(), "violations": list(plan.violations),
              "inputs": {"lambda": lam, "T_s": T_s, "persist": persist, "in_flight": in_flight, **asdict(p)},
              "baselines": {"young": young_interval(lam, T_s, max_interval),
                            "daly": daly_interval(lam, T_s, max_interval),
                            "checkfreq": checkfreq_interval(1.0, T_s, persist, budget, max_interval),
                            "pccheck": pccheck_interval(1.0, T_s, persist, pccheck_in_flight, budget, max_interval)}}
    if t is not None:
        report["at_t"] = {"t": t, "delta_F": prediction_deviation(t, plan.T_c, p),
                          "relative_excess": relative_excess(t, plan.T_c, p),
                          "T_p_eq13": pbr_cost(t, plan.T_c, p), "T_p_eq14": pbr_cost_linear(t, plan.T_c, p)}
    return report
