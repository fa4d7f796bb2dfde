"""A real code corpus, byte-level, with batches that are a pure function of the iteration.

By default the corpus is the Python standard library's own source files. Files are
split into train and validation by a hash of their relative path, so the split does
not depend on which files happen to exist. Batch ``i`` is drawn from a generator
seeded with ``(seed, i, micro-batch index)``: a run restarted at iteration ``k`` sees
exactly the batches a failure-free run saw from ``k`` on, whatever happened before.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

VOCAB_SIZE = 256
DEFAULT_SUFFIXES = (".py",)
VALIDATION_EVERY = 20  # one file in 20 (by path hash) is held out


def default_corpus_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def _text_files(root: str, suffixes: tuple[str, ...] | None) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__") and not d.startswith("."))
        found += [os.path.join(dirpath, f) for f in sorted(filenames) if suffixes is None or f.endswith(suffixes)]
    return found


def load_corpus(data_dir: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Return (train, validation) byte arrays of ``data_dir`` (default: the stdlib's sources).

    With ``data_dir`` every regular file is read; binary files are the user's choice.
    """
    root = data_dir or default_corpus_dir()
    if not os.path.isdir(root):
        raise FileNotFoundError(f"corpus directory not found: {root}")
    paths = _text_files(root, DEFAULT_SUFFIXES if data_dir is None else None)
    train, valid = [], []
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        rel = os.path.relpath(path, root).encode()
        (valid if zlib.crc32(rel) % VALIDATION_EVERY == 0 else train).append(data)
    if not train or not valid:
        raise ValueError(f"corpus {root} needs at least {VALIDATION_EVERY} files for a train/validation split, found {len(paths)}")
    join = lambda parts: np.frombuffer(b"\n".join(parts), dtype=np.uint8)  # noqa: E731
    return join(train), join(valid)


@dataclass
class Batches:
    """Deterministic language-model batches over a byte corpus.

    ``micro_batches(i)`` yields this data-parallel rank's ``grad_accum`` micro-batches
    of iteration ``i``, each ``(tokens, labels)`` of shape ``[micro_batch, seq_length]``.
    """

    train: np.ndarray
    valid: np.ndarray
    seq_length: int
    micro_batch: int
    grad_accum: int
    dp_rank: int = 0
    dp_size: int = 1
    seed: int = 1234
    valid_sequences: int = 64

    def _sample(self, data: np.ndarray, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + np.arange(self.seq_length + 1)[None, :]
        window = torch.from_numpy(data[idx].astype(np.int64))
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def micro_batch_at(self, iteration: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = self.dp_rank * self.grad_accum + micro
        rng = np.random.default_rng([self.seed, iteration, index])
        starts = rng.integers(0, len(self.train) - self.seq_length - 1, size=self.micro_batch)
        return self._sample(self.train, starts)

    def micro_batches(self, iteration: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for micro in range(self.grad_accum):
            yield self.micro_batch_at(iteration, micro)

    def validation(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's share of a fixed validation set, evenly spread over the held-out split.

        Pipeline stages exchange fixed-shape activations, so every validation
        micro-batch has exactly ``micro_batch`` sequences.
        """
        per_rank = self.valid_sequences // self.dp_size // self.micro_batch
        if per_rank == 0:
            raise ValueError(f"valid_sequences={self.valid_sequences} is fewer than micro_batch x dp_size")
        span = len(self.valid) - self.seq_length - 1
        starts = np.linspace(0, span, per_rank * self.micro_batch * self.dp_size, dtype=np.int64)
        mine = starts.reshape(self.dp_size, per_rank, self.micro_batch)[self.dp_rank]
        return [self._sample(self.valid, part) for part in mine]
