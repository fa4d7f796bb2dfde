"""A restart on another world size: what may change, and the global batch kept across it.

Each start records its layout (world size, pipeline and tensor-parallel degrees, micro-batch,
gradient accumulation) in ``DIR/cpsr_world.json``. A restart compares its own layout with
the newest record any rank sees (with node-local directories a node may hold none, or an
older one):

- a different data-parallel degree is served: the checkpoints load into it (ZeRO's
  partitions through recovery's full-tensor path), and gradient accumulation is raised or
  lowered so that micro-batch x accumulation x data-parallel degree, the global batch, stays
  the same, hence iteration i trains on the same sequences (corpus.Batches draws micro-batch
  index ``dp_rank * grad_accum + micro``, a function of the product only);
- a global batch that cannot be kept (not a multiple of micro-batch x the new degree), a
  different pipeline degree or a different tensor-parallel degree is refused with one
  :class:`WorldChangeError` naming what changed and what to do, before any engine exists.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace

from cpsr_ds.checkpoint.storage.filesystem import fs

LAYOUT = "cpsr_world.json"


class WorldChangeError(RuntimeError):
    """A restart the run directory's checkpoints cannot serve; the message says what changed and what to do."""


@dataclass(frozen=True)
class Layout:
    world_size: int
    pipeline: int
    tensor: int
    micro_batch: int
    grad_accum: int
    attempt: int = 0  # the start that recorded it

    @property
    def data_parallel(self) -> int:
        return self.world_size // (self.pipeline * self.tensor)

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.data_parallel


def batch_of(config: dict, data_parallel: int) -> tuple[int, int]:
    """(micro-batch, gradient accumulation) a DeepSpeed config gives at ``data_parallel``, resolved as DeepSpeed does."""
    total = config.get("train_batch_size")
    micro = config.get("train_micro_batch_size_per_gpu")
    accum = config.get("gradient_accumulation_steps")
    if micro is None:
        accum = accum or 1
        micro = total // (accum * data_parallel)
    elif accum is None:
        accum = 1 if total is None else total // (micro * data_parallel)
    return int(micro), int(accum)


def layout_of(config: dict, world_size: int, pipeline: int, tensor: int, attempt: int) -> Layout:
    micro, accum = batch_of(config, world_size // (pipeline * tensor))
    return Layout(world_size, pipeline, tensor, micro, accum, attempt)


def unservable(old: Layout, new: Layout) -> str | None:
    """Why checkpoints written under ``old`` cannot load into ``new``; None: they can."""
    changed = [f"{what} {a} -> {b}" for what, a, b in (("pipeline stages", old.pipeline, new.pipeline),
                                                      ("tensor-parallel degree", old.tensor, new.tensor)) if a != b]
    if changed:
        return (f"{' and '.join(changed)} (world size {old.world_size} -> {new.world_size}): a checkpoint loads "
                f"only into the pipeline and tensor-parallel degrees it was written with; restart with "
                f"{old.pipeline} pipeline stages and tensor-parallel degree {old.tensor} (a world size that is a "
                f"multiple of {old.pipeline * old.tensor}), or use another checkpoint.dir to start from scratch")
    per_rank = old.global_batch // old.micro_batch  # micro-batches per iteration, all ranks together
    if per_rank % new.data_parallel:
        fits = [d * old.pipeline * old.tensor for d in range(1, per_rank + 1) if per_rank % d == 0]
        return (f"data-parallel degree {old.data_parallel} -> {new.data_parallel} (world size {old.world_size} -> "
                f"{new.world_size}): the global batch of {old.global_batch} sequences (micro-batch {old.micro_batch} "
                f"x gradient accumulation {old.grad_accum} x {old.data_parallel} data-parallel ranks) is no multiple "
                f"of micro-batch {old.micro_batch} x {new.data_parallel}, so the run cannot keep its batches; "
                f"restart with a world size of {', '.join(map(str, fits))}, or use another checkpoint.dir to start "
                "from scratch")
    return None


def resized(old: Layout, new: Layout) -> Layout:
    """``new`` with ``old``'s micro-batch and the gradient accumulation that keeps ``old``'s global batch."""
    return replace(new, micro_batch=old.micro_batch,
                   grad_accum=old.global_batch // (old.micro_batch * new.data_parallel))


def adapt(config: dict, old: Layout | None, new: Layout) -> tuple[dict, Layout, str | None]:
    """The config and layout to start with under ``new``, after ``old``; the change made, None if none.

    Raises :class:`WorldChangeError` where ``old``'s checkpoints cannot serve ``new``. With
    the data-parallel degree unchanged the config is the user's, as it is.
    """
    if old is None:
        return config, new, None
    why = unservable(old, new)
    if why is not None:
        raise WorldChangeError(f"cpsr: the job's layout changed since its last start: {why}")
    if old.data_parallel == new.data_parallel:
        return config, new, None
    kept = resized(old, new)
    config = {**config, "train_batch_size": kept.global_batch, "train_micro_batch_size_per_gpu": kept.micro_batch,
              "gradient_accumulation_steps": kept.grad_accum}
    return config, kept, (f"data-parallel degree {old.data_parallel} -> {new.data_parallel} (world size "
                          f"{old.world_size} -> {new.world_size}): gradient accumulation {old.grad_accum} -> "
                          f"{kept.grad_accum}, keeping the global batch of {kept.global_batch} sequences")


def newest(layouts: list[Layout | None]) -> Layout | None:
    """The layout of the latest start among ``layouts`` (each rank's reading of its directory)."""
    found = [layout for layout in layouts if layout is not None]
    return max(found, key=lambda layout: layout.attempt, default=None)


def read_layout(directory: str) -> Layout | None:
    """The recorded layout; None where there is none or it cannot be read (cut short by a crash)."""
    try:
        with open(os.path.join(directory, LAYOUT)) as f:
            return Layout(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None


def write_layout(directory: str, layout: Layout) -> None:
    os.makedirs(directory, exist_ok=True)  # a node-local directory only rank 0's lock has not made yet
    fs.write_json_atomic(os.path.join(directory, LAYOUT), asdict(layout))
