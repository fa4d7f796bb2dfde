"""Loading a checkpoint file: checked against its rank's manifest, counted for the recovery report.

The checkpoint engines' ``load`` reads through :func:`load_file`; files of DeepSpeed's
own format, without manifests, load as they are. Within :func:`each_file_once` a file
loaded again gets what its first load returned (DeepSpeed reads some files twice, see
integration/deepspeed/load_hooks.py).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Optional

from cpsr_ds.checkpoint.storage.fileformat import CheckpointError, read_snapshot
from cpsr_ds.checkpoint.storage.records import manifest_entry, read_manifests

_bytes_loaded = 0  # by load_file in this process: what a restart read (recovery's report)
_loaded_once: Optional[dict] = None  # inside each_file_once(): path -> what load_file returned


def bytes_loaded() -> int:
    """The bytes of every checkpoint file :func:`load_file` has read in this process (and :func:`count_loaded`)."""
    return _bytes_loaded


def count_loaded(nbytes: int) -> None:
    """Count ``nbytes`` of checkpoint files read elsewhere (a file's header) in :func:`bytes_loaded`."""
    global _bytes_loaded
    _bytes_loaded += nbytes


@contextlib.contextmanager
def each_file_once() -> Iterator[None]:
    """Within the block a file loaded again gets what its first load returned (once); what is kept goes when it
    ends."""
    global _loaded_once
    _loaded_once = {}
    try:
        yield
    finally:
        _loaded_once = None


def load_file(path: str, map_location: Any = None) -> Any:
    """A file of a checkpoint, checked against its manifests; files of DeepSpeed's own format load as they are."""
    if _loaded_once is not None and path in _loaded_once:
        return _loaded_once.pop(path)
    count_loaded(os.path.getsize(path))
    tag_dir = os.path.dirname(path)
    manifests = read_manifests(tag_dir)
    if not manifests:
        loaded = read_snapshot(path, map_location=map_location)
    else:
        found = manifest_entry(manifests, tag_dir, path)
        if found is None:
            raise CheckpointError(f"{path}: listed in no rank manifest of {tag_dir} (partial checkpoint)")
        entry, algorithm = found
        loaded = read_snapshot(path, entry, algorithm, map_location)
    if _loaded_once is not None:
        _loaded_once[path] = loaded
    return loaded
