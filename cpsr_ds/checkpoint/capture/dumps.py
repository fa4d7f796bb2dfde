"""Survivor dumps on disk: where a dump is written, how it is written atomically, and read back verified.

A dump (survivor.py makes one when the job fails around a rank; host_snapshot.py in
memory every few iterations) goes to ``checkpoint.survivor_dir``, by default in ``/dev/shm``::

    SURVIVOR_DIR/<run>/owner.json                              the run directory it belongs to
    SURVIVOR_DIR/<run>/rankNNNNN/state.cpsr                    snapshot file (fileformat.py)
    SURVIVOR_DIR/<run>/rankNNNNN/cpsr_manifest.rankNNNNN.json  size, checksum, iteration, attempt

``<run>`` is the run's identity (run_id.py). The root and everything under it are this
user's alone (private_dir.py); a planted or symlinked directory is refused when dumps are
made and when they are read. A dump is written into a hidden directory and renamed into
place once its manifest is durable, and verified (manifest, checksum, finite values) on reading.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from cpsr_ds.checkpoint.capture import rng
from cpsr_ds.checkpoint.capture.run_id import held_run, read_bytes, run_identity
from cpsr_ds.checkpoint.storage import ondisk, private_dir, records
from cpsr_ds.checkpoint.storage.fileformat import CheckpointError, file_prefix, flatten, layout, nonfinite_tensors, read_snapshot
from cpsr_ds.checkpoint.storage.filesystem import fs
from cpsr_ds.config import CheckpointConfig
from cpsr_ds.integration.deepspeed.engine_state import base_optimizer, group_settings

log = logging.getLogger(__name__)

OWNER = "owner.json"
STATE_FILE = "state.cpsr"
TAG = "survivor"
SETTING = "checkpoint.survivor_dir"  # the key that moves the root


def default_root() -> str:
    """``/dev/shm/cpsr-survivors-<uid>`` (the system's temporary directory where there is no /dev/shm)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"cpsr-survivors-{os.getuid()}")


def survivor_root(cfg: CheckpointConfig) -> str:
    return cfg.survivor_dir or default_root()


def dump_dir(root: str, run: str, rank: int) -> str:
    return os.path.join(root, run, f"rank{rank:05d}")


def prepare(cfg: CheckpointConfig) -> tuple[str, str]:
    """The survivor root and this run's identity, after making the root and the run's directory under it this
    user's alone (:class:`private_dir.PrivateDirError` where they are not) and marking the run's with the run
    directory it belongs to (owner.json)."""
    root, run = survivor_root(cfg), run_identity(cfg.dir)
    os.makedirs(os.path.dirname(os.path.abspath(root)), exist_ok=True)
    private_dir.ensure(root, SETTING)
    private_dir.ensure(os.path.join(root, run), SETTING)
    fs.write_json_atomic(os.path.join(root, run, OWNER), {"run_dir": os.path.abspath(cfg.dir)},
                            mode=private_dir.FILE_MODE)
    return root, run


def counters(engine) -> dict:
    """The step counters, LR schedule, the optimizer's param-group settings and random-number state (rng.py; None
    where none is recorded for this iteration) the state belongs with: with them a restart resumes from the dump
    alone, without a checkpoint under it (engine_state.set_counters)."""
    scheduler = engine.lr_scheduler
    steps = {int(st["step"]) for st in base_optimizer(engine).state.values() if "step" in st}
    return {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps, "micro_steps": engine.micro_steps,
            "optimizer_steps": sorted(steps),
            "lr_scheduler": None if scheduler is None else scheduler.state_dict(),
            "param_groups": group_settings(engine), "rng": rng.recorded(engine)}


@dataclass(frozen=True)
class Survivor:
    """A verified dump: this rank's state after ``iteration`` optimizer steps."""

    iteration: int
    rank: int
    stage: int
    world_size: int  # of the job that wrote it
    attempt: int  # of the job that wrote it
    state: dict[str, torch.Tensor]  # engine_state's keys; a fragment where ``fragments`` names the parameter
    fragments: dict[str, tuple[int, int]]  # parameter name -> (start, numel) of its flattened tensor (ZeRO/bf16)
    counters: dict
    nbytes: int
    reason: str  # what made the rank dump
    # the module's whole weights by parameter name, where a data-parallel peer's partition needs them
    # (engine_state.replica_weights); None otherwise
    weights: dict[str, torch.Tensor] | None = None


def _chunks(prefix: bytes, tensors: list[torch.Tensor], specs) -> Iterator:
    """The snapshot file of ``tensors`` (fileformat.py), tensor by tensor, straight from the tensors."""
    yield prefix
    pos = 0
    for t, spec in zip(tensors, specs):
        if spec.offset > pos:
            yield bytes(spec.offset - pos)
        yield t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        pos = spec.offset + spec.nbytes


def identity(engine, run: str, attempt: int) -> dict:
    """Whose a dump is: the manifest fields that tell a restart whether it may use it."""
    return {"rank": engine.global_rank, "world_size": engine.world_size, "attempt": attempt, "run": run,
            "stage": engine.stage_id}


def write_dump(directory: str, contents: dict, manifest: dict, checksum: str,
               may_commit: Callable[[], bool] = lambda: True) -> int:
    """Write ``contents`` as the dump in ``directory``, atomically; returns its bytes, 0 if ``may_commit()`` said no.

    Everything goes into a hidden directory beside it, which replaces ``directory`` only
    once its file and manifest are durable, and only if ``may_commit()`` then says so.
    """
    parent = os.path.dirname(directory)
    private_dir.ensure(parent, SETTING)
    tmp = fs.temp_name(directory)
    shutil.rmtree(tmp, ignore_errors=True)
    private_dir.ensure(tmp, SETTING)
    skeleton, tensors = flatten(contents)
    specs, _ = layout(tensors)
    prefix = file_prefix(os.path.join(directory, STATE_FILE), skeleton, specs)
    size, digest = fs.write_atomic(os.path.join(tmp, STATE_FILE), _chunks(prefix, tensors, specs), checksum,
                                      mode=private_dir.FILE_MODE)
    rank = manifest["rank"]
    fs.write_json_atomic(os.path.join(tmp, ondisk.manifest_name(rank)),
                            {**manifest, "tag": TAG, "checksum": checksum, "failed": None,
                             "files": {STATE_FILE: {"size": size, "digest": digest}}}, mode=private_dir.FILE_MODE)
    if not may_commit():
        return 0
    _remove(directory)
    fs.rename(tmp, directory)
    return size


def _remove(path: str) -> None:
    # Renamed away first, so that no reader sees a dump half deleted.
    fs.remove_tree(path, f"{os.path.dirname(path)}/{ondisk.TRASH_PREFIX}{os.path.basename(path)}-{uuid.uuid4().hex}")


def read_survivor(root: str, rank: int, run: str, attempt: Optional[int] = None) -> Optional[Survivor]:
    """``rank``'s dump of run ``run`` (of job attempt ``attempt``; None: any) under ``root``, verified;
    None where it is missing, partial, damaged, of another run or attempt, or holds a NaN or an infinity
    (the reason logged)."""
    return read_dump(dump_dir(root, run, rank), rank, run, attempt, "survivor dump")


def read_dump(directory: str, rank: int, run: str, attempt: Optional[int], what: str) -> Optional[Survivor]:
    """:func:`read_survivor` of the dump in ``directory`` (``what`` it is, for the log); the dump's directory, its
    run's and the root above must be this user's alone (a planted one is refused)."""
    man = read_dump_manifest(directory, rank, run, attempt, what)
    return None if man is None else load_dump(directory, man, what)


def read_dump_manifest(directory: str, rank: int, run: str, attempt: Optional[int], what: str) -> Optional[dict]:
    """The manifest of ``rank``'s dump in ``directory`` where it is this run's (and ``attempt``'s; None: any) and
    its directories are this user's alone; None, the reason logged, where not. Reads no state: a restart choosing
    among several dumps reads only the one it takes (:func:`load_dump`)."""
    if not os.path.isdir(directory):
        log.info("cpsr: no %s of rank %d in %s", what, rank, directory)
        return None
    try:
        return _manifest(directory, rank, run, attempt)
    except (CheckpointError, OSError, private_dir.PrivateDirError) as err:
        log.warning("cpsr: %s of rank %d in %s not used: %s", what, rank, directory, err)
        return None


def load_dump(directory: str, man: dict, what: str) -> Optional[Survivor]:
    """The dump in ``directory`` whose manifest :func:`read_dump_manifest` gave, verified against its checksum and
    free of NaN and infinity; None, the reason logged, where not."""
    try:
        return _load(directory, man)
    except (CheckpointError, OSError) as err:
        log.warning("cpsr: %s of rank %d in %s not used: %s", what, man["rank"], directory, err)
        return None


def check_private(*directories: str) -> None:
    """Raise PrivateDirError unless each of ``directories`` is this user's alone; FileNotFoundError where one is
    missing."""
    for path in directories:
        private_dir.check(path, SETTING)


def _owner(run_root: str) -> str:
    """The run directory that the run's directory ``run_root`` under the survivor root belongs to (its owner.json)."""
    try:
        return str(json.loads(read_bytes(os.path.join(run_root, OWNER)))["run_dir"])
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"{OWNER} in {run_root} is damaged: {err!r}") from None


