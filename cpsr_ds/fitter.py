"""The fitter (Section IV-A): the loss descent trajectory, fitted on the job's own recent losses.

The paper fits the loss curve over recent spans only, since optimizer noise and the
learning-rate schedule bend it. Here the span is the second half of the run so far and
the model is l(i) = a + b ln(i) (lag.py's curve fit, degree 1): two coefficients,
stable under the per-iteration noise of training losses. Recovery uses it to turn a
lag (iterations) into the loss excess it costs; the planner issue builds its cost
model on the same fit.
"""

from __future__ import annotations

from cpsr_ds.lag import CurveFit, fit_curve

MIN_POINTS = 16  # losses needed for a fit


def recent_losses(losses: dict[int, float], f: int) -> dict[int, float]:
    """The losses of iterations f/2..f, the span the fit uses (``losses``: by iteration)."""
    return {i: loss for i, loss in losses.items() if max(1, f // 2) <= i <= f}


def fit_recent(losses: dict[int, float], f: int) -> CurveFit | None:
    """Fit the losses of iterations f/2..f (``losses``: by iteration); None with fewer than MIN_POINTS."""
    its = sorted(recent_losses(losses, f))
    if len(its) < MIN_POINTS:
        return None
    return fit_curve(its, [losses[i] for i in its], lo=f // 2, hi=f, degree=1)


def loss_excess(curve: CurveFit, f: int, lag: float) -> float:
    """Relative loss excess at f of a run ``lag`` iterations behind: (l(f - lag) - l(f)) / l(f)."""
    at = float(curve(f))
    return (float(curve(max(1.0, f - lag))) - at) / at
