"""On-disk layout of checkpoints: file format, manifests, commit records, ``latest``, retention.

A checkpoint directory ``CKPT_DIR`` holds one directory per tag, named as DeepSpeed
names them (``global_step100``), and DeepSpeed's plain-text ``latest`` file::

    CKPT_DIR/latest                           tag of the newest committed checkpoint
    CKPT_DIR/TAG/<files DeepSpeed saves>      snapshot files (see fileformat.py)
    CKPT_DIR/TAG/cpsr_manifest.rank00003.json rank 3's files: size and xxhash digest each
    CKPT_DIR/TAG/cpsr_commit.json             written by rank 0 once every rank's manifest is there
    CKPT_DIR/TAG/cpsr_progress.rank00003.jsonl rank 3's files landed so far, while it persists them

Every file is written to a hidden temporary name, fsynced, renamed, and its directory
fsynced, so a reader sees either nothing or the whole file. A rank writes its
manifest only after its files are durable; rank 0 writes the commit record only after
all ``world_size`` manifests exist, and moves ``latest`` only after the commit record
is durable. Hence ``latest`` never names a checkpoint that is incomplete on any rank.
Until its manifest is written, a rank records each file as it lands (size, digest and
attempt, one line each) in its progress record, which the manifest then replaces: the
landed files of a checkpoint a failure cut short can still be checked (recovery's
``in_flight`` source reads the parameters there).

Checkpoints are ordered by ``order_key`` (iteration, then the job attempt that wrote
them), never by a clock: clocks differ between hosts and jump. Nothing read from
storage is trusted: a damaged manifest, commit record or ``latest`` is reported by name
and the checkpoint it belongs to is skipped, never a crash. A directory holding any of
our snapshot files is ours (``cpsr``) and loadable only with every manifest and the
commit record; one of ``torch.save`` files without manifests (DeepSpeed's own engine)
is at best ``unverified``, and is opened and checked before it is chosen.
"""

from __future__ import annotations

import contextlib
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
from typing import Any, Callable, Collection, Iterable, Iterator, NamedTuple, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cpsr_ds.checkpoint.storage.fileformat import (MAGIC, PAGE, CheckpointError, check_size, new_hasher, read_skeleton,
                                           read_snapshot, scan_file)
from cpsr_ds.checkpoint.engines.throttle import Throttle
from cpsr_ds.config import CheckpointConfig

log = logging.getLogger(__name__)

LATEST = "latest"
COMMIT = "cpsr_commit.json"
MANIFEST_RE = re.compile(r"^cpsr_manifest\.rank(\d{5})\.json$")
PROGRESS_RE = re.compile(r"^cpsr_progress\.rank(\d{5})\.jsonl$")
TEMP_RE = re.compile(r"^\..+\.tmp(\d+)$")
TRASH_PREFIX = ".trash-"
# Other nodes' parts kept for them (node-local storage): a checkpoint directory of its own, see replica.py.
REPLICAS = "replicas"
POLL_S = 0.02  # how often a thread waiting on other ranks' files or word looks again
DEEPSPEED_FILE_RE = re.compile(r".*(model_states|optim_states)\.pt$")
_MAX_TAG = 4096
Checksum = CheckpointConfig.model_fields["checksum"].annotation  # the algorithms the config allows


class MetadataError(CheckpointError, ValueError):
    """A damaged manifest or commit record; the message names the file and what is wrong."""


def manifest_name(rank: int) -> str:
    return f"cpsr_manifest.rank{rank:05d}.json"


def progress_name(rank: int) -> str:
    return f"cpsr_progress.rank{rank:05d}.jsonl"


