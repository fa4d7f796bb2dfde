"""The file system, as checkpoint storage uses it: every write atomic and durable, every removal atomic.

One small interface, in the manner of PyTorch DCP's ``FileSystemBase``: :class:`FileSystem`'s
methods are the file-system effects storage builds on, each with its contract, and ``fs`` is
the one instance everything writes through. A file is written to a hidden temporary name,
fsynced, renamed, and its directory fsynced, so a reader sees either nothing or the whole
file; a directory is renamed away before it is deleted, so a reader never sees it half gone.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import queue
import shutil
import threading
import uuid
from typing import Any, Iterable, Iterator, Optional

import numpy as np

from cpsr_ds.checkpoint.engines.throttle import Throttle
from cpsr_ds.checkpoint.storage.fileformat import PAGE, new_hasher

POLL_S = 0.02  # how often a thread waiting on other ranks' files or word looks again


class FileSystem:
    """Local POSIX file systems, with direct I/O where the file system has it."""

    @staticmethod
    def temp_name(path: str) -> str:
        """The hidden name ``path`` is written under until it is whole."""
        # Hidden so that DeepSpeed's globs over layer files never pick up a half-written one.
        d, name = os.path.split(path)
        return os.path.join(d, f".{name}.tmp{os.getpid()}")

    @staticmethod
    def fsync_dir(path: str) -> None:
        """Make the names in directory ``path`` (a rename, a new file) durable."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_atomic(self, path: str, chunks: Iterable, algorithm: Optional[str] = None,
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
        tmp = self.temp_name(path)
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
            self.fsync_dir(os.path.dirname(path) or ".")
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

    def write_json_atomic(self, path: str, obj: Any, mode: Optional[int] = None) -> None:
        """``obj`` as JSON in ``path``, as :meth:`write_atomic` writes."""
        self.write_atomic(path, [json.dumps(obj, indent=1, sort_keys=True).encode()], mode=mode)

    def append_durable(self, path: str, text: str, first: bool) -> None:
        """Append ``text`` to ``path`` and fsync it (``first``: start the file anew, and make its name durable).
        Not atomic: a reader may see a last line cut short, and must stop there."""
        with open(path, "w" if first else "a") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if first:
            self.fsync_dir(os.path.dirname(path))

    def publish_once(self, path: str, data: bytes) -> bool:
        """Create ``path`` holding ``data``, durably, unless a file is there already (a hard link fails where one
        is: whoever makes it first wins); whether this call made it."""
        tmp = f"{self.temp_name(path)}-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
            self.fsync_dir(os.path.dirname(path))
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        return True

    def rename(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst`` (a file there, or an empty directory, is replaced) and make it durable."""
        os.replace(src, dst)
        self.fsync_dir(os.path.dirname(dst))

    @staticmethod
    def remove_tree(path: str, trash: str) -> bool:
        """Delete the directory ``path``, renamed to ``trash`` (beside it) first, so that no reader sees it half
        deleted; False where it was not there. Another error of the rename propagates."""
        try:
            os.replace(path, trash)
        except FileNotFoundError:
            return False
        shutil.rmtree(trash, ignore_errors=True)
        return True


fs = FileSystem()


def describe_error(err: OSError) -> str:
    """``ENOSPC No space left on device: /ckpt/x`` -- the cause an operator can act on.

    A failed rename names both paths (``tmp -> destination``): the destination is often the one in the way.
    """
    code = errno.errorcode.get(err.errno, "") if err.errno else ""
    where = f": {err.filename}" if err.filename else ""
    if err.filename2:
        where += f" -> {err.filename2}"
    return f"{code} {err.strerror or err}{where}".strip()


def cause(err: OSError) -> str:
    """``EACCES Permission denied``: what went wrong, for a message that names the path itself."""
    return f"{errno.errorcode.get(err.errno, '')} {err.strerror or err}".strip()


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
