"""The replica source: a data-parallel peer of a rank that lost its state (killed: no survivor dump) supplies
what it holds of it, from its own dump (recovery/sources/survivor.py).

Without ZeRO every replica of a stage holds the stage's whole state, so the lost rank
takes an exact copy of its parameters and Adam moments. Under ZeRO-1/2 (and bf16) a
replica holds the module's whole weights but only its own partition of the fp32 masters
and moments: the lost rank's masters come from the replica's weights (exact in fp32;
rounded to the weights' precision in bf16), and only its moments are missing, which the
next source, the predictor, supplies (by default, ``predictor.moments: keep``, c's).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cpsr_ds.integration.deepspeed.engine_state import MOMENTS, base_optimizer, data_parallel, load_local_state, local_state, partitioned

SOURCE = "replica"


def covers(engine, holders: list[bool]) -> bool:
    """Whether the stage's replicas with their dump (``holders``, by data-parallel rank) can give every other rank
    its exact state: some have one, and each holds the whole state (no ZeRO partitions)."""
    return any(holders) and not all(holders) and not partitioned(engine)


def covers_weights(engine, holders: list[bool], with_weights: list[bool]) -> bool:
    """Whether, under ZeRO partitions, the stage's replicas with their dump give every other rank its parameters:
    some have one, and a dump that holds the module's whole weights (``with_weights``, by data-parallel rank)."""
    return any(holders) and not all(holders) and partitioned(engine) and any(with_weights)


def partial_source(predictor: str) -> str:
    """The report's source of a rank whose parameters came from a replica and whose moments ``predictor`` predicted."""
    return f"{SOURCE}+{predictor}"


def copy_from_replica(engine, holder: int) -> None:
    """Every rank of the stage's data-parallel group takes data-parallel rank ``holder``'s parameters and Adam
    moments (a collective over that group; ``holder`` restored its dump before)."""
    group = data_parallel(engine).group
    src = dist.get_global_rank(group, holder)
    opt_state = base_optimizer(engine).state
    with torch.no_grad():
        for p in engine.module.parameters():
            dist.broadcast(p.data, src=src, group=group)
            for kind in MOMENTS:
                dist.broadcast(opt_state[p][kind], src=src, group=group)


def fill_partition(engine, dump, holder: int, predicted: dict[str, torch.Tensor]) -> None:
    """Under ZeRO: a rank with its ``dump`` restores it; a rank without takes its partition's fp32 masters from
    the weights in data-parallel rank ``holder``'s dump and its moments from ``predicted`` (its own partition's
    predicted state, :func:`engine_io.own_share`). A collective over the stage's data-parallel group."""
    group = data_parallel(engine).group
    src = dist.get_global_rank(group, holder)
    # Into the module's own weights, as copy_from_replica does: load_local_state refreshes them from the partitions.
    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            if dump is not None and dump.weights is not None:
                p.copy_(dump.weights[name])
            dist.broadcast(p.data, src=src, group=group)
    if dump is not None:
        load_local_state(engine, dump.state, dump.fragments)
        return
    _, fragments = local_state(engine)
    state = dict(predicted)
    for name, p in engine.module.named_parameters():
        if f"param/{name}" in predicted:  # the partition holds some of p
            start, numel = fragments.get(name, (0, p.numel()))
            state[f"param/{name}"] = p.detach().reshape(-1)[start:start + numel].float().clone()
    load_local_state(engine, state, fragments)
