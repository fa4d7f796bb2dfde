"""Persist: background threads that put snapshots on storage and commit checkpoints.

The writer thread of every rank writes each file of a checkpoint atomically, then the
rank's manifest, which lists every file's size, checksum and floating tensors holding
NaN or Inf. Rank 0's committer thread waits, by polling the shared checkpoint
directory, until all ``world_size`` manifests of a tag are there, then writes the
commit record and moves ``latest`` (see committing.py). With node-local storage the
manifests' summaries and rank 0's decision go through the job's key-value store, every
rank's committer follows the decision on its node, and each node's records wait until
every rank's part is replicated to the next node (layout.py). Neither thread uses
collectives.

An ``OSError`` (disk full, permission denied, storage gone) is logged with its cause
and retried with exponential backoff; on a full disk, committed checkpoints beyond the
``min_keep`` newest are deleted first. Training never waits for failing storage: from
a failed write until one succeeds, a checkpoint that would wait for host buffers is
skipped (``BufferPool``). A checkpoint is given up, and rank 0 removes its directory,
when rank 0's part fails, when another rank reports in its manifest (``failed``)
that its part failed, when a manifest lists a
non-finite tensor, or when a manifest is still missing after ``commit_timeout_s``, or
at once once the process is failing (``Committer.stop_waiting``, see exiting.py).
``latest`` then stays on the last good checkpoint.
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

from cpsr_ds.checkpoint.storage import committing, filesystem, ondisk, progress_record, records, retention
from cpsr_ds.checkpoint.storage.filesystem import describe_error, fs
from cpsr_ds.checkpoint.storage.layout import CommitVerdict, SharedLayout
from cpsr_ds.checkpoint.engines.snapshot import HostBuffers, SnapshotFile
from cpsr_ds.checkpoint.engines.throttle import Throttle

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


class Writer:
    """Writes the jobs of one rank in order: every file, then the rank's manifest.

    ``throttle``: the process's write-rate limit; this thread waits on it, training never does.
    """

    def __init__(self, rank: int, world_size: int, checksum: str, policy: RetryPolicy, overlap: bool,
                 pool: BufferPool, on_error: Callable[[Job, OSError], None], persisted: Callable[[Job], None],
                 throttle: Optional[Throttle] = None, layout=None):
        self.rank = rank
        self.layout = layout or SharedLayout(rank, world_size)
        self.throttle = throttle
        self.overlap = overlap
        self.world_size = world_size
        self.checksum = checksum
        self.policy = policy
        self._pool = pool
        self._on_error = on_error
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
        if not job.part:
            job.durable = time.perf_counter()
            self._persisted(job)
            return
        entries = {} if job.skipped else self._write_files(job)
        name = ondisk.manifest_name(self.rank)
        if job.ok:
            manifest = self._attempt(job, f"writing {name}", lambda: self._write_manifest(job, entries, name))
            if manifest is not None:
                progress_record.forget_progress(job.tag_dir, self.rank)
                self._publish(job, manifest)
        if not job.ok and self.rank != 0:
            self._report_failure(job, entries, name)
        job.durable = time.perf_counter()
        self._persisted(job)

    def _write_files(self, job: Job) -> dict:
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
            entry = self._attempt(job, f"writing {snap.rel}", lambda: self._write_file(job, snap))
            if entry is not None:
                entries[snap.rel] = entry
                job.nbytes += entry["size"]
                self._record_progress(job, snap.rel, entry, first=len(entries) == 1)
        # The buffers go back to the next checkpoint only once nothing copies into them.
        for snap in snaps:
            snap.wait_quietly()
        self._pool.give(job.buffers)
        return entries

    def _record_progress(self, job: Job, rel: str, entry: dict, first: bool) -> None:
        """The landed file to the progress record, which only recovery from this checkpoint cut short reads: where
        it cannot be written, the checkpoint goes on without it."""
        try:
            progress_record.record_progress(job.tag_dir, self.rank, rel, entry, job.attempt, self.checksum, first)
        except OSError as err:
            log.warning("checkpoint %s: could not record %s as landed: %s", job.tag, rel, describe_error(err))

    def _attempt(self, job: Job, what: str, action: Callable):
        """``action()`` with retries; its result, or None once the job is given up (logged)."""
        try:
            result = with_retries(action, self.policy, f"checkpoint {job.tag}: {what}",
                                  on_error=lambda err: self._retry(job, err))
        except OSError as err:
            job.give_up(f"{what}: {describe_error(err)}")
            if job.removed():
                log.info("checkpoint %s: rank 0 gave it up, rank %d stopped %s", job.tag, self.rank, what)
            else:
                log.error("checkpoint %s: giving up %s after %d retries: %s; latest stays on the last good checkpoint",
                          job.tag, what, self.policy.retries, describe_error(err))
            return None
        except Exception as err:
            job.give_up(f"{what}: {err!r}")
            log.exception("checkpoint %s: %s failed", job.tag, what)
            return None
        self._pool.succeeded()
        return result

    def _retry(self, job: Job, err: OSError) -> bool:
        if job.removed():
            return False
        self._on_error(job, err)
        return True

    def _make_dirs(self, job: Job, path: str) -> None:
        """Create ``path``'s directory; the tag directory only once, so that one rank 0 removed stays removed."""
        if not job.dir_made:
            os.makedirs(job.tag_dir, exist_ok=True)
            job.dir_made = True
        elif job.removed():
            raise FileNotFoundError(errno.ENOENT, "checkpoint directory removed", job.tag_dir)
        os.makedirs(os.path.dirname(path), exist_ok=True)

    def _write_file(self, job: Job, snap: SnapshotFile) -> dict:
        path = os.path.join(job.tag_dir, snap.rel)
        self._make_dirs(job, path)
        # Checking for NaN and Inf beside the write, not after it, keeps it off the persist time.
        check = Concurrent(snap.nonfinite)
        try:
            size, digest = fs.write_atomic(path, snap.chunks(), self.checksum, direct=True,
                                              throttle=self.throttle)
        finally:
            # The check reads the host buffers, which go to the next checkpoint after this.
            check.join()
        entry = {"size": size, "digest": digest}
        nonfinite = check.result()
        if nonfinite:
            entry["nonfinite"] = nonfinite
        return entry

    def _manifest(self, job: Job, entries: dict, failed: Optional[str] = None) -> dict:
        return {"tag": job.tag, "rank": self.rank, "world_size": self.world_size, "attempt": job.attempt,
                "started_ns": job.started_ns, "iteration": ondisk.tag_iteration(job.tag),
                "checksum": self.checksum, "files": entries, "failed": failed}

    def _write_manifest(self, job: Job, entries: dict, name: str, failed: Optional[str] = None) -> dict:
        manifest = self._manifest(job, entries, failed)
        fs.write_json_atomic(os.path.join(job.tag_dir, name), manifest)
        return manifest

    def _publish(self, job: Job, manifest: dict) -> None:
        """Tell rank 0 what this rank's manifest says (node_local: through the job's store)."""
        try:
            self.layout.publish(job.key, manifest)
        except RuntimeError as err:  # torch's DistError: the store went with the process that held it
            log.error("checkpoint %s: rank %d could not tell rank 0 about its part: %s", job.tag, self.rank, err)

    def _report_failure(self, job: Job, entries: dict, name: str) -> None:
        """Tell rank 0 at once, by a manifest saying ``failed``, that this rank's part will not come; failing
        that, take the part away."""
        self._publish(job, self._manifest(job, entries, job.error))
        if job.removed():
            return
        try:
            # Into the tag directory only if it is there: one rank 0 removed must not come back.
            self._write_manifest(job, entries, name, failed=job.error)
        except OSError as err:
            log.warning("checkpoint %s: could not tell rank 0 that rank %d gave up (%s); removing its files",
                        job.tag, self.rank, describe_error(err))
            for rel in entries:
                try:
                    os.unlink(os.path.join(job.tag_dir, rel))
                except OSError:
                    pass


