"""The run's identity: made at its first start in ``DIR/cpsr_run.json``, bound to the run directory.

Survivor dumps and host snapshots are kept under it, so two jobs on one machine never
share a dump, nor does a copy of a run directory (``cp -r``) take the original's: the
identity made at the first start is bound to the directory's real path and inode.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from typing import Optional

from cpsr_ds.checkpoint.storage.filesystem import fs

log = logging.getLogger(__name__)

RUN_ID = "cpsr_run.json"  # in the run directory: the run's identity, made at its first start


def run_identity(run_dir: str) -> str:
    """The identity of the run in ``run_dir``, made on first use: every rank that sees the directory gets the same,
    and a copy of the directory another (:func:`_bound`)."""
    return _bound(_made(run_dir)["run"], run_dir)


def held_run(run_dir: str) -> Optional[str]:
    """The identity of the run ``run_dir`` holds now, None where it holds none; raises OSError or ValueError where
    its record is unreadable or damaged."""
    try:
        return _bound(_parse(read_bytes(os.path.join(run_dir, RUN_ID)))["run"], run_dir)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _binding(run_dir: str) -> dict:
    """What a run identity is bound to: the directory's real path and inode. Not its device number: a network
    file system numbers it anew on each node and at each mount, where the directory is the same."""
    path = os.path.realpath(run_dir)
    return {"dir": path, "inode": os.stat(path).st_ino}


def _bound(made: str, run_dir: str) -> str:
    """The identity ``made`` at the run's first start, bound to ``run_dir``: a copy of the directory, or one
    moved, is another run, whose dumps are not the original's (cp -r copies cpsr_run.json too)."""
    binding = _binding(run_dir)
    return hashlib.sha256(f"{made}\0{binding['dir']}\0{binding['inode']}".encode()).hexdigest()[:32]


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _parse(raw: bytes) -> dict:
    """cpsr_run.json's record; ValueError where it holds no identity."""
    record = json.loads(raw)
    if not isinstance(record, dict) or not isinstance(record.get("run"), str):
        raise ValueError("no run identity in it")
    return record


def _made(run_dir: str) -> dict:
    """``run_dir``'s cpsr_run.json record, made on first use (with the binding it was made in, for the record)."""
    path = os.path.join(run_dir, RUN_ID)
    try:
        raw = read_bytes(path)
    except FileNotFoundError:
        # Another rank may make it first: the first one made is the run's identity.
        fs.publish_once(path, json.dumps({"run": uuid.uuid4().hex, **_binding(run_dir)}).encode())
        return _made(run_dir)
    try:
        return _parse(raw)
    except ValueError as err:
        log.warning("cpsr: %s is damaged (%s): the run gets a new identity, earlier survivor dumps are not used",
                    path, err)
        # Made from the damaged bytes, so that every rank that read them writes the same.
        fs.write_json_atomic(path, {"run": hashlib.sha256(raw).hexdigest()[:32], **_binding(run_dir)})
        return _made(run_dir)


def moved(run_dir: str) -> Optional[str]:
    """Where ``run_dir``'s identity was made, where that is not here (a copy, or a move); None otherwise."""
    record, here = _made(run_dir), _binding(run_dir)
    made_in = {k: record.get(k) for k in here}
    if None in made_in.values() or made_in == here:
        return None
    return f"{made_in['dir']} (inode {made_in['inode']})"
