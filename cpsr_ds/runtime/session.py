"""``cpsr_ds.initialize``: ``deepspeed.initialize`` plus CPSR's runtime.

With a ``"cpsr"`` block in the DeepSpeed config (and ``"enabled": true``) a start claims the run directory,
fits this start's layout to the last one's (world.py), builds the engine with our engine class (the pipeline engine
for a ``PipelineModule``, the plain engine otherwise) and checkpoint engine, and attaches the runtime (``engine.cpsr``), which recovers the engine from what earlier attempts left
(``engine.cpsr.recovery`` says how, and ``engine.global_steps`` is where to resume). Without the block it is
``deepspeed.initialize`` itself.
"""

from __future__ import annotations

import inspect
import logging
import os
from dataclasses import replace

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT

from cpsr_ds import world
from cpsr_ds.checkpoint.capture import exiting
from cpsr_ds.checkpoint.capture.journal import retire_journals
from cpsr_ds.checkpoint.storage.topology import verify_storage
from cpsr_ds.config import CPSRConfig
from cpsr_ds.runtime.elastic import check_restartable
from cpsr_ds.runtime.faults import check_kill_rank
from cpsr_ds.integration.deepspeed.data_iterator import resume_data
from cpsr_ds.integration.deepspeed.install import ds_config, installed, pass_config, release_shm_allreduce_name
from cpsr_ds.integration.deepspeed.topology import stages_of, tensor_parallel_size
from cpsr_ds.recovery import RecoveryReport, append_report
from cpsr_ds.runtime import restart_time
from cpsr_ds.runtime.rundir import check_writable, claim
from cpsr_ds.runtime.runtime import Runtime

log = logging.getLogger(__name__)


def initialize(*args, **kwargs):
    """Same arguments and return values as ``deepspeed.initialize``."""
    bound = inspect.signature(deepspeed.initialize).bind(*args, **kwargs)
    cfg = CPSRConfig.from_ds_config(ds_config(bound))
    if not cfg.enabled:
        return deepspeed.initialize(*args, **kwargs)
    if bound.arguments.get("model") is None:
        raise TypeError("cpsr_ds.initialize: no model (pass model=...)")
    with restart_time.clock() as clock:
        engine, optimizer, dataloader, scheduler = _start(bound, cfg, clock)
    engine.cpsr.recovery = replace(engine.cpsr.recovery, seconds=clock.seconds)
    if engine.global_rank == 0:
        log.info(engine.cpsr.recovery.describe())
        append_report(cfg.checkpoint.dir, engine.cpsr.recovery)
        engine.cpsr.monitor.recovery(engine.cpsr.recovery)
    return engine, optimizer, dataloader, scheduler


def _start(bound: inspect.BoundArguments, cfg: CPSRConfig, clock: restart_time.RestartClock) -> tuple:
    """``deepspeed.initialize``'s engine with CPSR's runtime, recovered; each part's time on ``clock``."""
    _init_distributed(bound)
    clock.mark("distributed_init")
    check_writable(cfg.checkpoint)
    verify_storage(cfg.checkpoint)
    # Before any engine exists: an exception anywhere in the script bounds its exit (exiting.py).
    exiting.install()
    check_kill_rank(cfg.faults, dist.get_world_size())
    lock = claim(cfg.checkpoint.dir, _collective_device())
    try:
        change = _fit_layout(bound, cfg, lock.attempt)
        clock.mark("run_directory")
        with installed(cfg, lock.attempt):
            engine, optimizer, dataloader, scheduler = deepspeed.initialize(*bound.args, **bound.kwargs)
        release_shm_allreduce_name(engine.global_rank)
        clock.mark("deepspeed_init")
        engine.cpsr = Runtime(engine, cfg, lock, world_change=change)
        if skipped := resume_data(engine):
            log.info("cpsr: the engine's training data resumes %d batches into its pass", skipped)
        _retire_departed(cfg.checkpoint.dir, lock.attempt)
        clock.mark("rest")
    except BaseException:
        lock.release()
        raise
    return engine, optimizer, dataloader, scheduler


def _init_distributed(bound: inspect.BoundArguments) -> None:
    """The process group, as ``deepspeed.initialize`` would make it: the run directory's lock needs it first."""
    check_restartable()
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                                   distributed_port=bound.arguments.get("distributed_port", TORCH_DISTRIBUTED_DEFAULT_PORT),
                                   dist_init_required=bound.arguments.get("dist_init_required"))


def _collective_device() -> torch.device:
    """Where this rank's buffers for a collective go before the engine exists (NCCL: this rank's GPU)."""
    if dist.get_backend() == "gloo":
        return torch.device("cpu")
    return torch.device(get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", 0))))


def _gather(local, device: torch.device) -> list:
    """Every rank's ``local``, before the engine exists (it sets this rank's device only later)."""
    if device.type != "cpu":
        get_accelerator().set_device(device.index)
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, local)
    return found


def _fit_layout(bound: inspect.BoundArguments, cfg: CPSRConfig, attempt: int) -> str | None:
    """Check this start's layout against the last start's and keep its global batch (world.adapt); the change made.

    The config ``deepspeed.initialize`` gets is rewritten in ``bound`` where the
    gradient accumulation changes. A change the checkpoints cannot serve raises
    :class:`WorldChangeError` on every rank, before any training, and rank 0 reports it
    in recovery.jsonl.
    """
    model, directory = bound.arguments["model"], cfg.checkpoint.dir
    config = ds_config(bound)
    here = world.layout_of(config, dist.get_world_size(), stages_of(model), tensor_parallel_size(model), attempt)
    last = world.newest(_gather(world.read_layout(directory), _collective_device()))
    try:
        config, here, change = world.adapt(config, last, here)
    except world.WorldChangeError as err:
        if dist.get_rank() == 0:
            log.error("%s", err)
            append_report(directory, RecoveryReport("refused", None, None, 0, reason=str(err),
                                                    world_change=str(err)))
        raise
    if change is not None:
        log.info("cpsr: %s", change)
        pass_config(bound, config)
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:  # one writer per node: node-local directories get theirs too
        world.write_layout(directory, here)
    return change


def _retire_departed(directory: str, attempt: int) -> None:
    """Retire the journals of ranks beyond this world, once every rank has read the progress (recover)."""
    if dist.get_world_size() > 1:
        dist.barrier()
    for path in retire_journals(directory, dist.get_world_size(), attempt):
        log.info("cpsr: %s: the journal of a rank this job no longer has, kept for the record", path)