def _check_owner(run_root: str, run: str) -> None:
    """Raise CheckpointError unless the run directory ``run_root``'s owner.json names still holds run ``run``."""
    try:
        run_dir = _owner(run_root)
        held = held_run(run_dir)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"its run directory is unknown: {err}") from None
    if held != run:
        raise CheckpointError(f"its run directory {run_dir} ({OWNER}) holds {'no run' if held is None else 'another run'}"
                              f" now, not run {run!r}")


def _manifest(directory: str, rank: int, run: str, attempt: Optional[int]) -> dict:
    run_root = os.path.dirname(directory)
    check_private(os.path.dirname(run_root), run_root, directory)
    man = records.read_manifests(directory).get(rank)
    if man is None:
        raise CheckpointError(f"no manifest {ondisk.manifest_name(rank)} (partial dump)")
    if man.get("run") != run:
        raise CheckpointError(f"written by run {man.get('run')!r}, not this run {run!r}")
    if attempt is not None and man["attempt"] != attempt:
        raise CheckpointError(f"written by attempt {man['attempt']}, not attempt {attempt}")
    _check_owner(os.path.dirname(directory), run)
    if man["files"].get(STATE_FILE) is None or man["iteration"] is None:
        raise CheckpointError(f"the manifest lists no {STATE_FILE} or no iteration")
    return {**man, "rank": rank}


