"""One job per run directory: rank 0 holds an exclusive ``flock`` on ``DIR/cpsr.lock``.

The lock lives as long as the descriptor, so a killed job's lock vanishes with its
process; the file itself stays and says who held it last. While holding it, the owner
writes its identity (host, pid, MASTER_ADDR:MASTER_PORT, start time, attempt) into it,
for the error a second job gets. Each successful lock counts one attempt of the job
(``DIR/cpsr_attempt.json``): 1 for the first start, 2 for the first restart, and so on;
checkpoints of a later attempt order after an earlier attempt's at the same iteration.
Every node's directory records it, so that a node whose node-local directory was lost
counts on from the others' records.

:func:`claim` is collective: rank 0 locks and tells every rank the outcome, so every
rank gets the attempt, or the same error, and none waits for ever.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time

import torch
import torch.distributed as dist

from cpsr_ds.checkpoint.store import write_json_atomic

LOCK = "cpsr.lock"
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


def acquire(directory: str, seen: int = 0) -> RunDirLock:
    """Lock ``directory`` for this process (making it if needed); raises :class:`RunDirectoryBusy`.

    ``seen``: the last attempt any rank found recorded; the new attempt comes after it
    even where this directory lost its records (a node-local directory on a replaced disk).
    """
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = describe_owner(_read_all(fd))
        os.close(fd)
        raise RunDirectoryBusy(f"cpsr: run directory {directory} is in use by another job: {owner}; "
                               f"one job at a time may use a run directory (lock {path})") from None
    except BaseException:
        os.close(fd)
        raise
    try:
        # Either record may have been lost to a crash while it was written; the other then counts.
        attempt = max(recorded_attempt(directory), _attempt_in(_read_all(fd)), seen) + 1
        write_json_atomic(os.path.join(directory, ATTEMPT), {"attempt": attempt})
        data = json.dumps(identity(attempt)).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    except BaseException:
        os.close(fd)
        raise
    return RunDirLock(directory, fd, attempt)


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
        except RunDirectoryBusy as err:
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
            write_json_atomic(os.path.join(directory, ATTEMPT), {"attempt": lock.attempt})
        except OSError as err:  # the record only orders a later restart's checkpoints: not worth stopping the job
            log.warning("cpsr: cannot record attempt %d in %s: %s", lock.attempt, directory, err)
    return lock
