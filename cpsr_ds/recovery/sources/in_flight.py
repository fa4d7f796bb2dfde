"""The in-flight source: the parameters of the checkpoint c' that was still persisting when the job failed.

A failure while checkpoint c' persists loses c' as a checkpoint: the newest committed one is c,
T_c iterations older, and recomputing redoes c..f. But each rank's writer records every file
as it lands (``progress_record.record_progress``: size and digest), and DeepSpeed's pipeline engine saves
a stage's layer files (its parameters) before the file with the optimizer's state, so the
parameters of c' are on storage, whole and checkable, well before c' commits (on the benchmark
model after a third of the persist: 0.56 of 1.67 MB). Where every rank finds its stage's layer
files of c' landed and sound, c < c' <= f, recomputing may start at c' with c''s parameters and
c's optimizer state, its step counters and learning rate schedule moved on to c': the iterations
c..c' are not redone, at the price of Adam's moments c' - c iterations old, which training
heals as it heals a predicted state's error. Not exact, so ``recovery.mode: recompute`` never
takes it.

Only where the optimizer steps the module's own parameters: under ZeRO or with fp16/bf16
master weights the layer files hold a copy in the module's precision, not the state the
optimizer steps. Only with shared storage (every rank sees the same tags) and a full cut
(not ``checkpoint.per_stage``).
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import torch

from cpsr_ds.checkpoint.storage import catalog, progress_record
from cpsr_ds.checkpoint.storage.fileformat import CheckpointError, read_snapshot
from cpsr_ds.config import CheckpointConfig
from cpsr_ds.recovery.agree import gathered
from cpsr_ds.integration.deepspeed.engine_state import advance_counters, base_optimizer, partitioned
from cpsr_ds.recovery.sources import Ahead
from cpsr_ds.recovery.validate import problem, specs_of

log = logging.getLogger(__name__)

SOURCE = "in flight"


class Landed(NamedTuple):
    """This rank's stage's parameters in checkpoint ``tag`` at ``iteration``: each layer's state dict, read
    and checked against the rank progress records' digests."""

    iteration: int
    tag: str
    layers: dict[int, dict]  # the pipeline module's local layer index -> its state dict


def ahead(cfg: CheckpointConfig, engine, c: int, f: int | None) -> Ahead | None:
    """The newest checkpoint c < c' <= f that is not committed but whose layer files every rank found landed
    and sound, as the state recomputing starts from; None on every rank where there is none (a collective,
    unless the config or f, the same on every rank, rule it out)."""
    if f is None or cfg.storage != "shared" or cfg.per_stage:
        return None
    tags = candidates(cfg.dir, c, f)
    if tags and not steps_module_parameters(engine):  # the same on every rank
        log.info("cpsr recovery: the parameters of checkpoint %s, which was persisting when the job failed, are not "
                 "used: the optimizer does not step the module's own parameters (ZeRO, or fp16/bf16 master "
                 "weights)", tags[0][0])
        return None
    for tag, iteration in tags:
        found, problem = read_layers(engine, os.path.join(cfg.dir, tag), iteration, tag)
        problems = [p for p in gathered(problem) if p is not None]
        if not problems:
            return Ahead(iteration, SOURCE, lambda engine, c: resume(engine, found, c))
        log.info("cpsr recovery: the parameters of checkpoint %s, which was persisting when the job failed, are "
                 "not used: %s", tag, problems[0])
    return None


def steps_module_parameters(engine) -> bool:
    """Whether the optimizer steps the module's own parameter tensors, which the layer files then hold exactly."""
    if partitioned(engine):
        return False
    stepped = {id(p) for group in base_optimizer(engine).param_groups for p in group["params"]}
    return all(id(p) in stepped for p in engine.module.parameters() if p.requires_grad)


def candidates(directory: str, c: int, f: int) -> list[tuple[str, int]]:
    """(tag, iteration) of the uncommitted checkpoints of ours after c, up to f, newest first."""
    found = [(ck.tag, ck.iteration) for ck in catalog.scan(directory)
             if ck.kind == "cpsr" and not ck.committed and ck.iteration is not None and c < ck.iteration <= f]
    return sorted(found, key=lambda t: t[1], reverse=True)


def read_layers(engine, tag_dir: str, iteration: int, tag: str) -> tuple[Landed | None, str | None]:
    """(this rank's stage's layers of the checkpoint in ``tag_dir``, None) or (None, why they are not usable: not
    landed, damaged, or, checked as every source's state is (:mod:`cpsr_ds.recovery.validate`), a tensor not
    finite or not of the shape and dtype of the layer's own)."""
    landed = progress_record.landed_files(tag_dir)
    module = engine.module
    layers = {}
    for index, layer in enumerate(module.forward_funcs):
        if not hasattr(layer, "load_state_dict"):  # DeepSpeed's load_state_dir skips these too
            continue
        path = module.ckpt_layer_path(tag_dir, index)
        rel = os.path.relpath(path, tag_dir)
        if rel not in landed:
            return None, f"rank {engine.global_rank}'s layer file {rel} had not landed"
        if landed[rel].entry.get("nonfinite"):
            return None, f"{path} holds non-finite values ({', '.join(landed[rel].entry['nonfinite'][:3])})"
        try:
            layers[index] = read_snapshot(path, landed[rel].entry, landed[rel].algorithm, map_location="cpu")
        except (CheckpointError, OSError) as err:
            return None, str(err)
        bad = problem(tensors(layers[index]), specs_of(tensors(layer.state_dict())))
        if bad is not None:
            return None, f"{path} holds {bad}"
    return Landed(iteration, tag, layers), None


def tensors(state) -> dict:
    """The tensors of a layer's state dict (megatron-core's layers keep ``_extra_state`` entries that are not);
    a file that holds no state dict has none."""
    return {k: v for k, v in state.items() if torch.is_tensor(v)} if isinstance(state, dict) else {}


def resume(engine, found: Landed, c: int) -> int:
    """Write the landed parameters into the engine, which holds checkpoint c, with the counters of their
    iteration; that iteration."""
    for index, state in found.layers.items():
        engine.module.forward_funcs[index].load_state_dict(state, strict=True)
    # As DeepSpeed's load_state_dir ends: each tied weight from the stage that owns it (a collective over ties).
    engine.module._synchronize_tied_weights()
    advance_counters(engine, found.iteration - c)
    # Not exact (Adam's moments are c's): the random-number state stays c's, loaded with it.
    log.info("cpsr recovery: parameters of iteration %d from checkpoint %s, which was persisting when the job "
             "failed; Adam's moments of iteration %d", found.iteration, found.tag, c)
    return found.iteration
