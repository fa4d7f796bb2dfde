"""The checkpoint source: retained checkpoints loaded through DeepSpeed (at any data-parallel degree), each
validated (:mod:`cpsr_ds.recovery.validate`), this rank's share of each handed to the predictor as it is loaded."""

from __future__ import annotations

import logging
import math
import os
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from cpsr_ds.checkpoint.capture import rng
from cpsr_ds.checkpoint.capture.exiting import RestartCannotHelp
from cpsr_ds.checkpoint.storage import catalog
from cpsr_ds.planning.fitter import NoFit, StageCurvature, curvature_of
from cpsr_ds.recovery.agree import gathered, on_any_rank
from cpsr_ds.integration.deepspeed.engine_state import (MOMENTS, base_optimizer, load_engine_state, own_share,
                                                        stage_sums, stepped_tensors, zero3)
from cpsr_ds.integration.deepspeed.load_hooks import load_counters
from cpsr_ds.recovery.validate import problem

log = logging.getLogger(__name__)


class Retained(NamedTuple):
    """A loaded checkpoint as recovery keeps it: its iteration and the stage's xi."""

    iteration: int
    curvature: StageCurvature | NoFit  # xi of the stage's whole state (stage_sums), for the paper's cost model


# Given each valid checkpoint's iteration and this rank's share of it (own_share: the engine's own tensors, valid
# until the next load), as it is loaded: the predictor's observe, which copies it into its history. Handing
# each share over at once, instead of keeping copies until the last is loaded, holds the history once, not twice.
Keep = Callable[[int, dict[str, torch.Tensor]], None]


def load(engine, directory: str, tag: str) -> dict:
    """Load ``tag`` into the engine, at whatever data-parallel degree it was written (:func:`zero_resharded`)."""
    resharded = zero_resharded(engine, directory, tag)
    if resharded is not None and zero3(engine):
        # DeepSpeed cannot load ZeRO-3 weights of another degree from our files (load_counters says why).
        client_state = load_counters(engine, resharded.model_states)
        rng.load(engine, os.path.join(directory, tag))
    else:
        load_path, client_state = engine.load_checkpoint(directory, tag=tag, load_optimizer_states=resharded is None)
        if load_path is None:
            raise RuntimeError(f"cpsr recovery: DeepSpeed could not load checkpoint {tag} in {directory}")
    if resharded is not None:
        _restore_groups(engine, resharded.saved)
        load_engine_state(engine, resharded.state)
    return client_state or {}


class Resharded(NamedTuple):
    """A ZeRO checkpoint of another data-parallel degree: its engine_state, its first rank's base optimizer state
    (the groups' settings and step), and its model-states file."""

    state: dict[str, torch.Tensor]
    saved: dict
    model_states: dict


def zero_resharded(engine, directory: str, tag: str) -> Resharded | None:
    """Under ZeRO, a checkpoint written at another data-parallel degree (:class:`Resharded`); else None.

    DeepSpeed refuses to load ZeRO partitions into another degree. Its universal
    checkpoint would convert every checkpoint to a new folder first (ds_to_universal, a
    separate pass writing as much again); instead this reads the old ranks' partitions
    (every rank reads them all: the stage's full state in host memory, for the one load of
    a changed degree) and reassembles the full fp32 parameters and moments, which
    load_engine_state writes into the new partitions. Under ZeRO-1/2 model weights, counters
    and the LR schedule load through DeepSpeed as usual; under ZeRO-3 from the model-states file (:func:`load`).
    """
    if not engine.zero_optimization() or _same_zero_degree(engine, directory, tag):
        return None
    model_states = engine.checkpoint_engine.load(engine._get_ckpt_name(directory, tag), map_location="cpu")
    old = model_states["dp_world_size"]
    if old == engine.dp_world_size:
        return None
    log.info("cpsr recovery: checkpoint %s was written by %d data-parallel ranks, this job has %d: "
             "reassembling its ZeRO partitions", tag, old, engine.dp_world_size)
    names = engine._get_mp_rank_zero_checkpoint_names(load_dir=directory, tag=tag, mp_rank=engine.checkpoint_mp_rank,
                                                      dp_world_size=old, bf16_mode=engine.bfloat16_enabled())
    parts = [engine.checkpoint_engine.load(name, map_location="cpu")["optimizer_state_dict"] for name in names]
    if int(parts[0]["zero_stage"]) == 3:
        return Resharded(full_zero3_state(parts, model_states["param_shapes"]), parts[0]["optimizer_state_dict"],
                         model_states)
    return Resharded(full_zero_state(parts, model_states["param_shapes"]), parts[0]["base_optimizer_state"],
                     model_states)


