"""Online planning (``checkpoint.interval: auto`` with the ``cpsr`` strategy): the math, without side effects.

The plugin measures every checkpoint (checkpoint_cost.CostMeter), gathers each pipeline
stage's latest measurements (:class:`StageInputs`) and, at the moments :func:`replan_reason`
names, asks :func:`plan` for the interval; it writes the result as a runlog.PlanRow.

- lambda: failure_rate.failure_rate_per_hour, the configured rate updated by the job's own
  failures (a Gamma-Poisson posterior mean);
- T_s, the persist time and the iteration time: each stage's checkpoint_cost.smoothed_costs,
  so that one noisy checkpoint does not set or re-plan the interval;
- alpha1, alpha2 (Eq. 11) from the journal's losses; tau1, tau2 (Eq. 8) from each stage's
  held-out errors (fitter.accuracy_fit, as recovery fits them); xi, N_p (Eq. 7) from its
  latest state.

Every interval :func:`plan` returns lies in [1, max_interval]; an input that is not
finite, or a fit that fails, gives a documented fallback (recompute-based planning, or
keeping the current interval), never an exception.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

from cpsr_ds.planning import planner, units
from cpsr_ds.planning.calibration import PESSIMISM
from cpsr_ds.planning.cost_model import (
    RECOMPUTE,
    SKIP,
    EmpiricalModel,
    diverging,
    paper_model,
    recovery_choice,
)
from cpsr_ds.planning.fault_tolerance_cost import PbrParams, guarded_lost_per_failure
from cpsr_ds.planning.fitter import AccuracyFit, LossFit, NoFit, StageCurvature
from cpsr_ds.planning.lr_schedule import UNKNOWN, Shape
from cpsr_ds.planning.planner import StageCosts

MIN_T_S = 1e-3  # iterations: a measured slowdown at or below 0 (noise around a free checkpoint)


# ---------------------------------------------------------------- each stage's inputs


@dataclass(frozen=True)
class StageInputs:
    """What one pipeline stage measured, as its first data-parallel rank sends it (seconds).

    accuracy: the Eq. 8 fit (or why none); relative_error: r at its latest checkpoint;
    phase: the index of its current phase (fitter.next_phase over its xi).
    """

    stage: int
    iteration_time_s: Optional[float] = None
    slowdown_s: Optional[float] = None
    persist_s: Optional[float] = None
    in_flight: int = 1
    n_p: Optional[int] = None
    xi: Optional[float] = None
    accuracy: AccuracyFit | NoFit | None = None
    relative_error: Optional[float] = None
    phase: int = 0

    @property
    def measured(self) -> bool:
        return self.iteration_time_s is not None




# ---------------------------------------------------------------- when to plan


def drift(before: dict, now: dict, threshold: float) -> list[str]:
    """The inputs (by name) that moved by more than ``threshold`` (relative) from ``before``, each said.

    A value that is missing or not finite on either side is no evidence of drift.
    """
    moved = []
    for name, was in before.items():
        value = now.get(name)
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (was, value)):
            continue
        change = abs(value - was) / abs(was) if was else (math.inf if value else 0.0)
        if change > threshold:
            moved.append(f"{name} {was:.4g} -> {value:.4g}")
    return moved


def watched(lambda_per_hour: float, stages: Sequence[StageInputs], lag_per_lost_iteration: Optional[float] = None) -> dict:
    """The inputs whose drift re-plans: lambda, the iteration time, each stage's T_s and persist time, and where
    the empirical model's rho depends on the run's place (:func:`place_lag`), the lag per iteration lost."""
    values = {"lambda_per_hour": lambda_per_hour}
    if lag_per_lost_iteration is not None:
        values["lag_per_lost_iteration"] = lag_per_lost_iteration
    for s in stages:
        if s.measured:
            values.setdefault("iteration_time_s", s.iteration_time_s)
            values[f"slowdown_s/stage{s.stage}"] = s.slowdown_s
            values[f"persist_s/stage{s.stage}"] = s.persist_s
    return values


def place_lag(model: str, predictor: str, schedule: Optional[Shape]) -> Optional[float]:
    """1 - rho where the empirical model's rho depends on how much of the decaying ``schedule`` is ahead; None
    elsewhere."""
    if model != "empirical":
        return None
    rho, place = EmpiricalModel(schedule=schedule).rho(predictor)
    return None if place is None else 1.0 - rho


def replan_reason(planned: Optional[dict], phase: int, planned_phase: int, measured: bool, drifted: Sequence[str],
                  restart: bool) -> Optional[str]:
    """Why to plan now (a runlog.PlanRow reason), or None.

    ``planned``: the watched inputs of the last plan (None: no plan yet); ``measured``:
    every stage has a measured checkpoint (no plan can be made before).
    """
    if not measured:
        return None
    if planned is None:
        return "restart" if restart else "first"
    if phase != planned_phase:
        return "phase"
    if drifted:
        return "drift"
    return None


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class JobInputs:
    """The job-wide inputs of a plan.

    iteration: where the plan is made (the origin of the paper model's t); loss: the Eq. 11
    fit of the journal (absolute iterations); model: planner.cost_model; mode:
    recovery.mode; current: the interval kept where no plan can be made; carried_lag: the
    lag (iterations) the run carries from earlier predictions (recovery.carried_lag), which
    the guard adds to a new one's before taking both pessimistically.
    """

    iteration: int
    lambda_per_hour: float
    loss: LossFit | NoFit
    model: str
    predictor: str
    mode: str
    max_relative_error: float
    max_loss_excess: float
    max_interval: int
    current: int
    failures: int = 0
    hours: float = 0.0
    carried_lag: float = 0.0
    schedule: Optional[Shape] = None  # the learning-rate schedule's shape at ``iteration``

    def empirical(self) -> EmpiricalModel:
        """The empirical model of this run: rho by how much of its schedule is ahead where the rate decays."""
        return EmpiricalModel(schedule=self.schedule)


@dataclass(frozen=True)
class Planned:
    """A plan's result: the fields of a runlog.PlanRow that the math decides."""

    T_c: int
    recovery: str  # "predict" or "recompute"
    inputs: dict
    stages: list
    fallback: str = ""


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def json_safe(value):
    """``value`` with every non-finite float as None, so plans.jsonl stays strict JSON."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _inputs(job: JobInputs, stages: Sequence[StageInputs], lam: Optional[float], iteration_time_s) -> dict:
    loss = job.loss if job.loss else None

    def per_stage(get):
        return [get(s) for s in stages]

    def fitted(s, name):
        return getattr(s.accuracy, name) if s.accuracy else None

    def in_iterations(value):
        return value / iteration_time_s if _finite(value) and _finite(iteration_time_s) and iteration_time_s > 0 else None

    return {"lambda_per_hour": job.lambda_per_hour, "lambda": lam, "failures": job.failures, "hours": job.hours,
            "iteration_time_s": iteration_time_s,
            "T_s": per_stage(lambda s: in_iterations(s.slowdown_s)),
            "persist": per_stage(lambda s: in_iterations(s.persist_s)), "in_flight": per_stage(lambda s: s.in_flight),
            "alpha1": loss and loss.alpha1, "alpha2": loss and loss.alpha2,
            "tau1": per_stage(lambda s: fitted(s, "tau1")), "tau2": per_stage(lambda s: fitted(s, "tau2")),
            "tau_T_c": per_stage(lambda s: fitted(s, "T_c")), "xi": per_stage(lambda s: s.xi),
            "N_p": per_stage(lambda s: s.n_p), "relative_error": per_stage(lambda s: s.relative_error),
            "loss_fit": job.loss.reason if not job.loss else "", "carried_lag": job.carried_lag,
            "schedule": job.schedule and job.schedule.kind,
            "schedule_remaining": job.schedule and job.schedule.remaining}


def _stage_costs(stages: Sequence[StageInputs], iteration_time_s: float) -> list[StageCosts]:
    return [StageCosts(max(s.slowdown_s / iteration_time_s, MIN_T_S), s.persist_s / iteration_time_s, s.in_flight)
            for s in stages]


def _accuracy(s: StageInputs) -> AccuracyFit | NoFit:
    return NoFit("too few", "no held-out errors") if s.accuracy is None else s.accuracy


def _curvature(s: StageInputs) -> StageCurvature | NoFit:
    if s.xi is None or s.n_p is None:
        return NoFit("too few", f"stage {s.stage}: no xi measured")
    return StageCurvature(s.xi, s.n_p)


def _paper_params(job: JobInputs, stages: Sequence[StageInputs]) -> tuple[list[PbrParams], list[str]]:
    """Each stage's PbrParams with t counted from the plan's iteration, or why there are none."""
    params, missing = [], []
    for s in stages:
        model = paper_model(job.loss, _accuracy(s), _curvature(s))
        if model.params is None:
            missing.append(f"stage {s.stage}: {model.missing}")
            continue
        p = model.params
        # Rebased: the loss and the error the fits give at the plan's iteration.
        params.append(replace(p, alpha2=p.alpha2 - p.alpha1 * job.iteration,
                              tau2=p.tau2 - p.tau1 * job.iteration / model.T_c))
    return params, missing


def stage_predictor(job: JobInputs, s: StageInputs) -> str:
    """The predictor recovery would predict stage ``s`` with: under recovery.mode auto and the empirical model,
    ``skip`` where the stage's held-out error diverges (recovery's fallback, recovery/decision.py); the job's
    otherwise. The paper models have no fit for ``skip`` (no held-out errors of it are measured), so there the
    guard recomputes, as recovery does."""
    if job.mode == "auto" and job.model == "empirical" and diverging(s.relative_error, job.max_relative_error):
        return SKIP
    return job.predictor


def guard(job: JobInputs, stages: Sequence[StageInputs], d: int,
          excess_at: Callable[[float], Optional[float]]) -> Optional[str]:
    """Why recovery would recompute a failure d iterations after a checkpoint at the plan's iteration (None:
    it would predict): the diverging-prediction guard on r, and cost_model.recovery_choice with the
    configured model for every stage with the predictor it would use (one stage's recompute is the job's)."""
    if job.mode != "auto":
        return None
    for s in stages:
        if diverging(s.relative_error, job.max_relative_error) and stage_predictor(job, s) != SKIP:
            return (f"stage {s.stage}: held-out error r = {s.relative_error:.3f}, not below max_relative_error "
                    f"{job.max_relative_error}")
    f = job.iteration
    if job.model == "empirical":
        models = [(None, job.empirical(), predictor) for predictor in sorted({stage_predictor(job, s) for s in stages})]
    else:
        models = [(s.stage, paper_model(job.loss, _accuracy(s), _curvature(s), exact=job.model == "paper"),
                   job.predictor) for s in stages]
    for stage, model, predictor in models:
        choice = recovery_choice(model.estimate(f, f - d, predictor), d, excess_at, job.max_loss_excess, PESSIMISM,
                                 job.carried_lag)
        if choice.method == RECOMPUTE:
            where = "" if stage is None else f"stage {stage}: "
            return f"{where}a failure {d} iterations after a checkpoint would recompute: {choice.reason}"
    return None


def _stage_dicts(job_plan: planner.JobPlan, stages: Sequence[StageInputs], costs: Sequence[StageCosts],
                 rho: Optional[Sequence[float]] = None, d_max: float = 0.0) -> list:
    """Each stage's plan and inputs; under the empirical model (``rho`` per stage, recomputing beyond ``d_max``)
    also the iterations a failure that storage serves is expected to cost at the job's T_c (``per_failure``)."""
    dicts = [{"stage": s.stage, **p.to_dict(), "T_s": c.T_s, "persist": c.persist, "in_flight": c.in_flight,
              "xi": s.xi, "N_p": s.n_p} for s, p, c in zip(stages, job_plan.stages, costs)]
    if rho is not None:
        for d, c, r in zip(dicts, costs, rho):
            d["per_failure"] = float(guarded_lost_per_failure(job_plan.T_c, r, d_max, c.persist))
    return dicts


