"""Persist: background threads that put snapshots on storage and commit checkpoints.

The writer thread of every rank writes each file of a checkpoint atomically, then the
rank's manifest. Rank 0's committer thread waits, by polling the shared checkpoint
directory, until all ``world_size`` manifests of a tag are there, then writes the
commit record and moves ``latest`` (see store.py). Neither thread uses collectives.
An ``OSError`` (disk full, permission denied, storage gone) is logged with its cause
and retried with exponential backoff; when retries run out the checkpoint is given
up, training goes on and ``latest`` stays on the last good checkpoint.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from cpsr_ds.checkpoint import store
from cpsr_ds.checkpoint.snapshot import HostBuffers, SnapshotFile

log = logging.getLogger(__name__)

_POLL_S = 0.02


@dataclass(frozen=True)
class RetryPolicy:
    retries: int
    backoff_s: float

    def delays(self) -> list[float]:
        return [self.backoff_s * 2 ** i for i in range(self.retries)]


def describe_error(err: OSError) -> str:
    """``ENOSPC No space left on device: /ckpt/x`` -- the cause an operator can act on."""
    code = errno.errorcode.get(err.errno, "") if err.errno else ""
    where = f": {err.filename}" if err.filename else ""
    return f"{code} {err.strerror or err}{where}".strip()


def with_retries(action: Callable, policy: RetryPolicy, what: str, sleep: Callable = time.sleep):
    """Run ``action``; on ``OSError`` log the cause and retry after a growing delay; the last error propagates."""
    delays = policy.delays()
    for attempt in range(len(delays) + 1):
        try:
            return action()
        except OSError as err:
            if attempt == len(delays):
                raise
            log.warning("%s failed (attempt %d of %d): %s; retrying in %.2f s",
                        what, attempt + 1, len(delays) + 1, describe_error(err), delays[attempt])
            sleep(delays[attempt])


@dataclass
class Job:
    """One checkpoint of one rank, from ``create()`` until it is persisted (and, on rank 0, committed)."""

    tag: str
    ckpt_dir: str
    started_ns: int
    buffers: HostBuffers
    files: queue.Queue = field(default_factory=queue.Queue)
    finished: threading.Event = field(default_factory=threading.Event)
    ok: bool = True
    nbytes: int = 0
    # perf_counter() when the first file write began and when the checkpoint became
    # durable: this rank's manifest on storage, or on rank 0 ``latest`` moved.
    write_start: Optional[float] = None
    durable: Optional[float] = None

    @property
    def persist_s(self) -> Optional[float]:
        if self.write_start is None or self.durable is None:
            return None
        return self.durable - self.write_start

    @property
    def tag_dir(self) -> str:
        return os.path.join(self.ckpt_dir, self.tag)

    def add(self, snap: SnapshotFile) -> None:
        self.files.put(snap)

    def seal(self) -> None:
        """No more files: the writer may write the manifest once those given are durable."""
        self.files.put(None)


class Writer:
    """Writes the jobs of one rank in order: every file, then the rank's manifest."""

    def __init__(self, rank: int, world_size: int, checksum: str, policy: RetryPolicy, overlap: bool,
                 release: Callable[[Job], None], persisted: Callable[[Job], None]):
        self.rank = rank
        self.overlap = overlap
        self.world_size = world_size
        self.checksum = checksum
        self.policy = policy
        self._release = release
        self._persisted = persisted
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"cpsr-writer{rank}", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        for job in iter(self._jobs.get, None):
            self._persist(job)

    def _persist(self, job: Job) -> None:
        entries = {}
        snaps = []
        files = iter(job.files.get, None)
        if not self.overlap:
            # Writing while the snapshot is copied competes for memory bandwidth and
            # lengthens the training stall, so wait for the whole snapshot first.
            files = list(files)
            for snap in files:
                snap.wait_quietly()
        for snap in files:
            snaps.append(snap)
            if not job.ok:
                continue
            if job.write_start is None:
                job.write_start = time.perf_counter()
            try:
                entries[snap.rel] = self._write_file(job, snap)
                job.nbytes += entries[snap.rel]["size"]
            except OSError as err:
                job.ok = False
                log.error("checkpoint %s: giving up writing %s after %d retries: %s; "
                          "latest stays on the last good checkpoint", job.tag, snap.rel,
                          self.policy.retries, describe_error(err))
            except Exception:
                job.ok = False
                log.exception("checkpoint %s: snapshot of %s failed", job.tag, snap.rel)
        # The buffers go back to the next checkpoint only once nothing copies into them.
        for snap in snaps:
            snap.wait_quietly()
        self._release(job)
        if job.ok:
            try:
                self._write_manifest(job, entries)
            except OSError as err:
                job.ok = False
                log.error("checkpoint %s: giving up writing the rank %d manifest: %s",
                          job.tag, self.rank, describe_error(err))
        job.durable = time.perf_counter()
        self._persisted(job)

    def _write_file(self, job: Job, snap: SnapshotFile) -> dict:
        path = os.path.join(job.tag_dir, snap.rel)

        def attempt():
            os.makedirs(os.path.dirname(path), exist_ok=True)
            return store.write_atomic(path, snap.chunks(), self.checksum, direct=True)

        size, digest = with_retries(attempt, self.policy, f"checkpoint {job.tag}: writing {snap.rel}")
        return {"size": size, "digest": digest}

    def _write_manifest(self, job: Job, entries: dict) -> None:
        manifest = {"tag": job.tag, "rank": self.rank, "world_size": self.world_size,
                    "started_ns": job.started_ns, "iteration": store.tag_iteration(job.tag),
                    "checksum": self.checksum, "files": entries}
        path = os.path.join(job.tag_dir, store.manifest_name(self.rank))
        with_retries(lambda: store.write_json_atomic(path, manifest), self.policy,
                     f"checkpoint {job.tag}: writing {store.manifest_name(self.rank)}")


