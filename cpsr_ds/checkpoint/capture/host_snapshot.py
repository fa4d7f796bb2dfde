"""Host snapshots: every ``checkpoint.memory_interval`` iterations each rank copies its
state into shared memory, beside its survivor dump (``checkpoint.survivor_dir``, by
default in /dev/shm), and persists nothing. Shared memory outlives the training
process, so when the process crashes (SIGKILL, a segfault, the OOM killer: no survivor
dump) and the node survives, a restart resumes from the snapshot rather than from the
last checkpoint, losing at most ``memory_interval`` iterations once the newest snapshot
is in place; a crash while it is still being written falls back to the one before it
(up to ``2 * memory_interval - 1`` iterations lost).

A snapshot is a dump in the survivor dump's format (``dumps.write_dump``: manifest,
checksum, atomic rename). Each rank keeps two, in alternating slots, each replacing the
one before it: a process killed while writing one (the kill can come right after the
iteration that started it) still has the one before, so every rank holds a snapshot of
a common iteration, which recovery needs (a rank's newest alone may be one interval
older than its peers'). The cost is twice the rank's state in shared memory. The copy
of the state to the host is the training loop's only cost; writing it into shared
memory runs on a thread, and a snapshot due while the previous one is still being
written is skipped.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from functools import partial
from statistics import median
from typing import Callable, Optional

import torch.distributed as dist

from cpsr_ds.checkpoint.storage import private_dir
from cpsr_ds.checkpoint.capture import dumps, run_id
from cpsr_ds.config import CheckpointConfig, PlannerConfig
from cpsr_ds.integration.deepspeed.engine_state import local_state
from cpsr_ds.planning import levels

log = logging.getLogger(__name__)

WHAT = "host snapshot"


SLOTS = 2


def snapshot_dir(root: str, run: str, rank: int, slot: int) -> str:
    return dumps.dump_dir(root, run, rank) + f".memory{slot}"


def snapshot_manifests(cfg: CheckpointConfig, rank: int, attempt: int) -> dict[int, tuple[str, dict]]:
    """``rank``'s host snapshots of job attempt ``attempt`` of the run in ``cfg.dir``, by iteration: (directory,
    manifest) of each slot whose manifest is this run's; nothing of the state read yet (:func:`load`)."""
    run, root = run_id.run_identity(cfg.dir), dumps.survivor_root(cfg)
    found = {}
    for slot in range(SLOTS):
        directory = snapshot_dir(root, run, rank, slot)
        man = dumps.read_dump_manifest(directory, rank, run, attempt, WHAT)
        if man is not None:
            found[man["iteration"]] = (directory, man)
    return found


def load(found: tuple[str, dict]) -> Optional[dumps.Survivor]:
    """The snapshot of one of :func:`snapshot_manifests`' entries, verified; None where it is damaged."""
    return dumps.load_dump(*found, WHAT)


def read_snapshots(cfg: CheckpointConfig, rank: int, attempt: int) -> list[dumps.Survivor]:
    """``rank``'s host snapshots of job attempt ``attempt`` of the run in ``cfg.dir``, verified: those usable."""
    found = (load(entry) for _, entry in sorted(snapshot_manifests(cfg, rank, attempt).items()))
    return [snap for snap in found if snap is not None]


