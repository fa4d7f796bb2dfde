"""Recovery cost as lag behind the reference (DESIGN.md, "Recovery cost").

A recovered run that restarts at iteration f is compared with the failure-free
reference through a smooth fit of the reference's validation curve: at f + k it
has the loss the reference had at iteration i*, so it runs L(k) = (f + k) - i*
iterations behind. The lag L is L(k) averaged over a late window, k in [2d, 4d],
after the transient has passed. Pure functions, tested directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

FIT_DEGREE = 2  # quadratic in log-iterations: smooth, yet bends with the curve over a span of a few T_c


@dataclass(frozen=True)
class CurveFit:
    """Loss as a polynomial in log(iteration), fitted over ``[lo, hi]``."""

    coefficients: np.ndarray
    lo: float
    hi: float

    def __call__(self, iteration):
        return np.polyval(self.coefficients, np.log(np.asarray(iteration, dtype=float)))

    def iteration_at(self, loss: float, margin: float) -> float:
        """The iteration where the fit reaches ``loss``, searched over the span widened by ``margin``.

        The fit is decreasing over a span of a descending loss curve; beyond the span's
        ends it is extrapolated, and a loss outside even the widened span is clipped to its
        ends (the caller sees a lag at the limit of what the data can tell).
        """
        grid = np.linspace(max(1.0, self.lo - margin), self.hi + margin, 4001)
        values = self(grid)
        below = np.nonzero(values <= loss)[0]
        if len(below) == 0:
            return float(grid[-1])
        j = below[0]
        if j == 0:
            return float(grid[0])
        # Linear interpolation between the grid points that straddle the loss.
        x0, x1, y0, y1 = grid[j - 1], grid[j], values[j - 1], values[j]
        return float(x0 + (loss - y0) * (x1 - x0) / (y1 - y0))


def fit_curve(iterations, losses, lo: float, hi: float, degree: int = FIT_DEGREE) -> CurveFit:
    """Fit the losses measured in ``[lo, hi]`` with a polynomial of ``degree`` in log(iteration)."""
    it = np.asarray(iterations, dtype=float)
    ls = np.asarray(losses, dtype=float)
    keep = (it >= lo) & (it <= hi) & (it > 0)
    if keep.sum() <= degree + 1:
        raise ValueError(f"need more than {degree + 1} reference points in [{lo}, {hi}], got {int(keep.sum())}")
    return CurveFit(np.polyfit(np.log(it[keep]), ls[keep], degree), lo, hi)


def lag_at(fit: CurveFit, iteration: int, loss: float, margin: float, residual: float = 0.0) -> float:
    """L(k) for a recovered run with validation ``loss`` at ``iteration`` = f + k.

    ``residual``: the reference's own deviation from its fit at the same iteration. Runs
    that see the same batch at the same iteration share most of that deviation, so
    subtracting it (the paired estimate) removes noise the fit cannot.
    """
    return iteration - fit.iteration_at(loss - residual, margin)


def late_lag(fit: CurveFit, f: int, d: int, points: dict[int, float], margin: float,
             reference: dict[int, float] | None = None) -> float:
    """L: the mean of L(k) over the recovered run's evaluations at k in [2d, 4d].

    With ``reference`` (validation loss by iteration) the estimate is paired (see :func:`lag_at`).
    """
    window = [lag_at(fit, f + k, loss, margin, _residual(fit, reference, f + k))
              for k, loss in points.items() if 2 * d <= k <= 4 * d]
    if not window:
        raise ValueError(f"no evaluation in the late window k in [{2 * d}, {4 * d}]")
    return float(np.mean(window))


def _residual(fit: CurveFit, reference: dict[int, float] | None, iteration: int) -> float:
    return 0.0 if reference is None else reference[iteration] - float(fit(iteration))


def transient(fit: CurveFit, f: int, d: int, points: dict[int, float], late: float, margin: float,
              reference: dict[int, float] | None = None, tolerance: float = 0.1) -> int:
    """Iterations until L(k) comes within ``tolerance * d`` of its late value and stays there."""
    settled = None
    for k in sorted(points):
        if abs(lag_at(fit, f + k, points[k], margin, _residual(fit, reference, f + k)) - late) <= tolerance * d:
            settled = k if settled is None else settled
        else:
            settled = None
    return 4 * d if settled is None else settled


def mean_ci95(values) -> tuple[float, float, float]:
    """Mean and the Student-t 95 % interval of the mean."""
    x = np.asarray(values, dtype=float)
    mean = float(x.mean())
    if len(x) < 2:
        return mean, -math.inf, math.inf
    half = float(stats.t.ppf(0.975, len(x) - 1)) * float(x.std(ddof=1)) / math.sqrt(len(x))
    return mean, mean - half, mean + half
