"""Snapshot: copy the tensors DeepSpeed hands to ``save()`` into reusable host buffers.

``flatten`` splits a state dict into a picklable skeleton (plain python objects,
captured at once) and its tensors. Each file gets one page-aligned byte arena holding
the whole file (header, then tensor bytes), allocated on first use and reused by
later checkpoints of the same shapes; with CUDA it is pinned and filled through a
side stream. The copy runs on a copier thread, so ``save()`` returns at once; the
training side blocks only in ``wait`` before the optimizer step would overwrite what
is still being copied. Writers write the arena to storage as it is, chunk by chunk,
each chunk as soon as it is copied (``SnapshotFile.chunks``), and once it is copied
check it for NaN and Inf (``SnapshotFile.nonfinite``), off the training path.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np
import torch

from cpsr_ds.checkpoint.storage.fileformat import (PAGE, TensorSpec, file_prefix, flatten, layout, nonfinite_tensors,
                                           tensor_from_bytes)


@dataclass(frozen=True)
class Piece:
    """Bytes [src_start, src_end) of tensor ``index`` go to the arena at ``dst``; after it, arena bytes below ``ready`` are final."""

    index: int
    src_start: int
    src_end: int
    dst: int
    ready: int


def plan(specs: list[TensorSpec], total: int, chunk_bytes: Optional[int], base: int = 0) -> list[Piece]:
    """Copy pieces in data order, cut at every ``chunk_bytes`` boundary of the file (data starts at ``base``)."""
    cuts = []
    for i, s in enumerate(specs):
        start = 0
        while start < s.nbytes:
            end = s.nbytes
            if chunk_bytes:
                end = min(end, ((base + s.offset + start) // chunk_bytes + 1) * chunk_bytes - base - s.offset)
            cuts.append((i, start, end, s.offset + start))
            start = end
    starts = [c[3] for c in cuts[1:]] + [total]
    return [Piece(i, a, b, d, r) for (i, a, b, d), r in zip(cuts, starts)]


class HostBuffers:
    """Byte arenas kept across checkpoints, one per file name; pinned when CUDA is there."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.allocations = 0
        self._arenas: dict[str, torch.Tensor] = {}
        self._used: set[str] = set()

    def get(self, key: str, nbytes: int) -> torch.Tensor:
        """``nbytes`` starting on a page boundary, as direct I/O requires."""
        arena = self._arenas.get(key)
        if arena is None or arena.numel() < nbytes:
            raw = torch.empty(nbytes + PAGE, dtype=torch.uint8, pin_memory=self.pin)
            start = -raw.data_ptr() % PAGE
            arena = raw[start:start + nbytes]
            self._arenas[key] = arena
            self.allocations += 1
        self._used.add(key)
        return arena[:nbytes]

    def drop_unused(self) -> None:
        """Free arenas no file of the last checkpoint used, so a changed file set does not leak."""
        self._arenas = {k: v for k, v in self._arenas.items() if k in self._used}
        self._used = set()


class SnapshotFile:
    """One file being copied into its arena (``prefix`` first, then the tensors); writers stream it with ``chunks``."""

    def __init__(self, rel: str, skeleton: Any, specs: list[TensorSpec], prefix: bytes, arena: torch.Tensor,
                 tensors: list[torch.Tensor], pieces: list[Piece], chunk_bytes: Optional[int]):
        self.rel = rel
        self._skeleton = skeleton
        self._specs = specs
        self.file = arena
        self.nbytes = arena.numel()
        self.base = len(prefix)
        arena[:self.base].numpy()[:] = np.frombuffer(prefix, dtype=np.uint8)
        self.arena = arena[self.base:]
        self.chunk_bytes = chunk_bytes or self.nbytes
        self._tensors = tensors
        self._pieces = pieces
        self._ready = 0
        self._finished = False
        self._error: Optional[BaseException] = None
        self._cond = threading.Condition()

    def copy(self, stream) -> None:
        """Run on the copier thread: fill the arena piece by piece, publishing progress."""
        try:
            sources = {}
            for p in self._pieces:
                if p.index not in sources:
                    sources[p.index] = self._tensors[p.index].contiguous().reshape(-1)
                src = sources[p.index]
                # Typed copies run at memory speed; byte-wise ones are several times slower.
                # Piece bounds are multiples of ALIGN, hence of every element size.
                size = src.element_size()
                src = src[p.src_start // size:p.src_end // size]
                dst = self.arena[p.dst:p.dst + p.src_end - p.src_start].view(src.dtype)
                if stream is not None and src.is_cuda:
                    with torch.cuda.stream(stream):
                        dst.copy_(src, non_blocking=True)
                    stream.synchronize()
                else:
                    dst.copy_(src)
                self._publish(p.ready)
        except BaseException as err:
            self._error = err
        finally:
            self._tensors = None
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    def _publish(self, ready: int) -> None:
        with self._cond:
            self._ready = ready
            self._cond.notify_all()

    def wait(self, upto: Optional[int] = None) -> None:
        """Block until arena bytes below ``upto`` (default: all) are copied; re-raise a copy error."""
        error = self._wait(upto)
        if error is not None:
            raise error

    def wait_quietly(self) -> None:
        """Block until the copy is over, successful or not (its error reaches training through ``wait``)."""
        self._wait(None)

    def _wait(self, upto: Optional[int]) -> Optional[BaseException]:
        with self._cond:
            self._cond.wait_for(lambda: self._finished or (upto is not None and self._ready >= upto))
            return self._error

    def chunks(self) -> Iterator:
        """The file's bytes in order, each chunk of the arena yielded as soon as it is copied."""
        data = self.file.numpy()
        for start in range(0, self.nbytes, self.chunk_bytes):
            end = min(start + self.chunk_bytes, self.nbytes)
            self.wait(end - self.base)
            yield data[start:end]

    def nonfinite(self) -> list[str]:
        """Key paths of the floating tensors holding NaN or Inf, read from the arena once the copy is complete."""
        self.wait()
        return nonfinite_tensors(self._skeleton, [tensor_from_bytes(self.arena, s) for s in self._specs])


class Copier:
    """One thread running snapshot copies in submission order."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._last: Optional[SnapshotFile] = None
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self._thread = threading.Thread(target=self._run, name="cpsr-snapshot", daemon=True)
        self._thread.start()

    def submit(self, snap: SnapshotFile) -> None:
        if self._stream is not None:
            # The side stream must not read state before the compute stream finished writing it.
            self._stream.wait_stream(torch.cuda.current_stream())
        self._last = snap
        self._queue.put(snap)

    def wait_all(self) -> None:
        """Block until every submitted copy finished (copies run in order, so the last one suffices)."""
        if self._last is not None:
            self._last.wait()

    def _run(self) -> None:
        for snap in iter(self._queue.get, None):
            snap.copy(self._stream)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()


def snapshot_file(rel: str, state: Any, buffers: HostBuffers, chunk_bytes: Optional[int]) -> SnapshotFile:
    """Capture ``state`` for file ``rel``: skeleton pickled now (a type reading it back would refuse raises
    CheckpointError), tensors to be copied into ``buffers``."""
    skeleton, tensors = flatten(state)
    specs, total = layout(tensors)
    prefix = file_prefix(rel, skeleton, specs)
    arena = buffers.get(rel, len(prefix) + total)
    pieces = plan(specs, total, chunk_bytes, len(prefix))
    return SnapshotFile(rel, skeleton, specs, prefix, arena, tensors, pieces, chunk_bytes)
