"""Ends of engines in flight on other threads, waited for when the interpreter exits.

DeepSpeed's engine destroys itself in ``__del__``, which Python's cyclic garbage collector calls on whichever
thread it runs in, a daemon thread of the checkpoint engine too. A script that leaves its engine to the
interpreter's exit (DeepSpeed's own examples do) may thus be ending it there when the interpreter's teardown
begins; a daemon thread inside a torch call then aborts the process ("terminate called without an active
exception": a clean end exits 134, DeepSpeed's launcher 250, and a supervisor restarts a finished job), or its
end is cut off before the last checkpoint is committed. :func:`running` marks an end in flight; at exit, on the
main thread, the interpreter waits for those and for collections running on other threads (each bounded).
"""

from __future__ import annotations

import atexit
import gc
import threading
import time
from contextlib import contextmanager

COLLECTION_BOUND_S = 60.0  # a collection on another thread, waited for at exit, beside the ends it runs


class Ends:
    """The ends in flight, and the collections running off the main thread (which may be about to end an
    engine); :meth:`wait` waits for them, each at most as long as it may take."""

    def __init__(self):
        self._changed = threading.Condition()
        self._deadlines: list[float] = []  # time.monotonic() by which each end in flight is over
        self._collections: dict[int, float] = {}  # thread id: the deadline of its collection in flight
        gc.callbacks.append(self._collecting)

    def _collecting(self, phase: str, info: dict) -> None:
        """gc's callback, on the collecting thread: a collection off the main thread counts as an end in flight."""
        if threading.current_thread() is threading.main_thread():
            return
        with self._changed:
            if phase == "start":
                self._collections[threading.get_ident()] = time.monotonic() + COLLECTION_BOUND_S
            else:
                self._collections.pop(threading.get_ident(), None)
                self._changed.notify_all()

    @contextmanager
    def running(self, bound_s: float):
        """An end in flight for the block, over within ``bound_s`` seconds."""
        deadline = time.monotonic() + bound_s
        with self._changed:
            self._deadlines.append(deadline)
        try:
            yield
        finally:
            with self._changed:
                self._deadlines.remove(deadline)
                self._changed.notify_all()

    def wait(self) -> None:
        """Until no end or collection is in flight, or the last one's bound has passed."""
        with self._changed:
            while (left := max([*self._deadlines, *self._collections.values()], default=0.0) - time.monotonic()) > 0:
                self._changed.wait(left)


_ENDS = Ends()
atexit.register(_ENDS.wait)


def running(bound_s: float):
    """A context: an engine's end in flight for the block, over within ``bound_s`` seconds."""
    return _ENDS.running(bound_s)
