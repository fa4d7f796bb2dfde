"""CheckFreq (FAST '21): snapshot and persist pipelined with training, one checkpoint in flight.

Each file is copied whole, then written. The interval comes from profiled costs: the
smallest number of iterations whose checkpoint stall stays within the overhead budget
and that leaves time to persist one checkpoint before the next one starts.
"""

from __future__ import annotations

import math
from typing import Optional

from cpsr_ds.checkpoint.engine import AsyncCheckpointEngine
from cpsr_ds.config import CheckpointConfig


def profiled_interval(iteration_time_s: float, stall_s: float, persist_s: float, budget: float,
                      in_flight: int) -> int:
    """Iterations between checkpoints so that stall <= budget * compute and persists keep up.

    With ``in_flight`` checkpoints persisting at once, a new one may start every
    ``persist_s / in_flight`` seconds without waiting for buffers.
    """
    by_budget = stall_s / (budget * iteration_time_s)
    by_persist = persist_s / (in_flight * iteration_time_s)
    return max(1, math.ceil(by_budget), math.ceil(by_persist))


class ProfiledIntervalEngine(AsyncCheckpointEngine):
    """An engine whose interval follows its own measured stall and persist times."""

    def interval(self, iteration_time_s: Optional[float] = None) -> int:
        if iteration_time_s is None or self.stats.last_stall_s is None or self.stats.last_persist_s is None:
            return self.cfg.interval
        return profiled_interval(iteration_time_s, self.stats.last_stall_s, self.stats.last_persist_s,
                                 self.cfg.overhead_budget, self._max_in_flight)


class CheckFreqEngine(ProfiledIntervalEngine):
    def __init__(self, cfg: CheckpointConfig, rank: int, world_size: int, **kwargs):
        super().__init__(cfg, rank, world_size, max_in_flight=1, chunk_bytes=None, overlap=False, **kwargs)
