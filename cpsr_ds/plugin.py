"""``cpsr_ds.initialize``: ``deepspeed.initialize`` plus CPSR's pieces.

With a ``"cpsr"`` block in the DeepSpeed config (and ``"enabled": true``) the
engine DeepSpeed builds is a subclass that, after every training iteration,
appends to the progress journal, takes a checkpoint when the schedule says
(:class:`Runtime`), measures what checkpoints cost and gives fault injection its chance; before returning, the engine is
restored from the run directory if an earlier run left progress there
(``engine.cpsr.recovery`` says how, and ``engine.global_steps`` is where to resume).
Without the block it is ``deepspeed.initialize`` itself.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import NamedTuple

import deepspeed
import deepspeed.runtime.engine as ds_engine
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

from cpsr_ds import ending, runlog, world
from cpsr_ds.planning import planner
from cpsr_ds.checkpoint.capture import exiting, host_snapshot, rng, survivor
from cpsr_ds.checkpoint.engines import throttle
from cpsr_ds.checkpoint.engines.factory import deepspeed_factory
from cpsr_ds.checkpoint.storage.topology import verify_storage
from cpsr_ds.integration.deepspeed.load_hook import reading_each_file_once
from cpsr_ds.checkpoint.capture.journal import (ProgressJournal, finished_iterations, journal_path, plausible, read_journal,
                                       retire_journals)
from cpsr_ds.config import CPSRConfig
from cpsr_ds.coordinator import (DROP_WAIT_S, Background, BubbleSchedule, CallJob, Coordinator, FillJob, PieceCost,
                                 PiecesJob, PredictorWork, TrainJob)
from cpsr_ds.elastic import check_restartable
from cpsr_ds.faults import FaultInjector, check_kill_rank
from cpsr_ds.planning.fitter import XiSums, accuracy_fit, curvature_of, fit_loss_o, next_phase, recent_losses
from cpsr_ds.planning.checkpoint_cost import Cost, CostMeter, smoothed_costs
from cpsr_ds.planning.failure_rate import failure_rate_per_hour, failures, running_hours
from cpsr_ds.planning.online_planner import (
    JobInputs,
    Planned,
    StageInputs,
    describe,
    drift,
    place_lag,
    plan,
    replan_reason,
    watched,
)
from cpsr_ds.recovery import (
    PREDICTOR_STATE,
    RecoveryReport,
    append_report,
    carried_lag,
    earlier_reports,
    excess_at,
    new_predictor,
    own_share,
    recover,
)
from cpsr_ds.recovery.adam_steps import align_bias_correction, stepped
from cpsr_ds.integration.deepspeed.engine_state import (base_optimizer, data_parallel, planned_iterations, replicas_read_once,
                                       stage_sums, weights_from_partitions)
from cpsr_ds.recovery.sources import summaries
from cpsr_ds.rundir import RunDirLock, check_writable, claim
from cpsr_ds.runlog import CostRow, PlanRow, StateRow
from cpsr_ds.stage_intervals import StageSchedule, multiples

logger = logging.getLogger("cpsr_ds")
if not logger.handlers:
    _handler = logging.StreamHandler(sys.stdout)
    _handler.setFormatter(logging.Formatter("[cpsr_ds] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


class RunHistory(NamedTuple):
    """What the run's earlier attempts leave to the planner."""

    failures: int  # the job's failures so far
    hours: float  # its hours of running before this attempt
    began: float  # when this attempt began (time.time())
    carried_lag: float  # the lag, in iterations, it carries from its predictions (recovery.carried_lag)


