"""The fitter (Section IV-A): the loss descent trajectory, fitted on the job's own recent losses.

The paper fits the loss curve over recent spans only, since optimizer noise and the
learning-rate schedule bend it. Here the span is the second half of the run so far and
the model is l(i) = a + b ln(i): two coefficients, stable under the per-iteration
noise of training losses. Recovery uses it to turn a lag (iterations) into the loss
excess it costs; the planner issue builds its cost model on the same fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MIN_POINTS = 16  # losses needed for a fit


@dataclass(frozen=True)
class LossCurve:
    """l(i) = a + b ln(i); b < 0 while the loss descends."""

    a: float
    b: float

    def __call__(self, iteration: float) -> float:
        return self.a + self.b * math.log(iteration)


def fit_recent(losses: dict[int, float], f: int) -> LossCurve | None:
    """Fit the losses of iterations f/2..f (``losses``: by iteration); None with fewer than MIN_POINTS."""
    its = [i for i in losses if max(1, f // 2) <= i <= f]
    if len(its) < MIN_POINTS:
        return None
    b, a = np.polyfit(np.log(its), [losses[i] for i in its], 1)
    return LossCurve(float(a), float(b))


def loss_excess(curve: LossCurve, f: int, lag: float) -> float:
    """Relative loss excess at f of a run ``lag`` iterations behind: (l(f - lag) - l(f)) / l(f)."""
    behind = max(1.0, f - lag)
    return (curve(behind) - curve(f)) / curve(f)