def _load(directory: str, man: dict) -> Survivor:
    entry, rank = man["files"][STATE_FILE], man["rank"]
    contents = read_snapshot(os.path.join(directory, STATE_FILE), entry, man["checksum"], mapped=True)
    weights = contents.get("weights")
    bad = nonfinite_tensors(*flatten({"state": contents["state"], "weights": weights or {}}))
    if bad:
        raise CheckpointError(f"non-finite values in {', '.join(bad)}")
    return Survivor(man["iteration"], rank, man.get("stage", 0), man.get("world_size", 0), man["attempt"], contents["state"],
                    contents["fragments"], contents["counters"], entry["size"], man.get("reason", ""), weights)


def remove_survivor(root: str, run: str, rank: int) -> None:
    """Delete ``rank``'s dump of run ``run`` and what an interrupted one left beside it."""
    remove_dump(dump_dir(root, run, rank))


def remove_dump(directory: str) -> None:
    """Delete the dump in ``directory`` and what an interrupted one left beside it."""
    _remove(directory)
    parent, name = os.path.split(directory)
    try:
        leftovers = [n for n in os.listdir(parent) if n.startswith(f".{name}.tmp") or
                     n.startswith(f"{ondisk.TRASH_PREFIX}{name}-")]
    except FileNotFoundError:
        return
    for n in leftovers:
        shutil.rmtree(os.path.join(parent, n), ignore_errors=True)


def remove_stale_runs(root: str) -> list[str]:
    """Delete the dumps of runs whose run directory is gone or now holds another run; returns their identities."""
    stale = []
    try:
        runs = os.listdir(root)
    except FileNotFoundError:
        return stale
    for run in runs:
        try:
            run_dir = _owner(os.path.join(root, run))
        except (OSError, ValueError):
            continue  # a run just starting, or not ours to judge
        try:
            current = held_run(run_dir) == run
        except (OSError, ValueError):
            continue
        if not current:
            shutil.rmtree(os.path.join(root, run), ignore_errors=True)
            stale.append(run)
    return stale
