"""Snapshot file format: a picklable skeleton plus the tensor bytes, checksummed on read.

A file is ``MAGIC``, the header length (8 bytes, little endian), the pickled header
``(skeleton, specs)``, zero padding to ``PAGE``, then the tensor bytes, each tensor at
an ``ALIGN``-aligned offset of the data region. The whole file is one page-aligned host
buffer, written from it with direct I/O and read straight into one, without an
intermediate copy. Files
without ``MAGIC`` are read with ``torch.load`` (checkpoints of DeepSpeed's own engine).
"""

from __future__ import annotations

import copy
import os
import pickle
import struct
from dataclasses import dataclass
from typing import Any, Optional

import torch
import xxhash

MAGIC = b"CPSRSNP2"
ALIGN = 64
# Direct I/O needs page-aligned file offsets, so the data region starts on a page.
PAGE = 4096
_READ_CHUNK = 64 << 20


class CheckpointError(RuntimeError):
    """A checkpoint file or directory that must not be loaded; the message names it."""


@dataclass(frozen=True)
class TensorSpec:
    dtype: str
    shape: tuple
    offset: int
    nbytes: int


def new_hasher(algorithm: str):
    return getattr(xxhash, algorithm)()


def align(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def file_prefix(header: bytes) -> bytes:
    """Everything in a snapshot file before the data region."""
    head = MAGIC + struct.pack("<Q", len(header)) + header
    return head + bytes(align(len(head), PAGE) - len(head))


class TensorRef:
    """Placeholder for the ``index``-th tensor in a flattened skeleton."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __reduce__(self):
        return TensorRef, (self.index,)


def _dense(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor) and obj.layout == torch.strided and obj.device.type != "meta"


def flatten(obj: Any, tensors: Optional[list] = None) -> tuple[Any, list[torch.Tensor]]:
    """(skeleton, tensors): ``obj`` with every dense tensor replaced by a ``TensorRef`` to its index."""
    tensors = [] if tensors is None else tensors
    if _dense(obj):
        tensors.append(obj)
        return TensorRef(len(tensors) - 1), tensors
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = flatten(v, tensors)[0]
        return out, tensors
    if isinstance(obj, list):
        return [flatten(v, tensors)[0] for v in obj], tensors
    if isinstance(obj, tuple):
        items = [flatten(v, tensors)[0] for v in obj]
        return (type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)), tensors
    return obj, tensors


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(skeleton, TensorRef):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        for k, v in skeleton.items():
            skeleton[k] = unflatten(v, tensors)
        return skeleton
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    if isinstance(skeleton, tuple):
        items = [unflatten(v, tensors) for v in skeleton]
        return type(skeleton)(*items) if hasattr(skeleton, "_fields") else type(skeleton)(items)
    return skeleton


def layout(tensors: list[torch.Tensor]) -> tuple[list[TensorSpec], int]:
    """Aligned byte offsets of ``tensors`` in one arena, and the arena's size."""
    specs, pos = [], 0
    for t in tensors:
        pos = align(pos)
        nbytes = t.numel() * t.element_size()
        specs.append(TensorSpec(str(t.dtype).removeprefix("torch."), tuple(t.shape), pos, nbytes))
        pos += nbytes
    return specs, pos


def tensor_from_bytes(data: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    dtype = getattr(torch, spec.dtype)
    return data[spec.offset:spec.offset + spec.nbytes].view(dtype).view(spec.shape)


def read_snapshot(path: str, expect: Optional[dict] = None, algorithm: str = "xxh3_64",
                  map_location: Any = None) -> Any:
    """Load a snapshot file or, without our magic, a ``torch.save`` file.

    ``expect`` is the file's manifest entry (``size``, ``digest``); when given, the bytes
    read are hashed and a mismatch raises :class:`CheckpointError` naming the file.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if expect is not None and size != expect["size"]:
            raise CheckpointError(f"{path}: truncated or overwritten: {size} bytes, manifest says {expect['size']}")
        head = f.read(16)
        if head[:8] != MAGIC:
            if expect is not None:
                check_digest(path, hash_file(f, algorithm, head), expect)
            f.seek(0)
            return torch.load(f, map_location=map_location, weights_only=False)
        hasher = new_hasher(algorithm)
        hasher.update(head)
        (hlen,) = struct.unpack("<Q", head[8:16])
        rest = f.read(align(16 + hlen, PAGE) - 16)
        hasher.update(rest)
        if len(rest) < hlen:
            raise CheckpointError(f"{path}: truncated header")
        skeleton, specs = pickle.loads(rest[:hlen])
        data = torch.empty(size - align(16 + hlen, PAGE), dtype=torch.uint8)
        buf = data.numpy()
        pos = 0
        while pos < len(buf):
            n = f.readinto(memoryview(buf[pos:pos + _READ_CHUNK]))
            if not n:
                raise CheckpointError(f"{path}: truncated data region")
            hasher.update(buf[pos:pos + n])
            pos += n
    if expect is not None:
        check_digest(path, hasher.hexdigest(), expect)
    tensors = [_to_location(tensor_from_bytes(data, s), map_location) for s in specs]
    return unflatten(skeleton, tensors)


def _to_location(t: torch.Tensor, map_location: Any) -> torch.Tensor:
    # Callables and dicts are DeepSpeed's "keep on CPU" idioms; devices are honoured.
    if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type != "cpu":
        return t.to(map_location)
    return t


def hash_file(f, algorithm: str, already: bytes = b"") -> str:
    hasher = new_hasher(algorithm)
    hasher.update(already)
    while chunk := f.read(_READ_CHUNK):
        hasher.update(chunk)
    return hasher.hexdigest()


def check_digest(path: str, digest: str, expect: dict) -> None:
    if digest != expect["digest"]:
        raise CheckpointError(f"{path}: checksum mismatch (corrupt): {digest} != manifest {expect['digest']}")
