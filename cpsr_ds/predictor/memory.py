"""The learning predictor's memory on its device and its cap, ``predictor.memory_mb`` (Sec. III-B, VI-C4: < 200 MB).

The footprint is the network's weights, the optimizer's state, the samples on the
device and the activations of one batch: what one training step allocates beyond
its samples, counted tensor by tensor (:func:`allocated_bytes`; every allocation
counted, none subtracted when freed, so an upper bound of what is alive at once).
Where the whole history of the predicted kinds fits under the cap with a full
batch, the samples live on the device (on CPU that is host memory and nothing is
copied); above it they are kept in host memory and streamed in batches of the most
chunks that fit (:func:`fit`). A batch smaller than the trainer's is a micro-batch:
the gradient of the full batch is summed over them, equal to the full batch's but
for float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

MIB = 2**20


class MemoryCapError(ValueError):
    """predictor.memory_mb leaves no room for one batch of one chunk."""


@dataclass(frozen=True)
class Footprint:
    """Bytes on the predictor's device; ``batch``: chunks per (micro-)batch; ``streamed``: samples from host memory."""

    weights: int
    optimizer: int
    samples: int
    activations: int
    batch: int
    streamed: bool

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.samples + self.activations

    def describe(self) -> str:
        return (f"weights {self.weights / MIB:.2f} MiB + optimizer state {self.optimizer / MIB:.2f} MiB + samples "
                f"{self.samples / MIB:.2f} MiB + activations {self.activations / MIB:.2f} MiB = "
                f"{self.total / MIB:.2f} MiB")


@dataclass(frozen=True)
class Costs:
    """What the footprint is made of: fixed bytes and bytes per chunk of a batch."""

    weights: int
    optimizer: int
    step_fixed: int  # a training step's allocations that do not grow with the batch (gradients, the update)
    step_per_chunk: int  # and those that do (the activations of one chunk)
    sample_per_chunk: int  # one chunk's inputs and target


def fit(costs: Costs, cap_bytes: float, batch_chunks: int, history_bytes: int) -> Footprint:
    """The footprint under ``cap_bytes``: samples resident if the ``history_bytes`` of samples fit with a batch of
    ``batch_chunks``, else streamed in the largest batch that fits; :class:`MemoryCapError` if one chunk does not."""
    base = costs.weights + costs.optimizer + costs.step_fixed

    def footprint(batch: int, streamed: bool) -> Footprint:
        samples = batch * costs.sample_per_chunk if streamed else history_bytes
        return Footprint(costs.weights, costs.optimizer, samples,
                         costs.step_fixed + batch * costs.step_per_chunk, batch, streamed)

    resident = footprint(batch_chunks, False)
    if resident.total <= cap_bytes:
        return resident
    per_chunk = costs.step_per_chunk + costs.sample_per_chunk
    batch = min(batch_chunks, int((cap_bytes - base) // per_chunk))
    if batch < 1:
        raise MemoryCapError(f"predictor.memory_mb ({cap_bytes / MIB:g} MiB) is below what vitp needs with batches "
                             f"of one chunk: {footprint(1, True).describe()}")
    return footprint(batch, True)


class _Allocations(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        # A view or an in-place result shares its input's storage: nothing new.
        self.bytes += sum(t.untyped_storage().nbytes() for t in tree_leaves(out)
                          if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs)
        return out


def allocated_bytes(run: Callable[[], object]) -> int:
    """Bytes of every tensor storage ``run()`` allocates (its backward pass included), freed or not."""
    mode = _Allocations()
    with mode:
        run()
    return mode.bytes


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
