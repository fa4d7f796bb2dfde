"""Around DeepSpeed's ``load_checkpoint``: what a stage's data-parallel replicas read, read once.

Each hook shadows one engine method with an instance attribute for the duration of one load, and removes it
after. Checked against DeepSpeed 0.19.8: runtime/engine.py DeepSpeedEngine.load_checkpoint ->
_load_checkpoint (reads the module through ``module.load_state_dir`` on a PipelineModule, runtime/pipe/module.py,
and every file through ``checkpoint_engine.load``) -> _load_zero_checkpoint (the ZeRO partitions; False where
_get_all_zero_checkpoints finds none).

The model-states check (:func:`reading_each_file_once`), checked against DeepSpeed 0.19.8,
runtime/state_dict_factory.py: ``SDLoaderBase.__init__`` calls ``check_ckpt_list``, which loads the first
file of the list whole to compare its ``mp_world_size`` with the list's length and throws it away;
``DeepSpeedEngine._load_checkpoint`` then loads the same file again (``SDLoaderFactory.get_sd_loader``).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch.distributed as dist
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from cpsr_ds.checkpoint.storage import loading
from cpsr_ds.checkpoint.storage.fileformat import CheckpointError, read_skeleton
from cpsr_ds.integration.deepspeed.engine_state import data_parallel, partitioned, update_weights


def _weights_in_partitions(engine) -> bool:
    """Whether the ZeRO-1/2 optimizer's fp32 partitions, loaded as DeepSpeed loads them by default
    (``zero_optimization.load_from_fp32_weights``), hold every entry of the pipeline module's state dict (an
    entry that is None, such as the ``_extra_state`` of megatron-core's linear layers without FP8, holds nothing)."""
    if not (isinstance(engine.optimizer, DeepSpeedZeroOptimizer) and isinstance(engine.module, PipelineModule)
            and engine.zero_load_from_fp32_weights()):
        return False
    trained = {name for name, p in engine.module.named_parameters() if p.requires_grad}
    held = {name for name, value in engine.module.state_dict().items() if value is not None}
    return held == trained


@contextlib.contextmanager
def weights_from_partitions(engine, load_optimizer_states: bool = True, load_module_only: bool = False):
    """Around the engine's ``load_checkpoint``: under ZeRO-1/2 the module's weights are not read from the
    checkpoint's layer files but gathered from the fp32 partitions just loaded (``update_lp_params``, what
    every optimizer step does), so that a stage's data-parallel replicas do not each read its whole weights.

    Only where the partitions hold the whole module state (no frozen parameters, buffers or
    tied duplicates: :func:`_weights_in_partitions`) and are loaded; otherwise DeepSpeed reads
    the layer files as usual.
    """
    if not load_optimizer_states or load_module_only or not _weights_in_partitions(engine):
        yield
        return
    loaded = []
    load_zero = engine._load_zero_checkpoint

    def load_zero_noted(*args, **kwargs):
        loaded.append(load_zero(*args, **kwargs))
        return loaded[-1]

    # Instance attributes shadow the methods for the one load.
    engine.module.load_state_dir = lambda *args, **kwargs: None
    engine._load_zero_checkpoint = load_zero_noted
    try:
        yield
    finally:
        del engine.module.load_state_dir, engine._load_zero_checkpoint
    if loaded == [True]:
        update_weights(engine)
    elif loaded:
        raise RuntimeError(f"cpsr: rank {engine.global_rank} found no ZeRO partition files in the checkpoint it "
                           "loaded, and did not read its layer files: the module's weights are not restored")


