"""On-disk layout of checkpoints: file format, manifests, commit records, ``latest``, retention.

A checkpoint directory ``CKPT_DIR`` holds one directory per tag, named as DeepSpeed
names them (``global_step100``), and DeepSpeed's plain-text ``latest`` file::

    CKPT_DIR/latest                           tag of the newest committed checkpoint
    CKPT_DIR/TAG/<files DeepSpeed saves>      snapshot files (see fileformat.py)
    CKPT_DIR/TAG/cpsr_manifest.rank00003.json rank 3's files: size and xxhash digest each
    CKPT_DIR/TAG/cpsr_commit.json             written by rank 0 once every rank's manifest is there

Every file is written to a hidden temporary name, fsynced, renamed, and its directory
fsynced, so a reader sees either nothing or the whole file. A rank writes its
manifest only after its files are durable; rank 0 writes the commit record only after
all ``world_size`` manifests exist, and moves ``latest`` only after the commit record
is durable. Hence ``latest`` never names a checkpoint that is incomplete on any rank.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import queue
import re
import shutil
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import numpy as np

from cpsr_ds.checkpoint.fileformat import MAGIC, PAGE, CheckpointError, check_digest, hash_file, new_hasher

log = logging.getLogger(__name__)

LATEST = "latest"
COMMIT = "cpsr_commit.json"
MANIFEST_RE = re.compile(r"^cpsr_manifest\.rank(\d{5})\.json$")
TEMP_RE = re.compile(r"^\..+\.tmp(\d+)$")
TRASH_PREFIX = ".trash-"
DEEPSPEED_FILE_RE = re.compile(r".*(model_states|optim_states)\.pt$")


def manifest_name(rank: int) -> str:
    return f"cpsr_manifest.rank{rank:05d}.json"


def tag_iteration(tag: str) -> Optional[int]:
    """The iteration a DeepSpeed tag stands for (``global_step120`` -> 120), if it ends in digits."""
    m = re.search(r"(\d+)$", tag)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------- atomic files

def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(path: str) -> str:
    # Hidden so that DeepSpeed's globs over layer files never pick up a half-written one.
    d, name = os.path.split(path)
    return os.path.join(d, f".{name}.tmp{os.getpid()}")


def write_atomic(path: str, chunks: Iterable, algorithm: Optional[str] = None,
                 direct: bool = False) -> tuple[int, Optional[str]]:
    """Write ``chunks`` (bytes-like) to ``path`` durably and atomically.

    Returns (size, hex digest or None). On any error the temporary file is removed and
    the error propagates; ``path`` is then untouched. ``direct``: bypass the page cache
    (O_DIRECT) for chunks that start on a page and span whole pages, as host arenas do;
    the rest of the file, and file systems without direct I/O, go through it.
    """
    tmp = temp_name(path)
    hashing = _Hashing(algorithm) if algorithm else None
    size = 0
    fd, direct = _open_for_writing(tmp, direct)
    try:
        for chunk in chunks:
            data = np.frombuffer(chunk, dtype=np.uint8)
            if hashing is not None:
                hashing.put(data)
            if direct:
                direct = _write_direct(fd, data)
            else:
                _write_all(fd, data)
            size += len(data)
        digest = hashing.digest() if hashing is not None else None
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path) or ".")
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    finally:
        if hashing is not None:
            hashing.stop()
    return size, digest


class _Hashing:
    """Hashes chunks in order on a thread of its own (xxhash releases the GIL), while the disk writes.

    A plain thread, not an executor: checkpoints are still written from ``atexit``,
    where executors refuse new work.
    """

    def __init__(self, algorithm: str):
        self._hasher = new_hasher(algorithm)
        self._queue: queue.Queue = queue.Queue()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="cpsr-hash", daemon=True)
        self._thread.start()

    def put(self, data) -> None:
        self._queue.put(data)

    def digest(self) -> str:
        self.stop()
        if self._error is not None:
            raise self._error
        return self._hasher.hexdigest()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        # Not iter(get, None): that compares numpy arrays to None element-wise.
        while (data := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._hasher.update(data)
                except BaseException as err:
                    self._error = err


def _open_for_writing(path: str, direct: bool) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if direct:
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o644), False


def _write_all(fd: int, data: np.ndarray) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _write_direct(fd: int, data: np.ndarray) -> bool:
    """Append ``data`` to ``fd``, its whole pages directly; False once the file went buffered."""
    whole = len(data) - len(data) % PAGE if data.ctypes.data % PAGE == 0 else 0
    start = os.lseek(fd, 0, os.SEEK_CUR)
    try:
        _write_all(fd, data[:whole])
        done = whole
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        done = os.lseek(fd, 0, os.SEEK_CUR) - start
    if done == len(data):
        return True
    # A partial page (the file's end) cannot go directly, so the file goes buffered from here.
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
    _write_all(fd, data[done:])
    return False


def write_json_atomic(path: str, obj: Any) -> None:
    write_atomic(path, [json.dumps(obj, indent=1, sort_keys=True).encode()])


def read_json(path: str) -> Any:
    with open(path, "rb") as f:
        return json.loads(f.read())


# ---------------------------------------------------------------- snapshot files

# ---------------------------------------------------------------- manifests and commits

def read_manifests(tag_dir: str) -> dict[int, dict]:
    """Every rank manifest in ``tag_dir``, by rank."""
    found = {}
    try:
        names = os.listdir(tag_dir)
    except FileNotFoundError:
        return found
    for name in names:
        m = MANIFEST_RE.match(name)
        if m:
            found[int(m.group(1))] = read_json(os.path.join(tag_dir, name))
    return found


def manifest_entry(manifests: dict[int, dict], tag_dir: str, path: str) -> Optional[tuple[dict, str]]:
    """The manifest entry of ``path`` and the checksum algorithm that made it, if any rank lists it."""
    rel = os.path.relpath(path, tag_dir)
    for man in manifests.values():
        if rel in man["files"]:
            return man["files"][rel], man["checksum"]
    return None


def read_latest(ckpt_dir: str) -> Optional[str]:
    try:
        with open(os.path.join(ckpt_dir, LATEST)) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def read_commit(tag_dir: str) -> Optional[dict]:
    try:
        return read_json(os.path.join(tag_dir, COMMIT))
    except (FileNotFoundError, ValueError):
        return None


def commit_checkpoint(ckpt_dir: str, tag: str, record: dict) -> bool:
    """Make ``tag`` committed and move ``latest`` to it if it is the newest; returns whether it moved.

    ``record`` carries ``started_ns``, the order of checkpoints. Retention is the
    caller's next step (``apply_retention``).
    """
    write_json_atomic(os.path.join(ckpt_dir, tag, COMMIT), record)
    current = read_latest(ckpt_dir)
    current_rec = read_commit(os.path.join(ckpt_dir, current)) if current else None
    moved = current_rec is None or current_rec["started_ns"] < record["started_ns"]
    if moved:
        write_atomic(os.path.join(ckpt_dir, LATEST), [tag.encode()])
    return moved


def apply_retention(ckpt_dir: str, keep_last: int, protected: Callable[[str], bool]) -> list[str]:
    """Delete our checkpoints beyond the ``keep_last`` newest committed ones; returns the tags deleted.

    Only directories carrying our manifests or commit records are touched, and never
    the one ``latest`` names. Uncommitted ones go only when older than the oldest kept.
    """
    ours = [c for c in scan(ckpt_dir) if c.kind == "cpsr"]
    committed = sorted((c for c in ours if c.committed), key=lambda c: c.started_ns, reverse=True)
    kept = committed[:keep_last]
    if not kept:
        return []
    floor = kept[-1].started_ns
    latest = read_latest(ckpt_dir)
    doomed = [c.tag for c in ours
              if c not in kept and c.tag != latest and not protected(c.tag)
              and (c.committed or c.started_ns < floor)]
    _remove_leftovers(ckpt_dir)
    for tag in doomed:
        remove_checkpoint(ckpt_dir, tag)
    return doomed


def remove_checkpoint(ckpt_dir: str, tag: str) -> bool:
    """Delete checkpoint ``tag``; returns whether it was there and is gone."""
    # Renaming first makes the removal atomic for readers and for a crash mid-delete.
    trash = os.path.join(ckpt_dir, f"{TRASH_PREFIX}{tag}-{os.getpid()}")
    try:
        os.replace(os.path.join(ckpt_dir, tag), trash)
    except FileNotFoundError:
        return False
    except OSError as err:
        log.warning("could not delete checkpoint %s: %s", tag, err)
        return False
    shutil.rmtree(trash, ignore_errors=True)
    return True


def _remove_leftovers(ckpt_dir: str) -> None:
    """Trash and temporary files that processes killed mid-way left in ``ckpt_dir``."""
    for name in os.listdir(ckpt_dir):
        path = os.path.join(ckpt_dir, name)
        temp = TEMP_RE.match(name)
        if name.startswith(TRASH_PREFIX):
            shutil.rmtree(path, ignore_errors=True)
        elif temp and int(temp.group(1)) != os.getpid():
            try:
                os.unlink(path)
            except OSError:
                pass


# ---------------------------------------------------------------- listing and verification

@dataclass
class Checkpoint:
    """One tag directory as found on storage."""

    tag: str
    kind: str                 # "cpsr" (has our metadata) or "deepspeed" (no manifest)
    started_ns: int           # order of checkpoints: rank 0's start time, or the directory mtime
    iteration: Optional[int]
    size: int
    committed: bool
    problems: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return self.committed and not self.problems


def scan(ckpt_dir: str) -> list[Checkpoint]:
    """Tag directories of ``ckpt_dir`` from metadata only (no data read), oldest first."""
    found = []
    try:
        names = sorted(os.listdir(ckpt_dir))
    except FileNotFoundError:
        return found
    for name in names:
        tag_dir = os.path.join(ckpt_dir, name)
        if name.startswith(".") or not os.path.isdir(tag_dir):
            continue
        try:
            ckpt = _describe(tag_dir, name)
        except FileNotFoundError:
            continue
        if ckpt is not None:
            found.append(ckpt)
    return sorted(found, key=lambda c: c.started_ns)


def _describe(tag_dir: str, tag: str) -> Optional[Checkpoint]:
    """The checkpoint in ``tag_dir``, or None for a directory that holds none (the journal, say)."""
    manifests = read_manifests(tag_dir)
    commit = read_commit(tag_dir)
    size = sum(_size(os.path.join(r, f)) for r, _, fs in os.walk(tag_dir) for f in fs)
    if not manifests and commit is None:
        if _unfinished_snapshot(tag_dir):
            kind = "cpsr"
        elif any(DEEPSPEED_FILE_RE.match(n) for n in os.listdir(tag_dir)):
            kind = "deepspeed"
        else:
            return None
        return Checkpoint(tag, kind, os.stat(tag_dir).st_mtime_ns, tag_iteration(tag), size, committed=False)
    meta = commit or next(iter(manifests.values()))
    return Checkpoint(tag, "cpsr", meta["started_ns"], meta.get("iteration"), size, committed=commit is not None)


def _size(path: str) -> int:
    # Writers rename and retention deletes while we look: a vanished file counts as empty.
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def _unfinished_snapshot(tag_dir: str) -> bool:
    """A tag directory holding only our temporary and snapshot files, at least one: a persist cut short.

    An empty directory is not one: the run directory holds other directories of ours
    (journal, fault markers) that may be empty, and retention must never touch them.
    """
    seen = False
    for name in os.listdir(tag_dir):
        path = os.path.join(tag_dir, name)
        if TEMP_RE.match(name):
            seen = True
            continue
        try:
            with open(path, "rb") as f:
                if f.read(len(MAGIC)) != MAGIC:
                    return False
            seen = True
        except FileNotFoundError:
            continue
        except IsADirectoryError:
            return False
    return seen


def verify(ckpt_dir: str, ckpt: Checkpoint, read_data: bool = True) -> list[str]:
    """Problems of a checkpoint of ours, each naming the rank or file; empty means loadable.

    Checks every rank's manifest is there and every listed file has its size and,
    with ``read_data``, its checksum.
    """
    tag_dir = os.path.join(ckpt_dir, ckpt.tag)
    commit = read_commit(tag_dir)
    manifests = read_manifests(tag_dir)
    if commit is None and not manifests:
        return [f"{ckpt.tag}: no manifest, snapshot files only (partial checkpoint)"]
    world = commit["world_size"] if commit else max(m["world_size"] for m in manifests.values())
    problems = [f"{ckpt.tag}: rank {r} manifest {manifest_name(r)} missing (partial checkpoint)"
                for r in range(world) if r not in manifests]
    if commit is None:
        problems.append(f"{ckpt.tag}: not committed ({COMMIT} missing)")
    for man in manifests.values():
        for rel, entry in man["files"].items():
            path = os.path.join(tag_dir, rel)
            try:
                if read_data:
                    with open(path, "rb") as f:
                        if os.fstat(f.fileno()).st_size != entry["size"]:
                            raise CheckpointError(f"{path}: size {os.fstat(f.fileno()).st_size} != manifest {entry['size']} (truncated)")
                        check_digest(path, hash_file(f, man["checksum"]), entry)
                elif os.path.getsize(path) != entry["size"]:
                    raise CheckpointError(f"{path}: size {os.path.getsize(path)} != manifest {entry['size']} (truncated)")
            except FileNotFoundError:
                problems.append(f"{path}: missing")
            except CheckpointError as err:
                problems.append(str(err))
    return problems


def list_checkpoints(ckpt_dir: str, read_data: bool = True) -> list[Checkpoint]:
    """All checkpoints, oldest first, ours verified; DeepSpeed ones count as committed when ``latest`` names them."""
    latest = read_latest(ckpt_dir)
    found = scan(ckpt_dir)
    for c in found:
        if c.kind == "cpsr":
            c.problems = verify(ckpt_dir, c, read_data)
        else:
            c.committed = c.tag == latest
    return found


def loadable_checkpoints(ckpt_dir: str, read_data: bool = True) -> list[Checkpoint]:
    """The valid checkpoints, oldest first; each rejected one newer than the newest valid is logged.

    Every rank reaches the same answer from the same shared directory, so no
    collective is needed.
    """
    found = list_checkpoints(ckpt_dir, read_data)
    for c in reversed(found):
        if c.valid:
            break
        if c.kind == "cpsr":
            log.error("checkpoint %s is not loadable, falling back to an older one: %s", c.tag, "; ".join(c.problems))
    return [c for c in found if c.valid]


def select_checkpoint(ckpt_dir: str, read_data: bool = True) -> Optional[str]:
    """The tag to load: the newest valid checkpoint, or None when there is none."""
    valid = loadable_checkpoints(ckpt_dir, read_data)
    return valid[-1].tag if valid else None
