"""Builds the checkpoint engine of the configured strategy (integration/deepspeed/install.py plugs it into DeepSpeed)."""

from __future__ import annotations

from typing import Any

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

from cpsr_ds.checkpoint.engines.checkfreq import CheckFreqEngine
from cpsr_ds.checkpoint.engines.cpsr import CPSRCheckpointEngine
from cpsr_ds.checkpoint.storage.layout import make_layout
from cpsr_ds.checkpoint.engines.pccheck import PCcheckEngine
from cpsr_ds.checkpoint.engines.torch_engine import TorchEngine
from cpsr_ds.config import CheckpointConfig

STRATEGIES = {"checkfreq": CheckFreqEngine, "pccheck": PCcheckEngine, "cpsr": CPSRCheckpointEngine}


def create_engine(cfg: CheckpointConfig, rank: int, world_size: int, config_params: Any = None, *,
                  attempt: int = 0, min_keep: int = 1, layout=None) -> CheckpointEngine:
    """The engine of ``cfg.strategy``; ``torch`` is DeepSpeed's synchronous engine with our manifests and commit.

    ``attempt``: the job attempt, recorded in manifests and commit records (order of
    checkpoints of one iteration). ``min_keep``: newest committed checkpoints that freeing
    space on a full disk never deletes. ``layout``: how the ranks' parts meet (layout.py), by
    default the one ``cfg.storage`` names (``torch`` commits on a shared directory only).
    """
    if cfg.strategy == "torch":
        return TorchEngine(cfg, rank, world_size, config_params, attempt=attempt, min_keep=min_keep)
    return STRATEGIES[cfg.strategy](cfg, rank, world_size, attempt=attempt, min_keep=min_keep,
                                    layout=layout or make_layout(cfg, rank, world_size))

