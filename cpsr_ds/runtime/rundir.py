"""One job per run directory: rank 0 holds an exclusive ``flock`` on ``DIR/cpsr.lock``.

The lock lives as long as the descriptor, so a killed job's lock vanishes with its
process; the file itself stays and says who held it last. While holding it, the owner
writes its identity (host, pid, MASTER_ADDR:MASTER_PORT, start time, attempt) into it,
for the error a second job gets. Each successful lock counts one attempt of the job
(``DIR/cpsr_attempt.json``): 1 for the first start, 2 for the first restart, and so on;
checkpoints of a later attempt order after an earlier attempt's at the same iteration.
Every node's directory records it, so that a node whose node-local directory was lost
counts on from the others' records.

The lock file is made 0600 whatever the umask, and one another user owns is refused:
``flock`` needs only a descriptor open for reading, so another user who can open the
file can hold the lock and keep the run from starting. One that is held only by other
users' processes (a descriptor opened while an older lock file was still world-readable
keeps working after its mode changed) is replaced by a new file only this user can
open, with a warning; a job of this user holding it is reported as the job in the way.
A guard file (``GUARD``, 0600) serialises the taking and the replacing of the lock, so
that two jobs of ours never both replace it and both hold a lock.

:func:`claim` is collective: rank 0 locks and tells every rank the outcome, so every
rank gets the attempt, or the same error, and none waits for ever. Before anything is
written, :func:`check_writable` stops every rank with an error naming
``checkpoint.dir`` where any rank cannot write its run directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import stat
import tempfile
import time
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from cpsr_ds.checkpoint.storage.private_dir import FILE_MODE, PrivateDirError, describe, user
from cpsr_ds.checkpoint.storage.filesystem import fs
from cpsr_ds.config import CheckpointConfig, ConfigError
from cpsr_ds.recovery.agree import on_any_rank

LOCK = "cpsr.lock"
GUARD = ".cpsr.lock.guard"
GUARD_TIMEOUT_S = 30.0  # the guard is held for a few system calls
ATTEMPT = "cpsr_attempt.json"

log = logging.getLogger(__name__)


class RunDirectoryBusy(RuntimeError):
    """Another job holds the run directory, or it cannot be locked; the message names both."""


class RunDirLock:
    """The held lock of one run directory; :meth:`release` (or the process's end) frees it."""

    def __init__(self, directory: str, fd: int, attempt: int):
        self.directory, self.attempt = directory, attempt
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def identity(attempt: int) -> dict:
    master = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return {"host": socket.gethostname(), "pid": os.getpid(), "master": master,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "attempt": attempt}


def describe_owner(text: str) -> str:
    try:
        owner = json.loads(text)
        return (f"host {owner['host']} pid {owner['pid']} (master {owner['master']}, started {owner['started']}, "
                f"attempt {owner['attempt']})")
    except (ValueError, TypeError, KeyError):
        return f"an unidentified job (lock file content {text[:200]!r})"


def _attempt_in(text: str) -> int:
    """The attempt a record's JSON text holds; 0 where it holds none (absent, or cut short by a crash)."""
    try:
        return int(json.loads(text)["attempt"])
    except (ValueError, TypeError, KeyError):
        return 0


def _read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _read_all(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def recorded_attempt(directory: str) -> int:
    """The last attempt ``directory``'s attempt record holds; 0 where it holds none."""
    return _attempt_in(_read_text(os.path.join(directory, ATTEMPT)))


def _open_own(path: str) -> int:
    """``path`` opened for reading and writing, made 0600 (where missing, or found wider), never through a
    symlink; raises :class:`PrivateDirError` where another user owns it or it is a symlink."""
    remedy = (f"another user who can open it can hold the lock and keep this run from starting; remove it "
              f"(rm {path}) and let only yourself write to the run directory {os.path.dirname(path)}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    except OSError:
        _refuse_foreign(path, os.lstat(path), remedy)  # a symlink, or another user's file not open to us
        raise
    try:
        _refuse_foreign(path, os.fstat(fd), remedy)
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _refuse_foreign(path: str, st: os.stat_result, remedy: str) -> None:
    """Raise :class:`PrivateDirError` where ``st`` (of ``path``) is a symlink or another user's."""
    if stat.S_ISLNK(st.st_mode):
        raise PrivateDirError(path, f"is a symlink ({describe(st)})", remedy)
    if st.st_uid != os.geteuid():
        raise PrivateDirError(path, f"is {describe(st)}, not by you ({user(os.geteuid())})", remedy)


@contextlib.contextmanager
def _guarded(directory: str) -> Iterator[None]:
    """Held while the lock is taken or replaced: jobs of ours take turns (a 0600 file no other user can open)."""
    fd = _open_own(os.path.join(directory, GUARD))
    try:
        deadline = time.monotonic() + GUARD_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise RunDirectoryBusy(f"cpsr: run directory {directory}: its lock's guard "
                                           f"{os.path.join(directory, GUARD)} stayed held for {GUARD_TIMEOUT_S:g} s "
                                           f"(by {_holders_text(fd)})") from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)


def holders(fd: int) -> dict[int, int]:
    """The processes holding a ``flock`` on ``fd``'s file, pid -> uid (from /proc/locks; those visible here)."""
    st = os.fstat(fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            rows = [line.split() for line in f]
    except OSError:
        return {}
    found = {}
    for row in rows:  # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:5678 0 EOF"; a waiter's has "->" after the "1:"
        if len(row) >= 6 and row[1] == "FLOCK" and row[5] == key and int(row[4]) > 0:
            try:
                found[int(row[4])] = os.stat(f"/proc/{row[4]}").st_uid
            except OSError:
                continue  # gone since
    return found


def _holders_text(fd: int) -> str:
    return ", ".join(f"pid {pid} of user {user(uid)}" for pid, uid in holders(fd).items()) or "a process not seen here"


def _foreign(found: dict[int, int]) -> bool:
    """Whether ``found`` (pid -> uid) are processes, all of them other users'."""
    return bool(found) and os.geteuid() not in found.values()


def _lock_file(directory: str) -> int:
    """``directory``'s lock file, opened and locked; raises :class:`RunDirectoryBusy` where a job of ours, or
    another user's process even once the file was replaced, holds it."""
    path = os.path.join(directory, LOCK)
    with _guarded(directory):
        fd = _open_own(path)
        try:
            if _locked(fd):
                return fd
            last = _make_way(fd, directory)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        fd = _open_own(path)
        if not _locked(fd):
            text = _holders_text(fd)
            os.close(fd)
            raise RunDirectoryBusy(f"cpsr: run directory {directory}: its lock file {path} is held by {text}, not "
                                   f"by a job of yours, even after it was replaced: the run directory or its lock "
                                   f"file is reachable by another user; let only yourself write to {directory}")
        os.pwrite(fd, last.encode(), 0)  # who held it last, and the attempt it counted
        return fd


def _make_way(fd: int, directory: str) -> str:
    """Unlink the lock file ``fd`` where only other users' processes hold it (with a warning) and return what it
    said; raise :class:`RunDirectoryBusy` naming the job where one of ours holds it (or no holder is seen)."""
    path = os.path.join(directory, LOCK)
    last = _read_all(fd)
    if not _foreign(holders(fd)):
        raise RunDirectoryBusy(f"cpsr: run directory {directory} is in use by another job: {describe_owner(last)}; "
                               f"one job at a time may use a run directory (lock {path})")
    log.warning("cpsr: the lock file %s was held by %s, not by a job of yours: the run directory or its lock file is "
                "reachable by another user; replaced it by a new one only you can open. Let only yourself write to "
                "%s (chmod go-w), and check who else can read it", path, _holders_text(fd), directory)
    os.unlink(path)
    return last


def _locked(fd: int) -> bool:
    """Whether this process now holds the exclusive lock of ``fd`` (False where another holds it)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def acquire(directory: str, seen: int = 0) -> RunDirLock:
    """Lock ``directory`` for this process (making it if needed); raises :class:`RunDirectoryBusy`, or
    :class:`PrivateDirError` where another user owns the lock file.

    ``seen``: the last attempt any rank found recorded; the new attempt comes after it
    even where this directory lost its records (a node-local directory on a replaced disk).
    """
    os.makedirs(directory, exist_ok=True)
    fd = _lock_file(directory)
    try:
        # Either record may have been lost to a crash while it was written; the other then counts.
        attempt = max(recorded_attempt(directory), _attempt_in(_read_all(fd)), seen) + 1
        fs.write_json_atomic(os.path.join(directory, ATTEMPT), {"attempt": attempt})
        data = json.dumps(identity(attempt)).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    except BaseException:
        os.close(fd)
        raise
    return RunDirLock(directory, fd, attempt)


def unwritable(directory: str) -> Optional[str]:
    """Why this process could not make ``directory`` or files in it (nothing is made); None where it could."""
    existing = os.path.abspath(directory)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    try:
        with tempfile.TemporaryFile(dir=existing):  # unnamed where the file system allows: nothing left behind
            pass
    except OSError as err:
        cause = f"cannot make files in {existing} as user {user(os.geteuid())}: {err.strerror or err}"
        return cause if existing == os.path.abspath(directory) else f"cannot make {directory}: {cause}"
    return None


def check_writable(cfg: CheckpointConfig) -> None:
    """Collective: :class:`ConfigError` on every rank where any rank cannot write its ``checkpoint.dir``."""
    problem = on_any_rank(unwritable(cfg.dir))
    if problem is not None:
        raise ConfigError(f"cpsr.checkpoint.dir: {problem}; make it writable or set checkpoint.dir to a directory "
                          "you can write")


def claim(directory: str, device: torch.device) -> RunDirLock:
    """Rank 0 locks ``directory``; every rank learns the attempt, or raises the same error.

    Every rank gets a :class:`RunDirLock` with the attempt; only rank 0's holds the
    lock. ``device``: where this rank's collective buffers live. The attempt follows
    the newest any rank's directory records, and each node's first rank records it
    in its node's directory where that is not rank 0's (``checkpoint.storage: node_local``).
    """
    lock = RunDirLock(directory, -1, 0)
    seen = torch.tensor([recorded_attempt(directory)], dtype=torch.int64, device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    outcome: list = [None]  # rank 0's attempt, or its error message
    if dist.get_rank() == 0:
        try:
            lock = acquire(directory, int(seen.item()))
            outcome[0] = lock.attempt
        except (RunDirectoryBusy, PrivateDirError) as err:
            outcome[0] = str(err)
        except Exception as err:  # whatever stops rank 0 must stop every rank, or they wait for ever
            outcome[0] = f"cpsr: cannot lock run directory {directory}: {err}"
    dist.broadcast_object_list(outcome, src=0, device=device)
    if isinstance(outcome[0], str):
        raise RunDirectoryBusy(outcome[0])
    lock.attempt = outcome[0]
    if int(os.environ.get("LOCAL_RANK", 0)) == 0 and recorded_attempt(directory) < lock.attempt:
        try:
            os.makedirs(directory, exist_ok=True)
            fs.write_json_atomic(os.path.join(directory, ATTEMPT), {"attempt": lock.attempt})
        except OSError as err:  # the record only orders a later restart's checkpoints: not worth stopping the job
            log.warning("cpsr: cannot record attempt %d in %s: %s", lock.attempt, directory, err)
    return lock
