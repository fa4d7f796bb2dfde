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
from dataclasses import dataclass
from statistics import median
from typing import Optional

import torch.distributed as dist

from cpsr_ds import runlog
from cpsr_ds.checkpoint.storage import private_dir
from cpsr_ds.checkpoint.capture import dumps, run_id
from cpsr_ds.config import CheckpointConfig, PlannerConfig
from cpsr_ds.integration.deepspeed.engine_state import local_state
from cpsr_ds.planning import levels
from cpsr_ds.runlog import MemoryPlanRow

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


@dataclass(frozen=True)
class MemoryPlan:
    """memory_interval auto's planner (rank 0's): levels.memory_interval at the process crashes' rate, each plan
    recorded in the run directory's plans.jsonl, on storage, where a restart finds it also after a lost node."""

    run_dir: str
    attempt: int
    crashes_per_hour: float
    max_interval: int

    def make(self, iteration: int, reason: str, stall_s: float, iteration_s: float) -> MemoryPlanRow:
        """The plan from a snapshot's stall and the iteration's time (seconds), recorded."""
        k = levels.memory_interval(stall_s, iteration_s, self.crashes_per_hour, self.max_interval)
        row = MemoryPlanRow(iteration, self.attempt, time.time(), reason, k, stall_s, iteration_s,
                            self.crashes_per_hour, k / 2)
        runlog.append(runlog.plans_path(self.run_dir), row)
        return row

    def at_restart(self, iteration: int) -> Optional[MemoryPlanRow]:
        """The plan from the newest earlier plan's measured stall and iteration time at this attempt's rate; None
        where the run has none."""
        rows, problems = runlog.read_memory_plans(self.run_dir)
        for problem in problems:
            log.warning("cpsr: skipping a damaged plan: %s", problem)
        if not rows:
            return None
        return self.make(iteration, "restart", rows[-1].stall_s, rows[-1].iteration_s)


class HostSnapshots:
    """Writes this rank's host snapshot every ``interval`` iterations (:meth:`after_iteration`).

    ``plan`` (memory_interval auto, rank 0's; the other ranks' is None): the interval from this attempt's first
    snapshot's stall and the iteration's time, sent to every rank, so that all snapshot the same iterations
    (recovery needs one they all hold). Until then the interval is the one given.
    """

    def __init__(self, engine, root: str, run: str, attempt: int, interval: int, checksum: str,
                 plan: Optional[MemoryPlan] = None, auto: bool = False):
        self.engine = engine
        self.directories = [snapshot_dir(root, run, engine.global_rank, slot) for slot in range(SLOTS)]
        self.manifest = dumps.identity(engine, run, attempt)
        self.interval = interval
        self.checksum = checksum
        self.plan = plan
        self.auto = auto  # the interval is planned from the first snapshot (on rank 0, by ``plan``)
        self.iteration_times: list[float] = []
        self.planned: Optional[MemoryPlanRow] = None  # the plan from this attempt's first snapshot, once made
        self.written = self.skipped = 0
        self.last_slot: Optional[int] = None
        self._writer: Optional[threading.Thread] = None

    def after_iteration(self, iteration: int, finite: bool = True, seconds: Optional[float] = None) -> None:
        """Snapshot ``iteration`` where due and its loss ``finite``; with a plan still to make, make it there."""
        if self.auto and seconds is not None:
            self.iteration_times.append(seconds)
        if iteration % self.interval:
            return
        copied = self._copy(iteration) if finite else None
        if self.auto:
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
        manifest = {**self.manifest, "iteration": iteration, "reason": WHAT, "written_ns": time.time_ns()}
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
        if self.plan is not None and stall_s is not None and self.iteration_times:
            planned = self.plan.make(iteration, "snapshot", stall_s, median(self.iteration_times))
        planned = from_rank0(planned)
        if planned is None:
            return
        self.planned, self.interval, self.auto = planned, planned.interval, False
        log.info("cpsr: host snapshots every %d iterations from iteration %d (memory_interval auto: stall %.3g s, "
                 "iteration %.3g s, %.3g crashes per hour)", self.interval, iteration, planned.stall_s,
                 planned.iteration_s, planned.crashes_per_hour)

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


def install(engine, cfg: CheckpointConfig, attempt: int, planner: Optional[PlannerConfig] = None,
            crashes_per_hour: Optional[float] = None) -> Optional[HostSnapshots]:
    """Remove the rank's snapshots of an earlier attempt (recovery has read them) and, with ``cfg.memory_interval``,
    return the engine's :class:`HostSnapshots`, which the runtime calls after each iteration; None without it.

    memory_interval auto plans the interval (:class:`MemoryPlan`, on rank 0) against ``crashes_per_hour`` (the
    process crashes' rate the run has observed; None: ``planner``'s configured rate and failure mix). A restart
    begins at the interval planned from the newest earlier plan's measured stall, else at planner.first_interval,
    and plans again from its own first snapshot.

    Raises :class:`private_dir.PrivateDirError` where memory_interval is set and the survivor root or the run's
    directory under it is not this user's alone; without memory_interval such a directory is left alone.
    """
    if cfg.memory_interval is None:
        _remove_earlier(cfg, engine.global_rank)
        return None
    root, run = dumps.prepare(cfg)
    for slot in range(SLOTS):
        dumps.remove_dump(snapshot_dir(root, run, engine.global_rank, slot))
    if cfg.memory_interval != "auto":
        return HostSnapshots(engine, root, run, attempt, cfg.memory_interval, cfg.checksum)
    planner = planner or PlannerConfig()
    if crashes_per_hour is None:
        crashes_per_hour = planner.failure_rate_per_hour * planner.failure_mix.process_crash
    plan = (MemoryPlan(cfg.dir, attempt, crashes_per_hour, planner.max_interval) if engine.global_rank == 0
            else None)
    restarted = from_rank0(plan.at_restart(engine.global_steps) if plan is not None else None)
    interval = restarted.interval if restarted is not None else planner.first_interval
    return HostSnapshots(engine, root, run, attempt, interval, cfg.checksum, plan, auto=True)


def from_rank0(value):
    """Rank 0's ``value`` on every rank (a collective where the job has several ranks)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def _remove_earlier(cfg: CheckpointConfig, rank: int) -> None:
    """Remove ``rank``'s snapshots of an earlier attempt that had memory_interval, where they are this user's."""
    root, run = dumps.survivor_root(cfg), run_id.run_identity(cfg.dir)
    try:
        dumps.check_private(root, os.path.join(root, run))
    except (OSError, private_dir.PrivateDirError):
        return
    for slot in range(SLOTS):
        dumps.remove_dump(snapshot_dir(root, run, rank, slot))
