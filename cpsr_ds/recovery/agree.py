"""Every rank decides alike: what one rank finds (about its stage or partition) reaches all of them."""

from __future__ import annotations

import torch.distributed as dist


def on_any_rank(local: str | None, among=None) -> str | None:
    """The first rank's non-None ``local`` (naming the rank when there are several), on every rank.

    Each rank holds its own stage or partition, so what one rank finds must make all
    of them decide alike. ``among``: only the ranks that pass the same (their pipeline
    stage, where each stage decides for itself) count.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, (among, local))
    return next((f"rank {r}: {value}" for r, (group, value) in enumerate(found)
                 if value is not None and group == among), None)


def gathered(local, group=None) -> list:
    """Every rank's ``local`` (of ``group``, default all), in rank order (just ``[local]`` without a process
    group)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [local]
    found = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, local, group=group)
    return found
