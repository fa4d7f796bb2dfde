"""The cpsr strategy's checkpoint interval: the online planner (planning/online_planner.py) run on rank 0 from
this run's measurements and history, each plan recorded in ``plans.jsonl`` and logged.

A plan is made when it is time to (the first measurements, a restart, a new training phase, a drift of the
watched inputs); otherwise the interval stays. The scheduler (schedule.py) asks for it after each checkpoint.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import replace
from typing import NamedTuple, Optional

from cpsr_ds import runlog
from cpsr_ds.checkpoint.capture.journal import finished_iterations, journal_path, plausible, read_journal
from cpsr_ds.config import CPSRConfig
from cpsr_ds.integration.deepspeed.engine_state import schedule_shape
from cpsr_ds.planning.fitter import fit_loss_o, recent_losses
from cpsr_ds.planning.failure_mix import NODE_LOST, PROCESS_CRASH
from cpsr_ds.planning.failure_rate import class_rates_per_hour, failures, running_hours
from cpsr_ds.planning.online_planner import (JobInputs, Planned, StageInputs, describe, drift, place_lag, plan,
                                             replan_reason, watched)
from cpsr_ds.recovery import RecoveryReport, carried_lag, earlier_reports, excess_at
from cpsr_ds.runlog import PlanRow
from cpsr_ds.runtime.hooks import Hook, Step
from cpsr_ds.runtime.monitor import Monitor

log = logging.getLogger(__name__)


class RunHistory(NamedTuple):
    """What the run's earlier attempts leave to the planner."""

    failures: Counter  # the job's failures so far, by the class each restart observed (None: not observed)
    hours: float  # its hours of running before this attempt
    began: float  # when this attempt began (time.time())
    carried_lag: float  # the lag, in iterations, it carries from its predictions (recovery.carried_lag)


def run_history(directory: str, recovery: RecoveryReport, resumed_at: int, entries: list) -> RunHistory:
    """What the run's earlier attempts (rank 0's journal ``entries``, the recovery reports) leave to the planner."""
    reports = [*earlier_reports(directory), recovery]
    return RunHistory(failures([(r.reached, r.failure_class) for r in reports], finished_iterations(directory)),
                      running_hours([(e.iteration, e.wall_time) for e in entries]), time.time(),
                      carried_lag(reports, resumed_at))


def journal_entries(directory: str) -> list:
    """Rank 0's journal, its plausible entries."""
    path = journal_path(directory, 0)
    return plausible(path, read_journal(path))[0] if os.path.exists(path) else []


class Planning(Hook):
    """Rank 0's planner: the run's history and losses, and the inputs of the last plan.

    The losses it fits are read from the journal once, at the start, then kept as they come.
    """

    def __init__(self, engine, cfg: CPSRConfig, attempt: int, recovery: RecoveryReport, monitor: Monitor,
                 resumed_at: int):
        self.engine, self.cfg, self.attempt, self.monitor = engine, cfg, attempt, monitor
        self.directory = cfg.checkpoint.dir
        entries = journal_entries(self.directory)
        self.history = run_history(self.directory, recovery, resumed_at, entries)
        self.losses = {e.iteration: e.loss for e in entries}
        self.planned = None  # the watched inputs of the last plan
        self.planned_phase = 0

    def after_iteration(self, step: Step) -> None:
        self.losses[step.iteration] = step.loss

    def plan(self, iteration: int, gathered: list[Optional[StageInputs]], start: bool,
             interval: int) -> tuple[int, Optional[list]]:
        """Plan if it is time to, from every stage's ``gathered`` inputs, else keep ``interval``.

        (the job's interval, each stage's own planned interval; None where no plan was made).
        """
        stages = sorted({s.stage: s for s in gathered if s is not None}.values(), key=lambda s: s.stage)
        measured = len(stages) == self.engine.num_stages and all(s.measured for s in stages)
        lambda_per_hour, n, hours = self._failure_rate()
        cfg = self.cfg
        schedule = schedule_shape(self.engine, iteration, cfg.planner.train_iters)
        now = watched(lambda_per_hour, stages,
                      place_lag(cfg.planner.cost_model, cfg.predictor.name, schedule))
        phase = max((s.phase for s in stages), default=0)
        moved = drift(self.planned, now, cfg.planner.replan_drift) if self.planned is not None else []
        reason = replan_reason(self.planned, phase, self.planned_phase, measured, moved, start)
        if reason is None:
            if start:
                self._write(iteration, "warm-up", phase, Planned(interval, "recompute", {}, [],
                                                                 "nothing measured yet: planner.first_interval"))
            return interval, None
        # Only the recent window is ever fitted again (a later plan's starts later): the rest is let go.
        losses = self.losses = recent_losses(self.losses, iteration)
        job = JobInputs(iteration, lambda_per_hour, fit_loss_o(losses, iteration), cfg.planner.cost_model,
                        cfg.predictor.name, cfg.recovery.mode, cfg.recovery.max_relative_error,
                        cfg.recovery.max_loss_excess, cfg.planner.max_interval, interval, n, hours,
                        self.history.carried_lag, schedule)
        # The guard's curve is fitted once: the plan asks it at many intervals.
        planned = plan(job, stages, excess_at(losses, iteration))
        if moved:
            planned = replace(planned, inputs={**planned.inputs, "drift": moved})
        self._write(iteration, reason, phase, planned)
        self.planned, self.planned_phase = now, phase
        return planned.T_c, [s["T_c"] for s in planned.stages]

    def _write(self, iteration: int, reason: str, phase: int, planned: Planned) -> None:
        """The plan to plans.jsonl, the log and DeepSpeed's monitor."""
        row = PlanRow(iteration, self.attempt, time.time(), reason, phase, self.cfg.planner.cost_model,
                      planned.recovery, planned.T_c, planned.inputs, planned.stages, planned.fallback)
        runlog.append(runlog.plans_path(self.directory), row)
        log.info(describe(reason, planned, self.cfg.planner.cost_model, phase))
        numbers = {f"cpsr/plan/{k}": v for k, v in planned.inputs.items() if isinstance(v, (int, float))}
        for k, values in planned.inputs.items():
            if isinstance(values, list):
                numbers.update({f"cpsr/plan/{k}/stage{s}": v for s, v in enumerate(values)
                                if isinstance(v, (int, float))})
        self.monitor.write([("cpsr/plan/T_c", planned.T_c), *numbers.items()], iteration)

    def class_rates(self) -> dict:
        """Each failure class's rate per hour now: the configured rate and mix updated by the job's failures of that
        class over its hours of running (failure_rate.class_rates_per_hour)."""
        h, planner = self.history, self.cfg.planner
        hours = h.hours + (time.time() - h.began) / 3600
        return class_rates_per_hour(planner.failure_rate_per_hour, planner.failure_mix.model_dump(), h.failures, hours)

    def _failure_rate(self) -> tuple[float, int, float]:
        """lambda per hour now, of the failures storage serves (with host snapshots the lost nodes' alone: a crash
        resumes from its node's snapshot, levels.py), the job's failures and the hours it is based on."""
        h = self.history
        rates = self.class_rates()
        snapshots = self.cfg.checkpoint.memory_interval is not None
        rate = rates[NODE_LOST] + (0.0 if snapshots else rates[PROCESS_CRASH])
        return rate, sum(h.failures.values()), h.hours + (time.time() - h.began) / 3600
