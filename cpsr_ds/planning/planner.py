"""The planner (Section V-C): the checkpoint interval T_c that minimises the fault-tolerance cost.

The cost rates it minimises are fault_tolerance_cost.py's; the unit is the iteration
(units.py). Theorem 1 (Eq. 16) gives the interval in closed form where its
approximations hold, a numerical minimum of Eq. 15 otherwise; per task (Section III-D)
each stage has its own plan, and the job one interval minimising their summed cost.
Young's, Daly's, CheckFreq's and PCcheck's rules give the baselines' intervals.

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
from cpsr_ds.planning.fault_tolerance_cost import (
    PbrParams,
    empirical_cost_rate,
    expected_excess,
    guarded_cost_rate,
    pbr_cost,
    pbr_cost_linear,
    pbr_cost_rate,
    prediction_deviation,
    relative_excess,
)
from cpsr_ds.planning.units import finite, non_negative, positive, whole

MAX_INTERVAL = 100_000  # iterations
GRID_POINTS = 61  # log-spaced T_c candidates between 1 and max_interval, about 20 % apart
REFINE_POINTS = 21  # per round of minimize_interval's refinement: the bracket narrows tenfold
# Where Theorem 1's approximations are taken to hold (see theorem1_violations).
SMALL = 0.1


def _max_interval(max_interval: float) -> float:
    if positive("max_interval", max_interval) < 1:
        raise ValueError(f"max_interval must be at least 1 iteration, got {max_interval!r}")
    return float(max_interval)


def clamp_interval(T_c: float, max_interval: float = MAX_INTERVAL) -> float:
    """T_c (iterations) limited to [1, max_interval]; infinity (no finite optimum) gives max_interval."""
    if math.isnan(T_c):
        raise ValueError("T_c is NaN")
    return min(max(float(T_c), 1.0), _max_interval(max_interval))


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
    return p.tau1 * p.excess0 / p.alpha1


def theorem1_B(lam: float, p: PbrParams) -> float:
    """B = alpha1 - lambda (Theorem 1), per iteration."""
    return p.alpha1 - positive("lambda", lam)


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
    positive("T_s", T_s)
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
    return clamp_interval(math.sqrt(2 * positive("T_s", T_s) / positive("lambda", lam)), max_interval)


def daly_interval(lam: float, T_s: float, max_interval: float = MAX_INTERVAL) -> float:
    """Daly's higher-order interval (FGCS 2006), iterations, M = 1 / lambda:

    sqrt(2 T_s M) (1 + sqrt(T_s / 2M) / 3 + T_s / 18M) - T_s for T_s < 2M, else M.
    """
    M, delta = 1 / positive("lambda", lam), positive("T_s", T_s)
    if delta >= 2 * M:
        return clamp_interval(M, max_interval)
    x = delta / (2 * M)
    return clamp_interval(math.sqrt(2 * delta * M) * (1 + math.sqrt(x) / 3 + x / 9) - delta, max_interval)


def _profiled(iteration_time_s, stall_s, persist_s, budget, in_flight, storage_s, max_interval) -> float:
    positive("iteration_time_s", iteration_time_s)
    non_negative("stall_s", stall_s)
    non_negative("persist_s", persist_s)
    non_negative("storage_s", storage_s)
    if not 0 < finite("budget", budget) <= 1:
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
    return _profiled(iteration_time_s, stall_s, persist_s, budget, whole("in_flight", in_flight), storage_s,
                     max_interval)


@dataclass(frozen=True)
class StageCosts:
    """One stage's measured costs, iterations: T_s the slowdown per checkpoint, persist its write time."""

    T_s: float
    persist: float = 0.0
    in_flight: int = 1

    def __post_init__(self):
        positive("T_s", self.T_s)
        non_negative("persist", self.persist)
        whole("in_flight", self.in_flight)


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
    young = young_interval((1.0 - rho) * positive("lambda", lam), costs.T_s, max_interval)
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
