"""What recovery decided at each start of the job: ``recovery.jsonl`` in the run directory, and the lag a run
carries from its earlier predictions."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

REPORTS = "recovery.jsonl"  # one line per start of the job, in the run directory


@dataclass(frozen=True)
class RecoveryReport:
    method: str  # "fresh", "restart" (no checkpoint yet), "recompute" (RB-R), "predict" (PB-R) or "refused"
    reached: int | None  # f: the last iteration every rank finished before the failure
    checkpoint: int | None  # c: the iteration of the restored checkpoint
    resume_iteration: int  # the next batch index the training loop must feed
    reason: str = ""
    predictor: str | None = None
    relative_error: float | None = None  # r: the predictor's held-out error
    estimated_cost: float | None = None  # T_p estimate, iterations
    cost_model: str | None = None  # the model that estimated it (planner.cost_model)
    guard_lag: float | None = None  # the pessimistic lag the loss-excess guard assumes, iterations
    loss_excess: float | None = None  # the relative loss excess guard_lag iterations of lag leave at f
    predicted_share: float | None = None  # N_p / N: the share of the job's parameters predicted (the rest exact)
    world_change: str | None = None  # how the job's layout changed since its last start (world.adapt)
    # checkpoint.per_stage PB-R: the checkpoint each pipeline stage was predicted from (c is the newest full cut)
    stage_checkpoints: list[int] | None = None
    # PB-R with survivor dumps: where each rank's state came from, by rank ("survivor": its own dump, "replica":
    # a data-parallel replica's, exact at f; "checkpoint": its stage's checkpoint at f; a predictor's name:
    # predicted; "replica+" a predictor's name: under ZeRO, parameters from a replica's dump, moments predicted);
    # None where no rank had a dump. RB-R from a state after the last checkpoint: "host snapshot" (exact) or
    # "in flight" (the parameters of the checkpoint persisting at the failure, Adam's moments the last one's)
    sources: dict[str, str] | None = None
    # PB-R: what every rank read together (checkpoint files and predictor summaries), and c's checkpoint's size
    bytes_read: int | None = None
    checkpoint_bytes: int | None = None
    # Where this start's time went, seconds by part in order (runtime/restart_time.py), on rank 0
    seconds: dict[str, float] | None = None
    # The class of the failure this start recovers from, as observed (recovery/failure_class.py); None: not observed
    failure_class: str | None = None

    @property
    def lost_iterations(self) -> int:
        """d = f - c (f for a restart from scratch)."""
        if self.reached is None:
            return 0
        return self.reached - (self.checkpoint or 0)

    def _how(self) -> str:
        if not self.sources:
            return f"with {self.predictor}"
        by_source: dict[str, list[str]] = {}
        for rank, source in sorted(self.sources.items(), key=lambda kv: int(kv[0])):
            by_source.setdefault(source, []).append(rank)
        how = {"survivor": "exact from {its} survivor dump{s}", "replica": "exact from a data-parallel replica's dump",
               "checkpoint": "from {its} checkpoint at f", "host snapshot": "from {its} host snapshot{s}"}

        def predicted(source: str) -> str:
            weights_from, _, predictor = source.rpartition("+")
            return (f"predicted with {predictor}" if not weights_from
                    else "parameters exact from a data-parallel replica's dump, {its} moments from " + predictor)

        return "; ".join(
            f"rank{'s' * (len(ranks) > 1)} {', '.join(ranks)} "
            + how.get(source, predicted(source)).format(its="their" if len(ranks) > 1 else "its",
                                                                s="s" * (len(ranks) > 1))
            for source, ranks in by_source.items())

    def describe(self) -> str:
        if self.method == "refused":
            return f"cpsr recovery: cannot resume: {self.reason}"
        if self.method == "fresh":
            return "cpsr recovery: no earlier progress, starting at iteration 0"
        if self.method == "restart":
            return f"cpsr recovery: job reached iteration {self.reached} but no checkpoint was committed; restarting from iteration 0"
        sources = set((self.sources or {}).values())
        restored = ("host snapshots of iteration" if "host snapshot" in sources
                    else "parameters of the checkpoint in flight at iteration" if "in flight" in sources
                    else "last checkpoint")
        head = f"cpsr recovery: job reached iteration {self.reached}, {restored} {self.checkpoint}; "
        if self.stage_checkpoints:
            head = (f"cpsr recovery: job reached iteration {self.reached}, last full cut {self.checkpoint}, stages' "
                    f"last checkpoints {', '.join(map(str, self.stage_checkpoints))}; ")
        if self.method == "predict":
            cost = "" if self.estimated_cost is None else f"estimated lag {self.estimated_cost:.1f} iterations against "
            return head + (
                f"predict (PB-R) {self._how()}: resuming at iteration {self.resume_iteration}, "
                f"{cost}{self.lost_iterations} to recompute ({self.reason})"
            )
        return head + (
            f"recompute (RB-R): {self.lost_iterations} iterations to redo, {self.checkpoint} saved against a restart "
            f"from scratch" + (f" ({self.reason})" if self.reason else "")
        )


def append_report(directory: str, report: RecoveryReport) -> None:
    with open(os.path.join(directory, REPORTS), "a") as f:
        f.write(json.dumps({**asdict(report), "description": report.describe()}) + "\n")


def read_reports(directory: str) -> list[RecoveryReport]:
    """Every start's recovery decision, oldest first."""
    with open(os.path.join(directory, REPORTS)) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [RecoveryReport(**{k: v for k, v in row.items() if k != "description"}) for row in rows]


def earlier_reports(directory: str) -> list[RecoveryReport]:
    """:func:`read_reports`, none for a run directory without any (a node that never held rank 0's)."""
    try:
        return read_reports(directory)
    except FileNotFoundError:
        return []


def carried_lag(reports: list[RecoveryReport], c: int) -> float:
    """The lag, in iterations, that a run resumed from checkpoint c carries from its earlier predictions.

    Each PB-R's estimated lag stays with the run, unless a later start restored a
    checkpoint from before that prediction's f (recomputing past it undid it) or
    started from scratch; a checkpoint after f holds the predicted state and its lag.
    """
    carried: list[tuple[int, float]] = []  # (f, estimated lag) of the predictions in the run's lineage
    for report in reports:
        restored = report.checkpoint if report.checkpoint is not None else 0
        carried = [(f, lag) for f, lag in carried if f <= restored]
        if report.method == "predict" and report.estimated_cost is not None:
            carried.append((report.reached, report.estimated_cost))
    return sum(lag for f, lag in carried if f <= c)
