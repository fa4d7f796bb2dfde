"""The recovery cost model (Section V-B, Eq. 13-14): the estimated PB-R cost of one failure.

A failure at iteration f with the last checkpoint at c loses d = f - c iterations;
recomputing them (RB-R) costs d. Predicting (PB-R) costs the lag T_p, in iterations,
that the prediction leaves behind the failure-free run. Two models estimate it, both
behind one interface, ``model.estimate(f, c, predictor) -> Estimate``:

- :class:`PaperModel`: Eq. 13 as written (Eq. 14, its linearisation, with ``exact=False``),
  from the fitted PbrParams (alpha1, alpha2 from Eq. 11 over the journal; tau1, tau2 from
  Eq. 8 over the predictor's held-out errors, fitter.accuracy_fit; xi, N_p from Eq. 7) and
  T_c, the spacing the fit scaled the held-out errors to;
- :class:`EmpiricalModel`: T_p = (1 - rho) d, rho per predictor as measured by
  the recovery benchmark (calibration.MEASURED_REDUCTION), times the share of the job's parameters predicted; where the
  learning rate decays to a planned end, rho of the default by how much of the schedule is still ahead.

How a failure maps onto the paper's t and T_c. Eq. 10's t is the time on the fits'
axis (the phase's start as origin in the planner, iteration 0 where the fits are on
absolute iterations, as fit_loss_o over the journal gives them) and t / T_c counts
the checkpoints the predictor has learnt from; Eq. 8's loss_p(t) is its held-out error,
which fit_loss_p fits on errors of predicting one interval ahead. At a failure:

- the predictor's accuracy is that at its last checkpoint: loss_p(c), not loss_p(f)
  (it has seen no checkpoint after c; Eq. 10 at f would credit it with d / T_c more);
- it predicts d iterations ahead, not T_c: an extrapolation whose rate is off, or
  ``skip``'s copy of c under a steady drift, misses each parameter by an amount that
  grows in proportion to the distance, so the squared error of Eq. 9 grows as
  (d / T_c)^DISTANCE_EXPONENT. At d = T_c this is Eq. 10 unchanged, the paper's
  "projected distance constrained by T_c" (Section IV-B);
- the excess is relative to the loss where the run resumes, so Eq. 13's
  exp(alpha1 t - alpha2) = 1 / loss_o is taken at t = f.

Hence T_p = ln(1 + x) / alpha1 (Eq. 13), or x / alpha1 (Eq. 14), with
x = exp(alpha1 f - alpha2) * xi N_p exp(-tau1 c / T_c + tau2) (d / T_c)^2 / 2.

Why the paper model estimates about 1/1000 of the measured lags (bench_recovery --quick, N_p = 136,960,
xi ~ 7.3e-6): Eq. 10 drops Eq. 6's first-order term, gradient x deviation, as small beside the second on
GPT3-3.35B; for a deviation uncorrelated with the gradient their ratio is about 2 / sqrt(N_p xi loss_p), which
grows as N_p shrinks and is 900 to 1300 on that benchmark, and the measured loss gap right after restoring is
1,200 (ridge) to 10,600 (linear) times Eq. 10's deviation, growing as d^1.5 to d^1.7 (second order alone: d^2).

The loss-excess guard belongs to the model: :func:`recovery_choice` predicts only where
the estimate is below d and a pessimistic lag (``pessimism`` times the estimate) leaves
a relative loss excess at f (by the job's loss curve: fitter.loss_excess) of at most the
limit; a missing or NaN input recomputes. :func:`evaluate` checks the models against
measured lags: Spearman rank correlation and median ratio estimate / measured.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Callable, Mapping, Optional, Protocol, Sequence

import numpy as np

from cpsr_ds.planning.calibration import END_OF_TRAINING_COS_MIN_RATIO, END_OF_TRAINING_REDUCTION, MEASURED_REDUCTION
from cpsr_ds.planning.fitter import DISTANCE_EXPONENT, AccuracyFit, LossFit, NoFit, StageCurvature
from cpsr_ds.planning.fault_tolerance_cost import PbrParams
from cpsr_ds.planning.lr_schedule import DECAY, UNKNOWN, Shape, remaining_at, warmup_cosine

PREDICT, RECOMPUTE = "predict", "recompute"
# The predictor that does not predict: c's state taken as the state at f. Recovery falls back to it for a stage
# whose own predictor diverges (its held-out error r, which is relative to exactly this, reaches the limit).
SKIP = "skip"


def diverging(r: Optional[float], max_relative_error: float) -> bool:
    """Whether the held-out error ``r`` (None: not measured) says the predictor diverges; a NaN does."""
    return r is not None and not r < max_relative_error


def _unusable(value) -> bool:
    return value is None or not math.isfinite(value)


@dataclass(frozen=True)
class Estimate:
    """A model's estimate of T_p (``lag``, iterations) with the inputs it used; falsy with a ``reason`` where it has none."""

    model: str
    lag: Optional[float]
    inputs: Mapping[str, float | str] = field(default_factory=dict)
    reason: str = ""

    def __bool__(self) -> bool:
        return self.lag is not None


