"""Snapshot file format: a picklable skeleton plus the tensor bytes, checksummed on read.

A file is ``MAGIC``, the header length (8 bytes, little endian), the pickled header
``(skeleton, specs)``, zero padding to ``PAGE``, then the tensor bytes, each tensor at
an ``ALIGN``-aligned offset of the data region. The whole file is one page-aligned host
buffer, written from it with direct I/O and read straight into one, without an
intermediate copy. Files
without ``MAGIC`` are read with ``torch.load(weights_only=True)`` (checkpoints of
DeepSpeed's own engine). The header is unpickled only once the checksum over the whole
file matched (where a manifest gives one), and only ever with allowlist.py's unpickler,
which refuses every global but the few a checkpoint holds. ``scan_file`` checks a
file's checksum, then the finiteness of its floating tensors, for verification.
"""

from __future__ import annotations

import copy
import io
import os
import struct
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np
import torch
import xxhash

from cpsr_ds.checkpoint.storage import allowlist

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


def allowed_pickle(path: str, obj: Any) -> bytes:
    """``obj`` pickled, for file ``path``; :class:`CheckpointError` naming the file and the type where it holds one
    that reading it back would refuse (allowlist.py)."""
    try:
        return allowlist.dumps(obj)
    except allowlist.RefusedGlobal as err:
        raise CheckpointError(f"{path}: not written: {err}") from err


def file_prefix(path: str, skeleton: Any, specs: list["TensorSpec"]) -> bytes:
    """Everything in snapshot file ``path`` before the data region (see :func:`allowed_pickle`)."""
    header = allowed_pickle(path, (skeleton, specs))
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
                  map_location: Any = None, mapped: bool = False) -> Any:
    """Load a snapshot file or, without our magic, a ``torch.save`` file.

    ``expect`` is the file's manifest entry (``size``, ``digest``); when given, the bytes
    read are hashed and a mismatch raises :class:`CheckpointError` naming the file, before
    anything of the file is unpickled. ``mapped``: a snapshot file's tensors view its pages,
    mapped copy-on-write, rather than a copy of them (for a file in shared memory, whose pages
    are memory already: no second copy of the state, one pass less); the file is to be
    replaced by renaming, never written in place, while they live.
    """
    with open(path, "rb") as f:
        size, hasher, head = _start_reading(f, path, expect, algorithm)
        if head[:8] != MAGIC:
            return _load_torch_file(f, path, head, hasher, expect, map_location)
        header, data_size = _header_bytes(f, path, size, head, hasher)
        if mapped and data_size:
            # The open file's own pages (not the path's, which a rename may have moved on); the data region
            # starts on a page, as a mapping must.
            data = torch.from_numpy(np.memmap(f, dtype=np.uint8, mode="c", offset=size - data_size,
                                              shape=(data_size,)))
            hasher.update(data.numpy())
        else:
            data = torch.empty(data_size, dtype=torch.uint8)
            buf = data.numpy()
            for pos in range(0, data_size, _READ_CHUNK):
                hasher.update(_read_into(f, path, buf[pos:pos + _READ_CHUNK]))
    _check(path, hasher, expect)
    skeleton, specs = _parse_header(path, header, data_size)
    tensors = [_to_location(tensor_from_bytes(data, s), map_location) for s in specs]
    return unflatten(skeleton, tensors)


def read_skeleton(path: str) -> tuple[Any, int] | None:
    """(the skeleton: every value of a snapshot file but its tensors, which are ``TensorRef``; the bytes read),
    reading the header alone; None for a ``torch.save`` file. Unverified: for metadata that guards nothing."""
    with open(path, "rb") as f:
        size, hasher, head = _start_reading(f, path, None, "xxh3_64")
        if head[:8] != MAGIC:
            return None
        header, data_size = _header_bytes(f, path, size, head, hasher)
    return _parse_header(path, header, data_size)[0], size - data_size