@contextlib.contextmanager
def replicas_read_once(engine):
    """Around the engine's ``load_checkpoint``: without ZeRO a stage's data-parallel replicas load the same files
    in the same order (its layer files, and its model-states file with the whole optimizer state), so the first
    replica reads each and broadcasts it to the others in the stage's data-parallel group, rather than every
    replica reading the stage's whole state. A read that fails on the first replica fails on every one."""
    dp = data_parallel(engine)
    if dp.size == 1 or partitioned(engine):
        yield
        return
    checkpoint_engine = engine.checkpoint_engine
    load = checkpoint_engine.load
    first = dist.get_global_rank(dp.group, 0)

    def broadcast_load(path, *args, **kwargs):
        loaded = [None]
        if dp.rank == 0:
            try:
                loaded[0] = load(path, *args, **kwargs)
            except Exception as err:  # the others wait for this file: they get the error instead
                loaded[0] = err
        dist.broadcast_object_list(loaded, src=first, group=dp.group)
        if isinstance(loaded[0], Exception):
            raise loaded[0]
        return loaded[0]

    checkpoint_engine.load = broadcast_load
    try:
        yield
    finally:
        del checkpoint_engine.load


@contextlib.contextmanager
def reading_each_file_once():
    """Around DeepSpeed's ``load_checkpoint`` (the plugin's engine wraps it): a file loaded again gets what its
    first load returned.

    DeepSpeed's SDLoader loads every model-states file twice in a row: its
    ``check_ckpt_list`` reads the first file of each list whole to see its
    ``mp_world_size``, and throws it away. With pipeline layer files that is the module's
    weights read twice. The first load's result, unused by the check, serves the second
    (once); what is kept goes when the block ends.

    The first file of the list is ``mp_rank_00_model_states.pt`` on every pipeline stage,
    which without ZeRO holds stage 0's optimizer state: a later stage's rank would read it
    whole for one integer. Within the block the check reads that integer from the file's
    header instead (:func:`_check_from_header`).
    """
    from deepspeed.runtime.state_dict_factory import SDLoaderBase

    with loading.each_file_once():
        check = SDLoaderBase.check_ckpt_list
        SDLoaderBase.check_ckpt_list = lambda loader: _check_from_header(loader, check)
        try:
            yield
        finally:
            SDLoaderBase.check_ckpt_list = check


def _check_from_header(loader, check: Callable) -> None:
    """DeepSpeed's ``SDLoaderBase.check_ckpt_list`` (``check``) on the header of a file in our format: the list
    holds as many files as the first one's ``mp_world_size`` says."""
    found = read_skeleton(loader.ckpt_list[0]) if loader.ckpt_list else None
    if found is None or not isinstance(found[0], dict):
        return check(loader)
    skeleton, header_bytes = found
    loading.count_loaded(header_bytes)
    saved = skeleton.get("mp_world_size")
    if saved is not None and len(loader.ckpt_list) != saved:
        raise CheckpointError(f"{loader.ckpt_list[0]}: checkpoint count {len(loader.ckpt_list)} is different from "
                              f"saved mp_world_size {saved}")


# What DeepSpeed's _load_checkpoint keeps of a model-states file for itself (DeepSpeed 0.19.8, runtime/engine.py);
# the rest is the user's client state.
DEEPSPEED_STATES = ("module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler",
                    "random_ltd", "lr_scheduler", "optimizer")


def load_counters(engine, model_states: dict) -> dict:
    """What ``load_checkpoint`` restores besides the module and the optimizer, from ``model_states`` (a
    model-states file): the step and sample counters, skipped steps and the LR schedule; the client state.

    For a ZeRO-3 checkpoint of another data-parallel degree, whose weights and moments recovery reassembles
    itself: DeepSpeed 0.19.8 loads ZeRO-3 weights without the optimizer through zero_to_fp32.py, which reads the
    files with torch.load directly, not through the checkpoint engine."""
    if engine.lr_scheduler is not None and model_states.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(model_states["lr_scheduler"])
    engine.global_steps = model_states["global_steps"]
    engine.global_samples = model_states.get("global_samples", engine.global_steps * engine.train_batch_size())
    engine.skipped_steps = model_states["skipped_steps"]
    return {key: value for key, value in model_states.items() if key not in DEEPSPEED_STATES}
