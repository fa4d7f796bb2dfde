"""How ``cpsr_ds.initialize`` gets its engine out of ``deepspeed.initialize``: the config it reads, our engine
class and checkpoint engine put in place for the one call, and DeepSpeed's CPU allreduce buffer let go.

Checked against DeepSpeed 0.19.8 (the version in the project's virtualenv); each use of a private name says
which source file and function it relies on.
"""

from __future__ import annotations

import copy
import inspect
import os
from contextlib import contextmanager
from typing import Callable

import deepspeed
import deepspeed.runtime.engine as ds_engine
import torch
from deepspeed import comm as ds_dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
# DeepSpeed 0.19.8, runtime/tensor_parallel/init_utils.py load_ds_config: a config path or dict as a dict, the
# way deepspeed.initialize reads it.
from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

from cpsr_ds.checkpoint.engines.factory import create_engine
from cpsr_ds.config import CPSRConfig
from cpsr_ds.integration.deepspeed.engine import CPSRPipelineEngine


def ds_config(bound: inspect.BoundArguments) -> dict:
    """The config dict DeepSpeed will use, from ``config``, ``config_params`` or ``args``."""
    args = bound.arguments
    config = args.get("config") or args.get("config_params")
    if config is None and args.get("args") is not None:
        config = getattr(args["args"], "deepspeed_config", None)
    if config is None:
        raise ValueError("cpsr_ds.initialize: no DeepSpeed config (pass config=... or --deepspeed_config)")
    return load_ds_config(os.fspath(config) if isinstance(config, os.PathLike) else config)


def pass_config(bound: inspect.BoundArguments, config: dict) -> None:
    """Make ``config`` the one ``deepspeed.initialize`` uses, in place of what the caller passed."""
    bound.arguments.pop("config_params", None)
    bound.arguments["config"] = config
    args = bound.arguments.get("args")
    if getattr(args, "deepspeed_config", None) is not None:
        bound.arguments["args"] = copy.copy(args)
        bound.arguments["args"].deepspeed_config = None


# DeepSpeed's own checkpoint-engine factory, which measurements of its engines use in place of ours.
DEEPSPEED_FACTORY = ds_engine.create_checkpoint_engine


def deepspeed_factory(cfg, *, attempt: int = 0, min_keep: int = 1) -> Callable[..., CheckpointEngine]:
    """A drop-in for ``deepspeed.runtime.engine.create_checkpoint_engine`` building our engine of ``cfg``
    (the "cpsr" block's checkpoint section).

    DeepSpeed 0.19.8, runtime/engine.py DeepSpeedEngine._configure_checkpointing calls the factory by this
    module-level name, with these keyword arguments.
    """

    def create_checkpoint_engine(config_params, groups, zero_stage, has_moe_layers, optimize_dp_state):
        return create_engine(cfg, ds_dist.get_rank(), ds_dist.get_world_size(), config_params,
                             attempt=attempt, min_keep=min_keep)

    return create_checkpoint_engine


@contextmanager
def installed(cfg: CPSRConfig, attempt: int):
    """Our engine class and checkpoint engine, for one ``deepspeed.initialize`` call.

    DeepSpeed 0.19.8, __init__.py initialize looks ``PipelineEngine`` up in the deepspeed module at call time,
    and runtime/engine.py imports ``create_checkpoint_engine`` into its own namespace, where the engine finds it.
    """
    original = deepspeed.PipelineEngine, ds_engine.create_checkpoint_engine
    deepspeed.PipelineEngine = CPSRPipelineEngine
    # Freeing space on a full disk must leave the predictor its history.
    ds_engine.create_checkpoint_engine = deepspeed_factory(cfg.checkpoint, attempt=attempt,
                                                           min_keep=cfg.predictor.history)
    try:
        yield
    finally:
        deepspeed.PipelineEngine, ds_engine.create_checkpoint_engine = original


def release_shm_allreduce_name(rank: int) -> None:
    """Unlink this rank's name of DeepSpeed's shared-memory allreduce buffer (CPU backend).

    DeepSpeed maps a 66 MB buffer in /dev/shm per rank and never unlinks it, so every
    multi-process job on a host leaves its buffers in RAM for good. Once every rank has
    mapped every buffer (the barrier: each rank maps all of them while initialising the
    backend), the names serve nothing, and unlinking lets the memory go with the processes.
    The name is DeepSpeed 0.19.8's, ops/csrc/cpu/comm/shm.cpp (SHM_BUFFER_NAME, shm_initialize).
    """
    torch.distributed.barrier()
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_" \
           f"{os.environ.get('MASTER_PORT', '')}_{rank}"
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:
        pass
