"""The fitter (Sections III-C, IV-A, V-A): the curves and statistics the cost model and planner read.

Pure functions of numbers the job already has (its journal's losses, the predictor's
held-out errors, Adam's second moment at checkpoints); reading them is the caller's job.

- :func:`fit_loss_o`: the training loss curve loss_o(t) = exp(-alpha1 t + alpha2), Eq. 11,
  over a recent window of the job's own losses;
- :func:`fit_recent` / :func:`loss_excess`: the log-linear fit l(t) = a + b ln t the
  loss-excess guard of recovery uses (see :func:`fit_recent` for why it stays), a
  :class:`CurveFit` (:func:`fit_curve`: a polynomial in ln t, which the benchmarks'
  lag estimator fits to a reference's validation losses too);
- :func:`held_out_error` (Eq. 9) and :func:`accuracy_fit` (:func:`fit_loss_p` at one
  spacing): the predictor's accuracy curve loss_p(t) = exp(-tau1 t / T_c + tau2), Eq. 8, one fit
  for the planner and recovery alike;
- :func:`stage_xi` (Eq. 7; :func:`xi_sums` and :func:`curvature_of` where the stage's state is
  split among data-parallel ranks) and :func:`next_phase`: the curvature xi of a pipeline stage
  and the training phases it divides the run into (Section V-C).

Inputs a fit cannot describe (too few points, a non-finite or non-positive value, a
curve that is flat, rising or too noisy to tell) give a :class:`NoFit` with the reason,
never an exception, a NaN or a non-positive rate: Eq. 13-16 divide by alpha1 and need
tau1 > 0, and none of the paper's model holds for a curve that does not fall, so the
caller falls back (the planner to recompute-based planning) and logs the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch
# scipy.special, not scipy.stats: a third of the import time. Imported with the module: the planner's first fit runs
# inside a checkpoint's measured time, which an import there (a second for scipy.stats) would be charged to.
from scipy.special import stdtrit

MIN_POINTS = 16  # losses needed for a loss-curve fit
MIN_CHECKPOINTS = 3  # held-out errors needed for an accuracy-curve fit (a slope and its error)
ACCURACY_WINDOW = 16  # the newest held-out errors the accuracy curve is fitted on
DISTANCE_EXPONENT = 2.0  # the held-out error's growth with the distance predicted, (d / T_c)^2
PHASE_THRESHOLD = 0.05  # accumulated relative change of xi that starts a new phase (Section VI-C5)
# A slope within this many log units over the whole window is no slope (rounding of a constant).
FLAT_LOG_CHANGE = 1e-9
FIT_DEGREE = 2  # of a CurveFit: quadratic in log-iterations, smooth, yet bends with the curve over a few T_c

CHUNK = 1 << 20  # values summed at a time in float64 (sum64, squared_distance)

# NoFit causes
TOO_FEW = "too few"
NOT_POSITIVE = "not finite and positive"
FLAT = "flat"
RISING = "rising"


@dataclass(frozen=True)
class NoFit:
    """No fit: ``cause`` is one of TOO_FEW, NOT_POSITIVE, FLAT, RISING; ``reason`` says it for the log.

    Falsy, so ``if not fit`` reads as "no fit".
    """

    cause: str
    reason: str

    def __bool__(self) -> bool:
        return False


@dataclass(frozen=True)
class LossFit:
    """loss_o(t) = exp(-alpha1 t + alpha2) (Eq. 11), fitted over iterations ``lo``..``hi``.

    alpha1: per iteration, > 0 (the loss falls by the factor exp(-alpha1) each iteration);
    alpha2: ln of the loss the curve extrapolates to at t = 0; rmse_log: root mean square
    of ln(loss) - ln(loss_o(t)) over the window, i.e. the fit's relative error (0.01 = 1 %);
    n: the losses fitted.
    """

    alpha1: float
    alpha2: float
    rmse_log: float
    lo: int
    hi: int
    n: int

    def __call__(self, t):
        return np.exp(-self.alpha1 * np.asarray(t, dtype=float) + self.alpha2)


@dataclass(frozen=True)
class AccuracyFit:
    """loss_p(t) = exp(-tau1 t / T_c + tau2) (Eq. 8), fitted on held-out errors at checkpoints.

    t in iterations, T_c in iterations (so t / T_c counts checkpoints); tau1 > 0 per
    checkpoint; tau2: ln of the error (squared parameter units, Eq. 9) at t = 0;
    rmse_log: root mean square of ln(error) - ln(loss_p(t)), the relative error of the fit.
    """

    tau1: float
    tau2: float
    T_c: float
    rmse_log: float
    n: int

    def __call__(self, t):
        return np.exp(-self.tau1 * np.asarray(t, dtype=float) / self.T_c + self.tau2)


@dataclass(frozen=True)
class CurveFit:
    """Loss as a polynomial in log(iteration), fitted over ``[lo, hi]``; ``scatter``: the RMS of its residuals."""

    coefficients: np.ndarray
    lo: float
    hi: float
    scatter: float = 0.0

    def __call__(self, iteration):
        return np.polyval(self.coefficients, np.log(np.asarray(iteration, dtype=float)))


def fit_curve(iterations, losses, lo: float, hi: float, degree: int = FIT_DEGREE) -> CurveFit:
    """Fit the losses measured in ``[lo, hi]`` with a polynomial of ``degree`` in log(iteration)."""
    it = np.asarray(iterations, dtype=float)
    ls = np.asarray(losses, dtype=float)
    keep = (it >= lo) & (it <= hi) & (it > 0)
    if keep.sum() <= degree + 1:
        raise ValueError(f"need more than {degree + 1} reference points in [{lo}, {hi}], got {int(keep.sum())}")
    coefficients = np.polyfit(np.log(it[keep]), ls[keep], degree)
    residuals = ls[keep] - np.polyval(coefficients, np.log(it[keep]))
    return CurveFit(coefficients, lo, hi, float(np.sqrt(np.mean(residuals ** 2))))


def t_975(dof: int) -> float:
    """Student's t distribution's 97.5 % quantile with ``dof`` degrees of freedom: a two-sided 95 % interval's."""
    return float(stdtrit(dof, 0.975))


