"""A rank's random-number state, saved with every state recovery resumes exactly and restored with it.

Dropout draws from torch's generators, so recomputing from a checkpoint reproduces the uninterrupted run
only where each rank's generators are where they were at the checkpoint: torch's CPU generator, the CUDA
generators where CUDA is in use, numpy's and Python's global ones, and the pipeline module's
``micro_offset`` (DeepSpeed's ``seed_layers`` reseeds every layer's forward pass from it; megatron-core's
CUDA RNG tracker, which the GPT reseeds there too, then needs nothing of its own).

The state is recorded right after each optimizer step (:func:`record`, under the survivor dump's state
lock): what the next iteration starts from. A checkpoint, host snapshot or survivor dump of iteration i
saves the record of i (:func:`recorded`), never a capture taken half-way through iteration i + 1's forward
passes. It holds tensors, ints, floats, str, lists and dicts only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import weakref
from typing import Iterator, Optional

import numpy as np
import torch

log = logging.getLogger(__name__)

# Each engine's record of its last optimizer step, kept beside the engine rather than on it, by the engine's
# module (the same through a weak proxy of the engine, which cannot be a key).
_RECORDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def file_name(rank: int) -> str:
    """This rank's file of random-number state in a checkpoint's tag directory."""
    return f"cpsr_rng_rank{rank:05d}.pt"


def _numpy_state() -> dict:
    algorithm, keys, pos, has_gauss, cached = np.random.get_state()
    return {"algorithm": algorithm, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def _python_state() -> dict:
    version, internal, gauss_next = random.getstate()
    return {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": [] if gauss_next is None else [gauss_next]}


def capture(module=None) -> dict:
    """The process's random-number state (and ``module``'s micro_offset, where it has one)."""
    state = {"torch": torch.get_rng_state(), "numpy": _numpy_state(), "python": _python_state()}
    # Only where CUDA is in use: asking an uninitialised CUDA for its state would initialise it.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if hasattr(module, "micro_offset"):
        state["micro_offset"] = int(module.micro_offset)
    return state


def restore(state: dict, module=None) -> None:
    """Set the generators (and ``module``'s micro_offset) to ``state``, as :func:`capture` took it."""
    # Copies: the generators read a state from the start of its storage, and a snapshot file's tensors are
    # views into one buffer (fileformat.read_snapshot).
    torch.set_rng_state(state["torch"].clone())
    if "cuda" in state and torch.cuda.is_available():
        for device, cuda_state in zip(range(torch.cuda.device_count()), state["cuda"]):
            torch.cuda.set_rng_state(cuda_state.clone(), device)
    numpy = state["numpy"]
    np.random.set_state((numpy["algorithm"], numpy["keys"].numpy().astype(np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["cached_gaussian"]))
    python = state["python"]
    random.setstate((python["version"], tuple(python["internal"].tolist()), (python["gauss_next"] or [None])[0]))
    if "micro_offset" in state and hasattr(module, "micro_offset"):
        module.micro_offset = state["micro_offset"]


@contextlib.contextmanager
def preserved(module=None) -> Iterator[None]:
    """The block leaves the random-number state as it found it (evaluation between iterations, which a
    restart does not redo, must not move the training's streams)."""
    state = capture(module)
    try:
        yield
    finally:
        restore(state, module)


def record(engine) -> dict:
    """Record (and return) the engine's state now, as the one of its ``global_steps``."""
    state = {"iteration": int(engine.global_steps), **capture(engine.module)}
    _RECORDS[engine.module] = state
    return state


def recorded(engine) -> Optional[dict]:
    """The state recorded for the engine's current iteration; None where there is none (no step since the
    engine's state last changed otherwise)."""
    state = _RECORDS.get(engine.module)
    return state if state is not None and state["iteration"] == engine.global_steps else None


def resume(engine, state: Optional[dict], source: str) -> None:
    """Restore ``state`` (:func:`record`'s, from ``source``, for the log) into the engine, and keep it as the
    record of its iteration; None: the streams go on from this process's own (logged)."""
    if state is None:
        log.warning("cpsr: rank %d: %s holds no random-number state; dropout and other random draws continue "
                    "from this process's own, not the uninterrupted run's", engine.global_rank, source)
        return
    restore(state, engine.module)
    _RECORDS[engine.module] = state


def save(engine, tag_dir: str) -> None:
    """Hand this rank's recorded state to the engine's checkpoint engine, as a file of the checkpoint being
    saved into ``tag_dir`` (between DeepSpeed's save_checkpoint and the commit)."""
    state = recorded(engine) or record(engine)
    engine.checkpoint_engine.save({**state, "world_size": engine.world_size},
                                  os.path.join(tag_dir, file_name(engine.global_rank)))


def load(engine, tag_dir: str) -> None:
    """Restore this rank's state saved with the checkpoint in ``tag_dir``, verified as its other files are; a
    checkpoint without one (older, or of another world size) leaves the streams as they are (logged)."""
    path = os.path.join(tag_dir, file_name(engine.global_rank))
    state = engine.checkpoint_engine.load(path, map_location="cpu") if os.path.exists(path) else None
    if state is not None and state.pop("world_size") != engine.world_size:
        state = None
    resume(engine, state, f"checkpoint {os.path.basename(tag_dir)} for a job of this world size")
