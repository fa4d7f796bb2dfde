"""The predictor's work at each checkpoint, and where it runs.

At a checkpoint the predictor observes this rank's data-parallel share of the stage's state (recovery's
``own_share``: under ZeRO the rank's own partition, else 1/DP of it), a learning predictor trains, and the
measuring rank records xi and the held-out error (Measurements.record_state). With more than one pipeline
stage that work goes into the pipeline's bubbles (:class:`~cpsr_ds.coordinator.Coordinator`); with one stage
and a learning predictor onto a low-priority thread (:class:`~cpsr_ds.coordinator.Background`); otherwise it
runs at the checkpoint. A predictor that summarizes its history has the summary written beside the
checkpoint once the checkpoint is sealed (recovery/sources/summaries.py).
"""

from __future__ import annotations

import copy
import logging
from functools import partial
from typing import NamedTuple, Optional

import torch

from cpsr_ds.checkpoint.capture import exiting
from cpsr_ds.checkpoint.engines import throttle
from cpsr_ds.config import CPSRConfig
from cpsr_ds.coordinator import Background, CallJob, Coordinator, FillJob, PieceCost, PiecesJob, TrainJob
from cpsr_ds.integration.deepspeed.engine_state import own_share, stage_sums
from cpsr_ds.integration.deepspeed.topology import Place
from cpsr_ds.planning.fitter import XiSums
from cpsr_ds.recovery import PREDICTOR_STATE
from cpsr_ds.recovery.sources import summaries
from cpsr_ds.runtime.hooks import Hook, Step
from cpsr_ds.runtime.measurements import Measurements

log = logging.getLogger(__name__)


class Prepared(NamedTuple):
    """The predictor's part of one checkpoint."""

    client_state: dict  # saved with the checkpoint
    jobs: list  # to run once it is saved (:meth:`PredictorWork.submit`)