def plan(job: JobInputs, stages: Sequence[StageInputs],
         excess_at: Callable[[float], Optional[float]] = lambda lag: None) -> Planned:
    """The interval for the job from every stage's measured inputs (iterations, in [1, max_interval]).

    Predicting-based where recovery would predict: the empirical model minimises
    fault_tolerance_cost.guarded_cost_rate with rho of each stage's predictor (MEASURED_REDUCTION, or at the
    plan's place in the planned run: EmpiricalModel.rho; :func:`stage_predictor`: ``skip`` for a stage
    whose predictor diverges) and the longest
    distance from the durable checkpoint at which :func:`guard` lets a failure predict, d_max
    (a failure beyond it recomputes, and it lies up to T_c plus one persist away), the paper models
    planner.plan_job with each stage's PbrParams (t from the plan's iteration; both "paper"
    and "paper-eq14" plan by Eq. 13, Theorem 1 being Eq. 14's optimum). Recompute-based
    (rho = 0, recovery "recompute") where recovery.mode is recompute, a paper-model input
    has no fit, the predictor has no measured reduction, or :func:`guard` says a failure
    would recompute; ``fallback`` says why. Without a usable iteration time, T_s, persist
    time or lambda no plan can be made: the current interval stays, and ``fallback`` says why.
    """
    times = [s.iteration_time_s for s in stages if s.measured]
    iteration_time_s = max(times) if times and all(_finite(t) for t in times) else None
    problems = [f"stage {s.stage}: {name} is {value}" for s in stages
                for name, value in (("iteration_time_s", s.iteration_time_s), ("T_s", s.slowdown_s),
                                    ("persist_s", s.persist_s))
                if not (_finite(value) and value >= 0)]
    if iteration_time_s is not None and iteration_time_s <= 0:
        problems.append(f"the iteration time is {iteration_time_s}")
    if not (_finite(job.lambda_per_hour) and job.lambda_per_hour > 0):
        problems.append(f"lambda is {job.lambda_per_hour} per hour")
    if problems or not stages:
        T_c = int(planner.clamp_interval(job.current, job.max_interval))
        return Planned(T_c, RECOMPUTE, json_safe(_inputs(job, stages, None, iteration_time_s)), [],
                       "no plan, the interval stays: " + ("; ".join(problems) or "no stage measured"))
    lam = units.failure_rate_per_iteration(job.lambda_per_hour, iteration_time_s)
    try:
        return _plan(job, stages, excess_at, lam, iteration_time_s)
    except ValueError as err:  # an input the checks above let through and the planner refuses
        T_c = int(planner.clamp_interval(job.current, job.max_interval))
        return Planned(T_c, RECOMPUTE, json_safe(_inputs(job, stages, lam, iteration_time_s)), [],
                       f"no plan, the interval stays: {err}")