def record_progress(tag_dir: str, rank: int, rel: str, entry: dict, attempt: int, algorithm: str,
                    first: bool) -> None:
    """Add file ``rel``, durable on storage with its manifest ``entry``, to ``rank``'s progress record in
    ``tag_dir`` (``first``: the first file of this attempt's part, which starts the record anew)."""
    line = json.dumps({"attempt": attempt, "checksum": algorithm, "file": rel, **entry}) + "\n"
    path = os.path.join(tag_dir, progress_name(rank))
    with open(path, "w" if first else "a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
    if first:
        fsync_dir(tag_dir)


def forget_progress(tag_dir: str, rank: int) -> None:
    """Remove ``rank``'s progress record, which its manifest has replaced."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(tag_dir, progress_name(rank)))


class Landed(NamedTuple):
    """One file a rank's progress record says landed: its manifest entry and the algorithm of its digest."""

    entry: dict
    algorithm: str
    attempt: int


def read_progress(tag_dir: str) -> dict[str, Landed]:
    """The files every rank's progress record in ``tag_dir`` lists, by path relative to it. Only the lines of a
    record's newest attempt count (an older attempt's file may have been written again since); a line that is
    not one (a write cut short) ends its record there."""
    landed: dict[str, Landed] = {}
    try:
        names = sorted(n for n in os.listdir(tag_dir) if PROGRESS_RE.match(n))
    except FileNotFoundError:
        return landed
    for name in names:
        path = os.path.join(tag_dir, name)
        try:
            with open(path, errors="replace") as f:
                lines = _progress_lines(f)
        except OSError as err:
            log.warning("%s: unreadable, skipped: %s", path, _cause(err))
            continue
        newest = max((file.attempt for _, file in lines), default=None)
        landed.update((rel, file) for rel, file in lines if file.attempt == newest)
    return landed


def landed_files(tag_dir: str) -> dict[str, Landed]:
    """The files of a checkpoint that did not commit known to have landed whole: those its ranks' progress
    records list (:func:`read_progress`) and those of the sound manifests of the ranks that finished their part
    (a manifest replaces its rank's record)."""
    landed = read_progress(tag_dir)
    try:
        manifests = _read_manifests(tag_dir).manifests
    except FileNotFoundError:
        return landed
    for man in manifests.values():
        landed.update((rel, Landed(entry, man["checksum"], man.get("attempt", 0))) for rel, entry in man["files"].items())
    return landed


def _progress_lines(f) -> list[tuple[str, Landed]]:
    lines = []
    for text in f:
        try:
            line = ProgressLine.model_validate_json(text)
        except ValidationError:
            break
        entry = line.model_dump(include=set(FileEntry.model_fields), exclude_defaults=True)
        lines.append((line.file, Landed(entry, line.checksum, line.attempt)))
    return lines


def tag_iteration(tag: str) -> Optional[int]:
    """The iteration a DeepSpeed tag stands for (``global_step120`` -> 120), if it ends in digits."""
    m = re.search(r"(\d+)$", tag)
    return int(m.group(1)) if m else None


def order_key(iteration: Optional[int], attempt: int) -> tuple[int, int]:
    """The order of checkpoints: by iteration (a tag without one first), then by the job attempt that wrote it."""
    return (-1 if iteration is None else iteration, attempt)


def _iteration_attempt(tag: str, record: dict) -> tuple[Optional[int], int]:
    iteration = record.get("iteration")
    return (tag_iteration(tag) if iteration is None else iteration), record.get("attempt", 0)


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
                 direct: bool = False, throttle: Optional[Throttle] = None,
                 mode: Optional[int] = None) -> tuple[int, Optional[str]]:
    """Write ``chunks`` (bytes-like) to ``path`` durably and atomically.

    Returns (size, hex digest or None). On any error the temporary file is removed and
    the error propagates; ``path`` is then untouched. ``direct``: bypass the page cache
    (O_DIRECT) for chunks that start on a page and span whole pages, as host arenas do;
    the rest of the file, and file systems without direct I/O, go through it.
    ``throttle``: the write rate limit, waited on piece by piece. ``mode``: the file's
    exact mode, whatever the umask; None: 0644 less the umask.
    """
    tmp = temp_name(path)
    hashing = _Hashing(algorithm) if algorithm else None
    size = 0
    fd, direct = _open_for_writing(tmp, direct, 0o644 if mode is None else mode)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        for chunk in chunks:
            data = np.frombuffer(chunk, dtype=np.uint8)
            if hashing is not None:
                hashing.put(data)
            for piece in _paced(data, throttle):
                if direct:
                    direct = _write_direct(fd, piece)
                else:
                    _write_all(fd, piece)
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


def _paced(data: np.ndarray, throttle: Optional[Throttle]) -> Iterator[np.ndarray]:
    """``data`` in pieces, each once ``throttle`` lets it pass; whole pages but the last, so O_DIRECT stays on."""
    if throttle is None:
        yield data
        return
    step = max(PAGE, throttle.burst - throttle.burst % PAGE)
    for start in range(0, len(data), step):
        piece = data[start:start + step]
        throttle.take(len(piece))
        yield piece