class CostModel(Protocol):
    name: str

    def estimate(self, f: int, c: int, predictor: str) -> Estimate:
        """T_p of a failure at iteration f, last checkpoint c, recovered by predicting with ``predictor``."""


def _lost(model: str, f, c) -> Estimate | float:
    """d = f - c, or an Estimate saying why there is none to estimate from."""
    if _unusable(f) or _unusable(c) or not c <= f:
        return Estimate(model, None, {"f": str(f), "c": str(c)}, f"no failure to estimate from: f = {f}, c = {c}")
    return f - c


@dataclass(frozen=True)
class PaperModel:
    """Eq. 13 (``exact``) or Eq. 14 from ``params`` and ``T_c``; ``missing``: why there are no params.

    One per predictor: tau1, tau2 fit that predictor's held-out errors, so the ``predictor``
    given to :meth:`estimate` is only recorded.
    """

    params: Optional[PbrParams]
    T_c: Optional[float]
    exact: bool = True
    missing: str = ""

    @property
    def name(self) -> str:
        return "paper" if self.exact else "paper-eq14"

    def estimate(self, f: int, c: int, predictor: str) -> Estimate:
        d = _lost(self.name, f, c)
        if isinstance(d, Estimate):
            return d
        p = self.params
        if p is None:
            return Estimate(self.name, None, {"d": d}, f"no {self.name} estimate: {self.missing}")
        inputs = {"d": d, "predictor": predictor, "T_c": self.T_c, **asdict(p)}
        if d == 0:
            return Estimate(self.name, 0.0, inputs)
        log_excess = (p.log_excess0 + p.alpha1 * f - p.tau1 * c / self.T_c
                      + DISTANCE_EXPONENT * math.log(d / self.T_c))
        # ln(1 + x) through logaddexp, so that an x beyond float range still gives ln x
        lag = float(np.logaddexp(0.0, log_excess) if self.exact else math.exp(min(log_excess, 700.0))) / p.alpha1
        return Estimate(self.name, lag, {**inputs, "relative_excess": math.exp(min(log_excess, 700.0))})


def paper_model(loss: LossFit | NoFit, accuracy: AccuracyFit | NoFit, curvature: StageCurvature | NoFit,
                exact: bool = True) -> PaperModel:
    """The paper's model from the fitter's results; a NoFit among them leaves it without params, saying why."""
    missing = [f"{what}: {fit.reason}" for what, fit in
               (("loss curve (Eq. 11)", loss), ("accuracy curve (Eq. 8)", accuracy), ("xi (Eq. 7)", curvature))
               if not fit]
    if missing:
        return PaperModel(None, None, exact, "; ".join(missing))
    try:
        params = PbrParams(loss.alpha1, loss.alpha2, accuracy.tau1, accuracy.tau2, curvature.xi, curvature.n_p)
    except ValueError as err:
        return PaperModel(None, None, exact, str(err))
    return PaperModel(params, accuracy.T_c, exact)


def end_of_training_profiles() -> dict[str, tuple[tuple[float, float], ...]]:
    """calibration.END_OF_TRAINING_REDUCTION as (q, rho): each measured place's share of the learning-rate area
    still ahead under the schedule it was measured with."""
    rates = warmup_cosine(1000, END_OF_TRAINING_COS_MIN_RATIO)
    return {predictor: tuple((remaining_at(rates, place), rho) for place, rho in profile)
            for predictor, profile in END_OF_TRAINING_REDUCTION.items()}