def _plan(job: JobInputs, stages: Sequence[StageInputs], excess_at, lam: float, iteration_time_s: float) -> Planned:
    costs = _stage_costs(stages, iteration_time_s)
    inputs = json_safe(_inputs(job, stages, lam, iteration_time_s))

    def recompute(why: str) -> Planned:
        job_plan = planner.plan_job_empirical(lam, [(c, 0.0) for c in costs], job.max_interval)
        stage_dicts = _stage_dicts(job_plan, stages, costs, [0.0] * len(costs))
        return Planned(job_plan.T_c, RECOMPUTE, inputs, json_safe(stage_dicts), why)

    if job.mode == "recompute":
        return recompute("recovery.mode is recompute")
    if job.model == "empirical":
        predictors = [stage_predictor(job, s) for s in stages]
        if job.schedule is not None and job.schedule.kind == UNKNOWN:
            return recompute(f"no end-of-training estimate: {job.schedule.reason}")
        rho = [job.empirical().rho(p)[0] for p in predictors]
        unmeasured = sorted({p for p, r in zip(predictors, rho) if not _finite(r)})
        if unmeasured:
            return recompute(f"no measured reduction for predictor {unmeasured[0]!r}")
        skipping = [s.stage for s, p in zip(stages, predictors) if p != job.predictor]
        note = "" if not skipping else (
            f"stage{'s' * (len(skipping) > 1)} {', '.join(map(str, skipping))}: held-out error not below "
            f"max_relative_error {job.max_relative_error}, planned for {SKIP} (c's state at f)")
        return _plan_guarded(job, stages, costs, rho, excess_at, lam, recompute, {**inputs, "rho": rho}, note)
    params, missing = _paper_params(job, stages)
    if missing:
        return recompute(f"{job.model} model: " + "; ".join(missing))

    def predicting(max_interval):
        return planner.plan_job(lam, list(zip(costs, params)), max_interval)

    note = ""
    job_plan = predicting(job.max_interval)
    why = guard(job, stages, max(1, round(job_plan.T_c / 2)), excess_at)
    if why is not None:
        # The guard's lag grows with d, so a shorter interval may let recovery predict, and
        # predicting at that interval may cost less than recomputing at the recompute optimum.
        fallback = recompute(why)
        bound = guard_bound(lambda T_c: guard(job, stages, max(1, round(T_c / 2)), excess_at) is None,
                            job_plan.T_c - 1)
        if bound is None:
            return fallback
        job_plan = predicting(bound)
        recompute_cost = planner.plan_job_empirical(lam, [(c, 0.0) for c in costs], job.max_interval).cost_rate
        if not job_plan.cost_rate < recompute_cost:
            return fallback
        note = "; ".join(filter(None, [note, (
            f"{why}; at most {bound} iterations apart a failure halfway would predict, and predicting there "
            f"costs {job_plan.cost_rate:.4g} against recomputing's {recompute_cost:.4g} per iteration")]))
    stage_dicts = _stage_dicts(job_plan, stages, costs)
    for d, p in zip(stage_dicts, params):
        d.update(tau1=p.tau1, tau2=p.tau2, alpha2_at_plan=p.alpha2)
    return Planned(job_plan.T_c, "predict", inputs, json_safe(stage_dicts), note)


