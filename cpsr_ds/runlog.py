"""The run's records for the planner, the recovery cost model and ``python -m cpsr_ds plan RUN_DIR``.

Files in the run directory (``checkpoint.dir``), one JSON object per line:

- ``measurements/rankNNNNN.jsonl``, one file per rank that measures (the first
  data-parallel rank of each pipeline stage), so that no two processes append to
  one file. Two kinds of rows: a :class:`StateRow` when a checkpoint is taken (what
  the state says: N_p, xi of Eq. 7, the predictor's held-out error of Eq. 9), and a
  :class:`CostRow` once it has persisted (what it cost).
- ``plans.jsonl``, rank 0 only: a :class:`PlanRow` for every plan of the storage interval the job made, a
  :class:`MemoryPlanRow` for every plan of the host-snapshot interval.

Writers append whole lines; readers skip a line that does not parse (a crash cut it
short) and say so in ``problems``, so a damaged record never stops a job.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Optional, Union

log = logging.getLogger(__name__)

MEASUREMENTS_DIR = "measurements"
PLANS = "plans.jsonl"


@dataclass(frozen=True)
class StateRow:
    """At the checkpoint of ``iteration``, for pipeline stage ``stage`` (measured on ``rank``).

    n_p: the stage's parameters (elements); xi: Eq. 7, mean exp_avg_sq (None: no second
    moment yet); held_out_error: Eq. 9, mean squared error per parameter of the predictor
    ``predictor`` predicting this checkpoint from the older ones it holds (None: too
    few yet); relative_error: the same as a ratio to not predicting (r of cpsr_ds.recovery).
    """

    iteration: int
    stage: int
    rank: int
    attempt: int
    predictor: str
    n_p: int
    xi: Optional[float] = None
    held_out_error: Optional[float] = None
    relative_error: Optional[float] = None
    kind: str = "state"


@dataclass(frozen=True)
class CostRow:
    """What the checkpoint of ``iteration`` cost on ``rank`` (stage ``stage``), seconds.

    iteration_time_s: the baseline, the median time of the iterations with no checkpoint
    in flight just before and after it; stall_s: training's wait for the snapshot; slowdown_s:
    T_s, all the training time the checkpoint added (the stall and the iterations slowed while
    it persisted, over the baseline), an estimate that noise can take below the stall or 0
    (checkpoint_cost.slowdown); persist_s: from its first write to durable;
    nbytes: its size on this rank.
    """

    iteration: int
    stage: int
    rank: int
    attempt: int
    iteration_time_s: float
    stall_s: float
    slowdown_s: float
    persist_s: float
    nbytes: int
    kind: str = "cost"


@dataclass(frozen=True)
class PlanRow:
    """One plan: made after the checkpoint of ``iteration`` (0: before any), for ``reason``.

    reason: "warm-up" (the first interval, nothing measured), "first" (the first plan from
    measured costs), "phase" (a new phase began), "drift" (an input moved by more than
    planner.replan_drift), "restart" (a new attempt of the job); phase: the phase's index;
    model: the cost model (planner.cost_model); recovery: "predict" where the phase is
    planned for PB-R, "recompute" where recovery would recompute there (the loss-excess
    guard, or no usable model) and the interval is Young/Daly-like; T_c: the interval
    chosen, iterations; inputs: lambda_per_hour, lambda (per iteration), iteration_time_s,
    T_s and persist (iterations), in_flight, and where known alpha1, alpha2, tau1, tau2,
    xi, N_p; stages: each stage's own plan (planner.Plan.to_dict() plus "stage");
    fallback: why the planner did not use the cost model's PB-R cost ("" when it did).
    """

    iteration: int
    attempt: int
    time: float
    reason: str
    phase: int
    model: str
    recovery: str
    T_c: int
    inputs: dict = field(default_factory=dict)
    stages: list = field(default_factory=list)
    fallback: str = ""
    kind: str = "plan"


@dataclass(frozen=True)
class MemoryPlanRow:
    """One plan of the host-snapshot interval (``checkpoint.memory_interval: auto``), made at ``iteration``.

    reason: "snapshot" (from this attempt's first snapshot's measured stall) or "restart" (from the attempt
    before's, at the restart: a node lost since then took its snapshots with it); interval: k, iterations;
    stall_s and iteration_s: what it was planned from, seconds; crashes_per_hour: the process crashes' rate
    (failure_rate.class_rates_per_hour); per_crash: the iterations a crash is expected to lose, k / 2.
    """

    iteration: int
    attempt: int
    time: float
    reason: str
    interval: int
    stall_s: float
    iteration_s: float
    crashes_per_hour: float
    per_crash: float
    kind: str = "memory"


Row = Union[StateRow, CostRow, PlanRow, MemoryPlanRow]
KINDS = {cls.__dataclass_fields__["kind"].default: cls for cls in (StateRow, CostRow, PlanRow, MemoryPlanRow)}


def measurements_path(directory: str, rank: int) -> str:
    return os.path.join(directory, MEASUREMENTS_DIR, f"rank{rank:05d}.jsonl")


def plans_path(directory: str) -> str:
    return os.path.join(directory, PLANS)


def append(path: str, row: Row) -> bool:
    """Append ``row`` as one line; False (logged) where the write fails: a record never stops training."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(asdict(row)) + "\n")
        return True
    except OSError as err:
        log.warning("cpsr: could not append to %s: %s", path, err)
        return False


def parse(line: str) -> Row:
    """A row from one line; ValueError (naming what is wrong) where it is not one."""
    obj = json.loads(line)
    if not isinstance(obj, dict) or obj.get("kind") not in KINDS:
        raise ValueError(f"not a record (kind {obj.get('kind') if isinstance(obj, dict) else None!r})")
    cls = KINDS[obj["kind"]]
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in obj.items() if k in names})
    except TypeError as err:
        raise ValueError(str(err)) from None


