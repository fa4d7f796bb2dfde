"""Asynchronous DeepSpeed checkpoint engine: snapshot into host buffers, persist in the background.

DeepSpeed calls ``create(info)``, then ``save(state, path)`` once per file, then
``commit(info)`` before the next optimizer step (``DeepSpeedEngine.step`` does this for
decoupled engines; a pipeline engine has to call it itself). ``save`` only captures
the state; ``commit`` blocks until the copies are done, which is the whole training
stall. The engine owns ``latest``: it reports ``save_latest=False`` to DeepSpeed, so
DeepSpeed never writes ``latest`` itself, and rank 0's committer moves it once every
rank's part is durable. While storage fails, a checkpoint that would have to wait for
host buffers is skipped: its ``save`` and ``commit`` do nothing and training goes on.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Collection, Optional

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from cpsr_ds.checkpoint.capture import exiting
from cpsr_ds.checkpoint.storage import loading, records, retention
from cpsr_ds.checkpoint.engines import throttle
from cpsr_ds.checkpoint.storage.layout import make_layout
from cpsr_ds.checkpoint.engines.committer import Committer
from cpsr_ds.checkpoint.engines.persist import BufferPool, Job, RetryPolicy
from cpsr_ds.checkpoint.engines.writer import Writer
from cpsr_ds.checkpoint.engines.snapshot import Copier, HostBuffers, snapshot_file
from cpsr_ds.checkpoint.storage.filesystem import describe_error
from cpsr_ds.config import CheckpointConfig

log = logging.getLogger(__name__)


@dataclass
class CheckpointStats:
    """What the last checkpoints cost; strategies derive their interval from it."""

    started: int = 0
    persisted: int = 0
    failed: int = 0
    # Not started: storage was failing and no host buffers were free.
    skipped: int = 0
    # The stalls of the last checkpoints, oldest first.
    stalls: deque = field(default_factory=lambda: deque(maxlen=64))
    # From the first file write to durable (see persist.Job); on rank 0 until ``latest`` moved.
    last_persist_s: Optional[float] = None
    last_bytes: int = 0
    # (tag, bytes, persist seconds) of the last persisted checkpoints, oldest first.
    recent: deque = field(default_factory=lambda: deque(maxlen=64))
    # Tags of the last checkpoints given up (failed or skipped), oldest first.
    given_up: deque = field(default_factory=lambda: deque(maxlen=64))

    def outcome(self, tag: str) -> Optional[tuple[int, float]] | bool:
        """(bytes, persist seconds) of a persisted checkpoint, False for one given up, None while pending."""
        # Snapshots: the persisting threads append while training reads.
        found = [(nbytes, persist_s) for t, nbytes, persist_s in tuple(self.recent) if t == tag]
        if found:
            return found[-1]
        return False if tag in tuple(self.given_up) else None

    @property
    def last_stall_s(self) -> Optional[float]:
        return self.stalls[-1] if self.stalls else None

    def stalled(self, stall_s: float) -> None:
        self.stalls.append(stall_s)


def fixed_interval(cfg: CheckpointConfig) -> Optional[int]:
    """``checkpoint.interval`` where it is a number of iterations; None for "auto"."""
    return cfg.interval if isinstance(cfg.interval, int) else None


class AsyncCheckpointEngine(CheckpointEngine):
    """Snapshot/persist engine; strategies differ in ``max_in_flight``, chunking, ``overlap`` and ``interval``.

    ``overlap``: writers start on a chunk as soon as it is copied, before the snapshot is
    complete (shorter persist, longer stall on hosts short of memory bandwidth).
    ``attempt``: the job attempt, written into every record (checkpoints are ordered by
    iteration, then attempt). ``min_keep``: the newest committed checkpoints that
    freeing space on a full disk never deletes (the predictor's history).
    """

    def __init__(self, cfg: CheckpointConfig, rank: int, world_size: int, max_in_flight: int,
                 chunk_bytes: Optional[int], overlap: bool, *, attempt: int = 0, min_keep: int = 1, layout=None):
        super().__init__(None)
        self.name = type(self).__name__
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.chunk_bytes = chunk_bytes
        self.attempt = attempt
        self.min_keep = min_keep
        self._max_in_flight = max_in_flight
        self.stats = CheckpointStats()
        pin = torch.cuda.is_available()
        self._pool = BufferPool([HostBuffers(pin) for _ in range(max_in_flight)])
        self._job: Optional[Job] = None
        self._info: Optional[CheckpointCommitInfo] = None
        # (ranks, stages) of the next checkpoint, given by select(); None: every rank's, as without per_stage.
        self._next_part: Optional[tuple] = None
        self._stall_s = 0.0
        self._jobs: list[Job] = []
        self._lock = threading.Lock()
        policy = RetryPolicy(cfg.retries, cfg.retry_backoff_s)
        self._copier = Copier()
        self._created = 0
        self.layout = layout or make_layout(cfg, rank, world_size)
        self._committer = (Committer(world_size, cfg.keep_last, cfg.commit_timeout_s, policy, self._in_flight,
                                     self._storage_error, self._finish, self.layout)
                           if self.layout.commits else None)
        self._writer = Writer(rank, world_size, cfg.checksum, policy, overlap, self._pool, self._storage_error,
                              self._persisted, throttle.shared(cfg.write_mbps), self.layout)
        self._closed = False
        # A script that ends without cleanup() still gets its last checkpoint committed.
        exiting.at_exit(self, "cleanup")

    # ------------------------------------------------------------ DeepSpeed interface

    def create(self, info: CheckpointCommitInfo):
        t0 = time.perf_counter()
        if self._job is not None:
            self._seal()
        selected = self._next_part is not None
        ranks, stages = self._next_part or (None, None)
        self._next_part = None
        part = ranks is None or self.rank in ranks
        # A rank that writes nothing must not wait for host buffers its last part still holds.
        buffers, failure = self._pool.take() if part else (None, None)
        job = Job(info.tag, info.save_dir, self.attempt, buffers, self._created, ranks=ranks, stages=stages,
                  part=part, own_persist=selected)
        self._created += 1
        if job.skipped:
            job.give_up(f"skipped, storage failing: {failure}")
            self.stats.skipped += 1
            log.error("checkpoint %s skipped: storage is failing (%s) and the checkpoints before it still hold "
                      "the host buffers; training goes on, latest stays on the last good checkpoint", job.tag, failure)
        else:
            # What an earlier run left under this tag must not be mistaken for this run's.
            records.forget_metadata(job.tag_dir, self.rank)
            self.stats.started += job.part
        with self._lock:
            self._jobs.append(job)
        self._job, self._info = job, info
        self._writer.submit(job)
        self._stall_s = time.perf_counter() - t0

    def save(self, state_dict, path: str):
        t0 = time.perf_counter()
        if self._job is None:
            raise RuntimeError(f"{self.name}.save({path}) outside create()/commit()")
        if not self._job.writes:
            return
        rel = os.path.relpath(path, self._job.tag_dir)
        snap = snapshot_file(rel, state_dict, self._job.buffers, self.chunk_bytes)
        self._copier.submit(snap)
        self._job.add(snap)
        self._stall_s += time.perf_counter() - t0

    def commit(self, info: CheckpointCommitInfo):
        """Seal the open checkpoint and wait until its state is copied: call before the optimizer step."""
        t0 = time.perf_counter()
        job = self._job
        if job is not None:
            self._seal()
        self.wait_snapshot()
        if job is None or job.writes:
            self.stats.stalled(self._stall_s + time.perf_counter() - t0)
        self._stall_s = 0.0
        return True

    def load(self, path: str, map_location=None):
        """Read a file, verifying it against its checkpoint's manifests; files of DeepSpeed's engine load as they are."""
        return loading.load_file(path, map_location)

    def makedirs(self, path, exist_ok=False):
        if self._job is not None and not self._job.writes and _inside(path, self._job.tag_dir):
            return
        # Storage trouble must not stop training here; the writer retries and reports it.
        try:
            os.makedirs(path, exist_ok=exist_ok)
        except OSError as err:
            log.warning("could not create %s: %s", path, describe_error(err))

    def is_decoupled(self):
        return True

    def preserves_storage_sharing(self):
        # True would make DeepSpeed clone every tensor on the device before save().
        return False

    def get_commit_info(self):
        if self._info is None:
            return None
        return CheckpointCommitInfo(tag=self._info.tag, save_dir=self._info.save_dir, save_latest=False)

    def cleanup(self):
        """Persist what is in flight and stop the threads; see exiting.py for how long that may take."""
        if self._closed:
            return
        self._closed = True
        failure = exiting.reason()
        if failure is not None and self._committer is not None:
            self._committer.stop_waiting(failure)
        bound_s = self.cfg.commit_timeout_s if failure is None else exiting.EXIT_GRACE_S
        deadline = time.monotonic() + bound_s
        try:
            self._close(bound_s, failure)
        finally:
            self.layout.release(max(0.0, deadline - time.monotonic()))

    def _close(self, bound_s: float, failure: Optional[str]) -> None:
        if not self.flush(bound_s):
            with self._lock:
                tags = [job.tag for job in self._jobs]
            why = "commit_timeout_s" if failure is None else f"the exit grace, this process is failing ({failure})"
            log.error("checkpoints %s not persisted within %g s (%s); abandoned at exit, "
                      "latest stays on the last committed checkpoint", ", ".join(tags), bound_s, why)
            # The threads are daemons; joining them would wait for the storage that held them up.
            return
        self._copier.stop()
        self._writer.stop()
        if self._committer is not None:
            self._committer.stop()
        if not self.layout.close(bound_s):
            log.error("replicas of the last checkpoints not sent within %g s; the owners' copies stand", bound_s)

    # ------------------------------------------------------------ beyond DeepSpeed's interface

    def wait_snapshot(self) -> None:
        """Block until every tensor handed to ``save`` is copied; re-raises a failed copy."""
        self._copier.wait_all()

    def flush(self, timeout_s: Optional[float] = None) -> bool:
        """Seal the open checkpoint and wait until all are persisted (and on rank 0 committed or given up)."""
        if self._job is not None:
            self._seal()
        return self.wait_persisted(timeout_s)

    def wait_persisted(self, timeout_s: Optional[float] = None) -> bool:
        """Wait until the sealed checkpoints in flight now are persisted (or given up); False where ``timeout_s``
        ran out. Seals nothing and waits for no open checkpoint, so other threads may wait here while the
        training loop saves."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            jobs = [job for job in self._jobs if job is not self._job]
        for job in jobs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not job.finished.wait(left):
                return False
        return True

    def select(self, ranks: Optional[Collection[int]], stages: Optional[Collection[int]] = None) -> None:
        """The next checkpoint holds the parts of ``ranks`` (of pipeline ``stages``) only; None: every rank's.

        Every rank still calls DeepSpeed's save_checkpoint (its barriers are collective); the
        others write nothing, and the commit record names the ranks and stages it holds. Each
        rank's persist time of a selected checkpoint is its own part's (each stage plans its
        own interval), not until every part is there.
        """
        self._next_part = (None, None) if ranks is None else (tuple(sorted(ranks)), tuple(sorted(stages or ())))

    def interval(self, iteration_time_s: Optional[float] = None) -> Optional[int]:
        """Iterations until the next checkpoint by this engine's own rule: the fixed ``checkpoint.interval``;
        None with "auto" (the planner chooses for cpsr)."""
        return fixed_interval(self.cfg)

    # ------------------------------------------------------------ internals

    def _seal(self) -> None:
        self._job.seal()
        self._job, self._info = None, None

    def _in_flight(self, tag: str) -> bool:
        with self._lock:
            return any(j.tag == tag for j in self._jobs)

    def _storage_error(self, job: Job, err: OSError) -> None:
        """A write failed and will be retried: checkpoints stop waiting for buffers; a full disk is freed."""
        self._pool.failed(describe_error(err))
        if err.errno != errno.ENOSPC:
            return
        try:
            freed = retention.apply_retention(job.ckpt_dir, self.min_keep, self._in_flight)
        except OSError as failed:
            log.warning("checkpoint %s: storage full, freeing space failed: %s", job.tag, describe_error(failed))
            return
        if freed:
            log.warning("checkpoint %s: storage full, deleted %s to free space (the %d newest committed stay)",
                        job.tag, ", ".join(freed), self.min_keep)

    def _persisted(self, job: Job) -> None:
        # Rank 0's committer also settles the checkpoints rank 0 gave up: it removes them.
        if self._committer is not None:
            self._committer.submit(job)
        else:
            self._finish(job)

    def _finish(self, job: Job) -> None:
        # A rank without a part in the checkpoint has no cost of its own to report.
        if job.part and job.ok:
            self.stats.persisted += 1
            self.stats.last_persist_s = job.persist_s
            self.stats.last_bytes = job.nbytes
            self.stats.recent.append((job.tag, job.nbytes, job.persist_s))
        elif job.part:
            self.stats.failed += not job.skipped
            self.stats.given_up.append(job.tag)
        job.finished.set()
        with self._lock:
            self._jobs.remove(job)


def _inside(path: str, directory: str) -> bool:
    path, directory = os.path.abspath(path), os.path.abspath(directory)
    return os.path.commonpath([path, directory]) == directory
