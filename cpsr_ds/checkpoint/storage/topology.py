"""Which ranks share a checkpoint directory: one node is the set of ranks that see each other's files.

:func:`verify_storage` finds the nodes at start, where collectives are safe: every rank
leaves a token in its checkpoint directory and reports whose it sees. A ``shared``
directory that is not shared by every rank is refused, naming ``checkpoint.storage``.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from cpsr_ds.checkpoint.storage import replica
from cpsr_ds.checkpoint.storage.filesystem import fs
from cpsr_ds.config import CheckpointConfig, ConfigError

log = logging.getLogger(__name__)

TOKENS = ".cpsr_ranks"  # hidden: no scan or retention looks at it


@dataclass(frozen=True)
class Nodes:
    """The ranks sharing each checkpoint directory, nodes ordered by their lowest rank; ``run``: this start's id."""

    groups: tuple[tuple[int, ...], ...]
    run: str = ""

    @staticmethod
    def single(world_size: int) -> "Nodes":
        return Nodes((tuple(range(world_size)),))

    @property
    def world_size(self) -> int:
        return sum(map(len, self.groups))

    def node_of(self, rank: int) -> int:
        return next(n for n, group in enumerate(self.groups) if rank in group)

    def ranks(self, node: int) -> tuple[int, ...]:
        return self.groups[node % len(self.groups)]

    def leads(self, rank: int) -> bool:
        """Whether ``rank`` is its node's lowest, the one that writes the node's commit records and ``latest``."""
        return rank == self.ranks(self.node_of(rank))[0]


_nodes: dict[str, Nodes] = {}  # by checkpoint directory, as verify_storage found them


def _token_path(ckpt_dir: str, rank: int) -> str:
    return os.path.join(ckpt_dir, TOKENS, f"rank{rank:05d}")


def _seen(ckpt_dir: str, run: str, world_size: int) -> list[int]:
    """The ranks whose token of this start ``ckpt_dir`` holds."""
    found = []
    for r in range(world_size):
        try:
            with open(_token_path(ckpt_dir, r)) as f:
                if f.read() == run:
                    found.append(r)
        except OSError:
            continue
    return found


def group_nodes(seen: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    """The nodes from which ranks each rank sees; raises ValueError where sharing is not mutual."""
    groups = sorted({tuple(s) for s in seen})
    for rank, s in enumerate(seen):
        if rank not in s or any(seen[other] != s for other in s):
            raise ValueError(f"rank {rank} sees the files of ranks {s}, which do not all see the same")
    return tuple(groups)


def check_nodes(storage: str, ckpt_dir: str, seen: list[list[int]], run: str) -> Nodes:
    """The nodes the ranks' views of ``ckpt_dir`` make, or a ConfigError naming ``checkpoint.storage``."""
    world = len(seen)
    try:
        nodes = Nodes(group_nodes(seen), run)
    except ValueError as err:
        raise ConfigError(f"cpsr.checkpoint.storage: the checkpoint directories {ckpt_dir} are neither shared "
                          f"nor one per node: {err}") from None
    if storage == "shared" and len(nodes.groups) > 1:
        blind = next(r for r, s in enumerate(seen) if len(s) < world)
        raise ConfigError(f"cpsr.checkpoint.storage is shared, but the checkpoint directory {ckpt_dir} is not "
                          f"shared by every rank: rank {blind} sees the files of ranks {seen[blind]} only, of "
                          f"{world}; set checkpoint.storage to node_local for a directory on each node's own disk")
    return nodes


def verify_storage(cfg: CheckpointConfig) -> Nodes:
    """Collective: every rank leaves a token in its checkpoint directory and reports whose it sees."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        nodes = Nodes.single(1)
    else:
        rank, world = dist.get_rank(), dist.get_world_size()
        box = [uuid.uuid4().hex if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        run = box[0]
        path = _token_path(cfg.dir, rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fs.write_atomic(path, [run.encode()])
        dist.barrier()
        seen: list = [None] * world
        dist.all_gather_object(seen, _seen(cfg.dir, run, world))
        nodes = check_nodes(cfg.storage, cfg.dir, seen, run)
        if cfg.storage == "node_local" and len(nodes.groups) > 1:
            replica.open_channel()
    _nodes[cfg.dir] = nodes
    log.info("cpsr: checkpoint storage %s, %d node(s): %s", cfg.storage, len(nodes.groups),
             "; ".join(f"ranks {list(g)}" for g in nodes.groups))
    return nodes


def found_nodes(ckpt_dir: str) -> Optional[Nodes]:
    """The nodes :func:`verify_storage` found for ``ckpt_dir`` in this process; None before."""
    return _nodes.get(ckpt_dir)
