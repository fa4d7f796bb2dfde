"""Where a start's time goes, from the process's creation to the end of ``cpsr_ds.initialize``: the ``seconds`` of
its line in recovery.jsonl, by part, in the order they run.

- ``process_start``: from the process's creation to ``import cpsr_ds`` (the interpreter's start and whatever the
  script imported first);
- ``imports``: from there to ``cpsr_ds.initialize`` (the rest of the script's imports and set-up); where the script
  marks parts of its own start (:func:`mark_start`: its imports, ``deepspeed.init_distributed``, building the
  model), each of those in its place, and ``script`` from the last of them to ``cpsr_ds.initialize``;
- ``distributed_init``, ``run_directory`` (claiming it, checking the layout), ``deepspeed_init`` (the engine);
- ``finding_state`` (which checkpoints, journals, dumps and snapshots there are, agreed by every rank),
  ``reading`` (loading the state and the predictor's history), ``prediction``, ``writing`` (into the engine);
- ``rest``: the runtime's set-up after recovery.

Recovery code marks its parts with :func:`mark`, which does nothing outside a start's :func:`clock`.
"""

from __future__ import annotations

import contextvars
import os
import time
from contextlib import contextmanager
from typing import Iterator, Optional


def process_age_s() -> Optional[float]:
    """Seconds since this process was created (Linux's /proc); None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            # Fields after the command's closing parenthesis start at field 3; field 22 is the start time in ticks.
            start_ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


_IMPORTED = (time.perf_counter(), process_age_s())  # when cpsr_ds was first imported
_script_parts: list[tuple[str, float]] = []  # the script's own parts before cpsr_ds.initialize (mark_start)
_current: contextvars.ContextVar[Optional["RestartClock"]] = contextvars.ContextVar("restart_clock", default=None)


class RestartClock:
    """Seconds per part of one start; :meth:`mark` closes the running part."""

    def __init__(self):
        imported_at, age_at_import = _IMPORTED
        self.seconds: dict[str, float] = {}
        if age_at_import is not None:
            self.seconds["process_start"] = age_at_import
        self._last = imported_at
        for part, at in _script_parts:
            self._close(part, at)
        self.mark("script" if _script_parts else "imports")
        _script_parts.clear()

    def mark(self, part: str) -> None:
        self._close(part, time.perf_counter())

    def _close(self, part: str, now: float) -> None:
        self.seconds[part] = self.seconds.get(part, 0.0) + now - self._last
        self._last = now


@contextmanager
def clock() -> Iterator[RestartClock]:
    """A start's clock, which :func:`mark` marks while it runs."""
    running = RestartClock()
    token = _current.set(running)
    try:
        yield running
    finally:
        _current.reset(token)


def mark_start(part: str) -> None:
    """Close part ``part`` of this process's start before ``cpsr_ds.initialize`` (``cpsr_ds.mark_start``): the
    training script's own parts, e.g. "imports", "distributed_init", "model", which the restart's breakdown in
    recovery.jsonl then shows instead of one "imports" part. Each part runs from the previous mark (or from
    ``import cpsr_ds``)."""
    _script_parts.append((part, time.perf_counter()))


def mark(part: str) -> None:
    """Close the running part of the start in progress, if any."""
    running = _current.get()
    if running is not None:
        running.mark(part)