class PredictorWork(Hook):
    """The predictor, its work at each checkpoint, and the summaries it keeps beside them."""

    def __init__(self, engine, cfg: CPSRConfig, place: Place, attempt: int, predictor, per_stage: bool,
                 measurements: Measurements):
        self.cfg, self.place, self.attempt, self.per_stage = cfg, place, attempt, per_stage
        self.measurements = measurements
        self.learning = hasattr(predictor, "step")
        persisted = getattr(engine.checkpoint_engine, "wait_persisted", None)  # our engines but torch's
        self._flush_checkpoints = getattr(engine.checkpoint_engine, "flush", None)
        self.summaries = summaries.Writer(throttle.shared(cfg.checkpoint.write_mbps),
                                          persisted and partial(persisted, cfg.checkpoint.commit_timeout_s))
        self._held_summary = None  # the arguments of summaries.submit for the newest checkpoint, until it is sealed
        # Also at exit, where a script that leaves its engine to the interpreter ends: before its teardown, which
        # aborts a thread still inside torch, and before the checkpoint engine's own cleanup.
        exiting.at_exit(self, "close")
        # With a pipeline the work goes in its bubbles. Without one a learning predictor's goes to a low-priority
        # thread; a simple predictor's (copies and reductions, milliseconds per checkpoint) costs the training loop
        # less at the checkpoint than on that thread, which shares the interpreter's lock and the cores with it.
        runs_on = Coordinator if place.stages > 1 else Background if self.learning else None
        self.coordinator = (runs_on(cfg.coordinator, cfg.checkpoint.dir, place.rank, place.stage)
                            if cfg.coordinator.enabled and runs_on is not None else None)
        self.observing = cfg.recovery.mode != "recompute"
        if not self.learning and not (self.observing and (place.measuring or predictor.summarizes)):
            # Simple predictors fit at recovery time; a measuring rank's keeps observing for the held-out error,
            # and every rank's that keeps a summary of its own share beside each checkpoint, so that a
            # restart reads that checkpoint alone.
            predictor = None
        self.predictor = predictor

    def prepare(self, engine, iteration: int, part: bool) -> Prepared:
        """The predictor's work for the checkpoint at ``iteration``, up to what goes with it; ``part``: this rank's
        stage is due. Work done here, before the engine steps again, may read the engine's own tensors; the
        coordinator's later, so it gets a copy."""
        share = (self._share(engine, iteration, copy=self.coordinator is not None)
                 if part and (self.observing or self.learning) else None)
        if self.coordinator is not None:
            # The last checkpoint's work is done before the predictor sees this one.
            self.coordinator.flush()
        feed, record = ([], []) if share is None else \
            self._feed(iteration, share, stage_sums(engine, share) if self.observing else None)
        if self.coordinator is None:
            # At the checkpoint: the predictor observes and trains before its weights go with the checkpoint.
            for job in feed:
                job.run(None)
            feed = []
        client_state = {}
        if self.learning and share is not None:
            # A learning predictor's weights go with the checkpoint: a copy, taken before the coordinator's
            # queue trains on while the checkpoint persists.
            client_state = {PREDICTOR_STATE: host_copy(self.predictor.state_dict(include_history=False))}
        return Prepared(client_state, feed + record)

    def submit(self, jobs: list) -> None:
        """Each of ``jobs`` to the coordinator's queue, or to its end now where there is none (an optional job:
        not at all)."""
        for job in jobs:
            if self.coordinator is not None:
                self.coordinator.submit(job)
            elif not job.optional:
                job.run(None)

    @staticmethod
    def _share(engine, iteration: int, copy: bool) -> Optional[dict]:
        """This rank's share of the stage's state (own_share; ``copy`` False: the engine's own host tensors where
        they are), the predictor's; None before the optimizer's first step."""
        try:
            return own_share(engine, copy)
        except KeyError as err:  # the same on every rank: no step has made Adam's moments yet
            log.warning("cpsr: no state recorded at the checkpoint of iteration %d: the optimizer has no %s yet",
                        iteration, err)
            return None

    def _feed(self, iteration: int, share: dict, sums: Optional[XiSums]) -> tuple[list, list]:
        """(feed, record): the predictor's work for the checkpoint at ``iteration``, as jobs in their order:
        observe this rank's ``share`` and train (a learning predictor), then the record (:meth:`_record`) of the
        stage's ``sums``."""
        feed = []
        if self.predictor is not None:
            feed.append(PiecesJob(self.predictor.observing(iteration, share), self._piece("observe")))
            if self.learning:
                p = self.cfg.predictor
                feed.append(TrainJob(self.predictor, p.train_steps, p.train_budget_s, self._piece("train")))
        # The held-out check comes after the predictor's training, wherever that runs.
        record = [CallJob(partial(self._record, iteration, sums), self._piece("held_out"))] if self.observing else []
        if self.learning and self.cfg.coordinator.fill:
            record.append(FillJob(self.predictor, self._piece("train")))  # for the bubbles only: see submit
        return feed, record

    def _record(self, iteration: int, sums: XiSums) -> None:
        """The StateRow of the checkpoint on a measuring rank, and beside the checkpoint the summary a restart
        predicts from where the predictor keeps one."""
        # A restart of a per-stage job predicts from each stage's history (recover's _recover_stages).
        summarize = self.predictor is not None and self.predictor.summarizes and not self.per_stage
        measuring = self.place.measuring
        if not (measuring or summarize):
            return
        held_out = self.predictor.validation_error() if self.predictor is not None else None
        if summarize:
            summary = self.predictor.summary(held_out)
            if summary is not None:
                # Held until the checkpoint is sealed (the next optimizer step commits it), so that the writer
                # waits for its persist instead of sharing the storage with it.
                self._held_summary = (self.cfg.checkpoint.dir, self.place.rank, iteration, self.attempt, summary,
                                      self.cfg.checkpoint.keep_last)
        if measuring:
            self.measurements.record_state(iteration, sums, held_out)

    def _piece(self, kind: str) -> PieceCost:
        return self.coordinator.piece(kind) if self.coordinator is not None else PieceCost()

    def seal(self, deadline: Optional[float]) -> None:
        """The held summary to the writer: its checkpoint is sealed. ``deadline``: when the next checkpoint begins
        (time.monotonic()), which the summary must not delay; None: none follows."""
        if self._held_summary is not None:
            self.summaries.submit(*self._held_summary, deadline=deadline)
            self._held_summary = None

    def after_iteration(self, step: Step) -> None:
        if self.coordinator is not None:
            self.coordinator.end_iteration(step.iteration)

    def close(self) -> None:
        """The predictor's work queued or running cancelled (this may run from the engine's finaliser at
        interpreter exit, where no autograd may run), its summaries written, bounded as checkpoints' commits
        are (a failing process: the exit grace).

        Each summary waits for its checkpoint's persist, and one still being written by the daemon thread
        while the interpreter tears down would abort the process. The last checkpoint may still be open
        there (no optimizer step sealed it): it is sealed and persisted first, so that its summary does not
        share the storage with it.
        """
        if self.coordinator is not None:
            self.coordinator.drop()
        bound_s = self.cfg.checkpoint.commit_timeout_s if exiting.reason() is None else exiting.EXIT_GRACE_S
        if self._held_summary is not None and self._flush_checkpoints is not None:
            self._flush_checkpoints(bound_s)
        self.seal(None)
        if not self.summaries.close(bound_s):
            log.warning("cpsr: the predictor's summaries were not all written within %g s; a restart from the "
                        "newest checkpoints reads their full history instead", bound_s)


def host_copy(obj):
    """A deep copy of ``obj`` with every tensor in host memory: a checkpoint loads where there is no GPU too."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return copy.deepcopy(obj)
