"""PCcheck (ASPLOS '25): several checkpoints in flight, copy and write pipelined in chunks.

A writer starts on a chunk as soon as it is copied into pinned host memory, and up to
``max_in_flight`` checkpoints persist concurrently, each in its own buffers. The
interval follows the measured costs like CheckFreq's, with the persist time shared
among the checkpoints in flight.
"""

from __future__ import annotations

from cpsr_ds.checkpoint.engines.checkfreq import ProfiledIntervalEngine
from cpsr_ds.config import CheckpointConfig


class PCcheckEngine(ProfiledIntervalEngine):
    def __init__(self, cfg: CheckpointConfig, rank: int, world_size: int, **kwargs):
        super().__init__(cfg, rank, world_size, max_in_flight=cfg.max_in_flight, chunk_bytes=cfg.chunk_mb << 20,
                         overlap=True, **kwargs)
