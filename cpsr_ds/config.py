"""The ``"cpsr"`` block of a DeepSpeed config: typed schema, defaults, validation.

DeepSpeed accepts unknown top-level keys silently, so the block rides along in the
user's DeepSpeed JSON; a top-level key a typo away from ``"cpsr"`` is warned about, as
DeepSpeed would ignore it and train without checkpoints. Inside the block we are
strict: an unknown key, a wrong type, an out-of-range value or a path no file system
takes raises :class:`ConfigError` (a ``ValueError``) naming the key path, before any
training starts.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Literal, Optional, Union

from cpsr_ds.planning.failure_mix import LLAMA3_SHARES as FAILURE_SHARES, NODE_LOST, PROCESS_CRASH, check_shares
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

BLOCK = "cpsr"
VITP_MIN_HISTORY = 6  # its FFT window of 5 checkpoints plus one held out
NAME_MAX = 255  # bytes in one path component, on every common Linux file system
PATH_MAX = 4096  # bytes in a path, its terminating NUL included (Linux)
NEAR_MISS = 2  # the edit distance up to which a top-level key is taken for a misspelt BLOCK

log = logging.getLogger(__name__)


def _whole_positive(value: Any) -> bool:
    return type(value) is int and value > 0


def path_problem(value: str) -> Optional[str]:
    """What keeps every file system from taking ``value`` as a path; None where nothing does."""
    if "\0" in value:
        return "a path cannot contain a NUL byte"
    raw = os.fsencode(value)
    if len(raw) >= PATH_MAX:
        return f"a path of {len(raw)} bytes is longer than {PATH_MAX - 1}"
    long = next((part for part in raw.split(b"/") if len(part) > NAME_MAX), None)
    if long is not None:
        return f"path component {os.fsdecode(long)[:40]!r}... is longer than {NAME_MAX} bytes"
    return None


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest insertions, deletions and substitutions that make ``a`` into ``b``."""
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        diagonal, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (x != y))
    return row[-1]


def near_misses(keys) -> list[str]:
    """The keys among ``keys`` a typo away from BLOCK (case aside), BLOCK itself not."""
    return [k for k in keys if isinstance(k, str) and k != BLOCK and edit_distance(k.casefold(), BLOCK) <= NEAR_MISS]


class ConfigError(ValueError):
    """A bad value in the ``"cpsr"`` block; the message names every offending key path."""


class _Strict(BaseModel):
    # Infinity and NaN parse from JSON but are no sane value for any key (an unbounded wait, a guard never met).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)


