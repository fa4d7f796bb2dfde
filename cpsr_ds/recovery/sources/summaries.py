"""The predictor's summaries kept with each checkpoint, so that a predicting restart reads one checkpoint.

Without them PB-R loads the last ``predictor.history`` checkpoints in full (Section III-A's
history, 4x the bytes of one checkpoint by default). A predictor that can predict from the
newest checkpoint and a small summary of the older ones (``Predictor.summary``: for
``trend`` its least-squares slope in bf16 and its held-out error) has that summary written
by each rank beside the checkpoint, once the predictor has seen it:
``DIR/predictor_summaries/rankNNNNN/ITERATION-ATTEMPT.pt``, atomically, with a SHA-256 of
its bytes in front. The restart reads the newest checkpoint's and the checkpoint alone
where every rank has one that fits its share; anything else (missing, damaged, of another
attempt or layout) means the full history, as before.

:class:`Writer` writes them on a thread of its own, through the storage write limit the
checkpoints share (``checkpoint.write_mbps``): a summary is a sixth of the checkpoint's bytes
(2 of 12 per parameter), and written in the training loop it stalled training for its write
and two fsyncs. The checkpoints come first: a summary is written in short pieces, each after
the checkpoints in flight have persisted, and one whose checkpoint a newer checkpoint's summary
has superseded is dropped, even half written, and so is one that would not be written, with
the write limit's burst refilled, before the next checkpoint begins (:class:`NoRoom`). So where
the checkpoints keep the storage busy (an interval close to the persist time), summaries go
missing rather than checkpoints late: written beside the persists, they made each checkpoint at
such an interval wait for the one before it, and written in the gaps between persists they took
the burst the next checkpoint's persist starts with (at bench_ftcost's write limit and interval 18,
trend's checkpoints waited 53 ms each for free buffers, skip's, which keeps no summary, not at
all). One not yet written when the job dies is missing, as above.
"""

from __future__ import annotations

import glob
import hashlib
import io
import logging
import os
import queue
import threading
import time
from functools import partial
from typing import Callable, NamedTuple, Optional

import torch

from cpsr_ds.checkpoint.storage.filesystem import describe_error, fs
from cpsr_ds.checkpoint.engines.throttle import Throttle

log = logging.getLogger(__name__)

SUMMARIES_DIR = "predictor_summaries"
PIECE_S = 0.01  # a summary's piece, in seconds of the write limit: the most it delays a checkpoint starting to persist


class Superseded(Exception):
    """A newer checkpoint's summary was submitted: a restart would read that one, so this one is not written."""


class NoRoom(Exception):
    """The rest of the summary would not be written before the next checkpoint begins: it is not written."""


def path(directory: str, rank: int, iteration: int, attempt: int) -> str:
    return os.path.join(directory, SUMMARIES_DIR, f"rank{rank:05d}", f"{iteration:09d}-{attempt}.pt")


def encode(summary: dict) -> list[bytes]:
    """The file's bytes: the SHA-256 of the payload on a line of its own, then the payload (``summary`` saved)."""
    buffer = io.BytesIO()
    torch.save(summary, buffer)
    payload = buffer.getvalue()
    return [hashlib.sha256(payload).hexdigest().encode() + b"\n", payload]


def write(directory: str, rank: int, iteration: int, attempt: int, data: list[bytes], keep: int,
          throttle: Throttle | _Deferring | None = None) -> None:
    """Write a summary (``data``: :func:`encode`'s) for the checkpoint of ``iteration``; keep this rank's ``keep``
    newest. ``throttle``: a :class:`Throttle`, or a :class:`_Deferring` of one.

    A failed write costs a later restart its shortcut, not training: it is logged, not raised.
    """
    target = path(directory, rank, iteration, attempt)
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fs.write_atomic(target, data, throttle=throttle)
    except OSError as err:
        log.warning("cpsr: the predictor's summary of iteration %d was not written: %s", iteration,
                    describe_error(err))
        return
    for old in sorted(glob.glob(os.path.join(os.path.dirname(target), "*.pt")), key=_order)[:-keep]:
        try:
            os.unlink(old)
        except OSError:
            pass


class _Deferring:
    """The write limit for one summary of ``nbytes``: pieces of PIECE_S of ``throttle``'s rate, each taken only
    after ``before`` (which waits for the checkpoints in flight, or raises :class:`Superseded`), and only while
    the rest of the summary and then the throttle's burst fit before ``deadline`` (time.monotonic(); None: no
    checkpoint follows), else :class:`NoRoom`. The next checkpoint's persist starts with that burst: a summary
    that took it would make the persist as much longer."""

    def __init__(self, throttle: Throttle, before: Callable[[], None], nbytes: int, deadline: Optional[float]):
        self._throttle = throttle
        self._before = before
        self._left = nbytes
        self._deadline = deadline
        self.burst = max(1, int(throttle.bytes_per_s * PIECE_S))

    def take(self, nbytes: int) -> float:
        self._before()
        if self._deadline is not None:
            needed_s = (self._left + self._throttle.burst) / self._throttle.bytes_per_s
            if time.monotonic() + needed_s > self._deadline:
                raise NoRoom
        self._left -= nbytes
        return self._throttle.take(nbytes)


