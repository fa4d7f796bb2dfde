"""Per-stage checkpoint intervals (``checkpoint.per_stage``): the arithmetic, without side effects.

"CPSR does not enforce uniform T_c among tasks": each pipeline stage checkpoints at its
own interval. Recompute-based recovery needs every stage's state at one iteration (a
full cut), so each stage's interval is a whole multiple m_k of the shortest, T, and
every m_k divides the largest, M: every stage is due together every M T iterations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


def multiples(intervals: Sequence[float]) -> tuple[int, ...]:
    """Each stage's interval as a whole multiple of the shortest, each multiple dividing the largest.

    The largest is the longest interval over the shortest, rounded; every other stage
    gets the divisor of it nearest to its own ratio. Intervals that are not all positive
    and finite give 1 for every stage (all stages together).
    """
    if not intervals or not all(isinstance(t, (int, float)) and math.isfinite(t) and t > 0 for t in intervals):
        return tuple(1 for _ in intervals)
    shortest = min(intervals)
    ratios = [t / shortest for t in intervals]
    largest = max(1, round(max(ratios)))
    divisors = [d for d in range(1, largest + 1) if largest % d == 0]
    return tuple(min(divisors, key=lambda d: abs(d - r)) if r < max(ratios) else largest for r in ratios)


@dataclass(frozen=True)
class StageSchedule:
    """Stage k is due every ``base * multiples[k]`` iterations counted from ``origin``."""

    origin: int
    base: int
    multiples: tuple[int, ...]

    @staticmethod
    def together(origin: int, base: int, stages: int) -> "StageSchedule":
        """Every stage at every ``base`` iterations."""
        return StageSchedule(origin, base, (1,) * stages)

    @property
    def cycle(self) -> int:
        """Iterations between full cuts."""
        return self.base * max(self.multiples)

    def due(self, iteration: int) -> tuple[int, ...]:
        """The stages due at ``iteration`` (none at or before the origin)."""
        since = iteration - self.origin
        if since <= 0:
            return ()
        return tuple(k for k, m in enumerate(self.multiples) if since % (self.base * m) == 0)

    def full_cut(self, iteration: int) -> bool:
        """Whether every stage is due at ``iteration``."""
        return len(self.due(iteration)) == len(self.multiples)

    def intervals(self) -> list[int]:
        return [self.base * m for m in self.multiples]
