"""CheckFreq (FAST '21): snapshot and persist pipelined with training, one checkpoint in flight.

Each file is copied whole, then written. The interval comes from profiled costs: the
smallest number of iterations whose checkpoint stall stays within the overhead budget
and that leaves time to persist one checkpoint before the next one starts. The costs are
the medians of the last PROFILED checkpoints: the last one alone let one stall that a busy
host stretched to 150 ms set a 2 % budget's interval to 300 iterations.
"""

from __future__ import annotations

import math
from statistics import median
from typing import Optional

from cpsr_ds.checkpoint.engines.async_engine import AsyncCheckpointEngine, CheckpointStats, fixed_interval
from cpsr_ds.checkpoint.engines.throttle import MB
from cpsr_ds.config import CheckpointConfig

PROFILED = 5  # checkpoints whose median stall and persist time the interval follows


def profiled_interval(iteration_time_s: float, stall_s: float, persist_s: float, budget: float,
                      in_flight: int, storage_s: float = 0.0) -> int:
    """Iterations between checkpoints so that stall <= budget * compute and persists keep up.

    With ``in_flight`` checkpoints persisting at once, a new one may start every
    ``persist_s / in_flight`` seconds without waiting for buffers, but no more often than
    storage takes one checkpoint's bytes (``storage_s``, at a write limit the checkpoints in
    flight share): concurrency hides the copy and the write latency, not the bandwidth.
    Past that, the next snapshot waits for buffers, its stall breaks the budget and the
    interval swings to hundreds of iterations (the paper ran its baselines within the bandwidth).
    """
    by_budget = stall_s / (budget * iteration_time_s)
    by_persist = max(persist_s / in_flight, storage_s) / iteration_time_s
    return max(1, math.ceil(by_budget), math.ceil(by_persist))


def storage_time(cfg: CheckpointConfig, nbytes: int) -> float:
    """Seconds ``nbytes`` take at ``checkpoint.write_mbps`` (0 where the rate is unlimited)."""
    return nbytes / (cfg.write_mbps * MB) if cfg.write_mbps else 0.0


def measured_interval(cfg: CheckpointConfig, stats: CheckpointStats, iteration_time_s: Optional[float],
                      in_flight: int) -> Optional[int]:
    """The overhead_budget rule on the median stall and persist time of the last PROFILED checkpoints; before
    one is measured (or without a positive iteration time), the fixed ``checkpoint.interval`` (None with "auto")."""
    if (iteration_time_s is None or not math.isfinite(iteration_time_s) or iteration_time_s <= 0
            or not stats.stalls or not stats.recent):
        return fixed_interval(cfg)
    stall_s = median(list(stats.stalls)[-PROFILED:])
    persist_s = median([persist_s for _, _, persist_s in list(stats.recent)[-PROFILED:]])
    return profiled_interval(iteration_time_s, stall_s, persist_s, cfg.overhead_budget,
                             in_flight, storage_time(cfg, stats.last_bytes))


class ProfiledIntervalEngine(AsyncCheckpointEngine):
    """An engine whose interval follows its own measured stall and persist times."""

    def interval(self, iteration_time_s: Optional[float] = None) -> Optional[int]:
        return measured_interval(self.cfg, self.stats, iteration_time_s, self._max_in_flight)


class CheckFreqEngine(ProfiledIntervalEngine):
    def __init__(self, cfg: CheckpointConfig, rank: int, world_size: int, **kwargs):
        super().__init__(cfg, rank, world_size, max_in_flight=1, chunk_bytes=None, overlap=False, **kwargs)
