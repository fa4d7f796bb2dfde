"""The run's own evidence of rho, the share of the lost iterations a prediction saves (Section IV's T_p).

Each held-out check (the predictor predicting its newest checkpoint from the older ones) measures ``along``:
the share of the parameters' step to that checkpoint the prediction covered along the step
(predictor.base.along_step). Error across the step is curvature the optimizer removes within a few iterations
after a restart; a shortfall along it is progress not made, which training must redo. So the newest checks'
``along`` estimate rho for this run's model, data and rate, where the constants of calibration.py were measured
on the project's own small GPT. The estimate is their mean less its standard error (a lower bound, as the choice
must not predict on luck); with fewer than MIN_CHECKS checks the evidence is thin and recovery recomputes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

CHECKS = 4  # the newest held-out checks weighed: a predictor's history spans about as many checkpoints
MIN_CHECKS = 2  # fewer: no spread to bound the estimate by


@dataclass(frozen=True)
class Evidence:
    """``predictor``'s held-out ``alongs`` (newest last, at most CHECKS) up to the checkpoint of ``upto``."""

    predictor: str
    alongs: tuple[float, ...]
    upto: Optional[int] = None

    @property
    def thin(self) -> bool:
        return len(self.alongs) < MIN_CHECKS

    @property
    def mean(self) -> Optional[float]:
        return sum(self.alongs) / len(self.alongs) if self.alongs else None

    @property
    def stderr(self) -> Optional[float]:
        """The standard error of the mean; None under MIN_CHECKS checks."""
        n = len(self.alongs)
        if n < MIN_CHECKS:
            return None
        mean = self.mean
        return math.sqrt(sum((a - mean) ** 2 for a in self.alongs) / (n - 1) / n)

    @property
    def rho(self) -> Optional[float]:
        """The mean less its standard error, at most 1 (a prediction cannot save more than the lost
        iterations); None where the evidence is thin."""
        if self.thin:
            return None
        return min(1.0, self.mean - self.stderr)

    def describe(self) -> str:
        if self.thin:
            return (f"thin evidence: {len(self.alongs)} held-out check(s) of {self.predictor}"
                    f"{'' if self.upto is None else f' up to iteration {self.upto}'}, fewer than {MIN_CHECKS}")
        return f"{self.predictor}'s last {len(self.alongs)} held-out checks cover {self.mean:.2f} +- {self.stderr:.2f}"


def evidence(predictor: str, checks: Iterable[tuple[int, float]], upto: Optional[int] = None) -> Evidence:
    """The Evidence of ``predictor`` from its (iteration, along) checks, those after ``upto`` left out."""
    kept = sorted((i, a) for i, a in checks if upto is None or i <= upto)
    return Evidence(predictor, tuple(a for _, a in kept[-CHECKS:]), upto)


def worst(found: Iterable[Optional[Evidence]]) -> Optional[Evidence]:
    """The least of several stages' evidence (thin before any rho, then the least rho); None where none has any."""
    given = [e for e in found if e is not None]
    if not given:
        return None
    return min(given, key=lambda e: (not e.thin, e.rho if not e.thin else 0.0))