class CheckpointConfig(_Strict):
    dir: str = Field("checkpoints", min_length=1, description="Directory for checkpoints, the progress journal and fault markers.")
    interval: Union[int, Literal["auto"]] = Field(
        "auto",
        description="T_c: iterations between checkpoints, fixed; auto: chosen by the strategy's own rule from the "
        "measured costs (cpsr: the planner; torch, checkfreq and pccheck: the overhead_budget rule), "
        "planner.first_interval until one checkpoint has been measured.",
    )
    strategy: Literal["torch", "checkfreq", "pccheck", "cpsr"] = Field(
        "cpsr",
        description="Checkpoint engine: torch = DeepSpeed's synchronous torch.save; checkfreq = snapshot/persist pipelined, "
        "one checkpoint in flight; pccheck = max_in_flight checkpoints in flight, chunked pipelined copy and write; "
        "cpsr = asynchronous, one checkpoint in flight. With interval auto, cpsr's interval comes from the planner, the "
        "others' from overhead_budget.",
    )
    keep_last: int = Field(4, gt=0, description="Committed checkpoints kept on storage (count); older ones are deleted after a newer one commits.")
    max_in_flight: int = Field(2, gt=0, description="pccheck: checkpoints being persisted at once (count), each holding one set of host buffers; checkfreq and cpsr persist one at a time.")
    retries: int = Field(3, ge=0, description="Retries of a failed file or manifest write (count) before the checkpoint is given up.")
    retry_backoff_s: float = Field(1.0, ge=0.0, le=3600.0, description="Wait before the first retry in seconds; doubles on each further retry.")
    overhead_budget: float = Field(0.02, gt=0.0, le=1.0, description="checkfreq/pccheck: allowed training stall as a fraction of iteration time (0.02 = 2 %).")
    chunk_mb: int = Field(64, gt=0, description="pccheck: chunk size of the pipelined copy and write in MiB.")
    commit_timeout_s: float = Field(600.0, gt=0.0, le=86400.0, description="Seconds rank 0 waits for every rank's manifest before giving a checkpoint up.")
    checksum: Literal["xxh3_64", "xxh3_128"] = Field("xxh3_64", description="xxhash algorithm of the per-file checksums in the manifests.")
    storage: Literal["shared", "node_local"] = Field(
        "shared",
        description="shared: dir is one directory every rank sees (a shared file system), verified at start; "
        "node_local: dir is on each node's own disk, the commit goes through the job, and each rank's committed "
        "files are replicated to the next node (dir/replicas) so that losing a node loses no committed checkpoint.",
    )
    write_mbps: Optional[float] = Field(
        None, gt=0.0,
        description="Cap on the rate every checkpoint file of a process is written at, in MB/s (10^6 bytes/s), "
        "shared by all of that process's checkpoints in flight; null: unlimited.",
    )
    per_stage: bool = Field(
        False,
        description="Each pipeline stage checkpoints at its own interval, a whole multiple of the shortest (so "
        "that a checkpoint of every stage, a full cut, recurs every longest interval): with interval auto each "
        "stage's own planned interval, with a fixed interval N, N times the stage's measured persist time over the "
        "fastest stage's (rounded). Recompute-based recovery restores the newest full cut, predicting-based "
        "recovery predicts each stage from its own newest checkpoint. Needs strategy cpsr and storage shared; "
        "with one pipeline stage it changes nothing.",
    )
    survivor: bool = Field(
        True,
        description="When the job fails around a rank (SIGTERM from the launcher, or a failed collective in "
        "train_batch), the rank writes its exact state at the last iteration it completed to survivor_dir "
        "(cpsr_ds/checkpoint/capture/survivor.py), for recovery to use; false: no dump.",
    )
    survivor_dir: Optional[str] = Field(
        None, min_length=1,
        description="Fast local storage for survivor dumps, one directory per run and rank below it; null: "
        "/dev/shm/cpsr-survivors-<uid> (the system's temporary directory where there is no /dev/shm). It is yours "
        "alone: made 0700, and refused where another user owns it or may write to it, or a symlink is in its place.",
    )
    survivor_timeout_s: float = Field(
        20.0, gt=0.0, le=3600.0,
        description="Seconds a survivor dump may take, waiting for a running optimizer step included; past it the "
        "dump is abandoned, never used. Keep it inside the launcher's grace period (DeepSpeed's and torch's: 30 s).",
    )
    memory_interval: Union[None, int, Literal["auto"]] = Field(
        None,
        description="Iterations between host snapshots: each rank copies its state into shared memory beside its "
        "survivor dump (survivor_dir), no persist; a restart on the same node resumes from it when the training "
        "process crashed and the node survived. auto: sqrt(2 stall / lambda_crash) iterations from a snapshot's "
        "measured stall and the crashes' rate (planner.failure_rate_per_hour times planner.failure_mix.process_crash, "
        "updated by the crashes the run has seen; planning/levels.py), planned at a restart from the run's last plan "
        "(plans.jsonl) and again from each attempt's first snapshot; planner.first_interval until the first plan. "
        "With snapshots the storage interval is planned against the lost nodes' rate alone. null: none.",
    )

    @field_validator("interval", mode="before")
    @classmethod
    def _interval_or_auto(cls, value: Any) -> Any:
        if value != "auto" and not _whole_positive(value):
            raise ValueError(f'expected a whole number of iterations > 0 or "auto" (got {value!r})')
        return value

    @field_validator("memory_interval", mode="before")
    @classmethod
    def _memory_interval(cls, value: Any) -> Any:
        if value is not None and value != "auto" and not _whole_positive(value):
            raise ValueError(f'expected a whole number of iterations > 0, "auto" or null (got {value!r})')
        return value

    @model_validator(mode="after")
    def _node_local_commits_in_the_background(self) -> "CheckpointConfig":
        if self.storage == "node_local" and self.strategy == "torch":
            raise ValueError("storage node_local needs an asynchronous strategy (cpsr, checkfreq or pccheck): "
                             "the torch strategy commits through a shared directory")
        return self

    @model_validator(mode="after")
    def _per_stage_needs_cpsr(self) -> "CheckpointConfig":
        if self.per_stage and self.strategy != "cpsr":
            raise ValueError(f"per_stage needs strategy cpsr (got {self.strategy}): only its engine saves "
                             "some stages' parts of a checkpoint and commits them alone")
        if self.per_stage and self.storage != "shared":
            raise ValueError("per_stage needs storage shared: node_local commits and replicates every rank's "
                             "part of each checkpoint")
        return self

    @field_validator("dir", "survivor_dir")
    @classmethod
    def _a_path(cls, value: Optional[str]) -> Optional[str]:
        problem = None if value is None else path_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value


