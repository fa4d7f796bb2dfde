"""Progress journal: every iteration each rank appends ``iteration,loss,wall_time``.

It is how a restarted job knows how far the failed one got (the failure point f
of the paper's Section IV). One ``write`` on an ``O_APPEND`` descriptor per
iteration, no fsync: a killed process loses nothing the kernel already has, and
the journal only has to survive process failures, not power loss. A line cut short
by a crash is skipped when reading. A write that fails (a full disk) does not stop
training: the lines not written are kept, up to ``MAX_BACKLOG``, and go out with the
next append that succeeds, so the journal stays contiguous.

A journal is trusted only as far as it is plausible: each entry follows the one
before it (+1) or goes back (a restart resumed at an earlier checkpoint); an entry
that jumps forward, and all after it, are ignored. The ranks finish every iteration
together, so their journals end at most ``MAX_RANK_SKEW`` iterations apart.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import NamedTuple, Optional

from cpsr_ds.checkpoint.storage.filesystem import describe_error

log = logging.getLogger(__name__)

JOURNAL_DIR = "journal"
JOURNAL_NAME_RE = re.compile(r"^rank(\d+)\.csv$")
RETIRED_DIR = "retired"  # under JOURNAL_DIR: journals of ranks a smaller world no longer has
# A rank journals iteration i once its train_batch returned, which needs every rank's
# part of i; a rank killed before its own append is then one iteration behind.
MAX_RANK_SKEW = 1
MAX_BACKLOG = 100_000  # journal lines kept while writes fail; beyond it the oldest go, leaving a gap


class Entry(NamedTuple):
    iteration: int
    loss: float
    wall_time: float
    line: int = 0  # 1-based line number in the journal file


def journal_path(directory: str, rank: int) -> str:
    return os.path.join(directory, JOURNAL_DIR, f"rank{rank:05d}.csv")


class ProgressJournal:
    def __init__(self, directory: str, rank: int):
        self.directory = directory
        self.path = journal_path(directory, rank)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        self._gone = False
        self._backlog: list[bytes] = []  # lines, or the rest of one, that a failed write left
        self._failing = False
        # A line a killed job cut short must not run into the first line of this one.
        size = os.fstat(self._fd).st_size
        if size and os.pread(self._fd, 1, size - 1) != b"\n":
            self._backlog.append(b"\n")

    def append(self, iteration: int, loss: float) -> None:
        # repr keeps every bit of the float: the journal doubles as the loss record.
        self._backlog.append(f"{iteration},{loss!r},{time.time()!r}\n".encode())
        self._write_backlog()
        # A deleted run directory leaves the descriptor writing into an unlinked file.
        if not self._gone and os.fstat(self._fd).st_nlink == 0:
            self._gone = True
            log.warning("cpsr journal: the run directory %s is gone (%s was deleted): progress and checkpoints "
                        "are no longer recorded there", self.directory, self.path)

    def _write_backlog(self) -> None:
        data = b"".join(self._backlog)
        try:
            written = os.write(self._fd, data)
        except OSError as err:
            if not self._failing:
                log.warning("cpsr journal: cannot write %s (%s): training goes on, the lines are kept until a "
                            "write succeeds", self.path, describe_error(err))
            self._failing = True
            del self._backlog[:-MAX_BACKLOG]
            return
        # A short write (the disk filled mid-line) leaves the rest of the line for next time.
        self._backlog = [data[written:]] if written < len(data) else []
        if self._failing and not self._backlog:
            self._failing = False
            log.warning("cpsr journal: %s written again, nothing lost", self.path)

    def close(self) -> None:
        if self._fd >= 0:
            if self._backlog:
                self._write_backlog()
            os.close(self._fd)
            self._fd = -1


def read_journal(path: str) -> list[Entry]:
    entries = []
    with open(path, "rb") as f:
        for number, line in enumerate(f.read().decode(errors="replace").splitlines(), start=1):
            parts = line.split(",")
            if len(parts) != 3:
                continue
            try:
                entries.append(Entry(int(parts[0]), float(parts[1]), float(parts[2]), number))
            except ValueError:
                continue
    return entries


def forward_jump(entries: list[Entry]) -> Optional[int]:
    """Index of the first entry more than one iteration past the entry before it; None: no jump."""
    return next((k for k in range(1, len(entries)) if entries[k].iteration > entries[k - 1].iteration + 1), None)


def run_start(entries: list[Entry], f: int) -> Optional[int]:
    """The first of the iterations ``entries`` record, every one of them, up to f's last record; None: f is not
    there. A restart goes back (it resumed from a checkpoint or a snapshot) and the iterations recorded before
    stay covered; a jump forward leaves a gap, after which the record starts again."""
    last = next((k for k in range(len(entries) - 1, -1, -1) if entries[k].iteration == f), None)
    if last is None:
        return None
    start = entries[0].iteration
    for before, e in zip(entries, entries[1:last + 1]):
        start = e.iteration if e.iteration > before.iteration + 1 else min(start, e.iteration)
    return start


@dataclass(frozen=True)
class Progress:
    """What the journals say: each rank's plausible entries, f, and what was wrong with them."""

    entries: dict[int, list[Entry]]
    reached: Optional[int]  # f: the last iteration every rank finished; None: none ran one
    problems: tuple[str, ...] = ()

    def covered_from(self, f: int) -> Optional[int]:
        """Where every rank's record of consecutive iterations up to f starts at the latest; None: a rank lacks f."""
        starts = [run_start(entries, f) for entries in self.entries.values() if entries]
        return None if not starts or None in starts else max(starts)


