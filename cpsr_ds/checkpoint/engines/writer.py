"""The writer thread of a rank: every file of a checkpoint atomically, then the rank's manifest.

Each file lands in the rank's progress record as it is durable; the manifest, written
once every file is, lists every file's size, checksum and floating tensors holding NaN
or Inf, and replaces the progress record. A part that fails is reported to rank 0 at
once by a manifest saying ``failed``.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from typing import Callable, Optional

from cpsr_ds.checkpoint.engines.persist import BufferPool, Concurrent, Job, RetryPolicy, with_retries
from cpsr_ds.checkpoint.engines.snapshot import SnapshotFile
from cpsr_ds.checkpoint.engines.throttle import Throttle
from cpsr_ds.checkpoint.storage import ondisk, progress_record
from cpsr_ds.checkpoint.storage.filesystem import describe_error, fs
from cpsr_ds.checkpoint.storage.layout import SharedLayout

log = logging.getLogger(__name__)


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