def _falling_exponential(x: np.ndarray, y: np.ndarray, what: str, minimum: int, x_name: str = "t"):
    """Fit y = exp(-rate x + intercept) by least squares on ln y: (rate, intercept, rmse_log), or a NoFit.

    The rate must be positive at 95 % confidence (two-sided t-test on the slope):
    otherwise the data are flat, rising, or too noisy to say that they fall.
    """
    if len(x) < minimum:
        return NoFit(TOO_FEW, f"{len(x)} {what}, need at least {minimum}")
    bad = ~(np.isfinite(y) & (y > 0) & np.isfinite(x))
    if bad.any():
        j = int(np.argmax(bad))
        return NoFit(NOT_POSITIVE, f"{what}: {y[j]:g} at {x_name} = {x[j]:g}, ln undefined")
    ln = np.log(y)
    dx = x - x.mean()
    sxx = float(dx @ dx)
    if sxx == 0.0:
        return NoFit(TOO_FEW, f"all {len(x)} {what} at the same {x_name} = {x[0]:g}")
    slope = float(dx @ (ln - ln.mean())) / sxx
    intercept = float(ln.mean() - slope * x.mean())
    residuals = ln - (slope * x + intercept)
    rmse = math.sqrt(float(residuals @ residuals) / len(x))
    # Standard error of the slope, n - 2 degrees of freedom.
    se = math.sqrt(float(residuals @ residuals) / (len(x) - 2) / sxx)
    bound = t_975(len(x) - 2) * se
    span = float(x.max() - x.min())
    if -slope <= bound or -slope * span <= FLAT_LOG_CHANGE:
        cause = RISING if slope > bound and slope * span > FLAT_LOG_CHANGE else FLAT
        return NoFit(cause, f"{what} {'rise' if cause == RISING else 'do not fall measurably'} over "
                            f"{x_name} = {x.min():g}..{x.max():g}: ln slope {slope:.3g} +- {bound:.2g} (95 %)")
    return -slope, intercept, rmse