def _open_for_writing(path: str, direct: bool, mode: int) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if direct:
        try:
            return os.open(path, flags | os.O_DIRECT, mode), True
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
    return os.open(path, flags, mode), False


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


def write_json_atomic(path: str, obj: Any, mode: Optional[int] = None) -> None:
    write_atomic(path, [json.dumps(obj, indent=1, sort_keys=True).encode()], mode=mode)


def describe_error(err: OSError) -> str:
    """``ENOSPC No space left on device: /ckpt/x`` -- the cause an operator can act on.

    A failed rename names both paths (``tmp -> destination``): the destination is often the one in the way.
    """
    code = errno.errorcode.get(err.errno, "") if err.errno else ""
    where = f": {err.filename}" if err.filename else ""
    if err.filename2:
        where += f" -> {err.filename2}"
    return f"{code} {err.strerror or err}{where}".strip()


def _cause(err: OSError) -> str:
    """``EACCES Permission denied``: what went wrong, for a message that names the path itself."""
    return f"{errno.errorcode.get(err.errno, '')} {err.strerror or err}".strip()


# ---------------------------------------------------------------- manifests and commits

class _Record(BaseModel):
    # Strict: a value of the wrong type is damage, not something to coerce.
    model_config = ConfigDict(extra="allow", strict=True)

    tag: str
    world_size: int = Field(gt=0)
    iteration: Optional[int] = None
    attempt: int = Field(0, ge=0)


class CommitRecord(_Record):
    """``cpsr_commit.json``: rank 0 saw every rank's manifest. Other keys (``started_ns``) are information only.

    ``ranks`` and ``stages``: the ranks, and their pipeline stages, whose parts a checkpoint
    of some stages holds (``checkpoint.per_stage``); absent: every rank's (a full cut).
    """

    ranks: Optional[list[int]] = None
    stages: Optional[list[int]] = None

    @model_validator(mode="after")
    def _ranks_in_world(self) -> "CommitRecord":
        outside = [r for r in self.ranks or () if not 0 <= r < self.world_size]
        if outside:
            raise ValueError(f"ranks {outside} not in a world of {self.world_size}")
        return self


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    size: int = Field(ge=0)
    digest: str
    # Key paths of the floating tensors that held NaN or Inf when the file was written.
    nonfinite: list[str] = []


class Manifest(_Record):
    """``cpsr_manifest.rankNNNNN.json``: the files one rank wrote, all durable before it."""

    rank: int = Field(ge=0)
    checksum: Checksum
    files: dict[str, FileEntry]
    # Why the rank gave the checkpoint up; rank 0 then gives it up without waiting.
    failed: Optional[str] = None

    @field_validator("files")
    @classmethod
    def _inside_the_checkpoint(cls, files: dict) -> dict:
        for rel in files:
            _inside_the_checkpoint(rel)
        return files

    @model_validator(mode="after")
    def _rank_in_world(self) -> "Manifest":
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} not below world_size {self.world_size}")
        return self


class ProgressLine(FileEntry):
    """One line of ``cpsr_progress.rankNNNNN.jsonl``: a file that landed, with the entry its manifest will list."""

    attempt: int = Field(ge=0)
    checksum: Checksum
    file: str

    @field_validator("file")
    @classmethod
    def _inside_the_checkpoint(cls, rel: str) -> str:
        return _inside_the_checkpoint(rel)


def _inside_the_checkpoint(rel: str) -> str:
    if os.path.isabs(rel) or os.path.normpath(rel).split(os.sep)[0] in ("..", "."):
        raise ValueError(f"{rel!r} is not a path inside the checkpoint")
    return rel