def _plan_guarded(job: JobInputs, stages: Sequence[StageInputs], costs: Sequence[StageCosts], rho: list[float],
                  excess_at, lam: float, recompute: Callable[[str], Planned], inputs: dict, note: str) -> Planned:
    """The empirical model's plan: planner.plan_job_guarded with the longest d at which :func:`guard` lets
    recovery predict (d_max), recomputing where that costs less at every interval."""
    longest = int(job.max_interval + max(c.persist for c in costs))
    d_max = guard_bound(lambda d: guard(job, stages, d, excess_at) is None, longest)
    if d_max is None:
        return recompute(guard(job, stages, 1, excess_at))
    job_plan = planner.plan_job_guarded(lam, list(zip(costs, rho)), d_max, job.max_interval)
    recomputing = planner.plan_job_guarded(lam, [(c, 0.0) for c in costs], 0, job.max_interval)
    beyond = guard(job, stages, d_max + 1, excess_at) if d_max < longest else None
    if not job_plan.cost_rate < recomputing.cost_rate:
        return recompute("; ".join(filter(None, [beyond, f"predicting only up to {d_max} iterations behind a "
                                                         f"durable checkpoint costs no less than recomputing"])))
    if beyond is not None:
        note = "; ".join(filter(None, [note, (
            f"recovery predicts a failure up to {d_max} iterations behind the newest durable checkpoint and "
            f"recomputes beyond ({beyond})")]))
    stage_dicts = _stage_dicts(job_plan, stages, costs, rho, d_max)
    for d in stage_dicts:
        d["d_max"] = d_max
    return Planned(job_plan.T_c, "predict", {**inputs, "d_max": d_max}, json_safe(stage_dicts), note)


def guard_bound(passes: Callable[[int], bool], longest: int) -> Optional[int]:
    """The longest interval, or failure distance d, in [1, longest] at which ``passes`` (the guard lets
    recovery predict), or None.

    The guard's lag grows with either, so ``passes`` holds up to some value and not beyond:
    a bisection finds it.
    """
    if longest < 1 or not passes(1):
        return None
    lo, hi = 1, longest
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if passes(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def describe(reason: str, planned: Planned, model: str, phase: int) -> str:
    """The plan's log line."""
    def number(v):
        if isinstance(v, str):
            return v
        if isinstance(v, list):
            return "[" + ", ".join(number(x) for x in v) + "]"
        return f"{v:.4g}" if _finite(v) else str(v)

    said = [f"{k} {number(v)}" for k, v in planned.inputs.items()
            if k in ("lambda_per_hour", "iteration_time_s", "T_s", "persist", "alpha1", "xi", "N_p", "drift")]
    return "; ".join(filter(None, [f"cpsr plan ({reason}, phase {phase}, {model} model): T_c = {planned.T_c} iterations, "
                      f"planned for {planned.recovery}", ", ".join(said), planned.fallback]))