class Runtime:
    """CPSR's per-engine state: config, journal, fault injector, how the job recovered, the checkpoint schedule.

    ``lock``: the run directory's lock, held (on rank 0) until :meth:`close`.

    Checkpoints: with a fixed ``checkpoint.interval`` N at the multiples of N; with "auto"
    the first at ``planner.first_interval`` iterations after the start, then each at the
    interval the strategy's rule gives at the checkpoint before (cpsr: the online planner,
    :mod:`cpsr_ds.planning.online_planner`; torch, checkfreq, pccheck: the engine's overhead_budget
    rule on the measured iteration time), decided on rank 0 and broadcast so that every
    rank takes the same checkpoints. With ``checkpoint.per_stage`` each pipeline stage is
    due at its own interval (:meth:`_schedule_stages`); every rank still saves at an
    iteration where any stage is due, the others' ranks writing nothing.

    Every checkpoint is measured (runlog.CostRow on the measuring ranks, the first
    data-parallel rank of each stage) and, unless recovery.mode is recompute, its state
    (runlog.StateRow: xi of the stage's state, and the held-out error of the configured
    predictor). The predictor sees only this rank's data-parallel share of the stage's
    state (recovery.own_share: under ZeRO the rank's own partition, else 1/DP of it),
    the share it predicts at recovery; xi is summed over the shares (one small
    all-reduce). The measuring ranks keep that predictor observing every checkpoint: in host
    memory ``predictor.history`` copies of their share of the stage's fp32 parameters
    and both Adam moments, 12 bytes per parameter each (e.g. 4 x 12 x 350M = 17 GB for
    all of GPT2-0.35B in one stage without data parallelism); vitp keeps the same on
    every rank, as it did to learn, each rank training on its share with 1/DP of the
    stage's samples per step (VITPPredictor.split_work). The StateRow's held-out error
    is thus the first data-parallel rank's share's.

    With ``coordinator.enabled`` and more than one pipeline stage, the predictor's work
    after a checkpoint (observing the checkpoint, vitp's training, xi and the held-out
    check of the StateRow, the summary) is queued to
    :class:`~cpsr_ds.coordinator.Coordinator`, which runs it in the pipeline's bubbles;
    with one stage and a learning predictor to :class:`~cpsr_ds.coordinator.Background`,
    which runs it on a low-priority thread. Then the checkpoint costs the training loop
    only the copy of the share the work reads and xi's sums. With one stage and a
    simple predictor, or the coordinator disabled, it all runs at the checkpoint.
    """

    def __init__(self, engine: PipelineEngine, cfg: CPSRConfig, lock: RunDirLock | None = None):
        self.cfg = cfg
        self.lock = lock
        self.directory = cfg.checkpoint.dir
        self.diverged_at = None  # the first iteration whose loss was not finite
        rank, world = engine.global_rank, engine.world_size
        self.rank, self.world = rank, world
        self.stage = engine.stage_id
        self.measuring = engine.grid.get_data_parallel_rank() == 0 and engine.grid.get_slice_parallel_rank() == 0
        self.attempt = lock.attempt if lock is not None else 0
        self.journal = ProgressJournal(self.directory, rank)
        self.faults = FaultInjector(cfg.faults, self.directory, rank, world)
        self.predictor = new_predictor(cfg, data_parallel(engine).size)
        self.recovery = recover(engine, cfg, self.predictor, attempt=self.attempt)
        # Where the job resumed ahead of its newest state on storage, two origins differ from the resume point: the
        # predictor's records count to the checkpoint it was restored from (_load_measurements), and the schedule
        # counts from c after a predicting-based recovery, as a failure before the next checkpoint goes back there.
        restored = self.predictor.history.iterations
        predictor_at = restored[-1] if restored else engine.global_steps
        self.stored_at = self.recovery.checkpoint if self.recovery.method == "predict" else engine.global_steps
        self.learning = hasattr(self.predictor, "step")
        persisted = getattr(engine.checkpoint_engine, "wait_persisted", None)
        self._flush_checkpoints = getattr(engine.checkpoint_engine, "flush", None)
        self.summaries = summaries.Writer(throttle.shared(cfg.checkpoint.write_mbps),
                                          persisted and partial(persisted, cfg.checkpoint.commit_timeout_s))
        self._held_summary = None  # the arguments of summaries.submit for the newest checkpoint, until it is sealed
        exiting.at_exit(self, "_end_work")
        # With a pipeline the work goes in its bubbles. Without one a learning predictor's goes to a low-priority
        # thread; a simple predictor's (copies and reductions, milliseconds per checkpoint) costs the training loop
        # less at the checkpoint than on that thread, which shares the interpreter's lock and the cores with it.
        place = Coordinator if engine.num_stages > 1 else Background if self.learning else None
        self.coordinator = (place(cfg.coordinator, self.directory, rank, self.stage)
                            if cfg.coordinator.enabled and place is not None else None)
        self.observing = cfg.recovery.mode != "recompute"
        if not self.learning and not (self.observing and (self.measuring or self.predictor.summarizes)):
            # Simple predictors fit at recovery time; a measuring rank's keeps observing for the held-out error,
            # and every rank's that keeps a summary of its own share beside each checkpoint, so that a
            # restart reads that checkpoint alone.
            self.predictor = None
        self.monitor = engine.monitor if rank == 0 and engine.monitor.enabled else None
        self.meter = CostMeter()
        self._started = None  # when the running iteration's train_batch began
        self._load_measurements(engine.global_steps, predictor_at)
        # Rank 0 plans from the journal's losses: read once here, then kept as they are journaled.
        entries = self._journal_entries() if rank == 0 else None
        self.history = self._history(engine.global_steps, entries) if rank == 0 else None
        self.losses = {e.iteration: e.loss for e in entries} if rank == 0 else None
        self.planned = None  # the watched inputs of the last plan
        self.planned_phase = 0
        self.interval = cfg.planner.first_interval
        self.next_checkpoint = next_checkpoint_at(engine.global_steps, self.stored_at, self.interval)
        # checkpoint.per_stage: each stage at its own interval (stage_intervals.py); one stage is the usual case.
        self.per_stage = cfg.checkpoint.per_stage and engine.num_stages > 1
        self.stages = engine.num_stages
        self.rank_stages = [engine.grid._topo.get_coord(r).pipe for r in range(world)]
        fixed = self.cfg.checkpoint.interval
        self.schedule = (StageSchedule.together(engine.global_steps, self.interval, self.stages) if self.auto
                         else StageSchedule.together(0, fixed, self.stages))
        if self.per_stage or (self.auto and cfg.checkpoint.strategy == "cpsr"):
            self._schedule(engine, engine.global_steps, start=True)

    @property
    def auto(self) -> bool:
        return self.cfg.checkpoint.interval == "auto"

    def after_iteration(self, engine: PipelineEngine, loss: float) -> None:
        now = time.perf_counter()
        if self._started is not None:
            self.meter.iteration(now - self._started)
        iteration = engine.global_steps
        self._submit_summary(iteration)
        self.journal.append(iteration, loss)
        if self.losses is not None:
            self.losses[iteration] = loss
        finite = math.isfinite(loss)
        if not finite and self.diverged_at is None:
            self.diverged_at = iteration
            logger.error("cpsr: the training loss is %s at iteration %d: training diverged; no checkpoint is saved "
                         "at an iteration whose loss is not finite", loss, iteration)
        self._settle_costs(engine)
        due = self._due(iteration)
        if due:
            t0 = time.perf_counter()
            if finite:
                self._checkpoint(engine, iteration, due)
            else:
                logger.warning("cpsr: checkpoint of iteration %d skipped: the loss is %s", iteration, loss)
            # Per stage, the intervals change only at a full cut, so that full cuts keep recurring.
            if len(due) == self.stages if self.per_stage else self.auto:
                self._schedule(engine, iteration)
            if finite and self.stage in due:
                # Planning the next interval is part of what this checkpoint costs.
                self.meter.start(iteration, f"global_step{iteration}", time.perf_counter() - t0)
        if self.coordinator is not None:
            self.coordinator.end_iteration(iteration)
        snapshots = getattr(engine, "host_snapshots", None)  # host_snapshot.install's, with memory_interval
        if finite and snapshots is not None:
            snapshots.after_iteration(iteration)
        self.faults.check(iteration)

    def before_iteration(self) -> None:
        """An iteration's time is its train_batch's: what the training loop does between
        iterations (evaluation, logging) is not the checkpoints' to answer for."""
        self._started = time.perf_counter()

    def close(self) -> None:
        """Close the journal and give the run directory free for another job.

        The predictor's work still queued is dropped: this may run from the engine's
        finaliser at interpreter exit, where no autograd may run. The predictor's summaries
        are written first, as long as checkpoints may take to commit (a failing process: the exit grace).
        """
        self._end_work()
        self.journal.close()
        if self.lock is not None:
            self.lock.release()

    def _end_work(self) -> None:
        """The predictor's work queued or running cancelled, its summaries written. Also at exit (registered in
        __init__), where a script that leaves its engine to the interpreter ends: before its teardown, which
        aborts a thread still inside torch."""
        if self.coordinator is not None:
            self.coordinator.drop()
        self._close_summaries()

    def _close_summaries(self) -> None:
        """Write the summaries still queued, bounded as checkpoints' commits are (a failing process: the exit grace).

        Also at exit (registered in __init__, so it runs before the checkpoint engine's own cleanup), where a
        training script need not destroy its engine: each summary waits for its checkpoint's persist, and one
        still being written by the daemon thread while the interpreter tears down would abort the process. The
        last checkpoint may still be open there (no optimizer step sealed it): it is sealed and persisted first,
        so that its summary does not share the storage with it.
        """
        bound_s = self.cfg.checkpoint.commit_timeout_s if exiting.reason() is None else exiting.EXIT_GRACE_S
        if self._held_summary is not None and self._flush_checkpoints is not None:
            self._flush_checkpoints(bound_s)
        self._submit_summary()
        if not self.summaries.close(bound_s):
            logger.warning("cpsr: the predictor's summaries were not all written within %g s; a restart from the "
                           "newest checkpoints reads their full history instead", bound_s)

    def _submit_summary(self, iteration: int | None = None) -> None:
        """The held summary to the writer, which must not delay the next checkpoint (reckoned from ``iteration``,
        the one just trained; None: no checkpoint follows)."""
        if self._held_summary is not None:
            self.summaries.submit(*self._held_summary, deadline=self._next_checkpoint_at(iteration))
            self._held_summary = None

    def _next_checkpoint_at(self, iteration: int | None) -> float | None:
        """When (time.monotonic()) the checkpoint after ``iteration`` will begin, at the baseline iteration time;
        None where that is not known."""
        baseline = self.meter.baseline()
        if iteration is None or baseline is None:
            return None
        ahead = iterations_to_checkpoint(iteration, self.cfg.checkpoint.interval, self.next_checkpoint)
        return time.monotonic() + ahead * baseline

    def monitor_recovery(self) -> None:
        """The recovery decision of this start, to DeepSpeed's monitor."""
        report = self.recovery
        if report.reached is None:
            return
        events = [("cpsr/recovery/predict", float(report.method == "predict")),
                  ("cpsr/recovery/d", float(report.lost_iterations))]
        if report.estimated_cost is not None:
            events.append(("cpsr/recovery/estimated_cost", float(report.estimated_cost)))
        self._monitor(events, report.resume_iteration)

    # ------------------------------------------------------------ checkpoints

    def _due(self, iteration: int) -> tuple[int, ...]:
        """The pipeline stages due for a checkpoint at ``iteration``: without per_stage all of them or none."""
        if self.per_stage:
            return self.schedule.due(iteration)
        interval = self.cfg.checkpoint.interval
        due = iteration >= self.next_checkpoint if interval == "auto" else iteration % interval == 0
        return tuple(range(self.stages)) if due else ()

    def _checkpoint(self, engine: PipelineEngine, iteration: int, due: tuple[int, ...]) -> None:
        """Save, and feed the predictor this checkpoint's state: the checkpoint's own time, but for the
        predictor's work where the coordinator takes it (then only the copy of the state stays here).

        Every rank saves (DeepSpeed's save is collective); the ranks of stages not ``due`` write nothing.
        """
        part = self.stage in due
        # Work done here, before the engine steps again, may read the engine's own tensors; the coordinator's later.
        share = (self._share(engine, iteration, copy=self.coordinator is not None)
                 if part and (self.observing or self.learning) else None)
        client_state = {}
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
        if self.learning and share is not None:
            # A learning predictor's weights go with the checkpoint: a copy, taken before the coordinator's
            # queue trains on while the checkpoint persists.
            client_state = {PREDICTOR_STATE: host_copy(self.predictor.state_dict(include_history=False))}
        if self.per_stage:
            full = len(due) == self.stages
            engine.checkpoint_engine.select(None if full else [r for r, s in enumerate(self.rank_stages) if s in due],
                                            due)
        engine.save_checkpoint(self.directory, client_state=client_state)
        for job in feed + record:
            self._run(job)

    @staticmethod
    def _share(engine: PipelineEngine, iteration: int, copy: bool) -> dict | None:
        """This rank's share of the stage's state (own_share; ``copy`` False: the engine's own host tensors where
        they are), the predictor's; None before the optimizer's first step."""
        try:
            return own_share(engine, copy)
        except KeyError as err:  # the same on every rank: no step has made Adam's moments yet
            logger.warning("cpsr: no state recorded at the checkpoint of iteration %d: the optimizer has no %s yet",
                           iteration, err)
            return None

    def _feed(self, iteration: int, share: dict, sums: XiSums | None) -> tuple[list, list]:
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
            record.append(FillJob(self.predictor, self._piece("train")))  # for the bubbles only: see _run
        return feed, record

    def _record(self, iteration: int, sums: XiSums) -> None:
        """The StateRow of the checkpoint (xi of the stage's ``sums``, the predictor's held-out error) on a
        measuring rank, and beside the checkpoint the summary a restart predicts from where the predictor keeps
        one."""
        # A restart of a per-stage job predicts from each stage's history (recover's _recover_stages).
        summarize = self.predictor is not None and self.predictor.summarizes and not self.per_stage
        if not (self.measuring or summarize):
            return
        held_out = self.predictor.validation_error() if self.predictor is not None else None
        if summarize:
            summary = self.predictor.summary(held_out)
            if summary is not None:
                # Held until the checkpoint is sealed (the next optimizer step commits it), so that the writer
                # waits for its persist instead of sharing the storage with it.
                self._held_summary = (self.directory, self.rank, iteration, self.attempt, summary,
                                      self.cfg.checkpoint.keep_last)
        if not self.measuring:
            return
        curvature = curvature_of(sums)
        row = StateRow(iteration, self.stage, self.rank, self.attempt, self.cfg.predictor.name, sums.n_p,
                       xi=curvature.xi if curvature else None,
                       held_out_error=None if held_out is None else held_out.mse.get("param"),
                       relative_error=None if held_out is None else held_out.relative)
        self._add_state(row)
        runlog.append(runlog.measurements_path(self.directory, self.rank), row)

    def _piece(self, kind: str) -> PieceCost:
        return self.coordinator.piece(kind) if self.coordinator is not None else PieceCost()

    def _run(self, job) -> None:
        """``job`` to the coordinator's queue, or to its end now where there is none (an optional job: not at all)."""
        if self.coordinator is not None:
            self.coordinator.submit(job)
        elif not job.optional:
            job.run(None)

    def _add_state(self, row: StateRow) -> None:
        self.states.append(row)
        if row.xi is not None:
            self.phase = next_phase(self.phase, row.iteration, row.xi, self.cfg.planner.phase_threshold)

    def _settle_costs(self, engine: PipelineEngine) -> None:
        """Write the costs of the checkpoints measured since the last iteration."""
        stats = getattr(engine.checkpoint_engine, "stats", None)
        if stats is None:
            return
        self.meter.stalled(stats.last_stall_s)
        for window in [w for w in self.meter.pending if w.outcome is None]:  # not those waiting for their bracket
            self.meter.settle(window.tag, stats.outcome(window.tag))
        for cost in self.meter.finished():
            self.costs.append(cost)
            if self.measuring:
                runlog.append(runlog.measurements_path(self.directory, self.rank),
                              CostRow(cost.iteration, self.stage, self.rank, self.attempt, cost.iteration_time_s,
                                      cost.stall_s, cost.slowdown_s, cost.persist_s, cost.nbytes))
            self._monitor([(f"cpsr/checkpoint/{name}", getattr(cost, name))
                           for name in ("slowdown_s", "stall_s", "persist_s")], cost.iteration)

    # ------------------------------------------------------------ the schedule

    def _schedule(self, engine: PipelineEngine, iteration: int, start: bool = False) -> None:
        """The next checkpoint, by the strategy's rule, the same on every rank; ``start``: of this attempt."""
        if self.per_stage:
            self._schedule_stages(engine, iteration, start)
            return
        if self.cfg.checkpoint.strategy == "cpsr":
            stages = self._gather(self._stage_inputs(engine))
            planned = self._on_rank0(lambda: self._plan(engine, iteration, stages, start))
            interval = planned and planned[0]
        else:
            interval = self._on_rank0(lambda: engine.checkpoint_engine.interval(self.meter.baseline()))
        self.interval = self._clamped(interval)
        self.next_checkpoint = next_checkpoint_at(iteration, self.stored_at if start else iteration, self.interval)

    def _clamped(self, interval) -> int:
        return int(planner.clamp_interval(interval or self.cfg.planner.first_interval, self.cfg.planner.max_interval))

    def _schedule_stages(self, engine: PipelineEngine, iteration: int, start: bool) -> None:
        """Each stage's interval, a multiple of the shortest (stage_intervals.py), from a full cut at ``iteration``.

        interval auto: each stage's own planned interval (the plan's ``stages``), the
        intervals kept where no new plan is made; a fixed interval N: N times each stage's
        measured persist time over the fastest stage's, all N until every stage has one.
        """
        old = self.schedule
        if self.auto:
            stages = self._gather(self._stage_inputs(engine))
            planned = self._on_rank0(lambda: self._plan(engine, iteration, stages, start))
            if planned is None:
                schedule = StageSchedule.together(iteration, self.cfg.planner.first_interval, self.stages)
            elif planned[1] is None:
                schedule = replace(old, origin=iteration)
            else:
                intervals = planned[1] or [planned[0]] * self.stages
                schedule = StageSchedule(iteration, self._clamped(min(intervals)), multiples(intervals))
        else:
            persist = self._gather((self.stage, smoothed_costs(self.costs).get("persist_s")) if self.measuring else None)
            measured = dict(p for p in persist if p is not None and p[1] is not None)
            chosen = self._on_rank0(lambda: multiples([measured[s] for s in range(self.stages)])
                                    if len(measured) == self.stages else old.multiples)
            schedule = replace(old, origin=iteration, multiples=tuple(chosen or old.multiples))
        self.schedule, self.interval = schedule, schedule.base
        if self.rank == 0 and (start or schedule.intervals() != old.intervals()):
            logger.info("cpsr: per-stage checkpoint intervals from iteration %d: %s iterations; every stage together "
                        "every %d", iteration, ", ".join(f"stage {k} {t}" for k, t in enumerate(schedule.intervals())),
                        schedule.cycle)

    def _stage_inputs(self, engine: PipelineEngine) -> StageInputs | None:
        if not self.measuring:
            return None
        costs = smoothed_costs(self.costs)
        latest = self.states[-1] if self.states else None
        errors = runlog.held_out_errors(self.states, self.stage, self.cfg.predictor.name)
        return StageInputs(self.stage, **costs, in_flight=getattr(engine.checkpoint_engine, "_max_in_flight", 1),
                           n_p=latest and latest.n_p, xi=latest and latest.xi, accuracy=accuracy_fit(errors),
                           relative_error=latest and latest.relative_error,
                           phase=self.phase.index if self.phase is not None else 0)

    def _gather(self, local):
        """Every rank's ``local``, on every rank (a collective where the job has several ranks)."""
        if self.world == 1:
            return [local]
        found = [None] * self.world
        dist.all_gather_object(found, local)
        return found

    def _on_rank0(self, decide):
        """Rank 0's ``decide()``, on every rank. A failure there is logged and gives None (no rank may wait forever)."""
        result = None
        if self.rank == 0:
            try:
                result = decide()
            except Exception:
                logger.exception("cpsr: choosing the next checkpoint interval failed; keeping %d", self.interval)
        if self.world == 1:
            return result
        box = [result]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _plan(self, engine: PipelineEngine, iteration: int, gathered: list, start: bool) -> tuple[int, list | None]:
        """Rank 0: plan if it is time to (first measurements, a restart, a new phase, a drift), else keep the interval.

        (the job's interval, each stage's own planned interval; None where no plan was made).
        """
        stages = sorted({s.stage: s for s in gathered if s is not None}.values(), key=lambda s: s.stage)
        measured = len(stages) == engine.num_stages and all(s.measured for s in stages)
        lambda_per_hour, n, hours = self._failure_rate()
        cfg = self.cfg
        planned_length = planned_iterations(engine)
        now = watched(lambda_per_hour, stages,
                      place_lag(cfg.planner.cost_model, cfg.predictor.name, iteration, planned_length))
        phase = max((s.phase for s in stages), default=0)
        moved = drift(self.planned, now, cfg.planner.replan_drift) if self.planned is not None else []
        reason = replan_reason(self.planned, phase, self.planned_phase, measured, moved, start)
        if reason is None:
            if start:
                self._write_plan(iteration, "warm-up", phase, Planned(self.interval, "recompute", {}, [],
                                                                     "nothing measured yet: planner.first_interval"))
            return self.interval, None
        # Only the recent window is ever fitted again (a later plan's starts later): the rest is let go.
        losses = self.losses = recent_losses(self.losses, iteration)
        job = JobInputs(iteration, lambda_per_hour, fit_loss_o(losses, iteration), cfg.planner.cost_model,
                        cfg.predictor.name, cfg.recovery.mode, cfg.recovery.max_relative_error,
                        cfg.recovery.max_loss_excess, cfg.planner.max_interval, self.interval, n, hours,
                        self.history.carried_lag, planned_length)
        # The guard's curve is fitted once: the plan asks it at many intervals.
        planned = plan(job, stages, excess_at(losses, iteration))
        if moved:
            planned = replace(planned, inputs={**planned.inputs, "drift": moved})
        self._write_plan(iteration, reason, phase, planned)
        self.planned, self.planned_phase = now, phase
        return planned.T_c, [s["T_c"] for s in planned.stages]

    def _write_plan(self, iteration: int, reason: str, phase: int, planned: Planned) -> None:
        row = PlanRow(iteration, self.attempt, time.time(), reason, phase, self.cfg.planner.cost_model,
                      planned.recovery, planned.T_c, planned.inputs, planned.stages, planned.fallback)
        runlog.append(runlog.plans_path(self.directory), row)
        logger.info(describe(reason, planned, self.cfg.planner.cost_model, phase))
        numbers = {f"cpsr/plan/{k}": v for k, v in planned.inputs.items() if isinstance(v, (int, float))}
        for k, values in planned.inputs.items():
            if isinstance(values, list):
                numbers.update({f"cpsr/plan/{k}/stage{s}": v for s, v in enumerate(values)
                                if isinstance(v, (int, float))})
        self._monitor([("cpsr/plan/T_c", planned.T_c), *numbers.items()], iteration)

    # ------------------------------------------------------------ the run's history

    def _load_measurements(self, resumed_at: int, predictor_at: int) -> None:
        """This stage's earlier measurements and its phase: the checkpoints' costs up to where the job resumed,
        the predictor's records (held-out error, xi) up to ``predictor_at``, the newest checkpoint the predictor
        was restored from.

        A job resumed ahead of that checkpoint (from the parameters of one in flight, or a host snapshot) holds a
        predictor that never saw the checkpoints in between, and its next recovery weighs that predictor's held-out
        error: planned with the later one's (r 1.29), a restart in bench_ftcost chose 87 iterations for trend where
        recovery, at the committed one's r 1.51, fell back from it and recomputed failures 39 and 63 iterations on."""
        self.costs, self.states, self.phase = [], [], None
        if not self.measuring:
            return
        rows, problems = runlog.read_measurements(self.directory)
        for problem in problems:
            logger.warning("cpsr: %s", problem)
        for row in rows:
            if row.stage != self.stage:
                continue
            if isinstance(row, StateRow) and row.predictor == self.cfg.predictor.name and row.iteration <= predictor_at:
                self._add_state(row)
            elif isinstance(row, CostRow) and row.iteration <= resumed_at:
                self.costs.append(Cost(row.iteration, row.iteration_time_s, row.stall_s, row.slowdown_s,
                                       row.persist_s, row.nbytes))

    def _journal_entries(self) -> list:
        path = journal_path(self.directory, 0)
        return plausible(path, read_journal(path))[0] if os.path.exists(path) else []

    def _history(self, resumed_at: int, entries: list) -> RunHistory:
        """Rank 0: what the run's earlier attempts (their journal ``entries``) leave to the planner."""
        reports = [*earlier_reports(self.directory), self.recovery]
        return RunHistory(failures([r.reached for r in reports], finished_iterations(self.directory)),
                          running_hours([(e.iteration, e.wall_time) for e in entries]), time.time(),
                          carried_lag(reports, resumed_at))

    def _failure_rate(self) -> tuple[float, int, float]:
        """lambda per hour now, the failures and the hours it is based on."""
        h = self.history
        hours = h.hours + (time.time() - h.began) / 3600
        return failure_rate_per_hour(self.cfg.planner.failure_rate_per_hour, h.failures, hours), h.failures, hours

    def _monitor(self, events: list, step: int) -> None:
        """``events`` ((name, value)) to DeepSpeed's monitor, where the config enables one (rank 0)."""
        if self.monitor is None:
            return
        try:
            self.monitor.write_events([(name, value, step) for name, value in events])
        except Exception as err:  # a monitor's failure must not stop training
            logger.warning("cpsr: writing to DeepSpeed's monitor failed: %s", err)


