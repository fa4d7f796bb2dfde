"""The replica source: without ZeRO every data-parallel replica of a stage holds the
stage's whole state, so a rank that lost its own (killed: no survivor dump) takes an
exact copy from a replica that dumped it (recovery/sources/survivor.py). Under ZeRO a
replica holds only its own optimizer partition; the lost rank's partition is not there."""

from __future__ import annotations

import torch
import torch.distributed as dist

from cpsr_ds.recovery.engine_io import MOMENTS, base_optimizer, data_parallel, partitioned

SOURCE = "replica"


def covers(engine, holders: list[bool]) -> bool:
    """Whether the stage's replicas with their dump (``holders``, by data-parallel rank) can give every other rank
    its exact state: some have one, and each holds the whole state (no ZeRO partitions)."""
    return any(holders) and not all(holders) and not partitioned(engine)


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
