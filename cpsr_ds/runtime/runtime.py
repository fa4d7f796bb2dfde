"""``engine.cpsr``: CPSR's runtime on one engine, the only attribute CPSR sets on it.

Built once the engine exists: it recovers the engine from the run directory (recovery/), then runs the
iteration hooks (hooks.py) after every training iteration, in this order: the cost meter, the progress
journal, rank 0's planner, the checkpoint step (with the scheduler, schedule.py), the predictor's work, host
snapshots, fault injection; they close, when the engine ends, in the reverse order. When an iteration fails,
the survivor dump writes the state of the last one that completed.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import replace
from typing import Callable, Optional

from cpsr_ds.checkpoint.capture import host_snapshot, survivor
from cpsr_ds.checkpoint.capture.journal import ProgressJournal
from cpsr_ds.config import CPSRConfig
from cpsr_ds.coordinator import DROP_WAIT_S
from cpsr_ds.runtime.faults import FaultInjector
from cpsr_ds.integration.deepspeed.engine_state import data_parallel
from cpsr_ds.integration.deepspeed.topology import place_of
from cpsr_ds.planning.failure_mix import PROCESS_CRASH
from cpsr_ds.recovery import new_predictor, recover
from cpsr_ds.recovery import failure_class
from cpsr_ds.runtime.rundir import RunDirLock
from cpsr_ds.runtime.checkpoints import Checkpoints
from cpsr_ds.runtime.hooks import Hook, Journal, Snapshots, Step
from cpsr_ds.runtime.measurements import Measurements
from cpsr_ds.runtime.monitor import Monitor
from cpsr_ds.runtime.plans import Planning
from cpsr_ds.runtime.predictor_work import PredictorWork
from cpsr_ds.runtime.schedule import Scheduler, per_stage


class Runtime:
    """CPSR's state on one engine: its config, how it recovered, its hooks.

    ``lock``: the run directory's lock, held (on rank 0) until :meth:`close`; ``world_change``: how this start's
    layout differs from the last start's (world.adapt), for the recovery report.
    """

    def __init__(self, engine, cfg: CPSRConfig, lock: Optional[RunDirLock] = None,
                 world_change: Optional[str] = None):
        self.cfg, self.lock = cfg, lock
        self.attempt = lock.attempt if lock is not None else 0
        self.place = place = place_of(engine)
        directory = cfg.checkpoint.dir
        self.journal = ProgressJournal(directory, place.rank)
        self.faults = FaultInjector(cfg.faults, directory, place.rank, place.world)
        predictor = new_predictor(cfg, data_parallel(engine).size)
        observed = failure_class.observed_class(cfg.checkpoint, place.rank, self.attempt)
        self.recovery = replace(recover(engine, cfg, predictor, attempt=self.attempt), world_change=world_change,
                                failure_class=observed)
        # Where the job resumed ahead of its newest state on storage, two origins differ from the resume point: the
        # predictor's records count to the checkpoint it was restored from (Measurements.load), and the schedule
        # counts from c after a predicting-based recovery, as a failure before the next checkpoint goes back there.
        restored = predictor.history.iterations
        predictor_at = restored[-1] if restored else engine.global_steps
        stored_at = self.recovery.checkpoint if self.recovery.method == "predict" else engine.global_steps
        held = weakref.proxy(engine)  # the engine holds its runtime, not the other way round
        self.monitor = Monitor(engine, place.rank)
        self.measurements = Measurements(held, cfg, place, self.attempt, self.monitor)
        self.work = PredictorWork(engine, cfg, place, self.attempt, predictor, per_stage(cfg, place.stages),
                                  self.measurements)
        self.measurements.load(engine.global_steps, predictor_at)
        self.planning = (Planning(held, cfg, self.attempt, self.recovery, self.monitor, engine.global_steps)
                         if place.rank == 0 else None)
        self.scheduler = Scheduler(cfg, place, self.measurements, self.planning,
                                   lambda baseline_s: held.checkpoint_engine.interval(baseline_s),
                                   engine.global_steps, stored_at)
        checkpoints = Checkpoints(held, directory, place, self.scheduler, self.work, self.measurements)
        # After recovery, which reads the earlier dumps and snapshots these remove.
        self.survivor = survivor.install(engine, cfg.checkpoint, self.attempt)
        crashes = None if self.planning is None else self.planning.class_rates()[PROCESS_CRASH]
        self.host_snapshots = host_snapshot.install(engine, cfg.checkpoint, self.attempt, cfg.planner, crashes)
        failure_class.mark(cfg.checkpoint, place.rank, self.attempt)
        snapshots = ([] if self.host_snapshots is None
                     else [Snapshots(self.host_snapshots, cfg.checkpoint.commit_timeout_s)])
        self.hooks: list[Hook] = [
            self.measurements, Journal(self.journal), *([self.planning] if self.planning is not None else []),
            checkpoints, self.work, *snapshots, self.faults]
        self._started = None  # when the running iteration's train_batch began

    def before_iteration(self) -> None:
        """An iteration's time is its train_batch's: what the training loop does between
        iterations (evaluation, logging) is not the checkpoints' to answer for."""
        self._started = time.perf_counter()

    def after_iteration(self, engine, loss: float) -> None:
        """Every hook, in order, after the engine's iteration that ended with ``loss``."""
        seconds = None if self._started is None else time.perf_counter() - self._started
        step = Step(engine.global_steps, loss, seconds)
        for hook in self.hooks:
            hook.after_iteration(step)

    def stepping(self, step: Callable) -> Callable:
        """The optimizer ``step``, under the survivor dump's lock where dumps are on."""
        return step if self.survivor is None else self.survivor.stepping(step)

    def failed(self, reason: str) -> None:
        """An iteration raised (a failed collective): dump the state of the last one completed, for recovery."""
        if self.survivor is not None:
            self.survivor.dump(reason)

    def close(self) -> None:
        """Close the hooks in reverse order, then give the run directory free for another job."""
        for hook in reversed(self.hooks):
            hook.close()
        if self.lock is not None:
            self.lock.release()

    def end_bound_s(self) -> float:
        """How long the engine's end may take: its checkpoints' commit, then its summaries', then the host snapshot
        being written, each bounded by ``checkpoint.commit_timeout_s``, and the predictor's running piece on the
        background thread."""
        waits = 2 + (self.host_snapshots is not None)
        return waits * self.cfg.checkpoint.commit_timeout_s + DROP_WAIT_S
