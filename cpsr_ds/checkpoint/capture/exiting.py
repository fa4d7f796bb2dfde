"""Whether this process is failing, and so may no longer wait for other ranks' checkpoint parts.

A process learns that it is failing from an exception, the one signal every rank
gets: an exception that propagates out of ``train_batch`` or ``eval_batch`` (marked by
:func:`marks_failure`; a dead peer shows there, its sockets close and the next gloo
collective raises within seconds), or any exception left uncaught (marked by the
``sys.excepthook`` :func:`install` chains, which Python runs before ``atexit``).
Peers are not watched otherwise: a rank outside any collective, at a clean exit,
still waits up to ``commit_timeout_s`` for the others' manifests. SIGTERM and SIGKILL
end a process without ``atexit``, so nothing there waits at all.

A failing process waits for no other rank: their manifests may never come. Its own
files in flight get :data:`EXIT_GRACE_S` to become durable; what is still in flight
then is abandoned, never committed, and ``latest`` stays on the last committed checkpoint.

A restart that cannot proceed, and that another restart would meet the same way, raises
:class:`RestartCannotHelp`; left uncaught, the process exits with :data:`EXIT_RESTART_CANNOT_HELP`,
which ``launch/resilient.sh`` does not restart.
"""

from __future__ import annotations

import atexit
import sys
import weakref
from contextlib import contextmanager
from typing import Optional

# Long enough for a file already being written to finish on healthy storage, short
# enough that a supervisor sees the process leave and restarts the node in seconds.
EXIT_GRACE_S = 2.0
# The exit status of a process stopped by RestartCannotHelp: sysexits' EX_CONFIG. DeepSpeed's launcher exits with
# its first failed worker's status, so a supervisor sees it; launch/resilient.sh stops on it.
EXIT_RESTART_CANNOT_HELP = 78


class RestartCannotHelp(RuntimeError):
    """A restart cannot proceed, and restarting again would not either: no state is left to resume from, or
    the storage it needs is full. The message says what to do; the process exits with
    :data:`EXIT_RESTART_CANNOT_HELP`."""

_reason: Optional[str] = None


def mark(reason: str) -> None:
    """Record that this process is failing; the first reason stays."""
    global _reason
    if _reason is None:
        _reason = reason


def reason() -> Optional[str]:
    """Why this process is failing; None while it is not."""
    return _reason


def at_exit(owner: object, method: str) -> None:
    """Call ``owner.<method>()`` at interpreter exit where ``owner`` still lives then, without keeping it alive:
    a script need not close what it leaves to the exit. atexit runs the latest registered first."""
    ref = weakref.ref(owner)

    def call() -> None:
        alive = ref()
        if alive is not None:
            getattr(alive, method)()

    atexit.register(call)


@contextmanager
def marks_failure(where: str):
    """Mark the process failing when an exception leaves the block, and let the exception go on."""
    try:
        yield
    except BaseException as err:
        mark(f"{type(err).__name__} in {where}: {err}")
        raise


def _hook(previous):
    def excepthook(kind, value, traceback):
        mark(f"uncaught {kind.__name__}: {value}")
        previous(kind, value, traceback)
        if issubclass(kind, RestartCannotHelp):
            # Raised from the hook, SystemExit sets the exit status; atexit's handlers still run.
            sys.exit(EXIT_RESTART_CANNOT_HELP)

    excepthook.cpsr_marks_failure = True
    return excepthook


def install() -> None:
    """Chain a ``sys.excepthook`` that marks the process failing, and exits with :data:`EXIT_RESTART_CANNOT_HELP`
    after a :class:`RestartCannotHelp` (once per process)."""
    if not getattr(sys.excepthook, "cpsr_marks_failure", False):
        sys.excepthook = _hook(sys.excepthook)
