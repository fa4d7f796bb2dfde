"""Survivor dump: a rank whose job fails around it writes its exact state to fast local storage.

When a peer dies, DeepSpeed's launcher (and torch's elastic agent) sends SIGTERM to the
node's other ranks and waits 30 s before SIGKILL; a rank on another node sees its next
collective fail ("Connection reset by peer") within seconds. Either way the rank still
holds its state at the last iteration it completed, and :class:`Dumper` writes it
(parameters and Adam moments as ``engine_state`` has them, step counters, the LR
schedule; where and how: dumps.py).

The main thread may be blocked inside a collective when SIGTERM arrives, so a watcher
thread, woken through ``signal.set_wakeup_fd``, dumps. The optimizer step holds a lock
the dump takes too, so a dump never reads a state half updated; a step that raised
leaves the state torn, and nothing is dumped. An exception out of ``train_batch`` (a
failed collective) dumps before it propagates. The dump ends within
``checkpoint.survivor_timeout_s`` or is abandoned, never renamed into place; after a
signal the process then dies by that signal, as without a dump.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import sys
import threading
import time
import weakref
from typing import Callable, Optional

from cpsr_ds.checkpoint.capture.dumps import (counters, dump_dir, identity, prepare, remove_stale_runs, remove_survivor,
                                              write_dump)
from cpsr_ds.checkpoint.capture.run_id import moved
from cpsr_ds.checkpoint.engines.persist import Concurrent
from cpsr_ds.config import CheckpointConfig
from cpsr_ds.integration.deepspeed.engine_state import local_state, replica_weights

log = logging.getLogger(__name__)

# Signals a launcher stops a job's ranks with.
SIGNALS = (signal.SIGTERM,)


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