@dataclass(frozen=True)
class EmpiricalModel:
    """T_p = (1 - rho) d N_p / N, ``reduction``: rho per predictor name; ``share``: N_p / N.

    rho was measured predicting every parameter. Where exact sources (survivor dumps,
    replicas) give some stages their state at f, only N_p of the job's N parameters are
    predicted (Section VI-A: the interrupted task alone), and the lag is taken to scale
    with that share: to first order the loss gap a prediction leaves is a sum over the
    predicted parameters (Eq. 6), as Eq. 13's x scales with N_p.
    bench_recovery's ``--layouts pp2`` checks the scaling against measured lags.

    ``schedule``: the learning-rate schedule's shape at the failure (planning/lr_schedule.py;
    None: not known to the caller, taken as constant). The lag that counts is the one left
    at the end of training, which ``reduction`` (measured over [2d, 4d] after f) does not
    see. Where the schedule decays, a predictor with a profile in ``by_remaining`` takes rho
    at q, the share of the run's learning-rate area still ahead (linear between the measured
    points, constant beyond them); where it stays constant, ``reduction``'s rho holds to the
    end; a schedule of unknown shape gives no estimate, so recovery recomputes.

    ``horizon``: how far ahead the predictor's held-out check predicted (c minus the
    checkpoint before it), the distance rho holds to: bench_recovery measured it at d < T_c.
    A failure farther from c (one during the next checkpoint's persist, or again before a
    checkpoint after a predicted restart) is extrapolated beyond anything checked, and its lag
    is taken to grow as the paper model's does, as (d / T_c)^DISTANCE_EXPONENT: by
    (d / horizon)^(DISTANCE_EXPONENT - 1) over (1 - rho) d, continuous at d = horizon.
    None: no such bound (the planner's, where failures lie within an interval and a persist).
    """

    reduction: Mapping[str, float] = field(default_factory=lambda: dict(MEASURED_REDUCTION))
    name: str = "empirical"
    share: float = 1.0
    schedule: Optional[Shape] = None
    horizon: Optional[float] = None
    by_remaining: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=end_of_training_profiles)

    def rho(self, predictor: str) -> tuple[Optional[float], Optional[float]]:
        """(rho, the failure's place in the planned run or None where rho does not depend on it)."""
        profile = self.by_remaining.get(predictor)
        if profile and self.schedule is not None and self.schedule.kind == DECAY:
            remaining, reductions = zip(*sorted(profile))
            return float(np.interp(self.schedule.remaining, remaining, reductions)), self.schedule.place
        return self.reduction.get(predictor), None

    def estimate(self, f: int, c: int, predictor: str) -> Estimate:
        d = _lost(self.name, f, c)
        if isinstance(d, Estimate):
            return d
        if self.schedule is not None and self.schedule.kind == UNKNOWN:
            return Estimate(self.name, None, {"d": d}, f"no end-of-training estimate: {self.schedule.reason}")
        rho, place = self.rho(predictor)
        if rho is None or not math.isfinite(rho):
            return Estimate(self.name, None, {"d": d},
                            f"no measured reduction for predictor {predictor!r} (known: {', '.join(sorted(self.reduction))})")
        if not 0.0 <= self.share <= 1.0:
            return Estimate(self.name, None, {"d": d, "rho": rho}, f"the share predicted, {self.share}, is not in [0, 1]")
        reach = d / self.horizon if self.horizon and self.horizon > 0 and d > self.horizon else None
        inputs = {"d": d, "rho": rho, **({} if place is None else {"place": place, "remaining": self.schedule.remaining}),
                  **({} if self.share == 1.0 else {"share": self.share}),
                  **({} if reach is None else {"horizon": self.horizon})}
        beyond = 1.0 if reach is None else reach ** (DISTANCE_EXPONENT - 1)
        return Estimate(self.name, (1.0 - rho) * d * self.share * beyond, inputs)


@dataclass(frozen=True)
class Choice:
    """How to recover, why, and the guard's numbers (None where it did not get that far)."""

    method: str  # PREDICT or RECOMPUTE
    reason: str
    estimate: Estimate
    guard_lag: Optional[float] = None
    loss_excess: Optional[float] = None


def _where(estimate: Estimate) -> str:
    """Where rho depends on the failure's place in the planned run, that place and its rho; where d is beyond
    the predictor's checked horizon, both."""
    said = []
    if estimate.inputs.get("place") is not None:
        said.append(f"rho {estimate.inputs['rho']:.2f} at {estimate.inputs['place']:.0%} of the planned run, "
                    f"{estimate.inputs['remaining']:.0%} of its learning-rate area ahead")
    if estimate.inputs.get("horizon") is not None:
        said.append(f"{estimate.inputs['d']} iterations ahead, beyond the {estimate.inputs['horizon']:g} its "
                    f"held-out check predicted")
    return f" ({'; '.join(said)})" if said else ""


