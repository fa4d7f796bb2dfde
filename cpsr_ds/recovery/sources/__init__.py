"""Where recovered state comes from: the retained checkpoints (``checkpoint``), the predictor
(``prediction``, PB-R), the ranks' own survivor dumps and their replicas' (``survivor``,
``replica``), the predictor's summaries (``summaries``), and states after the newest
checkpoint c that recomputing may start from instead of c (:class:`Ahead`): every rank's
host snapshot (``host_snapshot``, exact) or the parameters of the checkpoint that was
still persisting (``in_flight``, Adam's moments c's)."""

from __future__ import annotations

from typing import Callable, NamedTuple


class Ahead(NamedTuple):
    """A state at iteration m > c that recomputing may start from instead of checkpoint c.

    ``resume(engine, c)`` writes it into the engine, which holds c, with the counters of m, and returns m (a
    collective where the source needs one); ``source`` names it in the recovery report. ``recovery.mode:
    recompute`` asks only the exact source, host snapshots (recovery.decision.recover). ``alone(engine)``, where
    the source holds everything the engine needs, writes it into an engine that holds no checkpoint and returns m,
    or None on every rank where some rank's engine cannot take it (a collective): recomputing from m then reads no
    checkpoint.
    """

    iteration: int
    source: str
    resume: Callable[[object, int], int]
    alone: Callable[[object], int | None] | None = None