def recent_losses(losses: dict[int, float], f: int, start: int | None = None) -> dict[int, float]:
    """The losses (by iteration) of the window ``start``..f (``start`` None: f/2, the recent span of Section III-C)."""
    lo = max(1, f // 2) if start is None else start
    return {i: loss for i, loss in losses.items() if lo <= i <= f}


def fit_loss_o(losses: dict[int, float], f: int, start: int | None = None) -> LossFit | NoFit:
    """Eq. 11 fitted on the losses (by iteration, the journal's or validation losses) of ``start``..f.

    ``start`` None is the recent window f/2..f. Least squares on ln(loss), so each loss
    weighs by its relative deviation, the noise a training loss has. Over a window where
    the curve bends, alpha1 is the window's mean rate, steeper than the rate at f (by
    about a quarter on the benchmark's validation curves, see :func:`fit_recent`).
    """
    recent = recent_losses(losses, f, start)
    its = sorted(recent)
    fit = _falling_exponential(np.array(its, dtype=float), np.array([recent[i] for i in its], dtype=float),
                               "losses", MIN_POINTS)
    if not fit:
        return fit
    alpha1, alpha2, rmse = fit
    return LossFit(alpha1, alpha2, rmse, its[0], its[-1], len(its))


def fit_recent(losses: dict[int, float], f: int) -> CurveFit | None:
    """l(t) = a + b ln t fitted on the losses of iterations f/2..f (``losses``: by iteration); None with fewer than MIN_POINTS.

    The loss-excess guard of recovery uses this fit, not Eq. 11: how much loss a lag
    leaves at f depends on the curve's slope at f, and this fit has it closer. Measured
    on the six validation curves of the recovery benchmark (GPT, cosine schedule, 2000
    and 4000 iterations, 33 cut points f from 0.2 to 0.67 of the run), each fit on f/2..f:
    held-out RMSE (loss units), median, over f..f + f/8: a + b ln t 0.0066, Eq. 11 0.0150;
    over f..f + f/2: 0.0119 against 0.0425 (better at 33 of 33); relative slope at f
    (measured: a line through the losses of f - f/8..f + f/8), median |fit / measured - 1|:
    0.09 against 0.27, Eq. 11 too steep (one exponential cannot bend with the curve over
    the window). On a 300-iteration training journal (7 cut points) the two tie, both at
    the per-iteration noise (held-out RMSE 0.090 and 0.085 over f..f + f/2).
    """
    its = sorted(recent_losses(losses, f))
    if len(its) < MIN_POINTS:
        return None
    return fit_curve(its, [losses[i] for i in its], lo=f // 2, hi=f, degree=1)


def loss_excess(curve: CurveFit, f: int, lag: float) -> float:
    """Relative loss excess at f of a run ``lag`` iterations behind: (l(f - lag) - l(f)) / l(f)."""
    at = float(curve(f))
    return (float(curve(max(1.0, f - lag))) - at) / at


def sum64(a: torch.Tensor) -> float:
    """sum(a) of a flat tensor in float64, a chunk at a time: at once, torch would first copy all of it into
    float64, twice a float32 vector's memory, which at a checkpoint or recovery is a share of a stage."""
    return sum(float(c.sum(dtype=torch.float64)) for c in a.split(CHUNK))


def squared_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """sum((a - b)^2) of two flat tensors: the difference and its square in float32, summed in float64 a chunk at a
    time (see :func:`sum64`). Each square is then within 2^-23 of itself, far inside any prediction error this
    measures; taking it in float64 copied both chunks into float64 first, which made the held-out check at every
    checkpoint (two distances over the stage's share) six times as slow (1.6 against 0.26 ms for 170k values)."""
    return sum(float(torch.sub(x.float(), y.float()).square_().sum(dtype=torch.float64))
               for x, y in zip(a.split(CHUNK), b.split(CHUNK)))


def held_out_error(predictor_output: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> float:
    """Eq. 9: sum over the N_p parameters of (x - y)^2 / N_p, squared parameter units.

    Both dicts are keyed ``kind/name`` as recovery's ``engine_state`` gives them; Eq. 9
    is over parameters only, so the ``param/`` entries of ``truth`` are compared and
    the moments ignored. A non-finite prediction is infinitely wrong: inf, never NaN.
    A parameter missing from the prediction or of another shape is a ValueError naming it.
    """
    total, n_p = 0.0, 0
    for key, y in truth.items():
        if not key.startswith("param/"):
            continue
        x = predictor_output.get(key)
        if x is None or x.shape != y.shape:
            raise ValueError(f"the prediction of {key} is {'missing' if x is None else tuple(x.shape)}, "
                             f"the true state's is {tuple(y.shape)}")
        total += squared_distance(x.detach().reshape(-1), y.detach().reshape(-1))
        n_p += y.numel()
    if n_p == 0:
        raise ValueError(f"no param/ entry in the true state (keys: {sorted(truth)[:5]})")
    return total / n_p if math.isfinite(total) else math.inf


def fit_loss_p(points, T_c: float) -> AccuracyFit | NoFit:
    """Eq. 8 fitted on (iteration t, held-out error) pairs measured at checkpoints T_c iterations apart.

    Least squares on ln(error) against t / T_c. T_c must be positive.
    """
    if not (math.isfinite(T_c) and T_c > 0):
        return NoFit(NOT_POSITIVE, f"checkpoint interval T_c = {T_c}: must be positive")
    pts = sorted(points)
    fit = _falling_exponential(np.array([t for t, _ in pts], dtype=float) / T_c,
                               np.array([e for _, e in pts], dtype=float), "held-out errors", MIN_CHECKPOINTS, "t / T_c")
    if not fit:
        return fit
    tau1, tau2, rmse = fit
    return AccuracyFit(tau1, tau2, float(T_c), rmse, len(pts))


def accuracy_fit(errors: Sequence[tuple[int, float]], whose: str = "") -> AccuracyFit | NoFit:
    """Eq. 8 on (checkpoint iteration, held-out error) pairs, spaced as the checkpoints were: the planner's fit and
    recovery's paper model's alike.

    Each error predicted its checkpoint from the one before it, h iterations earlier; an interval that changed
    mid-way (``checkpoint.interval: auto``) changes h. Errors grow as (h / T_c)^DISTANCE_EXPONENT with the
    distance predicted, as the cost model takes them to, so each is scaled to the newest spacing T_c before
    fitting the newest ACCURACY_WINDOW of them. The first error has no known spacing and is left out.
    ``whose``: whose errors they are, for a NoFit's reason.
    """
    pairs = sorted(dict(errors).items())
    spaced = [(t, e, t - before) for (before, _), (t, e) in zip(pairs, pairs[1:])]
    if len(spaced) < MIN_CHECKPOINTS:
        of = f" of {whose}" if whose else ""
        return NoFit(TOO_FEW, f"{len(pairs)} held-out errors{of}, need at least {MIN_CHECKPOINTS + 1} (the first, "
                              f"with no checkpoint before it to space it by, is left out)")
    T_c = spaced[-1][2]
    scaled = [(t, e * (T_c / h) ** DISTANCE_EXPONENT) for t, e, h in spaced[-ACCURACY_WINDOW:]]
    return fit_loss_p(scaled, T_c)


@dataclass(frozen=True)
class StageCurvature:
    """xi (Eq. 7) of one pipeline stage, squared gradient units; n_p: its parameters (elements)."""

    xi: float
    n_p: int


class XiSums(NamedTuple):
    """The sums xi (Eq. 7) is made of, over part of a stage's state: added up over the parts (data-parallel
    shares), they give the whole stage's (:func:`curvature_of`)."""

    v_sum: float  # sum of exp_avg_sq
    count: int  # values of exp_avg_sq
    n_p: int  # parameters (elements), optimised or not


def xi_sums(state: dict[str, torch.Tensor]) -> XiSums:
    """The sums of ``state`` (keys ``param/``, ``exp_avg_sq/`` as recovery's ``engine_state`` gives them, or a
    share of them): :func:`curvature_of` of them is :func:`stage_xi`."""
    moments = [t.detach().reshape(-1) for key, t in state.items() if key.startswith("exp_avg_sq/")]
    return XiSums(sum(sum64(m) for m in moments),
                  sum(m.numel() for m in moments),
                  sum(t.numel() for key, t in state.items() if key.startswith("param/")))


def curvature_of(sums: XiSums) -> StageCurvature | NoFit:
    """xi = sum_j v_j / N_p (Eq. 7) from a stage's :class:`XiSums`; see :func:`stage_xi`."""
    if sums.count == 0:
        return NoFit(TOO_FEW, "no exp_avg_sq in the state: the optimizer keeps no second moment")
    xi = sums.v_sum / sums.count
    if not (math.isfinite(xi) and xi > 0):
        return NoFit(NOT_POSITIVE, f"mean exp_avg_sq over {sums.count} parameters is {xi}")
    return StageCurvature(xi, sums.n_p)


def stage_xi(state: dict[str, torch.Tensor]) -> StageCurvature | NoFit:
    """xi = sum_j v_j / N_p over the stage's parameters (Eq. 7), from a checkpoint's state.

    ``state``: a stage's ``engine_state`` (keys ``param/``, ``exp_avg_sq/``). Adam's step
    t stores v_t = beta2 v_{t-1} + (1 - beta2) g_t^2, which is Eq. 7's bracket, so at a
    checkpoint taken after step t the stored ``exp_avg_sq`` is that bracket and xi is its
    mean; the bias correction Adam divides by is not applied (Eq. 7 has none). Parameters
    without a second moment (not optimised) count in N_p but not in the mean. No second
    moment at all, or a non-finite or zero one (before the first step), is a NoFit.
    """
    return curvature_of(xi_sums(state))


@dataclass(frozen=True)
class Phase:
    """A training phase (Section V-C): ``index`` from 0, begun at checkpoint iteration ``start``.

    ``xi_start``: xi when it began, the constant the phase's plan uses; ``xi_last``: the
    latest xi seen; ``change``: its accumulated relative change so far (see :func:`next_phase`).
    """

    index: int
    start: int
    xi_start: float
    xi_last: float
    change: float = 0.0


def next_phase(phase: Phase | None, iteration: int, xi: float,
               threshold: float = PHASE_THRESHOLD) -> Phase | None:
    """The phase after xi = ``xi`` was measured at the checkpoint of ``iteration``.

    The accumulated relative change of a phase begun at checkpoint s is
    sum_{k = s+1..current} |xi_k - xi_{k-1}| / xi_s over its checkpoints (every wiggle
    counts, so a xi that oscillates also ends the phase). Once it exceeds ``threshold``
    a new phase begins at this checkpoint, with this xi as its start. ``phase`` None
    begins phase 0. A xi that is not finite and positive is skipped: the phase is returned
    unchanged (None stays None), since a ratio to it is meaningless.
    """
    if not (math.isfinite(xi) and xi > 0):
        return phase
    if phase is None:
        return Phase(0, iteration, xi, xi)
    change = phase.change + abs(xi - phase.xi_last) / phase.xi_start
    if change > threshold:
        return Phase(phase.index + 1, iteration, xi, xi)
    return Phase(phase.index, phase.start, phase.xi_start, xi, change)


def phases(xis, threshold: float = PHASE_THRESHOLD) -> list[Phase]:
    """The phase at each checkpoint for a sequence of (iteration, xi): :func:`next_phase` folded over it.

    Entries before the first usable xi are None.
    """
    out, phase = [], None
    for iteration, xi in xis:
        phase = next_phase(phase, iteration, xi, threshold)
        out.append(phase)
    return out