def _read_record(path: str, schema: type[BaseModel]) -> dict:
    """The record in ``path``, checked against ``schema``; FileNotFoundError if absent, MetadataError if damaged."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise
    except OSError as err:
        raise MetadataError(f"{path}: unreadable: {_cause(err)}") from None
    try:
        return schema.model_validate_json(raw).model_dump()
    except ValidationError as err:
        what = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" if e["loc"] else e["msg"]
                         for e in err.errors())
        raise MetadataError(f"{path}: damaged: {what}") from None


def _read_manifest(path: str, rank: int) -> dict:
    man = _read_record(path, Manifest)
    if man["rank"] != rank:
        raise MetadataError(f"{path}: damaged: says rank {man['rank']}")
    return man


@dataclass
class _Metadata:
    """A tag directory's manifests and commit record; damaged ones are problems."""

    manifests: dict[int, dict] = field(default_factory=dict)  # the sound ones, by rank
    present: set[int] = field(default_factory=set)            # ranks with a manifest file, sound or not
    commit: Optional[dict] = None
    committed: bool = False                                   # a commit record is there, sound or not
    problems: list[str] = field(default_factory=list)
    # Manifests an earlier attempt's larger world left under a tag the committed attempt wrote again: not its.
    stale: dict[int, dict] = field(default_factory=dict)

    @property
    def found(self) -> bool:
        return bool(self.present) or self.committed


def _read_manifests(tag_dir: str, ranks: Optional[Collection[int]] = None) -> _Metadata:
    """The manifests of ``ranks`` (None: of every rank) in ``tag_dir``."""
    meta = _Metadata()
    for name in os.listdir(tag_dir):
        m = MANIFEST_RE.match(name)
        if not m or (ranks is not None and int(m.group(1)) not in ranks):
            continue
        rank = int(m.group(1))
        try:
            meta.manifests[rank] = _read_manifest(os.path.join(tag_dir, name), rank)
        except FileNotFoundError:  # deleted while we looked
            continue
        except MetadataError as err:
            meta.problems.append(str(err))
        meta.present.add(rank)
    return meta


def _read_metadata(tag_dir: str, ranks: Optional[Collection[int]] = None) -> _Metadata:
    meta = _read_manifests(tag_dir, ranks)
    try:
        meta.commit = read_commit(tag_dir)
        meta.committed = meta.commit is not None
    except MetadataError as err:
        meta.problems.append(str(err))
        meta.committed = True
    if meta.commit is not None:
        # A restart on fewer ranks writes a tag again; each rank forgets only its own earlier manifest.
        world, attempt = meta.commit["world_size"], meta.commit.get("attempt", 0)
        meta.stale = {r: m for r, m in meta.manifests.items() if r >= world and m.get("attempt", 0) != attempt}
        meta.manifests = {r: m for r, m in meta.manifests.items() if r not in meta.stale}
        meta.present -= set(meta.stale)
    return meta


def read_manifests(tag_dir: str) -> dict[int, dict]:
    """Every rank manifest in ``tag_dir``, by rank; a damaged one raises :class:`MetadataError` naming it."""
    try:
        meta = _read_manifests(tag_dir)
    except FileNotFoundError:
        return {}
    if meta.problems:
        raise MetadataError(meta.problems[0])
    return meta.manifests


def manifest_entry(manifests: dict[int, dict], tag_dir: str, path: str) -> Optional[tuple[dict, str]]:
    """The manifest entry of ``path`` and the checksum algorithm that made it, if any rank lists it."""
    rel = os.path.relpath(path, tag_dir)
    for man in manifests.values():
        if rel in man["files"]:
            return man["files"][rel], man["checksum"]
    return None


_bytes_loaded = 0  # by load_file in this process: what a restart read (recovery's report)
_loaded_once: Optional[dict] = None  # inside reading_each_file_once(): path -> what load_file returned


def bytes_loaded() -> int:
    """The bytes of every checkpoint file :func:`load_file` has read in this process."""
    return _bytes_loaded


@contextlib.contextmanager
def reading_each_file_once():
    """Around DeepSpeed's ``load_checkpoint`` (the plugin's engine wraps it): a file loaded again gets what its
    first load returned.

    DeepSpeed's SDLoader loads every model-states file twice in a row: its
    ``check_ckpt_list`` reads the first file of each list whole to see its
    ``mp_world_size``, and throws it away. With pipeline layer files that is the module's
    weights read twice. The first load's result, unused by the check, serves the second
    (once); what is kept goes when the block ends.

    The first file of the list is ``mp_rank_00_model_states.pt`` on every pipeline stage,
    which without ZeRO holds stage 0's optimizer state: a later stage's rank would read it
    whole for one integer. Within the block the check reads that integer from the file's
    header instead (:func:`_check_from_header`).
    """
    global _loaded_once
    from deepspeed.runtime.state_dict_factory import SDLoaderBase

    _loaded_once = {}
    check = SDLoaderBase.check_ckpt_list
    SDLoaderBase.check_ckpt_list = lambda loader: _check_from_header(loader, check)
    try:
        yield
    finally:
        SDLoaderBase.check_ckpt_list = check
        _loaded_once = None