def read(path: str) -> tuple[list[Row], list[str]]:
    """The rows of one file, oldest first, and the problems met (``path:line: what``); no file: nothing."""
    rows, problems = [], []
    try:
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return [], []
    except OSError as err:
        return [], [f"{path}: {err}"]
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(parse(line))
        except ValueError as err:
            problems.append(f"{path}:{number}: {err}")
    return rows, problems


def read_measurements(directory: str) -> tuple[list[Union[StateRow, CostRow]], list[str]]:
    """Every rank's measurements, in file order per rank, ranks in order; and the problems met."""
    rows, problems = [], []
    for path in sorted(glob.glob(os.path.join(directory, MEASUREMENTS_DIR, "rank*.jsonl"))):
        more, bad = read(path)
        rows += [r for r in more if isinstance(r, (StateRow, CostRow))]
        problems += bad
    return rows, problems


def read_plans(directory: str) -> tuple[list[PlanRow], list[str]]:
    """The storage interval's plans, oldest first, and the problems met."""
    rows, problems = read(plans_path(directory))
    return [r for r in rows if isinstance(r, PlanRow)], problems


def read_memory_plans(directory: str) -> tuple[list[MemoryPlanRow], list[str]]:
    """The host-snapshot interval's plans, oldest first, and the problems met."""
    rows, problems = read(plans_path(directory))
    return [r for r in rows if isinstance(r, MemoryPlanRow)], problems


def held_out_errors(rows, stage: int, predictor: str, upto: Optional[int] = None) -> list[tuple[int, float]]:
    """(iteration, Eq. 9 error) of ``predictor`` for ``stage`` at its checkpoints up to ``upto``, newest
    measurement per iteration (a restarted job measures a checkpoint again)."""
    found = {r.iteration: r.held_out_error for r in rows
             if isinstance(r, StateRow) and r.stage == stage and r.predictor == predictor
             and r.held_out_error is not None and (upto is None or r.iteration <= upto)}
    return sorted(found.items())
