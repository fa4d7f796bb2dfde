"""lambda, the failure rate (Table I), per hour of running: the configured rate updated by the job's own failures.

The plugin counts the job's failures from each start's recovery report and its hours of
running from the journal; the planner converts the rate to failures per iteration
(units.failure_rate_per_iteration).
"""

from __future__ import annotations

import math
from collections import Counter
from statistics import median
from typing import Optional, Sequence

# A pause between two journal lines longer than this many median iterations is a restart, not running time.
RESTART_GAP = 50


def failure_rate_per_hour(prior_per_hour: float, failures: int, hours: float) -> float:
    """The posterior mean failure rate, per hour: (1 + n) / (1 / rate + H).

    The prior is a Gamma distribution worth one failure observed over 1 / rate hours (the
    configured ``planner.failure_rate_per_hour``); the job then saw n failures in H hours of
    running. With no history it is the configured rate; after many hours it tends to n / H.
    A prior rate that is not positive and finite has no posterior: it is returned unchanged.
    """
    if not (math.isfinite(prior_per_hour) and prior_per_hour > 0):
        return prior_per_hour
    hours = hours if math.isfinite(hours) and hours > 0 else 0.0
    return (1 + max(0, failures)) / (1 / prior_per_hour + hours)


def failures(reached: Sequence[Optional[int]], finished: Sequence[int] = ()) -> int:
    """The job's failures from each start's recovery report ``reached``: a start after progress ended an attempt,
    but for one start at each iteration where an attempt ended cleanly (``finished``, journal.finished_iterations):
    that start resumed a job that had finished, not failed."""
    clean, count = Counter(finished), 0
    for r in (r for r in reached if r is not None):
        if clean[r]:
            clean[r] -= 1
        else:
            count += 1
    return count


def running_hours(entries: Sequence[tuple[int, float]]) -> float:
    """Hours of running in a journal's (iteration, wall_time) lines, restarts' downtime left out.

    The time between consecutive lines counts where the iteration follows by one and the
    pause is at most RESTART_GAP median pauses; a restart (the iteration going back, or a
    predicted one resuming after a long pause) ends one span and begins the next.
    """
    gaps = [(b_t - a_t) for (a_i, a_t), (b_i, b_t) in zip(entries, entries[1:])
            if b_i == a_i + 1 and math.isfinite(b_t - a_t) and b_t >= a_t]
    if not gaps:
        return 0.0
    limit = RESTART_GAP * median(gaps)
    return sum(g for g in gaps if g <= limit) / 3600