class _Job(NamedTuple):
    number: int  # of the summaries submitted: the newest is the only one not superseded
    deadline: Optional[float]  # when the next checkpoint begins (time.monotonic()); None: none follows
    directory: str
    rank: int
    iteration: int
    attempt: int
    summary: dict
    keep: int


class Writer:
    """:func:`write` on a daemon thread of its own, in the order submitted, waiting on ``throttle``; a daemon
    so that storage that hangs cannot hold the process at exit (as the checkpoint engine's writers).

    ``after``: called before each write and each piece of it, to wait until the checkpoints in flight have
    persisted: a summary written beside a checkpoint's persist would share its storage bandwidth
    (``checkpoint.write_mbps``) and make the checkpoint durable later, while the storage idles between
    checkpoints. A summary not yet written when the next one is submitted is dropped (:class:`Superseded`):
    it is only an accelerator, and a restart from a checkpoint without one reads the history instead; so is one
    that would not be written before its ``deadline`` (:class:`_Deferring`).
    """

    def __init__(self, throttle: Optional[Throttle] = None, after: Optional[Callable[[], object]] = None):
        self._throttle = throttle
        self._after = after
        self._jobs: queue.Queue = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0
        self._submitted = 0  # summaries submitted so far; the newest is the only one not superseded
        self._thread: Optional[threading.Thread] = None

    def submit(self, directory: str, rank: int, iteration: int, attempt: int, summary: dict, keep: int,
               deadline: Optional[float] = None) -> None:
        """``deadline``: when the next checkpoint begins (time.monotonic()), which the summary must not delay;
        None: no checkpoint follows."""
        with self._idle:
            self._pending += 1
            self._submitted += 1
            number = self._submitted
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cpsr-summaries", daemon=True)
            self._thread.start()
        self._jobs.put(_Job(number, deadline, directory, rank, iteration, attempt, summary, keep))

    def _before(self, number: int) -> None:
        if self._after is not None:
            self._after()
        with self._idle:
            if number != self._submitted:
                raise Superseded

    def _run(self) -> None:
        for job in iter(self._jobs.get, None):
            before = partial(self._before, job.number)
            try:
                before()
                data = encode(job.summary)
                pacing = self._throttle and _Deferring(self._throttle, before, sum(map(len, data)), job.deadline)
                write(job.directory, job.rank, job.iteration, job.attempt, data, job.keep, pacing)
            except Superseded:
                log.debug("cpsr: the predictor's summary of iteration %d is superseded, not written", job.iteration)
            except NoRoom:
                log.debug("cpsr: the predictor's summary of iteration %d is not written: it would not be written "
                          "before the next checkpoint begins", job.iteration)
            except Exception:  # a summary that cannot even be serialised: the restart reads the full history
                log.exception("cpsr: the predictor's summary of iteration %d was not written", job.iteration)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def flush(self, timeout_s: Optional[float] = None) -> bool:
        """Wait until every summary submitted is written (or failed, logged); False where ``timeout_s`` ran out."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout=timeout_s)

    def close(self, timeout_s: Optional[float] = None) -> bool:
        """:meth:`flush`, then stop the thread (what is left unwritten after ``timeout_s`` is abandoned) and, once
        flushed, wait for it to end: a thread that lets go of a summary's tensors while the interpreter exits
        aborts the process (torch's deallocator takes the GIL, and the thread is ended inside it)."""
        done = self.flush(timeout_s)
        if self._thread is not None:
            self._jobs.put(None)
            if done:
                self._thread.join()
        return done


def _order(name: str) -> tuple[int, int]:
    iteration, _, attempt = os.path.basename(name).removesuffix(".pt").partition("-")
    return int(iteration), int(attempt)


def read(directory: str, rank: int, iteration: int, attempt: int) -> tuple[dict | None, int]:
    """(the summary written for the checkpoint of ``iteration`` by ``attempt``, or None; the bytes read)."""
    target = path(directory, rank, iteration, attempt)
    try:
        with open(target, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None, 0
    except OSError as err:
        log.warning("cpsr recovery: cannot read %s: %s", target, describe_error(err))
        return None, 0
    digest, _, payload = data.partition(b"\n")
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        log.warning("cpsr recovery: %s is damaged (its SHA-256 does not match): reading the full history instead",
                    target)
        return None, len(data)
    try:
        summary = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as err:  # a summary of another version: the history serves instead
        log.warning("cpsr recovery: cannot load %s (%s): reading the full history instead", target, err)
        return None, len(data)
    if not isinstance(summary, dict):
        log.warning("cpsr recovery: %s holds a %s, not a summary: reading the full history instead", target,
                    type(summary).__name__)
        return None, len(data)
    return summary, len(data)


def load(predictor, summary: dict, newest: str) -> bool:
    """Whether ``predictor`` took ``summary``, the one kept with checkpoint ``newest`` (Predictor.load_summary);
    one it cannot take (a field of another version, a value of another type) is logged, and the history
    serves instead."""
    try:
        return predictor.load_summary(summary)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as err:
        log.warning("cpsr recovery: %s cannot take its summary of checkpoint %s (%s: %s): reading the full "
                    "history instead", predictor.name, newest, type(err).__name__, err)
        return False