class Committer:
    """Rank 0: commits each tag once every rank's manifest is on the shared directory."""

    def __init__(self, world_size: int, keep_last: int, timeout_s: float, policy: RetryPolicy,
                 in_flight: Callable[[str], bool], done: Callable[[Job], None]):
        self.world_size = world_size
        self.keep_last = keep_last
        self.timeout_s = timeout_s
        self.policy = policy
        self._in_flight = in_flight
        self._done = done
        self._pending: list[tuple[Job, float]] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="cpsr-committer", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            self._pending.append((job, time.monotonic() + self.timeout_s))
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._stopping)
                if not self._pending:
                    return
                pending = list(self._pending)
            done = [job for job, deadline in pending if self._try_commit(job, deadline)]
            with self._cond:
                self._pending = [p for p in self._pending if p[0] not in done]
            for job in done:
                self._done(job)
            if len(done) < len(pending):
                time.sleep(_POLL_S)

    def _try_commit(self, job: Job, deadline: float) -> bool:
        """True when the job needs no more attention: committed or given up."""
        try:
            ranks = store.read_manifests(job.tag_dir)
        except (OSError, ValueError) as err:
            ranks, cause = {}, err
        else:
            cause = None
        missing = [r for r in range(self.world_size) if r not in ranks]
        if missing:
            if time.monotonic() < deadline:
                return False
            job.ok = False
            log.error("checkpoint %s: not committed, rank manifests %s missing after %.0f s%s", job.tag,
                      missing, self.timeout_s, f" ({cause})" if cause else "")
            return True
        record = {"tag": job.tag, "world_size": self.world_size, "started_ns": job.started_ns,
                  "iteration": store.tag_iteration(job.tag), "committed_time": time.time()}
        try:
            moved = with_retries(lambda: store.commit_checkpoint(job.ckpt_dir, job.tag, record),
                                 self.policy, f"checkpoint {job.tag}: commit")
        except OSError as err:
            job.ok = False
            log.error("checkpoint %s: giving up the commit: %s", job.tag, describe_error(err))
            return True
        job.durable = time.perf_counter()
        log.info("checkpoint %s committed%s", job.tag, ", latest moved to it" if moved else "")
        # Deleting old checkpoints takes long (file systems mounted with discard trim
        # synchronously), so it comes after the commit and does not delay it.
        try:
            store.apply_retention(job.ckpt_dir, self.keep_last, self._in_flight)
        except OSError as err:
            log.warning("checkpoint %s: retention failed: %s", job.tag, describe_error(err))
        return True

