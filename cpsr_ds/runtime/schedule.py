"""When the next checkpoint is due: a fixed interval, "auto", and per pipeline stage.

A fixed ``checkpoint.interval`` N: at the multiples of N. "auto": the first ``planner.first_interval``
iterations after the newest state on storage, then each at the interval the strategy's rule gives at the
checkpoint before (cpsr: the online planner, :class:`~cpsr_ds.runtime.plans.Planning`; torch, checkfreq,
pccheck: the checkpoint engine's ``interval``, the overhead_budget rule on the measured iteration time),
decided on rank 0 and broadcast so that every rank takes the same checkpoints.

``checkpoint.per_stage``: "CPSR does not enforce uniform T_c among tasks". Each pipeline stage is due at its
own interval, a whole multiple m_k of the shortest, T, every m_k dividing the largest, M: every stage is due
together every M T iterations (a full cut, which recompute-based recovery needs). Every rank saves at an
iteration where any stage is due, the others' ranks writing nothing.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import torch.distributed as dist

from cpsr_ds.config import CPSRConfig
from cpsr_ds.integration.deepspeed.topology import Place
from cpsr_ds.planning import planner
from cpsr_ds.recovery.agree import gathered
from cpsr_ds.runtime.measurements import Measurements
from cpsr_ds.runtime.plans import Planning

log = logging.getLogger(__name__)


def next_checkpoint_at(iteration: int, stored_at: int, interval: int) -> int:
    """The iteration of the next checkpoint after ``iteration``: ``interval`` after the newest state on storage
    (``stored_at``), and at the earliest at the next iteration (where that state is already ``interval`` old)."""
    return max(iteration + 1, stored_at + interval)


def iterations_to_checkpoint(iteration: int, interval, auto_next: int) -> int:
    """Iterations after ``iteration`` until the next checkpoint: at the multiples of a fixed ``interval``, or with
    "auto" at ``auto_next`` (the one the schedule set); 0 where it is due already."""
    due = auto_next if interval == "auto" else (iteration // interval + 1) * interval
    return max(due - iteration, 0)


def multiples(intervals: Sequence[float]) -> tuple[int, ...]:
    """Each stage's interval as a whole multiple of the shortest, each multiple dividing the largest.

    The largest is the longest interval over the shortest, rounded; every other stage
    gets the divisor of it nearest to its own ratio. Intervals that are not all positive
    and finite give 1 for every stage (all stages together).
    """
    if not intervals or not all(isinstance(t, (int, float)) and math.isfinite(t) and t > 0 for t in intervals):
        return tuple(1 for _ in intervals)
    shortest = min(intervals)
    ratios = [t / shortest for t in intervals]
    largest = max(1, round(max(ratios)))
    divisors = [d for d in range(1, largest + 1) if largest % d == 0]
    return tuple(min(divisors, key=lambda d: abs(d - r)) if r < max(ratios) else largest for r in ratios)


@dataclass(frozen=True)
class StageSchedule:
    """Stage k is due every ``base * multiples[k]`` iterations counted from ``origin``."""

    origin: int
    base: int
    multiples: tuple[int, ...]

    @staticmethod
    def together(origin: int, base: int, stages: int) -> "StageSchedule":
        """Every stage at every ``base`` iterations."""
        return StageSchedule(origin, base, (1,) * stages)

    @property
    def cycle(self) -> int:
        """Iterations between full cuts."""
        return self.base * max(self.multiples)

    def due(self, iteration: int) -> tuple[int, ...]:
        """The stages due at ``iteration`` (none at or before the origin)."""
        since = iteration - self.origin
        if since <= 0:
            return ()
        return tuple(k for k, m in enumerate(self.multiples) if since % (self.base * m) == 0)

    def full_cut(self, iteration: int) -> bool:
        """Whether every stage is due at ``iteration``."""
        return len(self.due(iteration)) == len(self.multiples)

    def intervals(self) -> list[int]:
        return [self.base * m for m in self.multiples]


def per_stage(cfg: CPSRConfig, stages: int) -> bool:
    """Whether each pipeline stage checkpoints at its own interval (one stage is the usual case)."""
    return cfg.checkpoint.per_stage and stages > 1


class Scheduler:
    """Which stages are due at each iteration, and the interval after each checkpoint, the same on every rank.

    ``engine_interval``: the checkpoint engine's rule (rank 0); ``planning``: the online planner (rank 0, None
    elsewhere); ``stored_at``: the newest state on storage, from which the first "auto" interval counts.
    """

    def __init__(self, cfg: CPSRConfig, place: Place, measurements: Measurements, planning: Optional[Planning],
                 engine_interval: Callable[[Optional[float]], Optional[int]], iteration: int, stored_at: int):
        self.cfg, self.place, self.measurements, self.planning = cfg, place, measurements, planning
        self.engine_interval = engine_interval
        self.stored_at = stored_at
        self.interval = cfg.planner.first_interval
        self.next_checkpoint = next_checkpoint_at(iteration, stored_at, self.interval)
        self.per_stage = per_stage(cfg, place.stages)
        fixed = cfg.checkpoint.interval
        self.schedule = (StageSchedule.together(iteration, self.interval, place.stages) if self.auto
                         else StageSchedule.together(0, fixed, place.stages))
        if self.per_stage or (self.auto and cfg.checkpoint.strategy == "cpsr"):
            self._schedule(iteration, start=True)

    @property
    def auto(self) -> bool:
        return self.cfg.checkpoint.interval == "auto"

    def due(self, iteration: int) -> tuple[int, ...]:
        """The pipeline stages due for a checkpoint at ``iteration``: without per_stage all of them or none."""
        if self.per_stage:
            return self.schedule.due(iteration)
        interval = self.cfg.checkpoint.interval
        due = iteration >= self.next_checkpoint if interval == "auto" else iteration % interval == 0
        return tuple(range(self.place.stages)) if due else ()

    def after_checkpoint(self, iteration: int, due: tuple[int, ...]) -> None:
        """The next checkpoint after the one of ``due`` stages at ``iteration``. Per stage, the intervals change only
        at a full cut, so that full cuts keep recurring."""
        if len(due) == self.place.stages if self.per_stage else self.auto:
            self._schedule(iteration)

    def starts_at(self, iteration: int, baseline_s: Optional[float]) -> Optional[float]:
        """When (time.monotonic()) the checkpoint after ``iteration`` will begin, at ``baseline_s`` seconds an
        iteration; None where that is not known."""
        if baseline_s is None:
            return None
        ahead = iterations_to_checkpoint(iteration, self.cfg.checkpoint.interval, self.next_checkpoint)
        return time.monotonic() + ahead * baseline_s

    def _schedule(self, iteration: int, start: bool = False) -> None:
        """The next checkpoint, by the strategy's rule, the same on every rank; ``start``: of this attempt."""
        if self.per_stage:
            self._schedule_stages(iteration, start)
            return
        if self.cfg.checkpoint.strategy == "cpsr":
            planned = self._planned(iteration, start)
            interval = planned and planned[0]
        else:
            interval = self._on_rank0(lambda: self.engine_interval(self.measurements.meter.baseline()))
        self.interval = self._clamped(interval)
        self.next_checkpoint = next_checkpoint_at(iteration, self.stored_at if start else iteration, self.interval)

    def _planned(self, iteration: int, start: bool):
        """Rank 0's plan from every stage's measurements, on every rank: (the job's interval, each stage's, None
        where no new plan was made); None where planning failed."""
        stages = gathered(self.measurements.stage_inputs())
        return self._on_rank0(lambda: self.planning.plan(iteration, stages, start, self.interval))

    def _clamped(self, interval) -> int:
        return int(planner.clamp_interval(interval or self.cfg.planner.first_interval, self.cfg.planner.max_interval))

    def _schedule_stages(self, iteration: int, start: bool) -> None:
        """Each stage's interval, a multiple of the shortest, from a full cut at ``iteration``.

        interval auto: each stage's own planned interval (the plan's ``stages``), the
        intervals kept where no new plan is made; a fixed interval N: N times each stage's
        measured persist time over the fastest stage's, all N until every stage has one.
        """
        old, stages = self.schedule, self.place.stages
        if self.auto:
            planned = self._planned(iteration, start)
            if planned is None:
                schedule = StageSchedule.together(iteration, self.cfg.planner.first_interval, stages)
            elif planned[1] is None:
                schedule = replace(old, origin=iteration)
            else:
                intervals = planned[1] or [planned[0]] * stages
                schedule = StageSchedule(iteration, self._clamped(min(intervals)), multiples(intervals))
        else:
            persist = gathered((self.place.stage, self.measurements.persist_s()) if self.place.measuring else None)
            measured = dict(p for p in persist if p is not None and p[1] is not None)
            chosen = self._on_rank0(lambda: multiples([measured[s] for s in range(stages)])
                                    if len(measured) == stages else old.multiples)
            schedule = replace(old, origin=iteration, multiples=tuple(chosen or old.multiples))
        self.schedule, self.interval = schedule, schedule.base
        if self.place.rank == 0 and (start or schedule.intervals() != old.intervals()):
            log.info("cpsr: per-stage checkpoint intervals from iteration %d: %s iterations; every stage together "
                     "every %d", iteration, ", ".join(f"stage {k} {t}" for k, t in enumerate(schedule.intervals())),
                     schedule.cycle)

    def _on_rank0(self, decide):
        """Rank 0's ``decide()``, on every rank. A failure there is logged and gives None (no rank may wait forever)."""
        result = None
        if self.place.rank == 0:
            try:
                result = decide()
            except Exception:
                log.exception("cpsr: choosing the next checkpoint interval failed; keeping %d", self.interval)
        if self.place.world == 1:
            return result
        box = [result]
        dist.broadcast_object_list(box, src=0)
        return box[0]
