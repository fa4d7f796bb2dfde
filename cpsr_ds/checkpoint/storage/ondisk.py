"""What a checkpoint directory holds, by name, and the order of checkpoints.

A checkpoint directory ``CKPT_DIR`` holds one directory per tag, named as DeepSpeed
names them (``global_step100``), and DeepSpeed's plain-text ``latest`` file::

    CKPT_DIR/latest                            tag of the newest committed checkpoint
    CKPT_DIR/TAG/<files DeepSpeed saves>       snapshot files (fileformat.py)
    CKPT_DIR/TAG/cpsr_manifest.rank00003.json  rank 3's files: size and digest each (records.py)
    CKPT_DIR/TAG/cpsr_commit.json              written once every rank's manifest is there (committing.py)
    CKPT_DIR/TAG/cpsr_progress.rank00003.jsonl rank 3's files landed so far (progress_record.py)
    CKPT_DIR/replicas/TAG/...                  other nodes' parts kept for them (replica.py)

Checkpoints are ordered by :func:`order_key` (iteration, then the job attempt that wrote
them), never by a clock: clocks differ between hosts and jump.
"""

from __future__ import annotations

import re
from typing import Optional

LATEST = "latest"
COMMIT = "cpsr_commit.json"
MANIFEST_RE = re.compile(r"^cpsr_manifest\.rank(\d{5})\.json$")
PROGRESS_RE = re.compile(r"^cpsr_progress\.rank(\d{5})\.jsonl$")
TEMP_RE = re.compile(r"^\..+\.tmp(\d+)$")
TRASH_PREFIX = ".trash-"
# Other nodes' parts kept for them (node-local storage): a checkpoint directory of its own, see replica.py.
REPLICAS = "replicas"
DEEPSPEED_FILE_RE = re.compile(r".*(model_states|optim_states)\.pt$")


def manifest_name(rank: int) -> str:
    return f"cpsr_manifest.rank{rank:05d}.json"


def progress_name(rank: int) -> str:
    return f"cpsr_progress.rank{rank:05d}.jsonl"


def tag_iteration(tag: str) -> Optional[int]:
    """The iteration a DeepSpeed tag stands for (``global_step120`` -> 120), if it ends in digits."""
    m = re.search(r"(\d+)$", tag)
    return int(m.group(1)) if m else None


def order_key(iteration: Optional[int], attempt: int) -> tuple[int, int]:
    """The order of checkpoints: by iteration (a tag without one first), then by the job attempt that wrote it."""
    return (-1 if iteration is None else iteration, attempt)


def iteration_attempt(tag: str, record: dict) -> tuple[Optional[int], int]:
    """The iteration and attempt a manifest or commit ``record`` of ``tag`` gives (the tag's iteration if none)."""
    iteration = record.get("iteration")
    return (tag_iteration(tag) if iteration is None else iteration), record.get("attempt", 0)