def end_bound_s(cfg: CPSRConfig) -> float:
    """How long an engine's end may take: its checkpoints' commit, then its summaries', each bounded by
    ``checkpoint.commit_timeout_s``, and the predictor's running piece on the background thread."""
    return 2 * cfg.checkpoint.commit_timeout_s + DROP_WAIT_S


class CPSRPipelineEngine(PipelineEngine):
    cpsr: Runtime

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        # DeepSpeed's SDLoader reads each model-states file twice; the second read reuses the first. Under ZeRO
        # the weights come from the optimizer's partitions rather than from the layer files; without ZeRO one
        # data-parallel replica reads the stage's files for all.
        with reading_each_file_once(), weights_from_partitions(self, load_optimizer_states, load_module_only), \
                replicas_read_once(self):
            load_path, client_state = super().load_checkpoint(load_dir, tag, load_module_strict, load_optimizer_states,
                                                              load_lr_scheduler_states, load_module_only, custom_load_fn)
        if load_path is not None and not load_module_only:
            rng.load(self, os.path.dirname(load_path))
        return load_path, client_state

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        # Each rank's random-number state goes with every checkpoint, the user's own saves too (rng.py).
        saved = super().save_checkpoint(save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        rng.save(self, os.path.join(save_dir, str(tag if tag is not None else f"global_step{self.global_steps}")))
        return saved

    def _take_model_step(self, lr_kwargs):
        # The fused CPU Adam's bias correction follows a restored step count (adam_steps.py); the random-number
        # state the next iteration starts from is recorded with the step (rng.py).
        optimizer = base_optimizer(self)
        align_bias_correction(optimizer)
        super()._take_model_step(lr_kwargs)
        stepped(optimizer)
        rng.record(self)

    def destroy(self):
        # The run directory is another job's to take only once pending checkpoints are done
        # (bounded: cleanup waits for no other rank once this process is failing).
        runtime = getattr(self, "cpsr", None)
        with ending.running(0.0 if runtime is None else end_bound_s(runtime.cfg)):
            try:
                super().destroy()
            finally:
                if runtime is not None:
                    runtime.close()

    def _train_schedule(self):
        if getattr(self, "cpsr", None) is None or self.cpsr.coordinator is None:
            return super()._train_schedule()
        return BubbleSchedule(micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id)

    def _exec_predictor_work(self, slot):
        self.cpsr.coordinator.slot(slot)

    def _bubble_ended(self):
        if getattr(self, "cpsr", None) is not None and self.cpsr.coordinator is not None:
            self.cpsr.coordinator.waited()

    def _exec_recv_activations(self, buffer_id):
        PipelineEngine._exec_recv_activations(self, buffer_id)
        self._bubble_ended()

    def _exec_recv_grads(self, buffer_id):
        PipelineEngine._exec_recv_grads(self, buffer_id)
        self._bubble_ended()

    def train_batch(self, data_iter=None):
        # A peer's death shows here as a gloo error: from then on no wait at exit is for other ranks.
        with exiting.marks_failure("train_batch"):
            try:
                self.cpsr.before_iteration()
                loss = super().train_batch(data_iter)
                self.cpsr.after_iteration(self, float(loss))
            except Exception as err:
                dumper = getattr(self, "survivor", None)  # survivor.install's, unless checkpoint.survivor is off
                if dumper is not None:  # the state of the last completed iteration, for recovery
                    dumper.dump(f"{type(err).__name__} in train_batch: {err}")
                raise
        return loss

    def _get_all_ckpt_names(self, checkpoints_path, tag):
        # DeepSpeed's loader wants a model-state file per model-parallel rank and reads this rank's. A
        # checkpoint of some stages (checkpoint.per_stage) holds only theirs: this rank's stands for each.
        names = super()._get_all_ckpt_names(checkpoints_path, tag)
        own = self._get_ckpt_name(checkpoints_path, tag)
        return [own] * self.mp_world_size if len(names) != self.mp_world_size and own in names else names

    def eval_batch(self, *args, **kwargs):
        # A restart does not redo an evaluation: it must not move the training's random-number streams.
        with exiting.marks_failure("eval_batch"), rng.preserved(self.module):
            return super().eval_batch(*args, **kwargs)

    def _exec_optimizer_step(self, lr_kwargs=None):
        # DeepSpeed's PipelineEngine never commits a decoupled checkpoint engine. The
        # snapshot of the last checkpoint must be complete before the optimizer
        # overwrites the state it copies; this wait is the checkpoint's training stall.
        if self.checkpoint_engine.is_decoupled():
            self._commit_decoupled_checkpoint()
        super()._exec_optimizer_step(lr_kwargs)
        self._bubble_ended()

    # The schedule's instructions run through this class-level map of plain functions,
    # so an override takes effect only once it is mapped here.
    _INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP, schedule.OptimizerStep: _exec_optimizer_step,
                        schedule.RecvActivation: _exec_recv_activations, schedule.RecvGrad: _exec_recv_grads,
                        PredictorWork: _exec_predictor_work}


