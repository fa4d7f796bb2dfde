"""The committer thread: commits each checkpoint once every rank's part is there, or gives it up.

Rank 0 decides, from the manifests (or with node-local storage their summaries), and
writes the commit record and ``latest`` (committing.py), then applies retention; with
node-local storage every rank's committer follows rank 0's verdict and each node's
records wait for the replicas (layout.py). A checkpoint given up is removed, and
``latest`` stays on the last good one.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from cpsr_ds.checkpoint.engines.persist import Job, RetryPolicy, with_retries
from cpsr_ds.checkpoint.storage import committing, ondisk, records, retention
from cpsr_ds.checkpoint.storage.filesystem import POLL_S, describe_error
from cpsr_ds.checkpoint.storage.layout import CommitVerdict, SharedLayout

log = logging.getLogger(__name__)


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
                time.sleep(POLL_S)

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