def scan_file(path: str, expect: Optional[dict] = None, algorithm: str = "xxh3_64") -> list[str]:
    """Key paths of the floating tensors in ``path`` holding NaN or Inf.

    Raises :class:`CheckpointError` naming the file when it does not match ``expect`` or
    does not load. A snapshot file is read chunk by chunk, so memory stays bounded, and
    with ``expect`` twice: its header is unpickled, to tell where its floating tensors
    are, only once the first read matched the checksum.
    """
    with open(path, "rb") as f:
        size, hasher, head = _start_reading(f, path, expect, algorithm)
        if head[:8] != MAGIC:
            return nonfinite_tensors(*flatten(_load_torch_file(f, path, head, hasher, expect, "cpu")))
        header, data_size = _header_bytes(f, path, size, head, hasher)
        if expect is not None:
            data_start = f.tell()
            for _, chunk in _chunks(f, path, data_size):
                hasher.update(chunk.numpy())
            _check(path, hasher, expect)
            f.seek(data_start)
        skeleton, specs = _parse_header(path, header, data_size)
        bad = _nonfinite_data(f, path, specs, data_size)
    return _named(skeleton, bad)


def _chunks(f, path: str, data_size: int) -> Iterator[tuple[int, torch.Tensor]]:
    """The data region read chunk by chunk into one reused buffer: (its offset, the chunk)."""
    buf = torch.empty(min(_READ_CHUNK, data_size), dtype=torch.uint8)
    for pos in range(0, data_size, _READ_CHUNK):
        chunk = buf[:min(_READ_CHUNK, data_size - pos)]
        _read_into(f, path, chunk.numpy())
        yield pos, chunk


def _nonfinite_data(f, path: str, specs: list[TensorSpec], data_size: int) -> list[int]:
    """Indices of the floating tensors holding NaN or Inf, the data region read chunk by chunk.

    Chunks start at multiples of _READ_CHUNK and tensors at multiples of ALIGN, so a
    chunk holds whole elements of every tensor it overlaps.
    """
    waiting = deque(sorted((i for i, s in enumerate(specs) if getattr(torch, s.dtype).is_floating_point),
                           key=lambda i: specs[i].offset))
    bad = []
    for pos, chunk in _chunks(f, path, data_size):
        end = pos + len(chunk)
        while waiting and specs[waiting[0]].offset < end:
            s = specs[waiting[0]]
            part = chunk[max(s.offset - pos, 0):min(s.offset + s.nbytes - pos, len(chunk))]
            finite = is_finite(part.view(getattr(torch, s.dtype)))
            if not finite:
                bad.append(waiting[0])
            if finite and s.offset + s.nbytes > end:
                break  # the rest of it is in the next chunk
            waiting.popleft()
    return bad


def _start_reading(f, path: str, expect: Optional[dict], algorithm: str):
    """(size, hasher, first 16 bytes) of an open file, its size checked against ``expect``."""
    size = os.fstat(f.fileno()).st_size
    if expect is not None:
        check_size(path, size, expect)
    head = f.read(16)
    hasher = new_hasher(algorithm)
    hasher.update(head)
    return size, hasher, head


def _load_torch_file(f, path: str, head: bytes, hasher, expect: Optional[dict], map_location: Any) -> Any:
    """A ``torch.save`` file: checked against ``expect`` from one read into memory, else loaded from the file;
    unpickled by torch's weights-only unpickler, with allowlist.py's types."""
    if expect is None:
        f.seek(0)
        source = f
    else:
        raw = head + f.read()
        hasher.update(raw[len(head):])
        _check(path, hasher, expect)
        source = io.BytesIO(raw)
    try:
        return allowlist.torch_load(source, map_location)
    except allowlist.RefusedGlobal as err:
        raise CheckpointError(f"{path}: refused: {err}") from err
    except Exception as err:  # unpickling a damaged file fails in many ways; all mean the same here
        raise CheckpointError(f"{path}: does not load: {type(err).__name__}: {err}") from err


