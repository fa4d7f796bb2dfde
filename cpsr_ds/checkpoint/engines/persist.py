"""Persist: what the background threads that put checkpoints on storage share.

Every rank's writer thread (writer.py) writes its part of each checkpoint and its
manifest; the committer thread (committer.py) commits a checkpoint once every rank's
manifest is there, or gives it up. Neither uses collectives. Here: the :class:`Job`
both follow, the host buffers in flight (:class:`BufferPool`) and the retries. An
``OSError`` (disk full, permission denied, storage gone) is logged with its cause and
retried with exponential backoff; training never waits for failing storage: from a
failed write until one succeeds, a checkpoint that would wait for host buffers is
skipped. A checkpoint is given up when a rank's part fails, a manifest lists a
non-finite tensor, or one is still missing after ``commit_timeout_s`` (at once once the
process is failing, see exiting.py); ``latest`` then stays on the last good checkpoint.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from cpsr_ds.checkpoint.engines.snapshot import HostBuffers, SnapshotFile
from cpsr_ds.checkpoint.storage.filesystem import describe_error

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    retries: int
    backoff_s: float

    def delays(self) -> list[float]:
        return [self.backoff_s * 2 ** i for i in range(self.retries)]


def with_retries(action: Callable, policy: RetryPolicy, what: str, sleep: Callable = time.sleep,
                 on_error: Optional[Callable[[OSError], bool]] = None):
    """Run ``action``; on ``OSError`` log the cause and retry after a growing delay; the last error propagates.

    ``on_error`` sees every failure first; when it returns False the error propagates at once.
    """
    delays = policy.delays()
    for attempt in range(len(delays) + 1):
        try:
            return action()
        except OSError as err:
            go_on = on_error is None or on_error(err)
            if attempt == len(delays) or not go_on:
                raise
            log.warning("%s failed (attempt %d of %d): %s; retrying in %.2f s",
                        what, attempt + 1, len(delays) + 1, describe_error(err), delays[attempt])
            sleep(delays[attempt])


@dataclass
class Job:
    """One checkpoint of one rank, from ``create()`` until it is persisted (and, on rank 0, committed or given up)."""

    tag: str
    ckpt_dir: str
    attempt: int
    # None: the checkpoint was skipped, storage failing while every set of buffers was in use.
    buffers: Optional[HostBuffers]
    # The checkpoint's number in this process: every rank creates the same ones in the same order.
    seq: int = 0
    # The ranks whose parts the checkpoint holds and their pipeline stages (checkpoint.per_stage); None: every rank.
    ranks: Optional[tuple[int, ...]] = None
    stages: Optional[tuple[int, ...]] = None
    # Whether this rank writes a part of it; a rank that does not still takes part in DeepSpeed's save.
    part: bool = True
    # Durable once this rank's own part is (checkpoint.per_stage), on rank 0 too, not once committed.
    own_persist: bool = False
    # Information for operators only: clocks differ between hosts and attempts.
    started_ns: int = field(default_factory=time.time_ns)
    files: queue.Queue = field(default_factory=queue.Queue)
    finished: threading.Event = field(default_factory=threading.Event)
    # Why the checkpoint was given up; None while it may still commit.
    error: Optional[str] = None
    nbytes: int = 0
    # Whether this rank's writer made sure the tag directory exists; once it has, a
    # vanished directory means rank 0 gave the checkpoint up and removed it.
    dir_made: bool = False
    # perf_counter() when the first file write began and when the checkpoint became
    # durable: this rank's manifest on storage, or on rank 0 ``latest`` moved.
    write_start: Optional[float] = None
    durable: Optional[float] = None
    # Rank 0's commit record once it decided to commit; the commit waits for the replicas (layout.py).
    decided: Optional[dict] = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def skipped(self) -> bool:
        return self.part and self.buffers is None

    @property
    def writes(self) -> bool:
        """Whether this rank writes files for it."""
        return self.buffers is not None

    def give_up(self, cause: str) -> None:
        if self.error is None:
            self.error = cause

    @property
    def persist_s(self) -> Optional[float]:
        if self.write_start is None or self.durable is None:
            return None
        return self.durable - self.write_start

    @property
    def tag_dir(self) -> str:
        return os.path.join(self.ckpt_dir, self.tag)

    @property
    def key(self) -> str:
        """Names this checkpoint between the ranks of the job (layout.py)."""
        return f"{self.seq}/{self.tag}"

    def removed(self) -> bool:
        """Whether the tag directory this rank wrote into is gone: rank 0 gave the checkpoint up."""
        return self.dir_made and not os.path.isdir(self.tag_dir)

    def add(self, snap: SnapshotFile) -> None:
        self.files.put(snap)

    def seal(self) -> None:
        """No more files: the writer may write the manifest once those given are durable."""
        self.files.put(None)


class BufferPool:
    """The host buffers of the checkpoints in flight, and whether storage is failing.

    A checkpoint waits for free buffers while persisting is merely slower than the
    checkpoint interval (back-pressure), never while storage fails: from a failed
    write until one succeeds, ``take`` returns None instead of waiting.
    """

    def __init__(self, buffers: list[HostBuffers]):
        self._free = list(buffers)
        self.failure: Optional[str] = None
        self._cond = threading.Condition()

    def take(self) -> tuple[Optional[HostBuffers], Optional[str]]:
        """(free buffers, None), or (None, the failure) while storage fails and none are free."""
        with self._cond:
            self._cond.wait_for(lambda: self._free or self.failure is not None)
            return (self._free.pop(0), None) if self._free else (None, self.failure)

    def give(self, buffers: HostBuffers) -> None:
        buffers.drop_unused()
        with self._cond:
            self._free.append(buffers)
            self._cond.notify_all()

    def failed(self, cause: str) -> None:
        with self._cond:
            self.failure = cause
            self._cond.notify_all()

    def succeeded(self) -> None:
        with self._cond:
            self.failure = None


class Concurrent:
    """``fn()`` on a thread of its own.

    A plain thread, not an executor: checkpoints are still written from ``atexit``, where executors refuse new work.
    """

    def __init__(self, fn: Callable):
        self._fn = fn
        self._result = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="cpsr-check", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._fn()
        except BaseException as err:
            self._error = err

    def join(self) -> None:
        self._thread.join()

    def result(self):
        self.join()
        if self._error is not None:
            raise self._error
        return self._result
