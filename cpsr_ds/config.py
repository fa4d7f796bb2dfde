"""The ``"cpsr"`` block of a DeepSpeed config: typed schema, defaults, validation.

DeepSpeed accepts unknown top-level keys silently, so the block rides along in the
user's DeepSpeed JSON. Inside the block we are strict: an unknown key, a wrong type
or an out-of-range value raises :class:`ConfigError` (a ``ValueError``) naming the
key path, before any training starts.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

BLOCK = "cpsr"


class ConfigError(ValueError):
    """A bad value in the ``"cpsr"`` block; the message names every offending key path."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


class CheckpointConfig(_Strict):
    dir: str = Field("checkpoints", min_length=1, description="Directory for checkpoints, the progress journal and fault markers.")
    interval: int = Field(50, gt=0, description="T_c: iterations between checkpoints (strategy cpsr; the first interval of checkfreq and pccheck before they have profiled one checkpoint).")
    strategy: Literal["torch", "checkfreq", "pccheck", "cpsr"] = Field(
        "cpsr",
        description="Checkpoint engine: torch = DeepSpeed's synchronous torch.save; checkfreq = snapshot/persist pipelined, "
        "one checkpoint in flight, interval from overhead_budget; pccheck = max_in_flight checkpoints in flight, chunked "
        "pipelined copy and write, interval from overhead_budget; cpsr = asynchronous, fixed interval.",
    )
    keep_last: int = Field(3, gt=0, description="Committed checkpoints kept on storage (count); older ones are deleted after a newer one commits.")
    max_in_flight: int = Field(2, gt=0, description="Checkpoints being persisted at once (count), each holding one set of host buffers; checkfreq always uses 1.")
    retries: int = Field(3, ge=0, description="Retries of a failed file or manifest write (count) before the checkpoint is given up.")
    retry_backoff_s: float = Field(1.0, ge=0.0, description="Wait before the first retry in seconds; doubles on each further retry.")
    overhead_budget: float = Field(0.02, gt=0.0, le=1.0, description="checkfreq/pccheck: allowed training stall as a fraction of iteration time (0.02 = 2 %).")
    chunk_mb: int = Field(64, gt=0, description="pccheck: chunk size of the pipelined copy and write in MiB.")
    commit_timeout_s: float = Field(600.0, gt=0.0, description="Seconds rank 0 waits for every rank's manifest before giving a checkpoint up.")
    checksum: Literal["xxh3_64", "xxh3_128"] = Field("xxh3_64", description="xxhash algorithm of the per-file checksums in the manifests.")


class FaultConfig(_Strict):
    kill_rank: int = Field(0, ge=0, description="Global rank that the iteration-triggered failure kills.")
    kill_at_iteration: Optional[int] = Field(None, gt=0, description="SIGKILL kill_rank right after this iteration; null: never.")
    poisson_rate_per_hour: float = Field(0.0, ge=0.0, description="lambda: failures per hour of wall time on a random rank; 0: off.")
    seed: int = Field(0, ge=0, description="Seed of the Poisson failure times and of the rank they hit.")


class CPSRConfig(_Strict):
    enabled: bool = Field(True, description="false: cpsr_ds.initialize is exactly deepspeed.initialize.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    faults: FaultConfig = Field(default_factory=FaultConfig)

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
        else:
            lines.append(f"{path}: {e['msg']} (got {e.get('input')!r})")
    return "invalid DeepSpeed config block: " + "; ".join(lines)


def _model_at(loc: tuple) -> type[BaseModel]:
    model: type[BaseModel] = CPSRConfig
    for key in loc:
        model = model.model_fields[key].annotation
    return model