def plausible(path: str, entries: list[Entry]) -> tuple[list[Entry], Optional[str]]:
    """``entries`` up to a forward jump, and the problem the jump is."""
    k = forward_jump(entries)
    if k is None:
        return entries, None
    before, jump = entries[k - 1], entries[k]
    return entries[:k], (f"journal {path} line {jump.line} jumps from iteration {before.iteration} to "
                         f"{jump.iteration}: ignoring this line and every line after it")


def agreed_reach(reached: dict[int, int]) -> tuple[Optional[int], Optional[str]]:
    """f from each rank's last iteration: the slowest rank's, and the problem if the ranks are too far apart."""
    if not reached:
        return None, None
    slow, fast = min(reached, key=reached.get), max(reached, key=reached.get)
    f = reached[slow]
    if reached[fast] - f <= MAX_RANK_SKEW:
        return f, None
    return f, (f"the ranks' journals disagree: rank {fast} reached iteration {reached[fast]}, rank {slow} {f} "
               f"(more than {MAX_RANK_SKEW} apart); using the slowest rank's, {f}")


def read_progress(directory: str) -> Progress:
    entries, problems = {}, []
    for path in sorted(glob.glob(os.path.join(directory, JOURNAL_DIR, "rank*.csv"))):
        name = JOURNAL_NAME_RE.match(os.path.basename(path))
        if name is None:
            continue
        rank = int(name.group(1))
        try:
            entries[rank], problem = plausible(path, read_journal(path))
        except OSError as err:
            entries[rank], problem = [], f"journal {path} cannot be read ({err}): ignoring it"
        if problem:
            problems.append(problem)
    f, disagreement = agreed_reach({rank: max(e.iteration for e in es) for rank, es in entries.items() if es})
    if disagreement:
        problems.append(disagreement)
    return Progress(entries, f, tuple(problems))


def retire_journals(directory: str, world_size: int, attempt: int) -> list[str]:
    """Move the journals of ranks ``world_size`` and above out of the way; the paths they went to.

    Called once the ranks of a restarted job (attempt ``attempt``) have read the progress:
    those journals were the failed job's; from now on a rank that no longer exists must not
    fix f with its stale journal (the next failure's f would go back to the old failure
    point, and d below zero). They go to ``journal/retired/attempt<N>/``, kept for the
    record. Each node moves the journals it sees, so node-local directories retire theirs.
    Several ranks may do this at once: a journal another rank moved first is skipped.
    """
    moved = []
    target = os.path.join(directory, JOURNAL_DIR, RETIRED_DIR, f"attempt{attempt}")
    for path in sorted(glob.glob(os.path.join(directory, JOURNAL_DIR, "rank*.csv"))):
        name = JOURNAL_NAME_RE.match(os.path.basename(path))
        if name is None or int(name.group(1)) < world_size:
            continue
        os.makedirs(target, exist_ok=True)
        try:
            os.rename(path, os.path.join(target, os.path.basename(path)))
        except FileNotFoundError:
            continue
        moved.append(os.path.join(target, os.path.basename(path)))
    return moved


def reached_iteration(directory: str) -> int | None:
    """The last iteration every rank finished by their plausible journals, or None for a job that never ran one."""
    return read_progress(directory).reached


FINISHED_NAME = "finished.csv"  # in JOURNAL_DIR: one line "iteration,wall_time" per clean end of the job


def finished_path(directory: str) -> str:
    return os.path.join(directory, JOURNAL_DIR, FINISHED_NAME)


def record_finished(directory: str, iteration: int) -> None:
    """Record that the job ended cleanly after ``iteration`` (one process writes it, at the end of training):
    a later start there resumes a job that did not fail."""
    os.makedirs(os.path.join(directory, JOURNAL_DIR), exist_ok=True)
    with open(finished_path(directory), "a") as f:
        f.write(f"{iteration},{time.time()!r}\n")


def finished_iterations(directory: str) -> list[int]:
    """The iterations after which the job ended cleanly, oldest first (a line cut short is skipped)."""
    try:
        with open(finished_path(directory)) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    return [int(fields[0]) for fields in (line.split(",") for line in lines) if len(fields) == 2 and fields[0].isdigit()]


def finished_run(directory: str) -> int | None:
    """The iteration the run finished at, where its last clean end is where its journals end (nothing trained
    since); None: the run has not finished, or trained on after it did."""
    ends = finished_iterations(directory)
    return ends[-1] if ends and ends[-1] == reached_iteration(directory) else None


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