class FaultConfig(_Strict):
    kill_rank: int = Field(0, ge=0, description="Global rank that the iteration-triggered failure kills.")
    kill_at_iteration: Union[None, int, list[int]] = Field(
        None, description="SIGKILL kill_rank right after this iteration, or after each of a list of iterations "
        "(a failure trace); each fires once per run directory; null: never.")

    @field_validator("kill_at_iteration", mode="before")
    @classmethod
    def _iterations(cls, value: Any) -> Any:
        if value is None or _whole_positive(value):
            return value
        if not isinstance(value, list) or not all(_whole_positive(v) for v in value):
            raise ValueError(f"expected an iteration > 0, a list of them or null (got {value!r})")
        return value

    poisson_rate_per_hour: float = Field(0.0, ge=0.0, description="lambda: failures per hour of wall time on a random rank; 0: off.")
    seed: int = Field(0, ge=0, description="Seed of the Poisson failure times and of the rank they hit.")


class PredictorConfig(_Strict):
    name: Literal["skip", "linear", "trend", "damped", "ridge", "vitp"] = Field("trend", description="Predictor of the state at the failure point.")
    history: int = Field(4, ge=2, description="Checkpoints the predictor learns from (count); checkpoint.keep_last must be at least this.")
    params: Literal["predict", "keep"] = Field("predict", description="Parameters: extrapolated, or kept from the last checkpoint.")
    moments: Literal["predict", "keep"] = Field("keep", description="Adam's exp_avg and exp_avg_sq: extrapolated, or kept from the last checkpoint.")
    train_budget_s: Optional[float] = Field(
        0.5, ge=0.0, description="vitp: seconds of predictor training after each checkpoint; null: no time limit."
    )
    train_steps: Optional[int] = Field(
        None, gt=0,
        description="vitp: at most this many predictor training steps after each checkpoint (count); null: no step "
        "limit. A step limit alone makes the predictor's training independent of the machine's load.",
    )
    memory_mb: float = Field(
        200.0, gt=0.0,
        description="vitp: cap on the predictor's memory on its device in MiB (weights, optimizer state, samples, "
        "activations; the paper's 200 MB): above it the samples stay in host memory and are streamed in smaller "
        "batches; a cap below one chunk's batch is refused at the start, naming the sizes.",
    )

    device: Literal["cpu", "cuda"] = Field(
        "cpu",
        description="vitp: where it trains and predicts. cpu: host memory and cores, beside the checkpoint's host "
        "copies; cuda: the rank's GPU, its work issued on a side stream that starts at the bubble (memory_mb caps "
        "its footprint there). The other predictors work on the host copies.",
    )

    @model_validator(mode="after")
    def _training_is_bounded(self) -> "PredictorConfig":
        if self.train_budget_s is None and self.train_steps is None:
            raise ValueError("train_budget_s and train_steps are both null: predictor training after a checkpoint "
                             "needs a time or a step limit")
        if self.device != "cpu" and self.name != "vitp":
            raise ValueError(f"device {self.device!r} is for the learning predictor vitp; {self.name} works on "
                             "the host copies of the state (device cpu)")
        return self