def next_checkpoint_at(iteration: int, stored_at: int, interval: int) -> int:
    """The iteration of the next checkpoint after ``iteration``: ``interval`` after the newest state on storage
    (``stored_at``), and at the earliest at the next iteration (where that state is already ``interval`` old)."""
    return max(iteration + 1, stored_at + interval)


def iterations_to_checkpoint(iteration: int, interval, auto_next: int) -> int:
    """Iterations after ``iteration`` until the next checkpoint: at the multiples of a fixed ``interval``, or with
    "auto" at ``auto_next`` (the one the schedule set); 0 where it is due already."""
    due = auto_next if interval == "auto" else (iteration // interval + 1) * interval
    return max(due - iteration, 0)


def host_copy(obj):
    """A deep copy of ``obj`` with every tensor in host memory: a checkpoint loads where there is no GPU too."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return copy.deepcopy(obj)


def _ds_config(bound: inspect.BoundArguments) -> dict:
    """The config dict DeepSpeed will use, from ``config``, ``config_params`` or ``args``."""
    args = bound.arguments
    config = args.get("config") or args.get("config_params")
    if config is None and args.get("args") is not None:
        config = getattr(args["args"], "deepspeed_config", None)
    if config is None:
        raise ValueError("cpsr_ds.initialize: no DeepSpeed config (pass config=... or --deepspeed_config)")
    return load_ds_config(os.fspath(config) if isinstance(config, os.PathLike) else config)


@contextmanager
def _installed(cfg: CPSRConfig, attempt: int):
    """Our engine class and checkpoint engine, for one ``deepspeed.initialize`` call.

    ``deepspeed.initialize`` looks the pipeline engine class up at call time, and the
    engine looks its checkpoint-engine factory up in its own module.
    """
    original = deepspeed.PipelineEngine, ds_engine.create_checkpoint_engine
    deepspeed.PipelineEngine = CPSRPipelineEngine
    # Freeing space on a full disk must leave the predictor its history.
    ds_engine.create_checkpoint_engine = deepspeed_factory(cfg.checkpoint, attempt=attempt,
                                                           min_keep=cfg.predictor.history)
    try:
        yield
    finally:
        deepspeed.PipelineEngine, ds_engine.create_checkpoint_engine = original


def release_shm_allreduce_name(rank: int) -> None:
    """Unlink this rank's name of DeepSpeed's shared-memory allreduce buffer (CPU backend).

    DeepSpeed maps a 66 MB buffer in /dev/shm per rank and never unlinks it, so every
    multi-process job on a host leaves its buffers in RAM for good. Once every rank has
    mapped every buffer (the barrier: each rank maps all of them while initialising the
    backend), the names serve nothing, and unlinking lets the memory go with the processes.
    """
    torch.distributed.barrier()
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_" \
           f"{os.environ.get('MASTER_PORT', '')}_{rank}"
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:
        pass


def _init_distributed(bound: inspect.BoundArguments) -> None:
    """The process group, as ``deepspeed.initialize`` would make it: the run directory's lock needs it first."""
    check_restartable()
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                                   distributed_port=bound.arguments.get("distributed_port", TORCH_DISTRIBUTED_DEFAULT_PORT),
                                   dist_init_required=bound.arguments.get("dist_init_required"))


