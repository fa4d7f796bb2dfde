"""Progress journal: every iteration each rank appends ``iteration,loss,wall_time``.

It is how a restarted job knows how far the failed one got (the failure point f
of the paper's Section IV). One ``write`` on an ``O_APPEND`` descriptor per
iteration, no fsync: a killed process loses nothing the kernel already has, and
the journal only has to survive process failures, not power loss. A line cut short
by a crash is skipped when reading.
"""

from __future__ import annotations

import glob
import os
import time
from typing import NamedTuple

JOURNAL_DIR = "journal"


class Entry(NamedTuple):
    iteration: int
    loss: float
    wall_time: float


def journal_path(directory: str, rank: int) -> str:
    return os.path.join(directory, JOURNAL_DIR, f"rank{rank:05d}.csv")


class ProgressJournal:
    def __init__(self, directory: str, rank: int):
        self.path = journal_path(directory, rank)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def append(self, iteration: int, loss: float) -> None:
        # repr keeps every bit of the float: the journal doubles as the loss record.
        os.write(self._fd, f"{iteration},{loss!r},{time.time()!r}\n".encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_journal(path: str) -> list[Entry]:
    entries = []
    with open(path, "rb") as f:
        for line in f.read().decode(errors="replace").splitlines():
            parts = line.split(",")
            if len(parts) != 3:
                continue
            try:
                entries.append(Entry(int(parts[0]), float(parts[1]), float(parts[2])))
            except ValueError:
                continue
    return entries


def rank_journals(directory: str) -> dict[int, list[Entry]]:
    found = {}
    for path in sorted(glob.glob(os.path.join(directory, JOURNAL_DIR, "rank*.csv"))):
        rank = int(os.path.basename(path)[4:-4])
        found[rank] = read_journal(path)
    return found


def reached_iteration(directory: str) -> int | None:
    """The last iteration every rank finished, or None for a job that never ran one."""
    reached = [max(e.iteration for e in entries) for entries in rank_journals(directory).values() if entries]
    return min(reached) if reached else None


VALIDATION_FILE = "validation.csv"


def append_validation(directory: str, iteration: int, loss: float) -> None:
    """Log a validation loss; a recomputing run logs an iteration again, and the last entry wins."""
    with open(os.path.join(directory, VALIDATION_FILE), "a") as f:
        f.write(f"{iteration},{loss!r}\n")


def read_validation(directory: str) -> dict[int, float]:
    losses = {}
    with open(os.path.join(directory, VALIDATION_FILE)) as f:
        for line in f:
            iteration, loss = line.split(",")
            losses[int(iteration)] = float(loss)
    return losses
