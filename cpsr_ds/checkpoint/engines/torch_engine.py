"""The ``torch`` strategy: DeepSpeed's synchronous ``torch.save`` engine, with manifests and an atomic commit.

``save`` serialises a file with ``torch.save`` as DeepSpeed's engine does (refusing a
state that ``load``, whose unpickler allows only allowlist.py's types, would refuse), writes it
atomically (temporary name, fsync, rename) and records its size, checksum and
non-finite tensors. The engine is decoupled: DeepSpeed commits it before the next
optimizer step (``cleanup`` commits the last one), where every rank writes its manifest
and rank 0 waits for all of them, writes the commit record, moves ``latest`` and
applies retention. An engine that is not decoupled would not do: DeepSpeed then writes
``latest`` itself right after ``commit``, whatever became of the checkpoint, while a
decoupled one reports ``save_latest=False``. Training waits for every write, as with
DeepSpeed's engine, so a failed write is not retried: the checkpoint is given up
(logged, its manifest says why, so rank 0 need not wait) and training goes on.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

from cpsr_ds.checkpoint.capture import exiting
from cpsr_ds.checkpoint.storage import committing, filesystem, loading, ondisk, records, retention
from cpsr_ds.checkpoint.storage.filesystem import describe_error, fs
from cpsr_ds.checkpoint.engines import throttle
from cpsr_ds.checkpoint.engines.checkfreq import measured_interval
from cpsr_ds.checkpoint.engines.async_engine import CheckpointStats
from cpsr_ds.checkpoint.storage.fileformat import allowed_pickle, flatten, nonfinite_tensors
from cpsr_ds.config import CheckpointConfig

log = logging.getLogger(__name__)


@dataclass
class _Open:
    """This rank's part of a checkpoint between ``create`` and ``commit``."""

    info: CheckpointCommitInfo
    files: dict = field(default_factory=dict)
    failed: Optional[str] = None

    @property
    def tag_dir(self) -> str:
        return os.path.join(self.info.save_dir, self.info.tag)