def _collective_device() -> torch.device:
    """Where this rank's buffers for a collective go before the engine exists (NCCL: this rank's GPU)."""
    if dist.get_backend() == "gloo":
        return torch.device("cpu")
    return torch.device(get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", 0))))


def initialize(*args, **kwargs):
    """Same arguments and return values as ``deepspeed.initialize``."""
    bound = inspect.signature(deepspeed.initialize).bind(*args, **kwargs)
    cfg = CPSRConfig.from_ds_config(_ds_config(bound))
    if not cfg.enabled:
        return deepspeed.initialize(*args, **kwargs)
    if not isinstance(bound.arguments.get("model"), PipelineModule):
        raise TypeError("cpsr_ds: the model must be a deepspeed.pipe.PipelineModule (num_stages=1 for no pipelining)")
    _init_distributed(bound)
    check_writable(cfg.checkpoint)
    verify_storage(cfg.checkpoint)
    # Before any engine exists: an exception anywhere in the script bounds its exit (exiting.py).
    exiting.install()
    check_kill_rank(cfg.faults, dist.get_world_size())
    lock = claim(cfg.checkpoint.dir, _collective_device())
    try:
        change = _fit_layout(bound, cfg, lock.attempt)
        with _installed(cfg, lock.attempt):
            engine, optimizer, dataloader, scheduler = deepspeed.initialize(*bound.args, **bound.kwargs)
        release_shm_allreduce_name(engine.global_rank)
        engine.cpsr = Runtime(engine, cfg, lock)
        engine.cpsr.recovery = replace(engine.cpsr.recovery, world_change=change)
        # After recovery, which reads the earlier dumps and snapshots these remove.
        survivor.install(engine, cfg.checkpoint, lock.attempt)
        host_snapshot.install(engine, cfg.checkpoint, lock.attempt)
        _retire_departed(cfg.checkpoint.dir, lock.attempt)
    except BaseException:
        lock.release()
        raise
    if engine.global_rank == 0:
        logger.info(engine.cpsr.recovery.describe())
        append_report(cfg.checkpoint.dir, engine.cpsr.recovery)
        engine.cpsr.monitor_recovery()
    return engine, optimizer, dataloader, scheduler


def _gather(local, device: torch.device) -> list:
    """Every rank's ``local``, before the engine exists (it sets this rank's device only later)."""
    if device.type != "cpu":
        get_accelerator().set_device(device.index)
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, local)
    return found


