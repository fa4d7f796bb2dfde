"""Survivor dump: a rank whose job fails around it writes its exact state to fast local storage.

When a peer dies, DeepSpeed's launcher (and torch's elastic agent) sends SIGTERM to the
node's other ranks and waits 30 s before SIGKILL; a rank on another node sees its next
collective fail ("Connection reset by peer") within seconds. Either way the rank still
holds its state at the last iteration it completed. :class:`Dumper` writes that state
(parameters and Adam moments in the form recovery's ``engine_state`` has them, this
rank's partition only under ZeRO/bf16, there with the module's whole weights for a peer
that lost its partition; step counters and the LR schedule) to
``checkpoint.survivor_dir``, by default in ``/dev/shm``::

    SURVIVOR_DIR/<run>/owner.json                               the run directory it belongs to
    SURVIVOR_DIR/<run>/rankNNNNN/state.cpsr                      snapshot file (fileformat.py)
    SURVIVOR_DIR/<run>/rankNNNNN/cpsr_manifest.rankNNNNN.json    size, checksum, iteration, attempt

``<run>`` is the run's identity (``DIR/cpsr_run.json``, made at its first start, bound to
the run directory's real path and inode), so two jobs on one machine never share a dump,
nor does a copy of a run directory (``cp -r``) take the original's. The root and
everything under it are this user's alone (private_dir.py: 0700 directories, 0600
files, whatever the umask); a root or run directory that another user owns or may
write to, or a symlink in place of one, is refused when dumps are made and when they
are read. The dump is written into a hidden directory and
renamed into place once its manifest is durable: a torn or partial dump is never there
under the final name, and :func:`read_survivor` verifies the manifest and checksum anyway.

The main thread may be blocked inside a collective when SIGTERM arrives, so the dump
does not depend on it: the C-level signal handler writes the signal number to a wakeup
fd (``signal.set_wakeup_fd``) and a watcher thread dumps. The optimizer step holds a
lock the dump takes too, so the dump waits for a running step to end (or gives up at
its time limit) and never reads a state half updated; a step that raised leaves the
state torn, and nothing is dumped. An exception out of ``train_batch`` (a failed
collective) dumps before it propagates. The dump ends within
``checkpoint.survivor_timeout_s``; past it the partial dump is abandoned, never renamed
into place. After a signal the process then dies by that signal, as without a dump.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from cpsr_ds.checkpoint.storage import private_dir, store
from cpsr_ds.checkpoint.capture import rng
from cpsr_ds.checkpoint.engines.persist import Concurrent
from cpsr_ds.checkpoint.storage.fileformat import CheckpointError, file_prefix, flatten, layout, nonfinite_tensors, read_snapshot
from cpsr_ds.config import CheckpointConfig
from cpsr_ds.integration.deepspeed.engine_state import base_optimizer, local_state, replica_weights

log = logging.getLogger(__name__)

RUN_ID = "cpsr_run.json"  # in the run directory: the run's identity, made at its first start
OWNER = "owner.json"
STATE_FILE = "state.cpsr"
TAG = "survivor"
SETTING = "checkpoint.survivor_dir"  # the key that moves the root
# Signals a launcher stops a job's ranks with.
SIGNALS = (signal.SIGTERM,)


# ---------------------------------------------------------------- where dumps go


def default_root() -> str:
    """``/dev/shm/cpsr-survivors-<uid>`` (the system's temporary directory where there is no /dev/shm)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"cpsr-survivors-{os.getuid()}")


def survivor_root(cfg: CheckpointConfig) -> str:
    return cfg.survivor_dir or default_root()


def dump_dir(root: str, run: str, rank: int) -> str:
    return os.path.join(root, run, f"rank{rank:05d}")


def run_identity(run_dir: str) -> str:
    """The identity of the run in ``run_dir``, made on first use: every rank that sees the directory gets the same,
    and a copy of the directory another (:func:`_bound`)."""
    return _bound(_made(run_dir)["run"], run_dir)


def held_run(run_dir: str) -> Optional[str]:
    """The identity of the run ``run_dir`` holds now, None where it holds none; raises OSError or ValueError where
    its record is unreadable or damaged."""
    try:
        return _bound(_parse(_read_bytes(os.path.join(run_dir, RUN_ID)))["run"], run_dir)
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


def _read_bytes(path: str) -> bytes:
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
        raw = _read_bytes(path)
    except FileNotFoundError:
        _publish(run_dir, {"run": uuid.uuid4().hex, **_binding(run_dir)})
        return _made(run_dir)
    try:
        return _parse(raw)
    except ValueError as err:
        log.warning("cpsr: %s is damaged (%s): the run gets a new identity, earlier survivor dumps are not used",
                    path, err)
        # Made from the damaged bytes, so that every rank that read them writes the same.
        store.write_json_atomic(path, {"run": hashlib.sha256(raw).hexdigest()[:32], **_binding(run_dir)})
        return _made(run_dir)


def _publish(run_dir: str, record: dict) -> None:
    """Make ``record`` the run's identity unless another rank made one first (a link fails where one is there)."""
    path = os.path.join(run_dir, RUN_ID)
    tmp = f"{store.temp_name(path)}-{uuid.uuid4().hex}"
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
        store.fsync_dir(run_dir)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


def moved(run_dir: str) -> Optional[str]:
    """Where ``run_dir``'s identity was made, where that is not here (a copy, or a move); None otherwise."""
    record, here = _made(run_dir), _binding(run_dir)
    made_in = {k: record.get(k) for k in here}
    if None in made_in.values() or made_in == here:
        return None
    return f"{made_in['dir']} (inode {made_in['inode']})"


def prepare(cfg: CheckpointConfig) -> tuple[str, str]:
    """The survivor root and this run's identity, after making the root and the run's directory under it this
    user's alone (:class:`private_dir.PrivateDirError` where they are not) and marking the run's with the run
    directory it belongs to (owner.json)."""
    root, run = survivor_root(cfg), run_identity(cfg.dir)
    os.makedirs(os.path.dirname(os.path.abspath(root)), exist_ok=True)
    private_dir.ensure(root, SETTING)
    private_dir.ensure(os.path.join(root, run), SETTING)
    store.write_json_atomic(os.path.join(root, run, OWNER), {"run_dir": os.path.abspath(cfg.dir)},
                            mode=private_dir.FILE_MODE)
    return root, run


# ---------------------------------------------------------------- the state


def counters(engine) -> dict:
    """The step counters, LR schedule and random-number state (rng.py; None where none is recorded for this
    iteration) the state belongs with."""
    scheduler = engine.lr_scheduler
    steps = {int(st["step"]) for st in base_optimizer(engine).state.values() if "step" in st}
    return {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps, "micro_steps": engine.micro_steps,
            "optimizer_steps": sorted(steps),
            "lr_scheduler": None if scheduler is None else scheduler.state_dict(), "rng": rng.recorded(engine)}


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
    # (engine_io.replica_weights); None otherwise
    weights: dict[str, torch.Tensor] | None = None


# ---------------------------------------------------------------- writing


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
    tmp = store.temp_name(directory)
    shutil.rmtree(tmp, ignore_errors=True)
    private_dir.ensure(tmp, SETTING)
    skeleton, tensors = flatten(contents)
    specs, _ = layout(tensors)
    prefix = file_prefix(os.path.join(directory, STATE_FILE), skeleton, specs)
    size, digest = store.write_atomic(os.path.join(tmp, STATE_FILE), _chunks(prefix, tensors, specs), checksum,
                                      mode=private_dir.FILE_MODE)
    rank = manifest["rank"]
    store.write_json_atomic(os.path.join(tmp, store.manifest_name(rank)),
                            {**manifest, "tag": TAG, "checksum": checksum, "failed": None,
                             "files": {STATE_FILE: {"size": size, "digest": digest}}}, mode=private_dir.FILE_MODE)
    if not may_commit():
        return 0
    _remove(directory)
    os.replace(tmp, directory)
    store.fsync_dir(parent)
    return size


def _remove(path: str) -> None:
    # Renamed away first, so that no reader sees a dump half deleted.
    trash = f"{os.path.dirname(path)}/{store.TRASH_PREFIX}{os.path.basename(path)}-{uuid.uuid4().hex}"
    try:
        os.replace(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


# ---------------------------------------------------------------- reading and cleaning up


def read_survivor(root: str, rank: int, run: str, attempt: Optional[int] = None) -> Optional[Survivor]:
    """``rank``'s dump of run ``run`` (of job attempt ``attempt``; None: any) under ``root``, verified;
    None where it is missing, partial, damaged, of another run or attempt, or holds a NaN or an infinity
    (the reason logged)."""
    return read_dump(dump_dir(root, run, rank), rank, run, attempt, "survivor dump")


def read_dump(directory: str, rank: int, run: str, attempt: Optional[int], what: str) -> Optional[Survivor]:
    """:func:`read_survivor` of the dump in ``directory`` (``what`` it is, for the log); the dump's directory, its
    run's and the root above must be this user's alone (a planted one is refused)."""
    if not os.path.isdir(directory):
        log.info("cpsr: no %s of rank %d in %s", what, rank, directory)
        return None
    try:
        return _read(directory, rank, run, attempt)
    except (CheckpointError, OSError, private_dir.PrivateDirError) as err:
        log.warning("cpsr: %s of rank %d in %s not used: %s", what, rank, directory, err)
        return None


def check_private(*directories: str) -> None:
    """Raise PrivateDirError unless each of ``directories`` is this user's alone; FileNotFoundError where one is
    missing."""
    for path in directories:
        private_dir.check(path, SETTING)


def _owner(run_root: str) -> str:
    """The run directory that the run's directory ``run_root`` under the survivor root belongs to (its owner.json)."""
    try:
        return str(json.loads(_read_bytes(os.path.join(run_root, OWNER)))["run_dir"])
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


def _read(directory: str, rank: int, run: str, attempt: Optional[int]) -> Survivor:
    run_root = os.path.dirname(directory)
    check_private(os.path.dirname(run_root), run_root, directory)
    man = store.read_manifests(directory).get(rank)
    if man is None:
        raise CheckpointError(f"no manifest {store.manifest_name(rank)} (partial dump)")
    if man.get("run") != run:
        raise CheckpointError(f"written by run {man.get('run')!r}, not this run {run!r}")
    if attempt is not None and man["attempt"] != attempt:
        raise CheckpointError(f"written by attempt {man['attempt']}, not attempt {attempt}")
    _check_owner(os.path.dirname(directory), run)
    entry = man["files"].get(STATE_FILE)
    if entry is None or man["iteration"] is None:
        raise CheckpointError(f"the manifest lists no {STATE_FILE} or no iteration")
    contents = read_snapshot(os.path.join(directory, STATE_FILE), entry, man["checksum"])
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
                     n.startswith(f"{store.TRASH_PREFIX}{name}-")]
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


# ---------------------------------------------------------------- the dumper


class Dumper:
    """Dumps one engine's state once, on request from any thread, within ``timeout_s``."""

    def __init__(self, engine, root: str, run: str, attempt: int, timeout_s: float, checksum: str = "xxh3_64"):
        self.engine = weakref.proxy(engine)
        self.directory = dump_dir(root, run, engine.global_rank)
        self.manifest = identity(engine, run, attempt)
        self.timeout_s = timeout_s
        self.checksum = checksum
        # Held by the optimizer step and by a dump: a dump never reads a state half updated.
        self._state = threading.Lock()
        self.torn: Optional[str] = None  # why the engine's state is no longer one iteration's
        self._once = threading.Lock()
        self.outcome: Optional[bool] = None
        self._commit = threading.Lock()
        self._abandoned = self._committing = False

    def _may_commit(self) -> bool:
        """The writer's last word: commit, unless the dump was abandoned (then it never will)."""
        with self._commit:
            self._committing = not self._abandoned
            return self._committing

    def stepping(self, step: Callable) -> Callable:
        """``step`` (the engine's optimizer step) under the state lock; one that raises leaves the state torn."""
        @functools.wraps(step)
        def guarded(*args, **kwargs):
            with self._state:
                try:
                    return step(*args, **kwargs)
                except BaseException as err:
                    self.torn = f"the optimizer step of iteration {self.engine.global_steps + 1} raised {err!r}"
                    raise
        return guarded

    def dump(self, reason: str) -> bool:
        """Dump the state once (later calls wait for the first and return its outcome); whether a dump was committed."""
        with self._once:
            if self.outcome is None:
                self.outcome = self._dump(reason)
            return self.outcome

    def _dump(self, reason: str) -> bool:
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        if not self._state.acquire(timeout=self.timeout_s):
            log.error("cpsr: no survivor dump (%s): the optimizer step did not end within %g s", reason, self.timeout_s)
            return False
        try:
            if self.torn is not None:
                log.error("cpsr: no survivor dump (%s): %s", reason, self.torn)
                return False
            engine = self.engine
            if engine.global_steps == 0:
                log.info("cpsr: no survivor dump (%s): no optimizer step yet", reason)
                return False
            state, fragments = local_state(engine)
            contents = {"state": state, "fragments": fragments, "counters": counters(engine),
                        "weights": replica_weights(engine)}
            manifest = {**self.manifest, "iteration": engine.global_steps, "reason": reason,
                        "written_ns": time.time_ns()}
            writer = _Writing(lambda: write_dump(self.directory, contents, manifest, self.checksum, self._may_commit))
            finished = writer.wait(max(0.0, deadline - time.monotonic()))
            with self._commit:
                self._abandoned = not finished and not self._committing
            if self._abandoned:
                log.error("cpsr: survivor dump of iteration %d abandoned: not written within "
                          "checkpoint.survivor_timeout_s %g s", manifest["iteration"], self.timeout_s)
                return False
            nbytes = writer.result()
        except Exception as err:  # a failing dump must not hide why the process is ending
            log.error("cpsr: survivor dump failed (%s): %s: %s", reason, type(err).__name__, err)
            return False
        finally:
            self._state.release()
        log.warning("cpsr: survivor dump of iteration %d written to %s (%d bytes, %.2f s; %s)",
                    manifest["iteration"], self.directory, nbytes, time.monotonic() - t0, reason)
        return True


class _Writing(Concurrent):
    """The dump's writer: a daemon thread, so that the process may end with an abandoned one still running."""

    def wait(self, timeout: float) -> bool:
        """Whether it finished within ``timeout`` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


# ---------------------------------------------------------------- signals


def die(signum: int) -> None:
    """End the process by ``signum``'s default action, from any thread (launchers see the signal's meaning)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    libc = ctypes.CDLL(None)
    libc.signal.argtypes, libc.signal.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_void_p
    libc.signal(signum, None)  # SIG_DFL: Python's handler would only set a flag
    os.kill(os.getpid(), signum)
    time.sleep(1.0)
    os._exit(128 + signum)