def _header_bytes(f, path: str, size: int, head: bytes, hasher) -> tuple[bytes, int]:
    """(the pickled header, the data region's size) of a snapshot file whose first 16 bytes were read; hashed,
    not unpickled: the data region starts at the first page boundary past the header."""
    (hlen,) = struct.unpack("<Q", head[8:16])
    start = align(16 + hlen, PAGE)
    if start > size:
        raise CheckpointError(f"{path}: truncated header")
    rest = f.read(start - 16)
    hasher.update(rest)
    return rest[:hlen], size - start


def _parse_header(path: str, header: bytes, data_size: int) -> tuple[Any, list[TensorSpec]]:
    """(skeleton, specs) of a pickled header, unpickled with the allowlist; every spec inside the data region."""
    try:
        skeleton, specs = allowlist.loads(header)
        valid = all(isinstance(s, TensorSpec) and isinstance(getattr(torch, s.dtype, None), torch.dtype)
                    and 0 <= s.offset and s.offset + s.nbytes <= data_size for s in specs)
    except allowlist.RefusedGlobal as err:
        raise CheckpointError(f"{path}: refused: {err}") from err
    except Exception as err:  # a damaged pickle fails in many ways
        raise CheckpointError(f"{path}: damaged header: {type(err).__name__}: {err}") from err
    if not valid:
        raise CheckpointError(f"{path}: damaged header: tensor specs outside the data region")
    return skeleton, specs


def _read_into(f, path: str, buf):
    """Fill ``buf`` from ``f``, repeating short reads; returns it."""
    pos = 0
    while pos < len(buf):
        n = f.readinto(memoryview(buf[pos:]))
        if not n:
            raise CheckpointError(f"{path}: truncated data region")
        pos += n
    return buf


def _check(path: str, hasher, expect: Optional[dict]) -> None:
    if expect is not None:
        check_digest(path, hasher.hexdigest(), expect)


def is_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in floating tensor ``t``. Minimum and maximum propagate NaN, so two reductions tell,
    without a temporary of the tensor's size."""
    if t.numel() == 0:
        return True
    if t.element_size() == 1:
        t = t.float()  # 8-bit float formats have no min/max kernels
    low, high = torch.aminmax(t)
    return bool(low.isfinite() and high.isfinite())


def tensor_names(skeleton: Any, prefix: str = "") -> dict[int, str]:
    """The key path of every tensor of a skeleton, by index: ``module.3.weight``, ``optimizer.state.0.exp_avg``."""
    if isinstance(skeleton, TensorRef):
        return {skeleton.index: prefix}
    if isinstance(skeleton, dict):
        items = skeleton.items()
    elif isinstance(skeleton, (list, tuple)):
        items = enumerate(skeleton)
    else:
        return {}
    names = {}
    for k, v in items:
        names.update(tensor_names(v, f"{prefix}.{k}" if prefix else str(k)))
    return names


def nonfinite_tensors(skeleton: Any, tensors: list[torch.Tensor]) -> list[str]:
    """Key paths of the floating tensors holding NaN or Inf, sorted (``flatten`` gives both arguments)."""
    return _named(skeleton, [i for i, t in enumerate(tensors) if t.is_floating_point() and not is_finite(t)])


def _named(skeleton: Any, indices: list[int]) -> list[str]:
    names = tensor_names(skeleton)
    return sorted(names.get(i, f"tensor {i}") for i in indices)


def _to_location(t: torch.Tensor, map_location: Any) -> torch.Tensor:
    # Callables and dicts are DeepSpeed's "keep on CPU" idioms; devices are honoured.
    if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type != "cpu":
        return t.to(map_location)
    return t


def check_size(path: str, size: int, expect: dict) -> None:
    if size != expect["size"]:
        raise CheckpointError(f"{path}: truncated or overwritten: {size} bytes, manifest says {expect['size']}")


def check_digest(path: str, digest: str, expect: dict) -> None:
    if digest != expect["digest"]:
        raise CheckpointError(f"{path}: checksum mismatch (corrupt): {digest} != manifest {expect['digest']}")