class HostSnapshots:
    """Writes this rank's host snapshot every ``interval`` iterations (:meth:`after_iteration`).

    ``plan`` (memory_interval auto): the interval from a snapshot's stall and the iteration's time, seconds;
    rank 0 applies it to its first snapshot's and sends the result to every rank, so that all snapshot the
    same iterations (recovery needs one they all hold). Until then the interval is the one given.
    """

    def __init__(self, engine, root: str, run: str, attempt: int, interval: int, checksum: str,
                 plan: Optional[Callable[[float, float], int]] = None):
        self.engine = engine
        self.directories = [snapshot_dir(root, run, engine.global_rank, slot) for slot in range(SLOTS)]
        self.manifest = dumps.identity(engine, run, attempt)
        self.interval = interval
        self.checksum = checksum
        self.plan = plan
        self.iteration_times: list[float] = []
        self.planned: Optional[dict] = None  # the plan's inputs and interval, once made
        self.written = self.skipped = 0
        self.last_slot: Optional[int] = None
        self._writer: Optional[threading.Thread] = None

    def after_iteration(self, iteration: int, finite: bool = True, seconds: Optional[float] = None) -> None:
        """Snapshot ``iteration`` where due and its loss ``finite``; with a plan still to make, make it there, before
        the snapshot's manifest records the interval in force (a restart begins with it: :func:`install`)."""
        if self.plan is not None and seconds is not None:
            self.iteration_times.append(seconds)
        if iteration % self.interval:
            return
        copied = self._copy(iteration) if finite else None
        if self.plan is not None:
            self._replan(iteration, None if copied is None else copied[1])
        if copied is not None:
            self._start_writing(iteration, copied[0])

    def _copy(self, iteration: int) -> Optional[tuple[dict, float]]:
        """The snapshot's contents, copied to the host, and the copy's seconds; None where it is skipped."""
        if self._writer is not None and self._writer.is_alive():
            self.skipped += 1
            log.warning("cpsr: host snapshot of iteration %d skipped: the one before is still being written",
                        iteration)
            return None
        began = time.perf_counter()
        state, fragments = local_state(self.engine)
        # The copy is what the training loop waits for; the next optimizer step may then change the state.
        contents = {"state": {k: t.detach().to("cpu", copy=True) for k, t in state.items()},
                    "fragments": fragments, "counters": dumps.counters(self.engine)}
        return contents, time.perf_counter() - began

    def _start_writing(self, iteration: int, contents: dict) -> None:
        manifest = {**self.manifest, "iteration": iteration, "reason": WHAT, "written_ns": time.time_ns(),
                    "interval": self.interval}
        # The slot not written last (the first by the iteration's place): the interval may change, and the
        # snapshot written last must stay while this one is written.
        slot = iteration // self.interval % SLOTS if self.last_slot is None else (self.last_slot + 1) % SLOTS
        directory, self.last_slot = self.directories[slot], slot
        self._writer = threading.Thread(target=self._write, args=(directory, contents, manifest),
                                        name="cpsr-host-snapshot", daemon=True)
        self._writer.start()

    def _replan(self, iteration: int, stall_s: Optional[float]) -> None:
        """Rank 0's planned interval, on every rank; none yet where rank 0 measured no snapshot or iteration."""
        planned = None
        if self.engine.global_rank == 0 and stall_s is not None and self.iteration_times:
            iteration_s = median(self.iteration_times)
            planned = {"stall_s": stall_s, "iteration_s": iteration_s, "interval": self.plan(stall_s, iteration_s)}
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [planned]
            dist.broadcast_object_list(box, src=0)
            planned = box[0]
        if planned is None:
            return
        self.planned, self.interval, self.plan = planned, planned["interval"], None
        log.info("cpsr: host snapshots every %d iterations from iteration %d (memory_interval auto: stall %.3g s, "
                 "iteration %.3g s)", self.interval, iteration, planned["stall_s"], planned["iteration_s"])

    def _write(self, directory: str, contents: dict, manifest: dict) -> None:
        try:
            dumps.write_dump(directory, contents, manifest, self.checksum)
            self.written += 1
        # A full /dev/shm, or a root another user took over since the start, must not stop training: the
        # checkpoints still run.
        except (OSError, private_dir.PrivateDirError) as err:
            log.error("cpsr: host snapshot of iteration %d not written to %s: %s", manifest["iteration"],
                      directory, err)

    def wait(self, timeout_s: Optional[float] = None) -> None:
        """Until the snapshot being written is in place."""
        if self._writer is not None:
            self._writer.join(timeout_s)


def install(engine, cfg: CheckpointConfig, attempt: int,
            planner: Optional[PlannerConfig] = None) -> Optional[HostSnapshots]:
    """Remove the rank's snapshots of an earlier attempt (recovery has read them) and, with ``cfg.memory_interval``,
    return the engine's :class:`HostSnapshots`, which the runtime calls after each iteration; None without it.
    memory_interval auto plans the interval from ``planner`` (its rate, failure mix, first and longest interval),
    beginning with the one the previous attempt ended with (:func:`carried_interval`).

    Raises :class:`private_dir.PrivateDirError` where memory_interval is set and the survivor root or the run's
    directory under it is not this user's alone; without memory_interval such a directory is left alone.
    """
    if cfg.memory_interval is None:
        _remove_earlier(cfg, engine.global_rank)
        return None
    root, run = dumps.prepare(cfg)
    carried = carried_interval(cfg, engine, attempt) if cfg.memory_interval == "auto" else None
    for slot in range(SLOTS):
        dumps.remove_dump(snapshot_dir(root, run, engine.global_rank, slot))
    if cfg.memory_interval != "auto":
        return HostSnapshots(engine, root, run, attempt, cfg.memory_interval, cfg.checksum)
    planner = planner or PlannerConfig()
    crashes = planner.failure_rate_per_hour * planner.failure_mix.process_crash
    plan = partial(levels.memory_interval, crashes_per_hour=crashes, max_interval=planner.max_interval)
    return HostSnapshots(engine, root, run, attempt, carried or planner.first_interval, cfg.checksum, plan)


def carried_interval(cfg: CheckpointConfig, engine, attempt: int) -> Optional[int]:
    """The interval in force at rank 0's newest snapshot of the attempt before ``attempt`` (its manifest's), on
    every rank (a collective where the job has several); None where rank 0 holds none (its node was lost, a first
    attempt, a snapshot written before manifests kept it). memory_interval auto starts a restart with it rather
    than with planner.first_interval, so that a crash soon after the restart still finds a snapshot."""
    carried = None
    if engine.global_rank == 0 and attempt > 1:
        found = snapshot_manifests(cfg, 0, attempt - 1)
        carried = found[max(found)][1].get("interval") if found else None
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [carried]
        dist.broadcast_object_list(box, src=0)
        carried = box[0]
    return carried


def _remove_earlier(cfg: CheckpointConfig, rank: int) -> None:
    """Remove ``rank``'s snapshots of an earlier attempt that had memory_interval, where they are this user's."""
    root, run = dumps.survivor_root(cfg), run_id.run_identity(cfg.dir)
    try:
        dumps.check_private(root, os.path.join(root, run))
    except (OSError, private_dir.PrivateDirError):
        return
    for slot in range(SLOTS):
        dumps.remove_dump(snapshot_dir(root, run, rank, slot))
