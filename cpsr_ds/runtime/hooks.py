"""The iteration-hook protocol: what runs after every training iteration, and closes when the engine ends.

The runtime (:class:`~cpsr_ds.runtime.runtime.Runtime`) calls each hook's ``after_iteration`` in the order it
holds them and, when the engine ends, each ``close`` in the reverse order.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Protocol

from cpsr_ds.checkpoint.capture import exiting
from cpsr_ds.checkpoint.capture.host_snapshot import HostSnapshots
from cpsr_ds.checkpoint.capture.journal import ProgressJournal


class Step(NamedTuple):
    """One finished training iteration."""

    iteration: int  # the engine's global_steps after it
    loss: float
    seconds: Optional[float]  # its train_batch's time; None where it was not timed

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss)


class Hook(Protocol):
    def after_iteration(self, step: Step) -> None:
        """Called after every training iteration, on every rank."""

    def close(self) -> None:
        """Called once when the engine ends (or its runtime is closed)."""


class Journal(Hook):
    """The progress journal (journal.py): every iteration's loss, the record restarts read progress from."""

    def __init__(self, journal: ProgressJournal):
        self.journal = journal

    def after_iteration(self, step: Step) -> None:
        self.journal.append(step.iteration, step.loss)

    def close(self) -> None:
        self.journal.close()


class Snapshots(Hook):
    """Host snapshots (host_snapshot.py, with ``checkpoint.memory_interval``): never of a state whose loss is not
    finite."""

    def __init__(self, snapshots: HostSnapshots, bound_s: float):
        self.snapshots = snapshots
        self.bound_s = bound_s  # how long a clean end waits for the snapshot being written

    def after_iteration(self, step: Step) -> None:
        self.snapshots.after_iteration(step.iteration, step.finite, step.seconds)

    def close(self) -> None:
        # A snapshot's writer still holding its tensors while the interpreter exits aborts the process.
        self.snapshots.wait(self.bound_s if exiting.reason() is None else exiting.EXIT_GRACE_S)
