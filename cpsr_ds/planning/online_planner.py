"""Online planning (``checkpoint.interval: auto`` with the ``cpsr`` strategy): the math, without side effects.

The plugin measures every checkpoint (:class:`CostMeter`), gathers each pipeline
stage's latest measurements (:class:`StageInputs`) and, at the moments :func:`replan_reason`
names, asks :func:`plan` for the interval; it writes the result as a runlog.PlanRow.

- lambda: :func:`failure_rate_per_hour`, the configured rate updated by the job's own
  failures (a Gamma-Poisson posterior mean);
- T_s, the persist time and the iteration time: the median of each stage's last
  ``SMOOTHING`` measured checkpoints (:func:`smoothed_costs`; no plan before ``MIN_COSTS``),
  so that one noisy checkpoint does not set or re-plan the interval;
- alpha1, alpha2 (Eq. 11) from the journal's losses; tau1, tau2 (Eq. 8) from each
  stage's held-out errors (fitter.accuracy_fit, as recovery fits them); xi, N_p (Eq. 7) from its latest state.

Every interval :func:`plan` returns lies in [1, max_interval]; an input that is not
finite, or a fit that fails, gives a documented fallback (recompute-based planning, or
keeping the current interval), never an exception.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from statistics import median
from typing import Callable, Optional, Sequence

from cpsr_ds.planning import planner
from cpsr_ds.planning.calibration import PESSIMISM
from cpsr_ds.planning.cost_model import (
    RECOMPUTE,
    SKIP,
    EmpiricalModel,
    diverging,
    paper_model,
    recovery_choice,
)
from cpsr_ds.planning.fitter import AccuracyFit, LossFit, NoFit, StageCurvature
from cpsr_ds.planning.planner import PbrParams, StageCosts

BASELINE_WINDOW = 32  # iterations whose median is the baseline iteration time
BRACKET = 8  # iterations without a checkpoint in flight on each side of a checkpoint's window: its baseline
HORIZON = 256  # iterations a checkpoint's cost waits, at most, for clean iterations after it
SMOOTHING = 9  # the newest measured checkpoints whose median is a stage's current cost ...
MIN_COSTS = 3  # ... and how many are measured before the first plan
MIN_T_S = 1e-3  # iterations: a measured slowdown at or below 0 (noise around a free checkpoint)
# A pause between two journal lines longer than this many median iterations is a restart, not running time.
RESTART_GAP = 50


# ---------------------------------------------------------------- lambda


def failure_rate_per_hour(prior_per_hour: float, failures: int, hours: float) -> float:
    """The posterior mean failure rate, per hour: (1 + n) / (1 / rate + H).

    The prior is a Gamma distribution worth one failure observed over 1 / rate hours (the
    configured ``planner.failure_rate_per_hour``); the job then saw n failures in H hours of
    running. With no history it is the configured rate; after many hours it tends to n / H.
    A prior rate that is not positive and finite has no posterior: it is returned unchanged.
    """
    if not (math.isfinite(prior_per_hour) and prior_per_hour > 0):
        return prior_per_hour
    hours = hours if math.isfinite(hours) and hours > 0 else 0.0
    return (1 + max(0, failures)) / (1 / prior_per_hour + hours)


def failures(reached: Sequence[Optional[int]], finished: Sequence[int] = ()) -> int:
    """The job's failures from each start's recovery report ``reached``: a start after progress ended an attempt,
    but for one start at each iteration where an attempt ended cleanly (``finished``, journal.finished_iterations):
    that start resumed a job that had finished, not failed."""
    clean, count = Counter(finished), 0
    for r in (r for r in reached if r is not None):
        if clean[r]:
            clean[r] -= 1
        else:
            count += 1
    return count


def running_hours(entries: Sequence[tuple[int, float]]) -> float:
    """Hours of running in a journal's (iteration, wall_time) lines, restarts' downtime left out.

    The time between consecutive lines counts where the iteration follows by one and the
    pause is at most RESTART_GAP median pauses; a restart (the iteration going back, or a
    predicted one resuming after a long pause) ends one span and begins the next.
    """
    gaps = [(b_t - a_t) for (a_i, a_t), (b_i, b_t) in zip(entries, entries[1:])
            if b_i == a_i + 1 and math.isfinite(b_t - a_t) and b_t >= a_t]
    if not gaps:
        return 0.0
    limit = RESTART_GAP * median(gaps)
    return sum(g for g in gaps if g <= limit) / 3600


# ---------------------------------------------------------------- measuring a checkpoint


def slowdown(block_s: float, times: Sequence[float], baseline: float) -> float:
    """T_s in seconds: the checkpoint's own time in the training loop (``block_s``) plus, over the
    iterations while it persisted, their time above the baseline.

    An estimate: on a shared host one checkpoint's value is noisy, and may fall below the stall
    it includes, or below 0. It is not clamped there: a clamp at the stall biases the sum over a run's
    checkpoints (bench_ftcost's checkpoint cost) upward, by 26 to 76 % per strategy in bench_ftcost
    where a quarter of the checkpoints measured below 0; a median (the planner's smoothed_costs) is
    unaffected where most checkpoints measure above the stall."""
    return block_s + sum(t - baseline for t in times)


@dataclass
class Window:
    """A checkpoint being measured: the iterations after it until it persisted or the next one began
    (``times``), and the iterations without a checkpoint in flight nearest before it (``before``;
    ``fresh`` where the newest of them is among the last BASELINE_WINDOW) and after its persist
    (``after``), whose median is its baseline; ``started``: the meter's iteration count at its start."""

    iteration: int
    tag: str
    block_s: float
    before: list
    fresh: bool
    started: int
    fallback: Optional[float]
    times: list = field(default_factory=list)
    after: list = field(default_factory=list)
    collecting: bool = True
    stall_s: Optional[float] = None
    outcome: Optional[tuple[int, float]] = None  # (bytes, persist seconds) once persisted

    def baseline(self) -> Optional[float]:
        clean = self.before + self.after
        return median(clean) if clean else self.fallback


@dataclass(frozen=True)
class Cost:
    """One checkpoint's measured cost, seconds (the fields of runlog.CostRow)."""

    iteration: int
    iteration_time_s: float
    stall_s: float
    slowdown_s: float
    persist_s: float
    nbytes: int


class CostMeter:
    """Iteration times, the baseline, and the checkpoints being measured (no I/O).

    A checkpoint's window collects the iterations after it until it has persisted or the next
    checkpoint begins (which is then measured instead). Its baseline brackets the window: the
    median of the BRACKET iterations with no checkpoint in flight nearest before it and the
    BRACKET nearest after its persist. The host's speed drifts by a third within seconds here,
    and a baseline from the last such iterations, however old, stayed the same over 300 iterations
    and a dozen checkpoints where persists took almost the whole interval, and then measured
    checkpoints at -5 iterations where the host had sped up since. So a checkpoint's cost is
    final once BRACKET iterations after it are clean, or when the next checkpoint begins where
    some clean iteration lies within BASELINE_WINDOW before it or after it; one whose persists
    overlap the next checkpoints waits for the clean iterations after the whole stretch, up to
    HORIZON iterations. With no clean iteration ever, the baseline is the median of all recent ones.
    """

    def __init__(self):
        self.clean: deque = deque(maxlen=BASELINE_WINDOW)  # (iteration count, seconds)
        self.recent: deque = deque(maxlen=BASELINE_WINDOW)
        self.pending: list[Window] = []
        self.done: list[Cost] = []
        self.count = 0

    def baseline(self) -> Optional[float]:
        times = [t for _, t in self.clean] or self.recent
        return median(times) if times else None

    def iteration(self, seconds: float) -> None:
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        self.count += 1
        self.recent.append(seconds)
        in_flight = [w for w in self.pending if w.outcome is None]
        collecting = [w for w in in_flight if w.collecting]
        if collecting:
            collecting[-1].times.append(seconds)
        if in_flight:
            return
        self.clean.append((self.count, seconds))
        for w in list(self.pending):
            w.after.append(seconds)
            if len(w.after) >= BRACKET:
                self._close(w)

    def start(self, iteration: int, tag: str, block_s: float) -> None:
        for w in list(self.pending):
            w.collecting = False
            if w.outcome is not None and (w.fresh or w.after or self.count - w.started > HORIZON):
                self._close(w)
        fresh = bool(self.clean) and self.clean[-1][0] > self.count - BASELINE_WINDOW
        before = [t for _, t in self.clean][-BRACKET:]
        self.pending.append(Window(iteration, tag, block_s, before, fresh, self.count, self.baseline()))

    def stalled(self, stall_s: Optional[float]) -> None:
        """The engine's stall, known once the checkpoint after the newest window committed."""
        if self.pending and self.pending[-1].stall_s is None and self.pending[-1].times:
            self.pending[-1].stall_s = stall_s

    def settle(self, tag: str, outcome) -> None:
        """Record the engine's outcome for ``tag``: (bytes, persist_s) persisted, False given up, None pending.

        persist_s None: this rank had a part but wrote no file (a data-parallel rank past the first without
        ZeRO: DeepSpeed writes the module and optimizer from the first), so it has no cost of its own.
        The cost, once its baseline is bracketed, comes from :meth:`finished`.
        """
        window = next((w for w in self.pending if w.tag == tag and w.outcome is None), None)
        if window is None or outcome is None:
            return
        if outcome is False or outcome[1] is None:
            self.pending.remove(window)
            return
        window.outcome = (int(outcome[0]), float(outcome[1]))
        window.collecting = False

    def finished(self) -> list[Cost]:
        """The costs measured since the last call (a checkpoint's once its baseline is bracketed)."""
        done, self.done = self.done, []
        return done

    def _close(self, window: Window) -> None:
        self.pending.remove(window)
        baseline = window.baseline()
        if baseline is None:
            return
        nbytes, persist_s = window.outcome
        stall = window.stall_s if window.stall_s is not None else 0.0
        self.done.append(Cost(window.iteration, baseline, stall, slowdown(window.block_s, window.times, baseline),
                              persist_s, nbytes))


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


def smoothed_costs(costs: Sequence[Cost]) -> dict:
    """iteration_time_s, slowdown_s and persist_s: the medians over the newest SMOOTHING costs (empty: fewer
    than MIN_COSTS).

    With two the median is their mean, and one outlier set the interval: a one-off import in the
    first plan made a checkpoint cost 27 iterations against 2 for the others, and the next plan, on
    two costs, chose 138 iterations where 50 were due. One checkpoint's slowdown is noisy on a shared
    machine (2 to 170 ms around a median of 45 ms in bench_ftcost): over three, T_s swung between 0.5
    and 5 iterations from one plan to the next, and the interval with it (17 to 84 iterations).
    """
    recent = list(costs)[-SMOOTHING:]
    if len(recent) < MIN_COSTS:
        return {}
    return {name: median(getattr(c, name) for c in recent) for name in ("iteration_time_s", "slowdown_s", "persist_s")}


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


def place_lag(model: str, predictor: str, iteration: int, planned_iterations: Optional[int]) -> Optional[float]:
    """1 - rho at ``iteration`` where the empirical model's rho depends on the run's place; None elsewhere."""
    if model != "empirical":
        return None
    rho, place = EmpiricalModel(planned_iterations=planned_iterations).rho(iteration, predictor)
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
    planned_iterations: Optional[int] = None

    def empirical(self) -> EmpiricalModel:
        """The empirical model of this run: rho by its place in the planned run where it has a planned end."""
        return EmpiricalModel(planned_iterations=self.planned_iterations)


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
            "planned_iterations": job.planned_iterations}


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


def _stage_dicts(job_plan: planner.JobPlan, stages: Sequence[StageInputs], costs: Sequence[StageCosts]) -> list:
    return [{"stage": s.stage, **p.to_dict(), "T_s": c.T_s, "persist": c.persist, "in_flight": c.in_flight,
             "xi": s.xi, "N_p": s.n_p} for s, p, c in zip(stages, job_plan.stages, costs)]


def plan(job: JobInputs, stages: Sequence[StageInputs],
         excess_at: Callable[[float], Optional[float]] = lambda lag: None) -> Planned:
    """The interval for the job from every stage's measured inputs (iterations, in [1, max_interval]).

    Predicting-based where recovery would predict: the empirical model minimises
    planner.guarded_cost_rate with rho of each stage's predictor (MEASURED_REDUCTION, or at the
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
    lam = planner.failure_rate_per_iteration(job.lambda_per_hour, iteration_time_s)
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
        return Planned(job_plan.T_c, RECOMPUTE, inputs, json_safe(_stage_dicts(job_plan, stages, costs)), why)

    if job.mode == "recompute":
        return recompute("recovery.mode is recompute")
    if job.model == "empirical":
        predictors = [stage_predictor(job, s) for s in stages]
        rho = [job.empirical().rho(job.iteration, p)[0] for p in predictors]
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
    stage_dicts = _stage_dicts(job_plan, stages, costs)
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
