"""Retention: which committed checkpoints to keep, and deleting the rest.

Only directories carrying our manifests, commit records or snapshot files are touched,
never the one ``latest`` names, and a deletion is atomic (a rename first): a reader or a
crash mid-delete never leaves half a checkpoint under its tag.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Callable, Collection, Optional

from cpsr_ds.checkpoint.storage.catalog import Checkpoint, scan, verify
from cpsr_ds.checkpoint.storage.filesystem import fs
from cpsr_ds.checkpoint.storage.ondisk import TEMP_RE, TRASH_PREFIX
from cpsr_ds.checkpoint.storage.records import read_latest

log = logging.getLogger(__name__)


def apply_retention(ckpt_dir: str, keep_last: int, protected: Callable[[str], bool],
                    ranks: Optional[Collection[int]] = None) -> list[str]:
    """Delete our sound committed checkpoints beyond those :func:`retained` keeps; returns the tags deleted.

    Only directories carrying our manifests, commit records or snapshot files are
    touched, and never the one ``latest`` names. Sound: nothing wrong short of reading
    the data (a manifest listing a non-finite tensor is wrong) in the parts of ``ranks``
    (None: every rank's). Uncommitted and damaged ones go only when older than the oldest kept.
    """
    ours = [c for c in scan(ckpt_dir) if c.kind == "cpsr"]
    sound = [c for c in ours if c.committed and not verify(ckpt_dir, c, read_data=False, ranks=ranks)]
    if not sound:
        return []
    kept = retained(sound, keep_last)
    floor = min(c.key for c in sound if c.tag in kept)
    sound_tags = {c.tag for c in sound}
    latest = read_latest(ckpt_dir)
    doomed = [c.tag for c in ours if c.tag not in kept and c.tag != latest and not protected(c.tag)
              and (c.tag in sound_tags or c.key < floor)]
    _remove_leftovers(ckpt_dir)
    for tag in doomed:
        remove_checkpoint(ckpt_dir, tag)
    return doomed


def retained(sound: list[Checkpoint], keep_last: int) -> set[str]:
    """The tags to keep of ``sound`` committed checkpoints (oldest first): for every rank the ``keep_last``
    newest holding its part (the predictor's history of its stage), and the newest full cut (the one
    recompute-based recovery restores). Without checkpoints of some stages: the ``keep_last`` newest."""
    world = max((c.world_size for c in sound), default=0)
    kept = {c.tag for c in [c for c in sound if c.full][-1:]}
    for rank in range(world):
        kept.update(c.tag for c in [c for c in sound if c.holds(rank)][-keep_last:])
    return kept or {c.tag for c in sound[-keep_last:]}


def remove_checkpoint(ckpt_dir: str, tag: str) -> bool:
    """Delete checkpoint ``tag``; returns whether it was there and is gone."""
    # Renaming first makes the removal atomic for readers and for a crash mid-delete.
    trash = os.path.join(ckpt_dir, f"{TRASH_PREFIX}{tag}-{os.getpid()}")
    try:
        return fs.remove_tree(os.path.join(ckpt_dir, tag), trash)
    except OSError as err:
        log.warning("could not delete checkpoint %s: %s", tag, err)
        return False


def _remove_leftovers(ckpt_dir: str) -> None:
    """Trash and temporary files that processes killed mid-way left in ``ckpt_dir``."""
    for name in os.listdir(ckpt_dir):
        path = os.path.join(ckpt_dir, name)
        temp = TEMP_RE.match(name)
        if name.startswith(TRASH_PREFIX):
            shutil.rmtree(path, ignore_errors=True)
        elif temp and int(temp.group(1)) != os.getpid():
            try:
                os.unlink(path)
            except OSError:
                pass