def _same_zero_degree(engine, directory: str, tag: str) -> bool:
    """Whether ``tag`` holds a ZeRO partition file for exactly this job's data-parallel ranks: from the file
    names, so that the common restart does not read the model states file twice."""
    names = engine._get_mp_rank_zero_checkpoint_names(load_dir=directory, tag=tag, mp_rank=engine.checkpoint_mp_rank,
                                                      dp_world_size=engine.dp_world_size + 1,
                                                      bf16_mode=engine.bfloat16_enabled())
    return all(os.path.exists(name) for name in names[:-1]) and not os.path.exists(names[-1])


def _restore_groups(engine, saved: dict) -> None:
    """A ZeRO checkpoint's per-group settings (the learning rate the schedule set) and step, from one rank's
    ``saved`` base optimizer state, and zero moments for load_engine_state to fill: loaded without its
    optimizer states, the engine's Adam has none yet."""
    optimizer = base_optimizer(engine)
    for g, group in enumerate(optimizer.param_groups):
        group.update({k: v for k, v in saved["param_groups"][g].items() if k != "params"})
    step = next(iter(saved["state"].values()))["step"]  # Adam steps every group together
    for _, p in stepped_tensors(engine):
        optimizer.state[p].update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p),
                                  step=step.clone() if torch.is_tensor(step) else step)


def full_zero_state(parts: list[dict], param_shapes: list[dict]) -> dict[str, torch.Tensor]:
    """engine_state's dict from ZeRO-1/2 optimizer state dicts of every data-parallel rank, in rank order.

    Each param group is one flat tensor, cut into consecutive partitions, one per rank;
    ``param_shapes`` (the checkpoint's) names the parameters in their order in it, each
    followed by its alignment padding.
    """
    state = {}
    for g, shapes in enumerate(param_shapes):
        flat = {"param": torch.cat([p["single_partition_of_fp32_groups"][g] for p in parts])}
        for kind in MOMENTS:
            flat[kind] = torch.cat([p["base_optimizer_state"]["state"][g][kind] for p in parts])
        offset = 0
        for (name, shape), padding in zip(shapes.items(), parts[0]["param_alignment_paddings"][g]):
            n = math.prod(shape)
            for kind, t in flat.items():
                state[f"{kind}/{name}"] = t[offset:offset + n].view(shape).float().clone()
            offset += n + padding
    return state


def full_zero3_state(parts: list[dict], param_shapes: list[dict]) -> dict[str, torch.Tensor]:
    """engine_state's dict from ZeRO-3 optimizer state dicts of every data-parallel rank, in rank order.

    ZeRO-3 cuts each parameter into ceil(numel / ranks)-element partitions, one per rank (the last padded), and a
    rank's flat groups hold its partitions of the parameters consecutively, in ``param_shapes``' order (as
    DeepSpeed's zero_to_fp32.py reads them; checked against DeepSpeed 0.19.8).
    """
    flats = [{"param": torch.cat(p["fp32_flat_groups"]),
              **{kind: torch.cat([p["optimizer_state_dict"]["state"][g][kind]
                                  for g in sorted(p["optimizer_state_dict"]["state"])]) for kind in MOMENTS}}
             for p in parts]
    state, offset = {}, 0
    for shapes in param_shapes:
        for name, shape in shapes.items():
            n = math.prod(shape)
            size = math.ceil(n / len(parts))
            for kind in flats[0]:
                whole = torch.cat([flat[kind][offset:offset + size] for flat in flats])
                state[f"{kind}/{name}"] = whole[:n].view(shape).float().clone()
            offset += size
    return state


