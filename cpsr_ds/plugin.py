"""``cpsr_ds.initialize``: ``deepspeed.initialize`` plus CPSR's pieces.

With a ``"cpsr"`` block in the DeepSpeed config (and ``"enabled": true``) the
engine DeepSpeed builds is a subclass that, after every training iteration,
appends to the progress journal, takes a checkpoint every ``interval``
iterations and gives fault injection its chance; before returning, the engine is
restored from the run directory if an earlier run left progress there
(``engine.cpsr.recovery`` says how, and ``engine.global_steps`` is where to resume).
Without the block it is ``deepspeed.initialize`` itself.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import sys
from contextlib import contextmanager

import deepspeed
import deepspeed.runtime.engine as ds_engine
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

from cpsr_ds.checkpoint.factory import deepspeed_factory
from cpsr_ds.checkpoint.journal import ProgressJournal
from cpsr_ds.config import CPSRConfig
from cpsr_ds.faults import FaultInjector, check_kill_rank
from cpsr_ds.recovery import PREDICTOR_STATE, append_report, engine_state, new_predictor, recover
from cpsr_ds.rundir import RunDirLock, claim

logger = logging.getLogger("cpsr_ds")
if not logger.handlers:
    _handler = logging.StreamHandler(sys.stdout)
    _handler.setFormatter(logging.Formatter("[cpsr_ds] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


class Runtime:
    """CPSR's per-engine state: config, journal, fault injector, how the job recovered.

    ``lock``: the run directory's lock, held (on rank 0) until :meth:`close`.
    """

    def __init__(self, engine: PipelineEngine, cfg: CPSRConfig, lock: RunDirLock | None = None):
        self.cfg = cfg
        self.lock = lock
        self.directory = cfg.checkpoint.dir
        self.diverged_at = None  # the first iteration whose loss was not finite
        rank, world = engine.global_rank, engine.world_size
        self.journal = ProgressJournal(self.directory, rank)
        self.faults = FaultInjector(cfg.faults, self.directory, rank, world)
        self.predictor = new_predictor(cfg)
        self.recovery = recover(engine, cfg, self.predictor)
        if not hasattr(self.predictor, "step"):
            # Simple predictors fit at recovery time; only a network learns during the run.
            self.predictor = None

    def after_iteration(self, engine: PipelineEngine, loss: float) -> None:
        iteration = engine.global_steps
        self.journal.append(iteration, loss)
        finite = math.isfinite(loss)
        if not finite and self.diverged_at is None:
            self.diverged_at = iteration
            logger.error("cpsr: the training loss is %s at iteration %d: training diverged; no checkpoint is saved "
                         "at an iteration whose loss is not finite", loss, iteration)
        interval = self.cfg.checkpoint.interval
        if iteration % (self.cfg.planner.first_interval if interval == "auto" else interval) == 0:
            if finite:
                engine.save_checkpoint(self.directory, client_state=self._train_predictor(engine, iteration))
            else:
                logger.warning("cpsr: checkpoint of iteration %d skipped: the loss is %s", iteration, loss)
        self.faults.check(iteration)

    def close(self) -> None:
        """Close the journal and give the run directory free for another job."""
        self.journal.close()
        if self.lock is not None:
            self.lock.release()

    def _train_predictor(self, engine: PipelineEngine, iteration: int) -> dict:
        """Feed the checkpoint to a learning predictor, train it a little; its weights go with the checkpoint."""
        if self.predictor is None:
            return {}
        self.predictor.observe(iteration, engine_state(engine))
        self.predictor.step(budget_s=self.cfg.predictor.train_budget_s, n_steps=self.cfg.predictor.train_steps)
        return {PREDICTOR_STATE: self.predictor.state_dict(include_history=False)}


class CPSRPipelineEngine(PipelineEngine):
    cpsr: Runtime

    def destroy(self):
        # The run directory is another job's to take only once pending checkpoints are done.
        try:
            super().destroy()
        finally:
            if hasattr(self, "cpsr"):
                self.cpsr.close()

    def train_batch(self, data_iter=None):
        loss = super().train_batch(data_iter)
        self.cpsr.after_iteration(self, float(loss))
        return loss

    def _exec_optimizer_step(self, lr_kwargs=None):
        # DeepSpeed's PipelineEngine never commits a decoupled checkpoint engine. The
        # snapshot of the last checkpoint must be complete before the optimizer
        # overwrites the state it copies; this wait is the checkpoint's training stall.
        if self.checkpoint_engine.is_decoupled():
            self._commit_decoupled_checkpoint()
        super()._exec_optimizer_step(lr_kwargs)

    # The schedule's instructions run through this class-level map of plain functions,
    # so an override takes effect only once it is mapped here.
    _INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP, schedule.OptimizerStep: _exec_optimizer_step}


def _ds_config(bound: inspect.BoundArguments) -> dict:
    """The config dict DeepSpeed will use, from ``config``, ``config_params`` or ``args``."""
    args = bound.arguments
    config = args.get("config") or args.get("config_params")
    if config is None and args.get("args") is not None:
        config = getattr(args["args"], "deepspeed_config", None)
    if config is None:
        raise ValueError("cpsr_ds.initialize: no DeepSpeed config (pass config=... or --deepspeed_config)")
    return load_ds_config(os.fspath(config) if isinstance(config, os.PathLike) else config)


@contextmanager
def _installed(cfg: CPSRConfig, attempt: int):
    """Our engine class and checkpoint engine, for one ``deepspeed.initialize`` call.

    ``deepspeed.initialize`` looks the pipeline engine class up at call time, and the
    engine looks its checkpoint-engine factory up in its own module.
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