def nonfinite_tensors(manifests: dict[int, dict]) -> list[str]:
    """``file: tensor, ... (rank r)`` for every file whose manifest entry lists non-finite tensors."""
    return [f"{rel}: {', '.join(entry['nonfinite'])} (rank {rank})"
            for rank, man in sorted(manifests.items()) for rel, entry in man["files"].items()
            if entry.get("nonfinite")]


class Committer:
    """Commits each tag once every rank's manifest is there, or gives it up.

    Rank 0 decides; with node-local storage every other rank's committer follows its
    decisions (layout.py), and one rank writes the records of each node.
    """

    def __init__(self, world_size: int, keep_last: int, timeout_s: float, policy: RetryPolicy,
                 in_flight: Callable[[str], bool], on_error: Callable[[Job, OSError], None],
                 done: Callable[[Job], None], layout=None):
        self.layout = layout or SharedLayout(0, world_size)
        self.world_size = world_size
        self.keep_last = keep_last
        self.timeout_s = timeout_s
        self.policy = policy
        self._in_flight = in_flight
        self._on_error = on_error
        self._done = done
        self._pending: list[tuple[Job, float]] = []
        self._cond = threading.Condition()
        self._stopping = False
        # Why other ranks' manifests are no longer waited for; None while they are.
        self._no_wait: Optional[str] = None
        self._thread = threading.Thread(target=self._run, name="cpsr-committer", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            wait = 0.0 if self._no_wait is not None else self.timeout_s
            self._pending.append((job, time.monotonic() + wait))
            self._cond.notify()

    def stop_waiting(self, reason: str) -> None:
        """Wait for no more manifests: commit what is complete, give up the rest (now and later)."""
        with self._cond:
            self._no_wait = reason
            now = time.monotonic()
            self._pending = [(job, min(deadline, now)) for job, deadline in self._pending]
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
            done = [job for job, deadline in pending if self._settle(job, deadline)]
            with self._cond:
                self._pending = [p for p in self._pending if p[0] not in done]
            for job in done:
                self._done(job)
            if len(done) < len(pending):
                time.sleep(filesystem.POLL_S)

    def _settle(self, job: Job, deadline: float) -> bool:
        """True when the job needs no more attention: committed or given up."""
        try:
            return self._try_commit(job, deadline)
        except Exception as err:
            # Whatever went wrong, the checkpoint must not stay pending: exit waits for it.
            log.exception("checkpoint %s: commit failed", job.tag)
            if self.layout.decides and job.decided is None:
                return self._give_up(job, f"the commit failed: {err!r}")
            # Once rank 0 decided to commit, some rank may have committed it (the store the decision goes through
            # is gone with rank 0's process, say): this part may be what recovery needs, so it stays.
            return self._leave(job, f"the commit failed: {err!r}", logging.ERROR)

    def _try_commit(self, job: Job, deadline: float) -> bool:
        if job.decided is None:
            decision = self._decision(job, deadline)
            if decision is None:
                if self.layout.decides or time.monotonic() < deadline:
                    return False
                return self._leave(job, f"no commit decision from rank 0{self._waited()}")
            if decision.record is None:
                # Where this rank's own part failed its writer logged why; other reasons rank 0 logs as errors.
                level = logging.ERROR if self.layout.decides and job.ok else logging.INFO
                return self._give_up(job, decision.reason, level)
            job.decided = decision.record
            self.layout.replicate(job.key, job.tag, job.ckpt_dir, job.decided)
        if self.layout.writes_commit:
            failed = self.layout.replication_failed(job.key)
            if failed is not None:
                return self._leave(job, f"not replicated to the next node: {failed}", logging.ERROR)
            if not self.layout.replicated(job.key):
                if time.monotonic() < deadline:
                    return False
                return self._leave(job, f"its replicas on the next nodes not confirmed{self._waited()}")
        return self._commit(job, job.decided)

    def _decision(self, job: Job, deadline: float) -> Optional[CommitVerdict]:
        """Rank 0's decision on ``job``, announced where it is rank 0's own; None: not yet."""
        if self.layout.decides:
            decision = self._decide(job, deadline)
            if decision is not None:
                # Decided before announced: once part of an announcement is out, a follower may have committed,
                # and an error in the rest must leave this part for recovery (see _settle).
                job.decided = decision.record
                self.layout.announce(job.key, decision)
            return decision
        if job.ok:
            return self.layout.decision(job.key)
        # This rank told rank 0 it gave up (Writer._report_failure): the decision can only be that.
        return CommitVerdict(reason=f"rank {self.layout.rank} gave it up: {job.error}")

    def _decide(self, job: Job, deadline: float) -> Optional[CommitVerdict]:
        """Rank 0: commit or give up once every rank's manifest is there or one says no; None: wait on."""
        if not job.ok:
            # Rank 0's writer, or create() for a skipped checkpoint, logged the cause already.
            return CommitVerdict(reason=f"rank 0 gave it up: {job.error}")
        try:
            ranks = self.layout.parts(job.key, job.tag_dir)
        except (OSError, ValueError) as err:
            ranks, cause = {}, err
        else:
            cause = None
        expected = job.ranks or range(self.world_size)
        ranks = {r: m for r, m in ranks.items() if r in expected}
        missing = [r for r in expected if r not in ranks]
        aborted = [f"rank {r} gave its part up: {m['failed']}" for r, m in sorted(ranks.items()) if m.get("failed")]
        if aborted:
            return CommitVerdict(reason="; ".join(aborted))
        nonfinite = nonfinite_tensors(ranks)
        if nonfinite:
            return CommitVerdict(reason="non-finite values (NaN or Inf) in " + "; ".join(nonfinite))
        if missing:
            if time.monotonic() < deadline:
                return None
            return CommitVerdict(reason=f"rank manifests {missing} missing{self._waited()}" + (f" ({cause})" if cause else ""))
        record = {"tag": job.tag, "world_size": self.world_size, "attempt": job.attempt,
                  "started_ns": job.started_ns, "iteration": ondisk.tag_iteration(job.tag),
                  "committed_time": time.time()}
        if job.ranks is not None:
            record.update(ranks=list(job.ranks), stages=list(job.stages or ()))
        return CommitVerdict(record)

    def _waited(self) -> str:
        return (f", not waited for: this process is failing ({self._no_wait})" if self._no_wait is not None
                else f" after {self.timeout_s:.0f} s")

    def _commit(self, job: Job, record: dict) -> bool:
        """Write the commit record and move ``latest`` (where this rank writes them), retention."""
        if self.layout.writes_commit:
            try:
                moved = with_retries(lambda: committing.commit_checkpoint(job.ckpt_dir, job.tag, record),
                                     self.policy, f"checkpoint {job.tag}: commit",
                                     on_error=lambda err: self._on_error(job, err) or True)
            except OSError as err:
                if not self.layout.record_commits:
                    # Committed all the same, by rank 0's decision: other nodes' records say so.
                    log.error("checkpoint %s: committed, but its commit record not written here: %s",
                              job.tag, describe_error(err))
                    return True
                return self._give_up(job, f"the commit failed: {describe_error(err)}")
            log.info("checkpoint %s committed%s", job.tag, ", latest moved to it" if moved else "")
            # Deleting old checkpoints takes long (file systems mounted with discard trim
            # synchronously), so it comes after the commit and does not delay it.
            try:
                retention.apply_retention(job.ckpt_dir, self.keep_last, self._in_flight, self.layout.retention_ranks)
            except OSError as err:
                log.warning("checkpoint %s: retention failed: %s", job.tag, describe_error(err))
        if not (job.own_persist and job.part):
            job.durable = time.perf_counter()
        return True

    def _leave(self, job: Job, cause: str, level: int = logging.WARNING) -> bool:
        """Not committed here, but keep this rank's part as it is: the other ranks' parts may stand beside it
        (rank 0 may have decided to commit), and recovery takes a checkpoint whose every part is sound."""
        job.give_up(cause)
        log.log(level, "checkpoint %s: %s; its part here stays, uncommitted on this node", job.tag, job.error)
        return True

    @staticmethod
    def _give_up(job: Job, reason: str, level: int = logging.ERROR) -> bool:
        """Mark the job given up and remove its directory, unless it holds a commit record (an earlier commit)."""
        job.give_up(reason)
        removed = records.read_commit(job.tag_dir) is None and retention.remove_checkpoint(job.ckpt_dir, job.tag)
        log.log(level, "checkpoint %s: not committed, %s; %s, latest stays on the last good checkpoint",
                job.tag, reason, "its directory removed" if removed else "nothing to remove")
        return True