class RecoveryConfig(_Strict):
    mode: Literal["auto", "predict", "recompute"] = Field(
        "auto",
        description="auto: predict (PB-R) unless the predictor is not ready, its held-out error reaches "
        "max_relative_error (then skip, c's state at f, is weighed instead), the cost model (planner.cost_model) estimates a lag not below the d lost iterations, "
        "or a pessimistic lag would cost more than max_loss_excess, else recompute (RB-R); predict: PB-R whenever "
        "the predictor is ready; both recompute from the parameters of a checkpoint still in flight at the failure "
        "where they landed (recovery/sources/in_flight.py); recompute: always RB-R, from exact states only.",
    )
    max_relative_error: float = Field(
        1.5, gt=0.0,
        description="auto: a stage whose predictor's held-out error, relative to not predicting, is not below "
        "this (a guard against diverging predictions) takes skip (c's state at f) instead where the cost model "
        "says it costs less than d, else RB-R.",
    )
    max_loss_excess: float = Field(
        0.005, ge=0.0,
        description="auto: PB-R only if the loss the run had a pessimistic lag (the cost model's estimate plus the "
        "estimated lags of the earlier predictions the run carries, times calibration.PESSIMISM) before the failure "
        "is at most this share above the loss at the failure (by the job's loss curve): under a decaying learning "
        "rate a lag stays as a loss excess to the end of training, and the lags of several predictions add up.",
    )


class FailureMixConfig(_Strict):
    process_crash: float = Field(
        FAILURE_SHARES[PROCESS_CRASH], ge=0.0, le=1.0,
        description="Share of failures that kill the training process on a node that lives (host memory and "
        "node-local disk survive: host snapshots serve them). Default: the Llama 3 report's 419 unexpected "
        "interruptions by root cause (cpsr_ds/planning/failure_mix.py, docs/concepts/cost-model.md).",
    )
    node_lost: float = Field(
        FAILURE_SHARES[NODE_LOST], ge=0.0, le=1.0,
        description="Share of failures that take the rank's node (its memory and node-local disk gone, the other "
        "nodes live: storage or a replica serves its ranks). The two shares sum to 1.",
    )

    @model_validator(mode="after")
    def _shares_sum_to_one(self) -> "FailureMixConfig":
        check_shares(self.model_dump())
        return self


class PlannerConfig(_Strict):
    failure_rate_per_hour: float = Field(
        0.08, gt=0.0,
        description="lambda before the job has failed: failures per hour of the whole job (all its ranks), the "
        "paper's 0.08 by default (one in 12.5 h, from production traces). Take your cluster's record for jobs of "
        "this many servers: failures per hour of running. The job's own restarts in recovery.jsonl update it.",
    )
    failure_mix: FailureMixConfig = Field(
        default_factory=FailureMixConfig,
        description="How failure_rate_per_hour splits by failure class, as shares: process_crash and node_lost.",
    )
    cost_model: Literal["empirical", "paper", "paper-eq14"] = Field(
        "empirical",
        description="The recovery cost model both the recovery decision and the planner use: empirical, "
        "T_p = (1 - rho) d with rho measured per predictor by benchmarks/bench_recovery.py; paper: Eq. 13; "
        "paper-eq14: its linearisation, Eq. 14.",
    )
    phase_threshold: float = Field(
        0.05, gt=0.0,
        description="A new training phase, and a new plan, begins once xi's accumulated relative change since the "
        "phase began exceeds this (0.05 = 5 %, the paper's).",
    )
    replan_drift: float = Field(
        0.2, gt=0.0,
        description="Re-plan when a measured input (iteration time, T_s, persist time, lambda) has moved by more "
        "than this share since the last plan.",
    )
    first_interval: int = Field(
        50, gt=0, description="Iterations between checkpoints with checkpoint.interval auto, until the first "
        "checkpoint's costs have been measured.")
    max_interval: int = Field(10_000, gt=0, description="The longest interval auto plans, iterations.")
    train_iters: Optional[int] = Field(
        None, gt=0,
        description="The run's planned length in iterations, for a learning-rate scheduler that does not say it "
        "(torch's LambdaLR, which Hugging Face's schedules are): a lag a prediction leaves counts by how much of the "
        "decaying schedule is still ahead, read up to this end. DeepSpeed's decaying schedules say it "
        "(total_num_steps); with neither, a decaying schedule's end is unknown and recovery recomputes.")