def _check_from_header(loader, check: Callable) -> None:
    """DeepSpeed's ``SDLoaderBase.check_ckpt_list`` (``check``) on the header of a file in our format: the list
    holds as many files as the first one's ``mp_world_size`` says."""
    global _bytes_loaded
    found = read_skeleton(loader.ckpt_list[0]) if loader.ckpt_list else None
    if found is None or not isinstance(found[0], dict):
        return check(loader)
    skeleton, header_bytes = found
    _bytes_loaded += header_bytes
    saved = skeleton.get("mp_world_size")
    if saved is not None and len(loader.ckpt_list) != saved:
        raise CheckpointError(f"{loader.ckpt_list[0]}: checkpoint count {len(loader.ckpt_list)} is different from "
                              f"saved mp_world_size {saved}")


def load_file(path: str, map_location: Any = None) -> Any:
    """A file of a checkpoint, checked against its manifests; files of DeepSpeed's own format load as they are."""
    global _bytes_loaded
    if _loaded_once is not None and path in _loaded_once:
        return _loaded_once.pop(path)
    _bytes_loaded += os.path.getsize(path)
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


def forget_metadata(tag_dir: str, rank: int) -> None:
    """Remove what an earlier run left under a tag for ``rank`` (its manifest; on rank 0 the commit record),
    so that it cannot be mistaken for this run's."""
    for name in [manifest_name(rank)] + ([COMMIT] if rank == 0 else []):
        try:
            os.unlink(os.path.join(tag_dir, name))
        except FileNotFoundError:
            pass
        except OSError as err:
            log.warning("%s: could not remove the stale %s: %s", tag_dir, name, _cause(err))


def read_latest(ckpt_dir: str) -> Optional[str]:
    """The tag ``latest`` names; None when it is missing, or damaged (logged with its path and what is wrong)."""
    path = os.path.join(ckpt_dir, LATEST)
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_TAG + 1)
    except FileNotFoundError:
        return None
    except OSError as err:
        problem = f"unreadable: {_cause(err)}"
    else:
        problem = _tag_problem(raw)
    if problem:
        log.warning("%s: damaged, ignored: %s", path, problem)
        return None
    return raw.decode().strip()


def _tag_problem(raw: bytes) -> Optional[str]:
    """What makes the content of ``latest`` no tag, if anything."""
    try:
        tag = raw.decode().strip()
    except UnicodeDecodeError:
        return f"not text: {raw[:40]!r}"
    if len(raw) > _MAX_TAG:
        return f"longer than {_MAX_TAG} bytes"
    if not tag:
        return "empty"
    if tag in (".", "..") or tag.startswith(".") or "/" in tag or "\0" in tag:
        return f"{tag!r} is not a checkpoint tag"
    return None


def read_commit(tag_dir: str) -> Optional[dict]:
    """The commit record of ``tag_dir``; None if there is none, :class:`MetadataError` if it is damaged."""
    try:
        return _read_record(os.path.join(tag_dir, COMMIT), CommitRecord)
    except FileNotFoundError:
        return None


def commit_checkpoint(ckpt_dir: str, tag: str, record: dict) -> bool:
    """Make ``tag`` committed and move ``latest`` to it if it is the newest; returns whether it moved.

    ``record`` carries ``iteration`` and ``attempt``, the order of checkpoints (``order_key``);
    ``latest`` also moves when what it names is missing or damaged, never to a checkpoint
    of some stages only (``ranks`` in the record). Retention is the caller's next step
    (``apply_retention``).
    """
    write_json_atomic(os.path.join(ckpt_dir, tag, COMMIT), record)
    if record.get("ranks") is not None:
        return False  # ``latest`` names a checkpoint every rank can load: a full cut
    current = _sound(ckpt_dir, read_latest(ckpt_dir))
    moved = current is None or current.tag == tag or order_key(*_iteration_attempt(tag, record)) >= current.key
    if moved:
        path = os.path.join(ckpt_dir, LATEST)
        if os.path.isdir(path) and not os.path.islink(path):
            # No rename can replace a directory: out of the way with it, as with a checkpoint.
            log.warning("%s: a directory where the latest tag belongs; removing it", path)
            remove_checkpoint(ckpt_dir, LATEST)
        write_atomic(path, [tag.encode()])
    return moved


