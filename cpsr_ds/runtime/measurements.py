"""The cost meter and the stage's measured state, the planner's inputs.

Every checkpoint is measured (runlog.CostRow: its stall, the slowdown of the iterations after it, its
persist time) on the measuring ranks, the first data-parallel rank of each stage; unless
``recovery.mode`` is recompute, so is the stage's state at it (runlog.StateRow: xi, and the held-out
error of the predictor of this rank's share). A restart reads them back up to where it resumed.
"""

from __future__ import annotations

import logging
from typing import Optional

from cpsr_ds import runlog
from cpsr_ds.config import CPSRConfig
from cpsr_ds.integration.deepspeed.topology import Place
from cpsr_ds.planning.fitter import XiSums, curvature_of, next_phase
from cpsr_ds.planning.checkpoint_cost import Cost, CostMeter, smoothed_costs
from cpsr_ds.planning.fitter import accuracy_fit
from cpsr_ds.planning.online_planner import StageInputs
from cpsr_ds.runlog import CostRow, StateRow
from cpsr_ds.runtime.hooks import Hook, Step
from cpsr_ds.runtime.monitor import Monitor

log = logging.getLogger(__name__)


class Measurements(Hook):
    """The checkpoints' costs and the stage's states measured so far, and the training phase they show."""

    def __init__(self, engine, cfg: CPSRConfig, place: Place, attempt: int, monitor: Monitor):
        self.engine = engine
        self.cfg, self.place, self.attempt, self.monitor = cfg, place, attempt, monitor
        self.path = runlog.measurements_path(cfg.checkpoint.dir, place.rank)
        self.meter = CostMeter()
        self.costs: list[Cost] = []
        self.states: list[StateRow] = []
        self.phase = None

    def load(self, resumed_at: int, predictor_at: int) -> None:
        """This stage's earlier measurements and its phase: the checkpoints' costs up to where the job resumed,
        the predictor's records (held-out error, xi) up to ``predictor_at``, the newest checkpoint the predictor
        was restored from.

        A job resumed ahead of that checkpoint (from the parameters of one in flight, or a host snapshot) holds a
        predictor that never saw the checkpoints in between, and its next recovery weighs that predictor's held-out
        error: planned with the later one's (r 1.29), a restart in bench_ftcost chose 87 iterations for trend where
        recovery, at the committed one's r 1.51, fell back from it and recomputed failures 39 and 63 iterations on."""
        if not self.place.measuring:
            return
        rows, problems = runlog.read_measurements(self.cfg.checkpoint.dir)
        for problem in problems:
            log.warning("cpsr: %s", problem)
        for row in rows:
            if row.stage != self.place.stage:
                continue
            if isinstance(row, StateRow) and row.predictor == self.cfg.predictor.name and row.iteration <= predictor_at:
                self._add_state(row)
            elif isinstance(row, CostRow) and row.iteration <= resumed_at:
                self.costs.append(Cost(row.iteration, row.iteration_time_s, row.stall_s, row.slowdown_s,
                                       row.persist_s, row.nbytes))

    def after_iteration(self, step: Step) -> None:
        """The iteration's time, then the costs of the checkpoints measured since the last iteration."""
        if step.seconds is not None:
            self.meter.iteration(step.seconds)
        stats = getattr(self.engine.checkpoint_engine, "stats", None)  # DeepSpeed's own engine keeps none
        if stats is None:
            return
        self.meter.stalled(stats.last_stall_s)
        for window in [w for w in self.meter.pending if w.outcome is None]:  # not those waiting for their bracket
            self.meter.settle(window.tag, stats.outcome(window.tag))
        for cost in self.meter.finished():
            self.costs.append(cost)
            if self.place.measuring:
                runlog.append(self.path, CostRow(cost.iteration, self.place.stage, self.place.rank, self.attempt,
                                                 cost.iteration_time_s, cost.stall_s, cost.slowdown_s, cost.persist_s,
                                                 cost.nbytes))
            self.monitor.write([(f"cpsr/checkpoint/{name}", getattr(cost, name))
                                for name in ("slowdown_s", "stall_s", "persist_s")], cost.iteration)

    def checkpointed(self, iteration: int, seconds: float) -> None:
        """The checkpoint at ``iteration`` kept the training loop ``seconds``: measure it from here."""
        self.meter.start(iteration, f"global_step{iteration}", seconds)

    def record_state(self, iteration: int, sums: XiSums, held_out) -> None:
        """The StateRow of the checkpoint at ``iteration``: xi of the stage's ``sums``, the predictor's
        ``held_out`` error (None: it has none yet)."""
        curvature = curvature_of(sums)
        row = StateRow(iteration, self.place.stage, self.place.rank, self.attempt, self.cfg.predictor.name, sums.n_p,
                       xi=curvature.xi if curvature else None,
                       held_out_error=None if held_out is None else held_out.mse.get("param"),
                       relative_error=None if held_out is None else held_out.relative)
        self._add_state(row)
        runlog.append(self.path, row)

    def _add_state(self, row: StateRow) -> None:
        self.states.append(row)
        if row.xi is not None:
            self.phase = next_phase(self.phase, row.iteration, row.xi, self.cfg.planner.phase_threshold)

    def stage_inputs(self) -> Optional[StageInputs]:
        """What the planner needs of this stage; None off the measuring ranks."""
        if not self.place.measuring:
            return None
        costs = smoothed_costs(self.costs)
        latest = self.states[-1] if self.states else None
        errors = runlog.held_out_errors(self.states, self.place.stage, self.cfg.predictor.name)
        in_flight = getattr(self.engine.checkpoint_engine, "_max_in_flight", 1)  # the torch strategy's: one
        return StageInputs(self.place.stage, **costs, in_flight=in_flight, n_p=latest and latest.n_p,
                           xi=latest and latest.xi, accuracy=accuracy_fit(errors),
                           relative_error=latest and latest.relative_error,
                           phase=self.phase.index if self.phase is not None else 0)

    def persist_s(self) -> Optional[float]:
        """This stage's smoothed persist time; None where none is measured."""
        return smoothed_costs(self.costs).get("persist_s")
