"""Builds the checkpoint engine of the configured strategy and plugs it into DeepSpeed."""

from __future__ import annotations

from typing import Any, Callable

from deepspeed import comm as dist
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

from cpsr_ds.checkpoint.checkfreq import CheckFreqEngine
from cpsr_ds.checkpoint.cpsr import CPSRCheckpointEngine
from cpsr_ds.checkpoint.pccheck import PCcheckEngine
from cpsr_ds.config import CheckpointConfig

STRATEGIES = {"checkfreq": CheckFreqEngine, "pccheck": PCcheckEngine, "cpsr": CPSRCheckpointEngine}


def create_engine(cfg: CheckpointConfig, rank: int, world_size: int, config_params: Any = None) -> CheckpointEngine:
    """The engine of ``cfg.strategy``; ``torch`` is DeepSpeed's own synchronous engine."""
    if cfg.strategy == "torch":
        return TorchCheckpointEngine(config_params)
    return STRATEGIES[cfg.strategy](cfg, rank, world_size)


def deepspeed_factory(cfg: CheckpointConfig) -> Callable[..., CheckpointEngine]:
    """A drop-in for ``deepspeed.runtime.engine.create_checkpoint_engine`` building our engine."""

    def create_checkpoint_engine(config_params, groups, zero_stage, has_moe_layers, optimize_dp_state):
        return create_engine(cfg, dist.get_rank(), dist.get_world_size(), config_params)

    return create_checkpoint_engine