def _sound(ckpt_dir: str, tag: Optional[str]) -> Optional[Checkpoint]:
    """Checkpoint ``tag`` if it is there and nothing is wrong with it short of reading its data."""
    if tag is None:
        return None
    try:
        ckpt = _describe(os.path.join(ckpt_dir, tag), tag)
    except OSError:
        return None
    return ckpt if ckpt is not None and not verify(ckpt_dir, ckpt, read_data=False) else None


def apply_retention(ckpt_dir: str, keep_last: int, protected: Callable[[str], bool],
                    ranks: Optional[Collection[int]] = None) -> list[str]:
    """Delete our sound committed checkpoints beyond those :func:`retained` keeps; returns the tags deleted.

    Only directories carrying our manifests, commit records or snapshot files are
    touched, and never the one ``latest`` names. Sound: nothing wrong short of reading
    the data (a manifest listing a non-finite tensor is wrong) in the parts of ``ranks``
    (None: every rank's). Uncommitted and damaged ones go only when older than the oldest kept.
    """
    ours = [c for c in scan(ckpt_dir) if c.kind == "cpsr"]
    sound = [c for c in ours if c.committed and not verify(ckpt_dir, c, read_data=False, ranks=ranks)]
    if not sound:
        return []
    kept = retained(sound, keep_last)
    floor = min(c.key for c in sound if c.tag in kept)
    sound_tags = {c.tag for c in sound}
    latest = read_latest(ckpt_dir)
    doomed = [c.tag for c in ours if c.tag not in kept and c.tag != latest and not protected(c.tag)
              and (c.tag in sound_tags or c.key < floor)]
    _remove_leftovers(ckpt_dir)
    for tag in doomed:
        remove_checkpoint(ckpt_dir, tag)
    return doomed