class CoordinatorConfig(_Strict):
    enabled: bool = Field(
        True,
        description="The predictor's work after a checkpoint (observing it, a learning predictor's training, the "
        "held-out check) runs off the training loop's path (cpsr_ds/coordinator.py): with pipeline parallelism in "
        "the pipeline's bubbles, with one pipeline stage and a learning predictor (vitp) on a low-priority "
        "background thread; what is left at the next checkpoint runs there. With one stage and a simple "
        "predictor it runs at the checkpoint, where it costs the training loop less. false: at the checkpoint, "
        "on the training loop's path.",
    )
    percentile: float = Field(
        10.0, gt=0.0, le=100.0,
        description="A bubble's budget is this percentile (10 = a low one) of its measured waits over the last "
        "window iterations, times safety.",
    )
    window: int = Field(20, gt=0, description="Iterations of measured waits a bubble's budget is taken from (count).")
    safety: float = Field(
        0.8, gt=0.0, le=1.0,
        description="Share of a bubble's measured wait that predictor work may fill (0.8 = 80 %).",
    )
    log_every: int = Field(
        100, gt=0,
        description="Iterations summed up per line of the run directory's coordinator/rankNNNNN.jsonl (count).",
    )
    fill: bool = Field(
        False,
        description="With pipeline parallelism and a learning predictor (vitp): once a checkpoint's work is done, "
        "the predictor keeps training in what is left of the bubbles until the next checkpoint, beyond "
        "predictor.train_steps or train_budget_s, while it helps: a second split of chunks is held out of its "
        "training, and where a few more steps do not lower the error on it they are undone and filling waits for "
        "the next checkpoint. That training never runs on the training loop's path. The predictor's training then "
        "depends on the bubbles' measured length, so two runs of one seed no longer train it alike.",
    )


class CPSRConfig(_Strict):
    enabled: bool = Field(True, description="false: cpsr_ds.initialize is exactly deepspeed.initialize.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    faults: FaultConfig = Field(default_factory=FaultConfig)
    predictor: PredictorConfig = Field(default_factory=PredictorConfig)
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    planner: PlannerConfig = Field(default_factory=PlannerConfig)
    coordinator: CoordinatorConfig = Field(default_factory=CoordinatorConfig)

    @model_validator(mode="after")
    def _history_is_retained(self) -> "CPSRConfig":
        if self.enabled and self.checkpoint.keep_last < self.predictor.history:
            raise ValueError(
                f"checkpoint.keep_last ({self.checkpoint.keep_last}) must be at least predictor.history "
                f"({self.predictor.history}): the predictor learns from the retained checkpoints"
            )
        if self.predictor.name == "vitp" and self.predictor.history < VITP_MIN_HISTORY:
            raise ValueError(f"predictor.history ({self.predictor.history}) must be at least {VITP_MIN_HISTORY} for vitp")
        return self

    @classmethod
    def from_ds_config(cls, ds_config: dict[str, Any]) -> "CPSRConfig":
        """Parse the ``"cpsr"`` block of a DeepSpeed config dict; no block means disabled. A top-level key a typo
        away from it is warned about."""
        for key in near_misses(ds_config):
            log.warning('cpsr: the DeepSpeed config has a top-level key %r, close to "%s": DeepSpeed ignores it, and '
                        'so does cpsr_ds (a typo? checkpoints and recovery are configured in the "%s" block)',
                        key, BLOCK, BLOCK)
        if BLOCK not in ds_config:
            return cls(enabled=False)
        return cls.parse_block(ds_config[BLOCK])

    @classmethod
    def parse_block(cls, block: Any) -> "CPSRConfig":
        if not isinstance(block, dict):
            raise ConfigError(f"{BLOCK}: expected an object, got {type(block).__name__}")
        try:
            return cls.model_validate(block)
        except ValidationError as err:
            raise ConfigError(_describe(err)) from None


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in (BLOCK, *e["loc"]))
        if e["type"] == "extra_forbidden":
            allowed = ", ".join(_model_at(e["loc"][:-1]).model_fields)
            lines.append(f"{path}: unknown key (allowed: {allowed})")
        elif e["type"] == "value_error":  # a rule across keys: its message names them
            lines.append(f"{path}: {e['ctx']['error']}")
        else:
            lines.append(f"{path}: {e['msg']} (got {e.get('input')!r})")
    return "invalid DeepSpeed config block: " + "; ".join(lines)


def _model_at(loc: tuple) -> type[BaseModel]:
    model: type[BaseModel] = CPSRConfig
    for key in loc:
        model = model.model_fields[key].annotation
    return model
