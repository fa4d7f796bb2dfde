"""Which failure class ended the attempt before, as its restart sees it (planning/failure_mix.py's classes).

Every start that keeps state in node memory (survivor dumps, host snapshots) leaves each rank's mark in the run's
directory under the survivor root (:func:`mark`). The next start looks for its rank's mark before it leaves a new
one: a rank that finds it runs where it ran before, with that memory. Where every rank finds its mark, the failure
was a process crash; where any rank's is gone (a replaced node, a rebooted host), a node was lost. A run that keeps
nothing in node memory leaves no mark, and its failures' class is not observed (None): the planner splits them by
the configured failure mix.
"""

from __future__ import annotations

import os
import time
from typing import Optional

from cpsr_ds.checkpoint.capture.dumps import prepare, survivor_root
from cpsr_ds.checkpoint.capture.run_id import run_identity
from cpsr_ds.checkpoint.storage.filesystem import fs
from cpsr_ds.checkpoint.storage.private_dir import FILE_MODE
from cpsr_ds.config import CheckpointConfig
from cpsr_ds.planning.failure_mix import NODE_LOST, PROCESS_CRASH
from cpsr_ds.recovery.agree import gathered


def _keeps_memory(cfg: CheckpointConfig) -> bool:
    return cfg.survivor or cfg.memory_interval is not None


def mark_path(root: str, run: str, rank: int) -> str:
    """Beside the rank's dump (dumps.dump_dir), where what its node holds of the run lies."""
    return os.path.join(root, run, f"rank{rank:05d}.mark")


def mark(cfg: CheckpointConfig, rank: int, attempt: int) -> None:
    """Leave ``rank``'s mark for the next start, where the run keeps state in node memory."""
    if _keeps_memory(cfg):
        root, run = prepare(cfg)
        fs.write_json_atomic(mark_path(root, run, rank), {"attempt": attempt, "time": time.time()}, mode=FILE_MODE)


def observed_class(cfg: CheckpointConfig, rank: int, attempt: int) -> Optional[str]:
    """The class of the failure that ended the attempt before ``attempt`` (a collective, before :func:`mark`);
    None on a first attempt or where the run keeps nothing in node memory."""
    kept = None
    if attempt > 1 and _keeps_memory(cfg):
        kept = os.path.exists(mark_path(survivor_root(cfg), run_identity(cfg.dir), rank))
    everyone = gathered(kept)
    if any(k is None for k in everyone):
        return None
    return PROCESS_CRASH if all(everyone) else NODE_LOST