def retained(sound: list[Checkpoint], keep_last: int) -> set[str]:
    """The tags to keep of ``sound`` committed checkpoints (oldest first): for every rank the ``keep_last``
    newest holding its part (the predictor's history of its stage), and the newest full cut (the one
    recompute-based recovery restores). Without checkpoints of some stages: the ``keep_last`` newest."""
    world = max((c.world_size for c in sound), default=0)
    kept = {c.tag for c in [c for c in sound if c.full][-1:]}
    for rank in range(world):
        kept.update(c.tag for c in [c for c in sound if c.holds(rank)][-keep_last:])
    return kept or {c.tag for c in sound[-keep_last:]}


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
    kind: str                 # "cpsr" (our metadata or snapshot files) or "deepspeed" (torch.save files only)
    iteration: Optional[int]
    attempt: int              # the job attempt that wrote it; with ``iteration`` the order of checkpoints
    size: int
    committed: bool           # DeepSpeed's format: ``latest`` names it or a newer one
    problems: list[str] = field(default_factory=list)
    ranks: Optional[tuple[int, ...]] = None  # the ranks whose parts it holds (checkpoint.per_stage); None: all
    world_size: int = 0       # of the job that wrote it; 0: unknown (DeepSpeed's format)

    @property
    def key(self) -> tuple[int, int]:
        return order_key(self.iteration, self.attempt)

    @property
    def full(self) -> bool:
        """Every rank's part: a consistent cut of the whole job."""
        return self.ranks is None

    def holds(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    @property
    def valid(self) -> bool:
        """Loadable: committed, nothing found wrong."""
        return self.committed and not self.problems

    @property
    def status(self) -> str:
        """valid, unverified (DeepSpeed's format: no manifest vouches for it), invalid or not committed."""
        if not self.committed:
            return "not committed"
        if self.problems:
            return "invalid"
        return "valid" if self.kind == "cpsr" else "unverified"


def scan(ckpt_dir: str) -> list[Checkpoint]:
    """Tag directories of ``ckpt_dir`` from metadata only (no data read), oldest first by ``order_key``."""
    found = []
    try:
        names = sorted(os.listdir(ckpt_dir))
    except FileNotFoundError:
        return found
    for name in names:
        tag_dir = os.path.join(ckpt_dir, name)
        if name.startswith(".") or name == REPLICAS or not os.path.isdir(tag_dir):
            continue
        try:
            ckpt = _describe(tag_dir, name)
        except FileNotFoundError:  # deleted while we looked
            continue
        except OSError as err:
            log.warning("%s: unreadable, skipped: %s", tag_dir, _cause(err))
            continue
        if ckpt is not None:
            found.append(ckpt)
    return sorted(found, key=lambda c: (c.key, c.tag))


def _describe(tag_dir: str, tag: str) -> Optional[Checkpoint]:
    """The checkpoint in ``tag_dir``, or None for a directory that holds none (the journal, say)."""
    meta = _read_metadata(tag_dir)
    files = _files(tag_dir)
    size = sum(files.values())
    if not meta.found:
        kind = _kind_without_metadata(tag_dir, files)
        if kind is None:
            return None
        return Checkpoint(tag, kind, tag_iteration(tag), 0, size, committed=False)
    record = meta.commit or next((meta.manifests[r] for r in sorted(meta.manifests)), {})
    ranks = record.get("ranks") if meta.commit else None
    return Checkpoint(tag, "cpsr", *_iteration_attempt(tag, record), size, committed=meta.committed,
                      ranks=None if ranks is None else tuple(ranks), world_size=record.get("world_size", 0))


def _files(tag_dir: str) -> dict[str, int]:
    """The size of every file under ``tag_dir``, by path relative to it."""
    return {os.path.relpath(os.path.join(root, name), tag_dir): _size(os.path.join(root, name))
            for root, _, names in os.walk(tag_dir) for name in names}


def _data_files(files: Iterable[str]) -> list[str]:
    """The files a checkpoint's manifests must list: all but our metadata and hidden (temporary) files."""
    return sorted(rel for rel in files
                  if not any(part.startswith(".") for part in rel.split(os.sep))
                  and rel != COMMIT and not MANIFEST_RE.match(rel) and not PROGRESS_RE.match(rel))


def _size(path: str) -> int:
    # Writers rename and retention deletes while we look: a vanished file counts as empty.
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def _kind_without_metadata(tag_dir: str, files: Iterable[str]) -> Optional[str]:
    """"cpsr" if any file is a snapshot or temporary file of ours (a persist cut short), "deepspeed" for
    DeepSpeed's files alone, None for other directories (the journal, fault markers: retention must not touch them).
    """
    names = [os.path.basename(rel) for rel in files]
    if any(TEMP_RE.match(n) for n in names) or any(_has_magic(os.path.join(tag_dir, rel)) for rel in files):
        return "cpsr"
    if any(DEEPSPEED_FILE_RE.match(n) for n in names):
        return "deepspeed"
    return None


def _has_magic(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def verify(ckpt_dir: str, ckpt: Checkpoint, read_data: bool = True,
           ranks: Optional[Collection[int]] = None, need_commit: bool = True) -> list[str]:
    """Problems of a checkpoint, each naming the file, rank or tensor; empty means loadable.

    Ours: every rank's manifest and the commit record are there and sound, the manifests
    list every file there is and no non-finite tensor, every file has its size and, with
    ``read_data``, its checksum and finite floating tensors (one read). DeepSpeed's
    format, only with ``read_data``: every file loads and its floating tensors are finite.
    ``ranks``: check only these ranks' parts (a node's own directory holds no others');
    files no manifest lists then go unnoticed. ``need_commit``: a missing commit record is a problem.
    """
    tag_dir = os.path.join(ckpt_dir, ckpt.tag)
    try:
        meta = _read_metadata(tag_dir, ranks)
        files = _files(tag_dir)
    except OSError as err:
        return [f"{tag_dir}: unreadable: {_cause(err)}"]
    if ckpt.kind == "deepspeed":
        if not read_data:
            return []
        return [p for rel in _data_files(files) for p in _check_file(os.path.join(tag_dir, rel), None, read_data)]
    if not meta.found:
        return [f"{ckpt.tag}: no manifest, snapshot files only (partial checkpoint)"]
    part = meta.commit.get("ranks") if meta.commit else None
    if part is not None:
        # A checkpoint of some stages: the other ranks wrote nothing into it, what they left is not its.
        ranks = sorted(set(part) if ranks is None else set(part) & set(ranks))
        meta.manifests = {r: m for r, m in meta.manifests.items() if r in ranks}
        meta.present &= set(ranks)
    problems = meta.problems + _incomplete(ckpt.tag, meta, ranks, need_commit)
    listed = {rel: (entry, man["checksum"]) for man in meta.manifests.values() for rel, entry in man["files"].items()}
    left = {rel for man in meta.stale.values() for rel in man["files"]}
    if not problems and ranks is None:
        # Every manifest is there and sound, so together they list every file of the checkpoint.
        problems += [f"{os.path.join(tag_dir, rel)}: listed in no rank manifest"
                     for rel in _data_files(files) if rel not in listed and rel not in left]
        if not listed:
            problems.append(f"{ckpt.tag}: the manifests list no files")
    for rel, (entry, algorithm) in sorted(listed.items()):
        problems += _check_file(os.path.join(tag_dir, rel), entry, read_data, algorithm)
    return problems


def _incomplete(tag: str, meta: _Metadata, ranks: Optional[Collection[int]] = None,
                need_commit: bool = True) -> list[str]:
    """Ranks (of ``ranks``, None: of the world) missing, disagreeing or giving up, and a missing commit record."""
    world = meta.commit["world_size"] if meta.commit else max(
        (m["world_size"] for m in meta.manifests.values()), default=0)
    expected = range(world) if ranks is None else sorted(ranks)
    problems = [f"{tag}: rank {r} manifest {manifest_name(r)} missing (partial checkpoint)"
                for r in expected if r not in meta.present]
    for r, man in sorted(meta.manifests.items()):
        if man["world_size"] != world:
            problems.append(f"{tag}: rank {r} manifest says world size {man['world_size']}, not {world}")
        if man["failed"]:
            problems.append(f"{tag}: rank {r} gave the checkpoint up: {man['failed']}")
    if need_commit and not meta.committed:
        problems.append(f"{tag}: not committed ({COMMIT} missing)")
    return problems


def _check_file(path: str, entry: Optional[dict], read_data: bool, algorithm: str = "xxh3_64") -> list[str]:
    """Problems of one file: its size against ``entry`` and the non-finite tensors it lists; with
    ``read_data`` also its checksum and every floating tensor (``entry`` None: DeepSpeed's format).
    """
    nonfinite = set(entry["nonfinite"]) if entry else set()
    try:
        if read_data:
            nonfinite.update(scan_file(path, entry, algorithm))
        elif entry is not None:
            check_size(path, os.path.getsize(path), entry)
    except FileNotFoundError:
        return [f"{path}: missing"]
    except CheckpointError as err:
        return [str(err)]
    except OSError as err:
        return [f"{path}: unreadable: {_cause(err)}"]
    return [f"{path}: non-finite values in {name}" for name in sorted(nonfinite)]


def list_checkpoints(ckpt_dir: str, read_data: bool = True, ranks: Optional[Collection[int]] = None) -> list[Checkpoint]:
    """All checkpoints, oldest first, each verified (the parts of ``ranks``, None: every rank's); those in
    DeepSpeed's format count as committed when ``latest`` names them or a newer checkpoint (DeepSpeed moves it
    only after a complete save)."""
    found = scan(ckpt_dir)
    latest = read_latest(ckpt_dir)
    named = next((c for c in found if c.tag == latest), None)
    for c in found:
        if c.kind == "deepspeed":
            c.committed = named is not None and c.key <= named.key
        if c.kind == "cpsr" or c.committed:
            c.problems = verify(ckpt_dir, c, read_data, ranks)
    return found


def loadable_checkpoints(ckpt_dir: str, read_data: bool = True) -> list[Checkpoint]:
    """The valid checkpoints, oldest first; each rejected one newer than the newest valid is logged.

    Checkpoints in DeepSpeed's format are opened and checked even without ``read_data``:
    nothing else vouches for them. Every rank reaches the same answer from the same
    shared directory, so no collective is needed.
    """
    found = list_checkpoints(ckpt_dir, read_data)
    if not read_data:
        for c in found:
            if c.kind == "deepspeed" and c.committed:
                c.problems = verify(ckpt_dir, c, read_data=True)
    for c in reversed(found):
        if c.valid:
            break
        if c.problems:
            log.error("checkpoint %s is not loadable, falling back to an older one: %s", c.tag, "; ".join(c.problems))
    return [c for c in found if c.valid]


def select_checkpoint(ckpt_dir: str, read_data: bool = True) -> Optional[str]:
    """The tag to load: the newest valid full cut (every rank's part), or None when there is none."""
    valid = [c for c in loadable_checkpoints(ckpt_dir, read_data) if c.full]
    return valid[-1].tag if valid else None