def recovery_choice(estimate: Estimate, d: int, excess_at: Callable[[float], Optional[float]],
                    max_loss_excess: float, pessimism: float, carried: float = 0.0) -> Choice:
    """PREDICT or RECOMPUTE for a failure that lost d iterations, by ``estimate``.

    ``excess_at(lag)``: the relative loss excess a lag of ``lag`` iterations leaves at f
    (fitter.loss_excess on the job's curve; None where the journal is too short to fit,
    which does not stop a prediction). The guard's lag is ``pessimism`` times the sum of
    the estimate and ``carried`` (the estimated lag, in iterations, the run already carries
    from its earlier predictions: lags add up, and under a decaying learning rate they stay
    to the end of training): one recovery's lag varies far more than the mean, and the
    carried estimates are no surer than the new one (in bench_ftcost the lag measured at the end of
    training was 1.4 to 3.3 times the sum of the estimates in 5 of 6 runs that predicted). No estimate,
    a NaN or None among the inputs, an estimate not below d or an excess above
    ``max_loss_excess`` recompute: every comparison is written so that NaN fails it.
    """
    def recompute(reason, lag=None, excess=None):
        return Choice(RECOMPUTE, reason, estimate, lag, excess)

    if not estimate:
        return recompute(estimate.reason)
    for name, value in (("d", d), ("the estimated lag", estimate.lag), ("max_loss_excess", max_loss_excess),
                        ("the guard's pessimism", pessimism), ("the carried lag", carried)):
        if _unusable(value):
            return recompute(f"{name} is {value}: no comparison to make")
    if not estimate.lag < d:
        return recompute(f"{estimate.model} estimates a lag of {estimate.lag:.1f} iterations{_where(estimate)}, "
                         f"not below the {d} recomputing costs")
    lag = pessimism * (carried + estimate.lag)
    excess = excess_at(lag)
    if excess is not None and not math.isfinite(excess):
        return recompute(f"the loss excess a lag of {lag:.1f} iterations leaves is {excess} "
                         "(non-finite losses in the journal)", lag, excess)
    if excess is not None and not excess <= max_loss_excess:
        earlier = f" ({pessimism * carried:.1f} of them carried from earlier predictions)" if carried else ""
        return recompute(f"a lag of {lag:.1f} iterations{earlier} would leave the loss {excess:.2%} higher, "
                         f"above max_loss_excess {max_loss_excess:.2%}", lag, excess)
    guard = "" if excess is None else f", loss excess at a lag of {lag:.1f}: {excess:.2%}"
    return Choice(PREDICT, f"{estimate.model} estimates a lag of {estimate.lag:.1f} of {d} iterations"
                  f"{_where(estimate)}{guard}",
                  estimate, lag, excess)


# ---------------------------------------------------------------- checked against measured lags


@dataclass(frozen=True)
class Case:
    """One predicting recovery: ``measured`` lag (None: unmeasurable) and each model's estimate (None: none)."""

    predictor: str
    measured: Optional[float]
    estimates: Mapping[str, Optional[float]]


def _spearman(estimated: Sequence[float], measured: Sequence[float]) -> Optional[float]:
    """Spearman's rank correlation (ties averaged); None where it is undefined (under 3 pairs, a constant side)."""
    if len(estimated) < 3 or len(set(estimated)) < 2 or len(set(measured)) < 2:
        return None
    from scipy import stats  # a second to import: only the benchmarks compare models

    return float(stats.spearmanr(estimated, measured).statistic)


def evaluate(cases: Sequence[Case]) -> dict:
    """Per model: Spearman's correlation of its estimates with the measured lags, and the median
    ratio estimate / measured overall and per predictor, over the cases that have both.

    Unmeasurable cases and cases the model gave no estimate for are counted, not entered;
    a measured lag <= 0 (the recovered run caught up) enters the correlation but has no ratio.
    """
    models = sorted({m for case in cases for m in case.estimates})
    unmeasurable = sum(_unusable(case.measured) for case in cases)
    report = {}
    for model in models:
        pairs = [(case.predictor, case.estimates[model], case.measured) for case in cases
                 if not _unusable(case.measured) and not _unusable(case.estimates.get(model))]
        ratios: dict[str, list[float]] = {}
        for predictor, estimated, measured in pairs:
            if measured > 0:
                ratios.setdefault(predictor, []).append(estimated / measured)
        report[model] = {
            "n": len(pairs),
            "unmeasurable": unmeasurable,
            "no_estimate": len(cases) - unmeasurable - len(pairs),
            "no_ratio": sum(measured <= 0 for _, _, measured in pairs),
            "spearman": _spearman([e for _, e, _ in pairs], [m for _, _, m in pairs]),
            "median_ratio": median([r for rs in ratios.values() for r in rs]) if ratios else None,
            "median_ratio_by_predictor": {p: median(rs) for p, rs in sorted(ratios.items())},
        }
    return report