class _Watcher:
    """The process's wakeup fd and the thread that reads it; signals dump the current engine's state, then
    end the process."""

    def __init__(self):
        self.dumper: Callable[[], Optional[Dumper]] = lambda: None
        read, write = os.pipe()
        os.set_blocking(write, False)
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)
            os.close(read)
            os.close(write)
            raise RuntimeError("another wakeup fd is installed (an asyncio event loop?)")
        for signum in SIGNALS:
            signal.signal(signum, self._handler)
        self._read = read
        threading.Thread(target=self._watch, name="cpsr-signals", daemon=True).start()

    def _handler(self, signum, frame) -> None:
        """Nothing: the watcher dumps and ends the process. This runs on the main thread wherever it executes
        Python next, possibly inside the optimizer step, which holds the lock the dump waits for."""

    def _watch(self) -> None:
        while True:
            for signum in os.read(self._read, 64):
                if signum in SIGNALS:
                    self.terminate(signum)

    def terminate(self, signum: int) -> None:
        dumper = self.dumper()
        if dumper is not None:
            dumper.dump(f"{signal.Signals(signum).name} received")
        die(signum)


_watcher: Optional[_Watcher] = None


def watch_signals(dumper: Dumper) -> bool:
    """Make ``dumper`` the one the process's signals dump (one engine at a time); whether signals are watched."""
    global _watcher
    try:
        if _watcher is None:
            _watcher = _Watcher()
    except (ValueError, RuntimeError, OSError) as err:  # ValueError: not the main thread
        log.warning("cpsr: survivor dumps on SIGTERM are off: %s; a failed collective still dumps", err)
        return False
    _watcher.dumper = weakref.ref(dumper)
    return True


def install(engine, cfg: CheckpointConfig, attempt: int) -> Optional[Dumper]:
    """After recovery has read the earlier dumps: remove them, and make this engine dump on failure.

    Raises :class:`private_dir.PrivateDirError` where the survivor root or the run's directory under it is not
    this user's alone. Watches SIGTERM; the engine's optimizer step runs under :meth:`Dumper.stepping`, and
    ``train_batch`` dumps through the dumper when an exception leaves (integration/deepspeed/engine.py).
    """
    if not cfg.survivor:
        return None
    root, run = prepare(cfg)
    origin = moved(cfg.dir)
    if origin is not None and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        log.warning("cpsr: the run directory %s was made as %s: a copy, or moved; it is a run of its own, and the "
                    "survivor dumps of the original are not its", os.path.realpath(cfg.dir), origin)
    remove_survivor(root, run, engine.global_rank)
    for stale in remove_stale_runs(root):
        log.info("cpsr: removed the survivor dumps of run %s in %s: its run directory is gone", stale, root)
    dumper = Dumper(engine, root, run, attempt, cfg.survivor_timeout_s, cfg.checksum)
    watch_signals(dumper)
    return dumper