def _load_checked(engine, directory: str, tag: str | None, among=None,
                  keep: Keep | None = None) -> tuple[dict, Retained | None]:
    """Load ``tag``; (client state, what recovery keeps of it), None where a rank's share (of the ranks ``among``
    names, see :func:`on_any_rank`) fails :func:`~cpsr_ds.recovery.validate.problem`: a non-finite value, a
    negative second moment. ``tag`` None: load nothing, only join the others' check.

    Each rank reads its share only (under ZeRO its own partition: nothing is gathered), the
    shares, together the whole state, are checked each by its rank, and a valid one goes
    to ``keep``. DeepSpeed's load refuses a tensor of another shape itself.
    """
    if tag is None:
        on_any_rank(None, among)  # the data check's
        on_any_rank(None, among)  # the state check's
        return {}, None
    damaged = on_any_rank(_data_problem(directory, tag, among), among)
    if damaged is not None:
        on_any_rank(None, among)  # the ranks that decide apart from these still check their states
        log.error("cpsr recovery: checkpoint %s in %s is damaged, leaving it out: %s", tag, directory, damaged)
        return {}, None
    client_state = load(engine, directory, tag)
    share = own_share(engine, copy=False)
    kept = Retained(engine.global_steps, curvature_of(stage_sums(engine, share)))
    bad = on_any_rank(problem(share), among)
    if bad is None:
        if keep is not None:
            keep(kept.iteration, share)
        return client_state, kept
    log.error("cpsr recovery: checkpoint %s in %s has %s: leaving it out", tag, directory, bad)
    return client_state, None


def _data_problem(directory: str, tag: str, among) -> str | None:
    """What is wrong with checkpoint ``tag``'s files (checksums, finite tensors), read only once recovery is
    about to load it: the checkpoints were listed from their metadata (manifests, sizes) alone. Where every rank
    decides together (``among`` None) each reads its share of the files, and together they read each once."""
    share = (dist.get_rank(), dist.get_world_size()) if among is None and dist.is_initialized() else None
    return "; ".join(catalog.verify_data(directory, tag, share)) or None


def restore(engine, directory: str, candidates, keep: Keep | None = None) -> tuple[dict, Retained]:
    """Load the first of ``candidates`` (newest first) whose state is valid (to ``keep``); (client state, what is
    kept of it). :class:`RestartCannotHelp` where none is."""
    tags = [ck.tag for ck in candidates]
    for tag in tags:
        client_state, kept = _load_checked(engine, directory, tag, keep=keep)
        if kept is not None:
            return client_state, kept
    raise RestartCannotHelp(f"cpsr recovery: no checkpoint in {directory} has a valid state (tried "
                            f"{', '.join(tags)}; why is logged above); move them away to start from scratch")


def load_history(engine, directory: str, verified: list, n: int, keep: Keep) -> tuple[list[Retained], dict]:
    """The valid states among the ``n`` newest checkpoints, oldest first, each given to ``keep`` (this rank's
    share), and c's client state.

    c is the newest checkpoint with a valid state, and the engine is left holding it,
    the state RB-R falls back to.
    """
    window = verified[-n:]
    history, good, client_state = [], [], {}
    for ck in window:
        loaded, kept = _load_checked(engine, directory, ck.tag, keep=keep)
        if kept is not None:
            history.append(kept)
            good.append(ck)
            client_state = loaded
    if good and good[-1] is window[-1]:
        return history, client_state
    # Reloaded for the engine to hold c: kept already, unless no checkpoint of the window was valid.
    client_state, kept = restore(engine, directory, [*reversed(good), *reversed(verified[:-n])],
                                 None if history else keep)
    return history or [kept], client_state


def stage_history(engine, directory: str, own: list, n: int, stage: int, keep: Keep) -> tuple[list[Retained], dict]:
    """This stage's valid states among the ``n`` newest of ``own`` checkpoints, oldest first, each given to
    ``keep`` (this rank's share), and the newest's client state; the engine is left holding the newest valid one.

    Stages hold different numbers of checkpoints: every rank loads as often as the one
    with the most (an empty round where it has fewer), so that the checks' collectives pair up.
    """
    window = own[-n:]
    rounds = max(gathered(len(window)))
    history, client_state, newest = [], {}, None
    for ck in [None] * (rounds - len(window)) + window:
        loaded, kept = _load_checked(engine, directory, ck and ck.tag, among=stage, keep=keep)
        if kept is not None:
            history.append(kept)
            client_state, newest = loaded, ck
    if newest is not None and newest is not window[-1]:
        # Loading involves no rank beyond this stage's.
        client_state = load(engine, directory, newest.tag)
    return history, client_state
