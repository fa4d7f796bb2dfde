"""Recovery cost as lag behind the reference: the estimator the recovery benchmarks measure with.

A recovered run that restarts at iteration f is compared with the failure-free
reference through a smooth fit of the reference's validation curve
(cpsr_ds.planning.fitter.fit_curve): at f + k it has the loss the reference had at
iteration i*, so it runs L(k) = (f + k) - i* iterations behind. The lag L is L(k)
averaged over a late window, k in [2d, 4d], after the transient has passed.

Where the reference's fit cannot tell a lag (it is flat or rises around the window,
or a loss lies beyond what it spans), the case is :class:`Unmeasurable`, with the
reason, never a number: one lag at the search's limit would swing a mean by far more
than every measured case together.
"""

from __future__ import annotations

import math

import numpy as np

from cpsr_ds.planning.fitter import CurveFit, t_975

# A change of the fit below this share of the loss is rounding, not a slope: an exactly
# flat reference's fit varies by about 1e-16.
_ROUNDING = 1e-9
_GRID = 4001


class Unmeasurable(Exception):
    """The reference's fit cannot turn a run's losses into a lag; ``kind`` names why, the message says it fully."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def iteration_at(fit: CurveFit, loss: float, margin: float) -> float:
    """The first iteration where ``fit`` reaches ``loss``, searched over its span widened by ``margin``.

    Beyond the span's ends the fit is extrapolated; a loss it does not reach within
    the widened span is :class:`Unmeasurable` (a lag clipped to the search's end would
    be a number the data never showed).
    """
    grid = np.linspace(max(1.0, fit.lo - margin), fit.hi + margin, _GRID)
    values = fit(grid)
    below = np.nonzero(values <= loss)[0]
    if len(below) == 0 or below[0] == 0:
        raise Unmeasurable("out of range", f"the loss {loss:.4f} lies outside the reference fit's range "
                           f"{values.min():.4f}-{values.max():.4f} over iterations {grid[0]:.0f}-{grid[-1]:.0f}")
    j = below[0]
    # Linear interpolation between the grid points that straddle the loss.
    x0, x1, y0, y1 = grid[j - 1], grid[j], values[j - 1], values[j]
    return float(x0 + (loss - y0) * (x1 - x0) / (y1 - y0))


def lag_at(fit: CurveFit, iteration: int, loss: float, margin: float, residual: float = 0.0) -> float:
    """L(k) for a recovered run with validation ``loss`` at ``iteration`` = f + k.

    ``residual``: the reference's own deviation from its fit at the same iteration. Runs
    that see the same batch at the same iteration share most of that deviation, so
    subtracting it (the paired estimate) removes noise the fit cannot.
    """
    return iteration - iteration_at(fit, loss - residual, margin)


def late_lag(fit: CurveFit, f: int, d: int, points: dict[int, float], margin: float,
             reference: dict[int, float] | None = None) -> float:
    """L: the mean of L(k) over the recovered run's evaluations at k in [2d, 4d].

    With ``reference`` (validation loss by iteration) the estimate is paired (see :func:`lag_at`).
    :class:`Unmeasurable` where the fit is flat or not decreasing around the window, or a
    loss lies beyond its range.
    """
    window = {f + k: loss - _residual(fit, reference, f + k) for k, loss in points.items() if 2 * d <= k <= 4 * d}
    if not window:
        raise ValueError(f"no evaluation in the late window k in [{2 * d}, {4 * d}]")
    check_resolvable(fit, f, d, len(window))
    # A run lagging up to d is compared with the reference from f + d on. Checked before
    # inverting: on a rising fit the inversion fails too, but names no cause.
    check_decreasing(fit, f + d, f + 4 * d)
    found = {i: iteration_at(fit, loss, margin) for i, loss in window.items()}
    check_decreasing(fit, min(f + d, *found.values()), max(f + 4 * d, *found.values()))
    return float(np.mean([i - found[i] for i in window]))


def check_resolvable(fit: CurveFit, f: int, d: int, evaluations: int) -> None:
    """:class:`Unmeasurable` ("flat") where a lag of d moves the window's mean loss less than the reference's scatter.

    The window's mean loss has the scatter of the reference around its fit over the
    square root of the number of evaluations; where the fit falls less than that over d
    iterations, a lag of d cannot be told from none.
    """
    a, b = f + 2 * d, f + 4 * d
    fall = float(fit(a) - fit(b)) / 2
    noise = max(fit.scatter / math.sqrt(evaluations), _ROUNDING * abs(float(fit(b))))
    if abs(fall) <= noise:
        raise Unmeasurable("flat", f"the reference's fit is flat over iterations {a}-{b}: it changes {fall:+.2g} per "
                           f"d = {d} iterations, within its scatter {fit.scatter:.2g} over {evaluations} evaluations")


def check_decreasing(fit: CurveFit, a: float, b: float) -> None:
    """:class:`Unmeasurable` ("not decreasing") unless the fit falls all the way from iteration ``a`` to ``b``.

    Where it rises, one loss maps to more than one iteration, or to none.
    """
    grid = np.linspace(a, b, _GRID)
    rising = np.nonzero(np.diff(fit(grid)) >= 0)[0]
    if len(rising):
        raise Unmeasurable("not decreasing", f"the reference's fit does not decrease over iterations {a:.0f}-{b:.0f}: "
                           f"it rises from iteration {grid[rising[0]]:.0f} on")


def _residual(fit: CurveFit, reference: dict[int, float] | None, iteration: int) -> float:
    return 0.0 if reference is None else reference[iteration] - float(fit(iteration))


def transient(fit: CurveFit, f: int, d: int, points: dict[int, float], late: float, margin: float,
              reference: dict[int, float] | None = None, tolerance: float = 0.1) -> int:
    """Iterations until L(k) comes within ``tolerance * d`` of its late value and stays there."""
    settled = None
    for k in sorted(points):
        try:
            near = abs(lag_at(fit, f + k, points[k], margin, _residual(fit, reference, f + k)) - late) <= tolerance * d
        except Unmeasurable:
            near = False  # far off the curve, as right after a bad prediction: not settled
        settled = (k if settled is None else settled) if near else None
    return 4 * d if settled is None else settled


def mean_ci95(values) -> tuple[float, float, float]:
    """Mean and the Student-t 95 % interval of the mean."""
    x = np.asarray(values, dtype=float)
    mean = float(x.mean())
    if len(x) < 2:
        return mean, -math.inf, math.inf
    half = t_975(len(x) - 1) * float(x.std(ddof=1)) / math.sqrt(len(x))
    return mean, mean - half, mean + half


def summarize(measured, unmeasurable) -> dict:
    """Median, mean and its 95 % interval, and standard deviation of the ``measured`` values; the ``unmeasurable``
    cases counted by kind.

    Both the median and the mean: a few extreme cases move the mean and its interval
    far, the median hardly; a reader sees how far they disagree. None where nothing
    was measured.
    """
    x = [float(v) for v in measured]
    kinds = {kind: list(unmeasurable).count(kind) for kind in sorted(set(unmeasurable))}
    out = {"median": None, "mean": None, "ci95": None, "sd": None, "measured": len(x),
           "unmeasurable": {"count": sum(kinds.values()), "by_reason": kinds}}
    if x:
        mean, lo, hi = mean_ci95(x)
        out.update(median=float(np.median(x)), mean=mean, ci95=[lo, hi], sd=float(np.std(x, ddof=1)) if len(x) > 1 else None)
    return out


def median_ci(summary: dict, digits: int = 2) -> str:
    """A :func:`summarize` result as "median [lo, hi]" (the mean's 95 % interval); "-" where nothing was measured."""
    if summary["median"] is None:
        return "-"
    ci = "" if summary["ci95"] is None else f" [{summary['ci95'][0]:.{digits}f}, {summary['ci95'][1]:.{digits}f}]"
    return f"{summary['median']:.{digits}f}{ci}"
