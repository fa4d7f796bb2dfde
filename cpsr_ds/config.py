"""The ``"cpsr"`` block of a DeepSpeed config: typed schema, defaults, validation.

DeepSpeed accepts unknown top-level keys silently, so the block rides along in the
user's DeepSpeed JSON. Inside the block we are strict: an unknown key, a wrong type
or an out-of-range value raises :class:`ConfigError` (a ``ValueError``) naming the
key path, before any training starts.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

BLOCK = "cpsr"
VITP_MIN_HISTORY = 6  # its FFT window of 5 checkpoints plus one held out
NAME_MAX = 255  # bytes in one path component, on every common Linux file system


class ConfigError(ValueError):
    """A bad value in the ``"cpsr"`` block; the message names every offending key path."""


class _Strict(BaseModel):
    # Infinity and NaN parse from JSON but are no sane value for any key (an unbounded wait, a guard never met).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)


class CheckpointConfig(_Strict):
    dir: str = Field("checkpoints", min_length=1, description="Directory for checkpoints, the progress journal and fault markers.")
    interval: int = Field(50, gt=0, description="T_c: iterations between checkpoints (strategy cpsr; the first interval of checkfreq and pccheck before they have profiled one checkpoint).")
    strategy: Literal["torch", "checkfreq", "pccheck", "cpsr"] = Field(
        "cpsr",
        description="Checkpoint engine: torch = DeepSpeed's synchronous torch.save; checkfreq = snapshot/persist pipelined, "
        "one checkpoint in flight, interval from overhead_budget; pccheck = max_in_flight checkpoints in flight, chunked "
        "pipelined copy and write, interval from overhead_budget; cpsr = asynchronous, fixed interval.",
    )
    keep_last: int = Field(4, gt=0, description="Committed checkpoints kept on storage (count); older ones are deleted after a newer one commits.")
    max_in_flight: int = Field(2, gt=0, description="pccheck: checkpoints being persisted at once (count), each holding one set of host buffers; checkfreq and cpsr persist one at a time.")
    retries: int = Field(3, ge=0, description="Retries of a failed file or manifest write (count) before the checkpoint is given up.")
    retry_backoff_s: float = Field(1.0, ge=0.0, le=3600.0, description="Wait before the first retry in seconds; doubles on each further retry.")
    overhead_budget: float = Field(0.02, gt=0.0, le=1.0, description="checkfreq/pccheck: allowed training stall as a fraction of iteration time (0.02 = 2 %).")
    chunk_mb: int = Field(64, gt=0, description="pccheck: chunk size of the pipelined copy and write in MiB.")
    commit_timeout_s: float = Field(600.0, gt=0.0, le=86400.0, description="Seconds rank 0 waits for every rank's manifest before giving a checkpoint up.")
    checksum: Literal["xxh3_64", "xxh3_128"] = Field("xxh3_64", description="xxhash algorithm of the per-file checksums in the manifests.")
    write_mbps: Optional[float] = Field(
        None, gt=0.0,
        description="Cap on the rate every checkpoint file of a process is written at, in MB/s (10^6 bytes/s), "
        "shared by all of that process's checkpoints in flight; null: unlimited.",
    )

    @field_validator("dir")
    @classmethod
    def _dir_can_exist(cls, value: str) -> str:
        if "\0" in value:
            raise ValueError("a path cannot contain a NUL byte")
        long = next((part for part in value.split("/") if len(part.encode(errors="surrogateescape")) > NAME_MAX), None)
        if long is not None:
            raise ValueError(f"path component {long[:40]!r}... is longer than {NAME_MAX} bytes")
        return value


class FaultConfig(_Strict):
    kill_rank: int = Field(0, ge=0, description="Global rank that the iteration-triggered failure kills.")
    kill_at_iteration: Optional[int] = Field(None, gt=0, description="SIGKILL kill_rank right after this iteration; null: never.")
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

    @model_validator(mode="after")
    def _training_is_bounded(self) -> "PredictorConfig":
        if self.train_budget_s is None and self.train_steps is None:
            raise ValueError("train_budget_s and train_steps are both null: predictor training after a checkpoint "
                             "needs a time or a step limit")
        return self


class RecoveryConfig(_Strict):
    mode: Literal["auto", "predict", "recompute"] = Field(
        "auto",
        description="auto: predict (PB-R) unless the predictor is not ready, its held-out error reaches "
        "max_relative_error or a pessimistic lag (guard_reduction) would cost more than max_loss_excess, else "
        "recompute (RB-R); predict: PB-R whenever the predictor is ready; recompute: always RB-R.",
    )
    max_relative_error: float = Field(
        1.5, gt=0.0,
        description="auto: PB-R only if the predictor's held-out error, relative to not predicting, is below this: "
        "a guard against diverging predictions.",
    )
    expected_reduction: float = Field(
        0.7, ge=0.0, lt=1.0,
        description="The share of the d lost iterations a prediction is expected to save: PB-R's estimated cost is "
        "(1 - expected_reduction) * d. Calibrated on benchmarks/bench_recovery.py, where the default predictor "
        "saved 69 % on average over 36 failures.",
    )
    max_loss_excess: float = Field(
        0.005, ge=0.0,
        description="auto: PB-R only if the loss the run had (1 - guard_reduction) * d iterations before the failure "
        "is at most this share above the loss at the failure (by the job's loss curve): under a decaying learning rate "
        "a lag stays as a loss excess to the end of training.",
    )
    guard_reduction: float = Field(
        0.5, ge=0.0, lt=1.0,
        description="auto: the share of d the max_loss_excess guard assumes a prediction saves, at most "
        "expected_reduction: one recovery's lag varies far more than the mean, and on benchmarks/bench_recovery.py "
        "28 of the default predictor's 36 recoveries lagged less than d / 2.",
    )

    @model_validator(mode="after")
    def _guard_is_pessimistic(self) -> "RecoveryConfig":
        if self.guard_reduction > self.expected_reduction:
            raise ValueError(f"guard_reduction ({self.guard_reduction}) must not exceed expected_reduction "
                             f"({self.expected_reduction}): the guard assumes the pessimistic case")
        return self


class CPSRConfig(_Strict):
    enabled: bool = Field(True, description="false: cpsr_ds.initialize is exactly deepspeed.initialize.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    faults: FaultConfig = Field(default_factory=FaultConfig)
    predictor: PredictorConfig = Field(default_factory=PredictorConfig)
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)

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
        """Parse the ``"cpsr"`` block of a DeepSpeed config dict; no block means disabled."""
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
