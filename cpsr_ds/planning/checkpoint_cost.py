"""T_s, the checkpoint cost (Table I), and the persist time, measured online at every checkpoint.

:class:`CostMeter` times the training loop's iterations around each checkpoint: T_s is the
checkpoint's own time in the loop plus the time the iterations while it persisted took over
a baseline of iterations with no checkpoint in flight (:func:`slowdown`). The planner reads
each stage's :func:`smoothed_costs`, so that one noisy checkpoint neither sets nor re-plans the
interval. No I/O: the plugin feeds the meter and writes each :class:`Cost` as a runlog.CostRow.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Optional, Sequence

BASELINE_WINDOW = 32  # iterations whose median is the baseline iteration time
BRACKET = 8  # iterations without a checkpoint in flight on each side of a checkpoint's window: its baseline
HORIZON = 256  # iterations a checkpoint's cost waits, at most, for clean iterations after it
SMOOTHING = 9  # the newest measured checkpoints whose median is a stage's current cost ...
MIN_COSTS = 3  # ... and how many are measured before the first plan


def slowdown(block_s: float, times: Sequence[float], baseline: float) -> float:
    """T_s in seconds: the checkpoint's own time in the training loop (``block_s``) plus, over the
    iterations while it persisted, their time above the baseline.

    An estimate: on a shared host one checkpoint's value is noisy, and may fall below the stall
    it includes, or below 0. It is not clamped there: a clamp at the stall biases the sum over a run's
    checkpoints (bench_ftcost's checkpoint cost) upward, by 26 to 76 % per strategy in bench_ftcost
    where a quarter of the checkpoints measured below 0; a median (the planner's smoothed_costs) is
    unaffected where most checkpoints measure above the stall."""
    return block_s + sum(t - baseline for t in times)


@dataclass
class Window:
    """A checkpoint being measured: the iterations after it until it persisted or the next one began
    (``times``), and the iterations without a checkpoint in flight nearest before it (``before``;
    ``fresh`` where the newest of them is among the last BASELINE_WINDOW) and after its persist
    (``after``), whose median is its baseline; ``started``: the meter's iteration count at its start."""

    iteration: int
    tag: str
    block_s: float
    before: list
    fresh: bool
    started: int
    fallback: Optional[float]
    times: list = field(default_factory=list)
    after: list = field(default_factory=list)
    collecting: bool = True
    stall_s: Optional[float] = None
    outcome: Optional[tuple[int, float]] = None  # (bytes, persist seconds) once persisted

    def baseline(self) -> Optional[float]:
        clean = self.before + self.after
        return median(clean) if clean else self.fallback


@dataclass(frozen=True)
class Cost:
    """One checkpoint's measured cost, seconds (the fields of runlog.CostRow)."""

    iteration: int
    iteration_time_s: float
    stall_s: float
    slowdown_s: float
    persist_s: float
    nbytes: int


class CostMeter:
    """Iteration times, the baseline, and the checkpoints being measured (no I/O).

    A checkpoint's window collects the iterations after it until it has persisted or the next
    checkpoint begins (which is then measured instead). Its baseline brackets the window: the
    median of the BRACKET iterations with no checkpoint in flight nearest before it and the
    BRACKET nearest after its persist. The host's speed drifts by a third within seconds here,
    and a baseline from the last such iterations, however old, stayed the same over 300 iterations
    and a dozen checkpoints where persists took almost the whole interval, and then measured
    checkpoints at -5 iterations where the host had sped up since. So a checkpoint's cost is
    final once BRACKET iterations after it are clean, or when the next checkpoint begins where
    some clean iteration lies within BASELINE_WINDOW before it or after it; one whose persists
    overlap the next checkpoints waits for the clean iterations after the whole stretch, up to
    HORIZON iterations. With no clean iteration ever, the baseline is the median of all recent ones.
    """

    def __init__(self):
        self.clean: deque = deque(maxlen=BASELINE_WINDOW)  # (iteration count, seconds)
        self.recent: deque = deque(maxlen=BASELINE_WINDOW)
        self.pending: list[Window] = []
        self.done: list[Cost] = []
        self.count = 0

    def baseline(self) -> Optional[float]:
        times = [t for _, t in self.clean] or self.recent
        return median(times) if times else None

    def iteration(self, seconds: float) -> None:
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        self.count += 1
        self.recent.append(seconds)
        in_flight = [w for w in self.pending if w.outcome is None]
        collecting = [w for w in in_flight if w.collecting]
        if collecting:
            collecting[-1].times.append(seconds)
        if in_flight:
            return
        self.clean.append((self.count, seconds))
        for w in list(self.pending):
            w.after.append(seconds)
            if len(w.after) >= BRACKET:
                self._close(w)

    def start(self, iteration: int, tag: str, block_s: float) -> None:
        for w in list(self.pending):
            w.collecting = False
            if w.outcome is not None and (w.fresh or w.after or self.count - w.started > HORIZON):
                self._close(w)
        fresh = bool(self.clean) and self.clean[-1][0] > self.count - BASELINE_WINDOW
        before = [t for _, t in self.clean][-BRACKET:]
        self.pending.append(Window(iteration, tag, block_s, before, fresh, self.count, self.baseline()))

    def stalled(self, stall_s: Optional[float]) -> None:
        """The engine's stall, known once the checkpoint after the newest window committed."""
        if self.pending and self.pending[-1].stall_s is None and self.pending[-1].times:
            self.pending[-1].stall_s = stall_s

    def settle(self, tag: str, outcome) -> None:
        """Record the engine's outcome for ``tag``: (bytes, persist_s) persisted, False given up, None pending.

        persist_s None: this rank had a part but wrote no file (a data-parallel rank past the first without
        ZeRO: DeepSpeed writes the module and optimizer from the first), so it has no cost of its own.
        The cost, once its baseline is bracketed, comes from :meth:`finished`.
        """
        window = next((w for w in self.pending if w.tag == tag and w.outcome is None), None)
        if window is None or outcome is None:
            return
        if outcome is False or outcome[1] is None:
            self.pending.remove(window)
            return
        window.outcome = (int(outcome[0]), float(outcome[1]))
        window.collecting = False

    def finished(self) -> list[Cost]:
        """The costs measured since the last call (a checkpoint's once its baseline is bracketed)."""
        done, self.done = self.done, []
        return done

    def _close(self, window: Window) -> None:
        self.pending.remove(window)
        baseline = window.baseline()
        if baseline is None:
            return
        nbytes, persist_s = window.outcome
        stall = window.stall_s if window.stall_s is not None else 0.0
        self.done.append(Cost(window.iteration, baseline, stall, slowdown(window.block_s, window.times, baseline),
                              persist_s, nbytes))


def smoothed_costs(costs: Sequence[Cost]) -> dict:
    """iteration_time_s, slowdown_s and persist_s: the medians over the newest SMOOTHING costs (empty: fewer
    than MIN_COSTS).

    With two the median is their mean, and one outlier set the interval: a one-off import in the
    first plan made a checkpoint cost 27 iterations against 2 for the others, and the next plan, on
    two costs, chose 138 iterations where 50 were due. One checkpoint's slowdown is noisy on a shared
    machine (2 to 170 ms around a median of 45 ms in bench_ftcost): over three, T_s swung between 0.5
    and 5 iterations from one plan to the next, and the interval with it (17 to 84 iterations).
    """
    recent = list(costs)[-SMOOTHING:]
    if len(recent) < MIN_COSTS:
        return {}
    return {name: median(getattr(c, name) for c in recent) for name in ("iteration_time_s", "slowdown_s", "persist_s")}