def _release_shm_allreduce_name(rank: int) -> None:
    """Unlink this rank's name of DeepSpeed's shared-memory allreduce buffer (CPU backend).

    DeepSpeed maps a 66 MB buffer in /dev/shm per rank and never unlinks it, so every
    multi-process job on a host leaves its buffers in RAM for good. Once every rank has
    mapped every buffer (the barrier: each rank maps all of them while initialising the
    backend), the names serve nothing, and unlinking lets the memory go with the processes.
    """
    torch.distributed.barrier()
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_" \
           f"{os.environ.get('MASTER_PORT', '')}_{rank}"
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:
        pass


def _init_distributed(bound: inspect.BoundArguments) -> None:
    """The process group, as ``deepspeed.initialize`` would make it: the run directory's lock needs it first."""
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                                   distributed_port=bound.arguments.get("distributed_port", TORCH_DISTRIBUTED_DEFAULT_PORT),
                                   dist_init_required=bound.arguments.get("dist_init_required"))


def _collective_device() -> torch.device:
    """Where this rank's buffers for a collective go before the engine exists (NCCL: this rank's GPU)."""
    if dist.get_backend() == "gloo":
        return torch.device("cpu")
    return torch.device(get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", 0))))


def initialize(*args, **kwargs):
    """Same arguments and return values as ``deepspeed.initialize``."""
    bound = inspect.signature(deepspeed.initialize).bind(*args, **kwargs)
    cfg = CPSRConfig.from_ds_config(_ds_config(bound))
    if not cfg.enabled:
        return deepspeed.initialize(*args, **kwargs)
    if not isinstance(bound.arguments.get("model"), PipelineModule):
        raise TypeError("cpsr_ds: the model must be a deepspeed.pipe.PipelineModule (num_stages=1 for no pipelining)")
    _init_distributed(bound)
    check_kill_rank(cfg.faults, dist.get_world_size())
    lock = claim(cfg.checkpoint.dir, _collective_device())
    try:
        with _installed(cfg, lock.attempt):
            engine, optimizer, dataloader, scheduler = deepspeed.initialize(*args, **kwargs)
        _release_shm_allreduce_name(engine.global_rank)
        engine.cpsr = Runtime(engine, cfg, lock)
    except BaseException:
        lock.release()
        raise
    if engine.global_rank == 0:
        logger.info(engine.cpsr.recovery.describe())
        append_report(cfg.checkpoint.dir, engine.cpsr.recovery)
    return engine, optimizer, dataloader, scheduler
