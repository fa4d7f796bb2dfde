"""The checkpoint step after each iteration: where the scheduler says one is due, save it (every rank: DeepSpeed's
save is collective), with the predictor's part, then set the next one; never at a loss that is not finite."""

from __future__ import annotations

import logging
import time
from typing import Optional

from cpsr_ds.integration.deepspeed.topology import Place
from cpsr_ds.runtime.hooks import Hook, Step
from cpsr_ds.runtime.measurements import Measurements
from cpsr_ds.runtime.predictor_work import PredictorWork
from cpsr_ds.runtime.schedule import Scheduler

log = logging.getLogger(__name__)


class Checkpoints(Hook):
    """After each iteration: the checkpoint the scheduler says is due, and the next one set."""

    def __init__(self, engine, directory: str, place: Place, scheduler: Scheduler, work: PredictorWork,
                 measurements: Measurements):
        self.engine, self.directory, self.place = engine, directory, place
        self.scheduler, self.work, self.measurements = scheduler, work, measurements
        self.diverged_at: Optional[int] = None  # the first iteration whose loss was not finite

    def after_iteration(self, step: Step) -> None:
        iteration = step.iteration
        # The optimizer step of this iteration sealed the checkpoint before it: its summary may be written now,
        # before the next checkpoint begins.
        self.work.seal(self.scheduler.starts_at(iteration, self.measurements.meter.baseline()))
        if not step.finite and self.diverged_at is None:
            self.diverged_at = iteration
            log.error("cpsr: the training loss is %s at iteration %d: training diverged; no checkpoint is saved "
                      "at an iteration whose loss is not finite", step.loss, iteration)
        due = self.scheduler.due(iteration)
        if not due:
            return
        t0 = time.perf_counter()
        if step.finite:
            self._checkpoint(iteration, due)
        else:
            log.warning("cpsr: checkpoint of iteration %d skipped: the loss is %s", iteration, step.loss)
        self.scheduler.after_checkpoint(iteration, due)
        if step.finite and self.place.stage in due:
            # Planning the next interval is part of what this checkpoint costs.
            self.measurements.checkpointed(iteration, time.perf_counter() - t0)

    def _checkpoint(self, iteration: int, due: tuple[int, ...]) -> None:
        """Save, and feed the predictor this checkpoint's state: the checkpoint's own time, but for the
        predictor's work where the coordinator takes it (then only the copy of the state stays here).

        Every rank saves (DeepSpeed's save is collective); the ranks of stages not ``due`` write nothing.
        """
        engine = self.engine
        prepared = self.work.prepare(engine, iteration, self.place.stage in due)
        if self.scheduler.per_stage:
            full = len(due) == self.place.stages
            engine.checkpoint_engine.select(
                None if full else [r for r, s in enumerate(self.place.rank_stages) if s in due], due)
        engine.save_checkpoint(self.directory, client_state=prepared.client_state)
        self.work.submit(prepared.jobs)
