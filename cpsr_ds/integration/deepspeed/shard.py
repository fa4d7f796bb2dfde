"""Data-parallel shares of a stage's state (Section III-B: DP-group sharding).

The DP data-parallel replicas of a pipeline stage hold the same state, so the
predictor's work on it (its history, training, held-out check and the prediction
at recovery) is split among them: each replica owns an even, contiguous slice of
every flattened tensor, the last one taking the remainder. A share keeps the
state's keys; its values are 1-D slices. Pure torch: the collectives that move
shares between ranks are the caller's.
"""

from __future__ import annotations

import math

import torch


def span(numel: int, rank: int, size: int) -> slice:
    """The elements ``rank`` of ``size`` owns of a flattened tensor of ``numel`` values."""
    if not 0 <= rank < size:
        raise ValueError(f"data-parallel rank {rank} is not in 0..{size - 1}")
    even = numel // size
    return slice(rank * even, numel if rank == size - 1 else (rank + 1) * even)


def _length(numel: int, rank: int, size: int) -> int:
    s = span(numel, rank, size)
    return s.stop - s.start


def share(state: dict[str, torch.Tensor], rank: int, size: int, copy: bool = True) -> dict[str, torch.Tensor]:
    """``rank``'s share of ``state``, copied so that the full tensors can go (``copy`` False: views of them);
    ``state`` itself for one rank."""
    if size == 1:
        return state
    views = {k: t.reshape(-1)[span(t.numel(), rank, size)] for k, t in state.items()}
    return {k: t.clone() for k, t in views.items()} if copy else views


def shapes_of(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(t.shape) for k, t in state.items()}


def assemble(shares: list[dict[str, torch.Tensor]], shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The full state from every rank's share, in rank order (the inverse of :func:`share`)."""
    if len(shares) == 1:
        return {k: shares[0][k].reshape(shape) for k, shape in shapes.items()}
    return {k: torch.cat([s[k] for s in shares]).view(shape) for k, shape in shapes.items()}


def packed_length(shapes: dict[str, tuple[int, ...]], rank: int, size: int) -> int:
    """How many values ``rank``'s share of a state of ``shapes`` packs into (:func:`pack`)."""
    return sum(_length(math.prod(shape), rank, size) for shape in shapes.values())


def pack(own: dict[str, torch.Tensor]) -> torch.Tensor:
    """A share as one float32 vector, keys in sorted order: one buffer for a collective."""
    return torch.cat([own[k].reshape(-1).float() for k in sorted(own)])


def unpack(flat: torch.Tensor, shapes: dict[str, tuple[int, ...]], rank: int, size: int) -> dict[str, torch.Tensor]:
    """``rank``'s share from :func:`pack`'s vector (views of ``flat``), given the full state's ``shapes``."""
    out, offset = {}, 0
    for k in sorted(shapes):
        length = _length(math.prod(shapes[k]), rank, size)
        out[k] = flat[offset:offset + length]
        offset += length
    return out