def _fit_layout(bound: inspect.BoundArguments, cfg: CPSRConfig, attempt: int) -> str | None:
    """Check this start's layout against the last start's and keep its global batch (world.adapt); the change made.

    The config ``deepspeed.initialize`` gets is rewritten in ``bound`` where the
    gradient accumulation changes. A change the checkpoints cannot serve raises
    :class:`WorldChangeError` on every rank, before any training, and rank 0 reports it
    in recovery.jsonl.
    """
    model, directory = bound.arguments["model"], cfg.checkpoint.dir
    config = _ds_config(bound)
    topology = model._topo
    tensor = topology.get_dim("model") if "model" in topology.get_axis_names() else 1
    here = world.layout_of(config, dist.get_world_size(), model.num_stages, tensor, attempt)
    last = world.newest(_gather(world.read_layout(directory), _collective_device()))
    try:
        config, here, change = world.adapt(config, last, here)
    except world.WorldChangeError as err:
        if dist.get_rank() == 0:
            logger.error("%s", err)
            append_report(directory, RecoveryReport("refused", None, None, 0, reason=str(err),
                                                    world_change=str(err)))
        raise
    if change is not None:
        logger.info("cpsr: %s", change)
        _pass_config(bound, config)
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:  # one writer per node: node-local directories get theirs too
        world.write_layout(directory, here)
    return change


def _pass_config(bound: inspect.BoundArguments, config: dict) -> None:
    """Make ``config`` the one ``deepspeed.initialize`` uses, in place of what the caller passed."""
    bound.arguments.pop("config_params", None)
    bound.arguments["config"] = config
    args = bound.arguments.get("args")
    if getattr(args, "deepspeed_config", None) is not None:
        bound.arguments["args"] = copy.copy(args)
        bound.arguments["args"].deepspeed_config = None


def _retire_departed(directory: str, attempt: int) -> None:
    """Retire the journals of ranks beyond this world, once every rank has read the progress (recover)."""
    if dist.get_world_size() > 1:
        dist.barrier()
    for path in retire_journals(directory, dist.get_world_size(), attempt):
        logger.info("cpsr: %s: the journal of a rank this job no longer has, kept for the record", path)
