"""The commit: a checkpoint's commit record written, then ``latest`` moved to it where it is the newest.

A rank writes its manifest only after its files are durable; rank 0 writes the commit
record only after all ``world_size`` manifests exist, and moves ``latest`` only after
the commit record is durable. Hence ``latest`` never names a checkpoint that is
incomplete on any rank.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from cpsr_ds.checkpoint.storage.catalog import Checkpoint, describe, verify
from cpsr_ds.checkpoint.storage.filesystem import fs
from cpsr_ds.checkpoint.storage.ondisk import COMMIT, LATEST, iteration_attempt, order_key
from cpsr_ds.checkpoint.storage.records import read_latest
from cpsr_ds.checkpoint.storage.retention import remove_checkpoint

log = logging.getLogger(__name__)


def commit_checkpoint(ckpt_dir: str, tag: str, record: dict) -> bool:
    """Make ``tag`` committed and move ``latest`` to it if it is the newest; returns whether it moved.

    ``record`` carries ``iteration`` and ``attempt``, the order of checkpoints (``order_key``);
    ``latest`` also moves when what it names is missing or damaged, never to a checkpoint
    of some stages only (``ranks`` in the record). Retention is the caller's next step
    (``apply_retention``).
    """
    fs.write_json_atomic(os.path.join(ckpt_dir, tag, COMMIT), record)
    if record.get("ranks") is not None:
        return False  # ``latest`` names a checkpoint every rank can load: a full cut
    current = _sound(ckpt_dir, read_latest(ckpt_dir))
    moved = current is None or current.tag == tag or order_key(*iteration_attempt(tag, record)) >= current.key
    if moved:
        path = os.path.join(ckpt_dir, LATEST)
        if os.path.isdir(path) and not os.path.islink(path):
            # No rename can replace a directory: out of the way with it, as with a checkpoint.
            log.warning("%s: a directory where the latest tag belongs; removing it", path)
            remove_checkpoint(ckpt_dir, LATEST)
        fs.write_atomic(path, [tag.encode()])
    return moved


def _sound(ckpt_dir: str, tag: Optional[str]) -> Optional[Checkpoint]:
    """Checkpoint ``tag`` if it is there and nothing is wrong with it short of reading its data."""
    if tag is None:
        return None
    try:
        ckpt = describe(os.path.join(ckpt_dir, tag), tag)
    except OSError:
        return None
    return ckpt if ckpt is not None and not verify(ckpt_dir, ckpt, read_data=False) else None