class TorchEngine(TorchCheckpointEngine):
    """``torch.save`` files, each written atomically and listed in its rank's manifest; committed like the others.

    ``stats`` as the asynchronous engines keep them: the stall is the whole save (create,
    save and commit), the persist time 0 (durable when the stall ends).
    """

    def __init__(self, cfg: CheckpointConfig, rank: int, world_size: int, config_params: Any = None, *,
                 attempt: int = 0, min_keep: int = 1):
        super().__init__(config_params)
        self.name = type(self).__name__
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.attempt = attempt
        self.min_keep = min_keep
        # Writes happen here, in the training loop: with a rate limit, training waits for it.
        self.throttle = throttle.shared(cfg.write_mbps)
        self._open: Optional[_Open] = None
        self.stats = CheckpointStats()
        self._stall_s = 0.0
        # A script that ends without cleanup() still gets its last checkpoint committed.
        exiting.at_exit(self, "cleanup")

    # ------------------------------------------------------------ DeepSpeed interface

    def create(self, info: CheckpointCommitInfo):
        if self._open is not None:
            self.commit(self._open.info)  # no optimizer step since the last save
        t0 = time.perf_counter()
        records.forget_metadata(os.path.join(info.save_dir, info.tag), self.rank)
        self._open = _Open(info)
        self.stats.started += 1
        self._stall_s = time.perf_counter() - t0

    def save(self, state_dict, path: str):
        t0 = time.perf_counter()
        try:
            self._save(state_dict, path)
        finally:
            self._stall_s += time.perf_counter() - t0

    def _save(self, state_dict, path: str):
        ckpt = self._open
        if ckpt is not None and ckpt.failed is not None:
            return
        buf = io.BytesIO()
        skeleton, tensors = flatten(state_dict)
        allowed_pickle(path, skeleton)  # the tensors' own globals are torch's, which load allows
        torch.save(state_dict, buf, _use_new_zipfile_serialization=self.zipfile_serialization)
        if ckpt is None:
            # Outside create()/commit(), as DeepSpeed's engine allows: atomic, but part of no checkpoint.
            fs.write_atomic(path, [buf.getbuffer()], throttle=self.throttle)
            return
        rel = os.path.relpath(path, ckpt.tag_dir)
        try:
            size, digest = self._write(ckpt, path, buf)
        except OSError as err:
            ckpt.failed = f"writing {rel}: {describe_error(err)}"
            log.error("checkpoint %s: giving up, %s; latest stays on the last good checkpoint",
                      ckpt.info.tag, ckpt.failed)
            return
        if rel.split(os.sep)[0] != "..":  # save_16bit_model writes beside the checkpoints, not into one
            ckpt.files[rel] = {"size": size, "digest": digest, "nonfinite": nonfinite_tensors(skeleton, tensors)}

    def load(self, path: str, map_location=None):
        return loading.load_file(path, map_location)

    def commit(self, info: CheckpointCommitInfo):
        """Write this rank's manifest; on rank 0 commit the checkpoint once every rank's is there."""
        t0 = time.perf_counter()
        ckpt, self._open = self._open, None
        if ckpt is None:
            return True
        problem = self._write_manifest(ckpt)
        problem = self._commit(ckpt, problem) if self.rank == 0 else problem or ckpt.failed
        self._settle(ckpt.info.tag, problem, sum(f["size"] for f in ckpt.files.values()),
                     self._stall_s + time.perf_counter() - t0)
        return True

    def is_decoupled(self):
        return True

    def get_commit_info(self):
        # DeepSpeed must not write latest: it moves only once the commit record is durable.
        return None if self._open is None else dataclasses.replace(self._open.info, save_latest=False)

    def cleanup(self):
        if self._open is not None:
            self.commit(self._open.info)

    def interval(self, iteration_time_s: Optional[float] = None) -> Optional[int]:
        """CheckFreq's overhead_budget rule with the whole save as the stall and nothing left to persist."""
        return measured_interval(self.cfg, self.stats, iteration_time_s, 1)

    # ------------------------------------------------------------ internals

    def _settle(self, tag: str, problem: Optional[str], nbytes: int, stall_s: float) -> None:
        self.stats.stalled(stall_s)
        self._stall_s = 0.0
        if problem is not None:
            self.stats.failed += 1
            self.stats.given_up.append(tag)
            return
        self.stats.persisted += 1
        self.stats.last_persist_s, self.stats.last_bytes = 0.0, nbytes
        self.stats.recent.append((tag, nbytes, 0.0))

    def _write(self, ckpt: _Open, path: str, buf: io.BytesIO) -> tuple[int, str]:
        def write():
            os.makedirs(os.path.dirname(path), exist_ok=True)
            return fs.write_atomic(path, [buf.getbuffer()], self.cfg.checksum, throttle=self.throttle)

        try:
            return write()
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
            # Space ran short: older checkpoints beyond the minimum history make room for one more try.
            freed = retention.apply_retention(ckpt.info.save_dir, self.min_keep, lambda tag: tag == ckpt.info.tag)
            if not freed:
                raise
            log.warning("checkpoint %s: %s; deleted %s to make room", ckpt.info.tag, describe_error(err), freed)
        return write()

    def _write_manifest(self, ckpt: _Open) -> Optional[str]:
        """Write this rank's manifest; returns why it could not be written, if so."""
        tag = ckpt.info.tag
        manifest = {"tag": tag, "rank": self.rank, "world_size": self.world_size,
                    "iteration": ondisk.tag_iteration(tag), "attempt": self.attempt, "checksum": self.cfg.checksum,
                    "files": ckpt.files, "failed": ckpt.failed}
        try:
            os.makedirs(ckpt.tag_dir, exist_ok=True)
            fs.write_json_atomic(os.path.join(ckpt.tag_dir, ondisk.manifest_name(self.rank)), manifest)
        except OSError as err:
            log.error("checkpoint %s: giving up writing the rank %d manifest: %s", tag, self.rank, describe_error(err))
            return f"rank {self.rank} manifest not written: {describe_error(err)}"
        return None

    def _commit(self, ckpt: _Open, problem: Optional[str]) -> Optional[str]:
        """Rank 0: commit once every rank's manifest is there, or give the checkpoint up and delete it (and say why)."""
        save_dir, tag = ckpt.info.save_dir, ckpt.info.tag
        manifests = {}
        if problem is None:
            manifests, problem = self._gather(ckpt.tag_dir)
        problem = problem or _refusal(manifests)
        if problem is None:
            record = {"tag": tag, "world_size": self.world_size, "iteration": ondisk.tag_iteration(tag),
                      "attempt": self.attempt, "committed_time": time.time()}
            try:
                moved = committing.commit_checkpoint(save_dir, tag, record)
            except OSError as err:
                problem = f"commit record not written: {describe_error(err)}"
        if problem is not None:
            log.error("checkpoint %s: given up, %s; latest stays on the last good checkpoint", tag, problem)
            retention.remove_checkpoint(save_dir, tag)
            return problem
        log.info("checkpoint %s committed%s", tag, ", latest moved to it" if moved else "")
        try:
            retention.apply_retention(save_dir, self.cfg.keep_last, lambda t: False)
        except OSError as err:
            log.warning("checkpoint %s: retention failed: %s", tag, describe_error(err))
        return None

    def _gather(self, tag_dir: str) -> tuple[dict, Optional[str]]:
        """Every rank's manifest (polled, no collectives), or why not within ``commit_timeout_s``.

        A rank that gave up says so in its manifest, which ends the wait at once, and so
        does this process failing (exiting.py): the missing manifests may never come.
        """
        deadline = time.monotonic() + self.cfg.commit_timeout_s
        while True:
            try:
                manifests, cause = records.read_manifests(tag_dir), None
            except (OSError, ValueError) as err:
                manifests, cause = {}, err
            missing = [r for r in range(self.world_size) if r not in manifests]
            if not missing or any(m["failed"] for m in manifests.values()):
                return manifests, None
            failure = exiting.reason()
            if failure is not None:
                return manifests, (f"rank manifests {missing} missing, not waited for: "
                                   f"this process is failing ({failure})")
            if time.monotonic() >= deadline:
                return manifests, (f"rank manifests {missing} missing after {self.cfg.commit_timeout_s:.0f} s"
                                   + (f" ({cause})" if cause else ""))
            time.sleep(filesystem.POLL_S)


def _refusal(manifests: dict[int, dict]) -> Optional[str]:
    """Why a checkpoint with all its manifests must not be committed: a rank gave up, or a tensor is not finite."""
    reasons = [f"rank {r} gave up: {m['failed']}" for r, m in sorted(manifests.items()) if m["failed"]]
    reasons += [f"{rel}: non-finite values in {name}" for _, m in sorted(manifests.items())
                for rel, entry in sorted(m["files"].items()) for name in entry["nonfinite"]]
    return "; ".join(reasons) or None
