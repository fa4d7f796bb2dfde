"""lambda, the failure rate (Table I), per hour of running: the configured rate updated by the job's own failures,
in all and per failure class.

The plugin counts the job's failures from each start's recovery report (with the class the restart observed:
recovery/failure_class.py) and its hours of running from the journal; the planner converts the rate to failures
per iteration (units.failure_rate_per_iteration).
"""

from __future__ import annotations

import math
from collections import Counter
from statistics import median
from typing import Optional, Sequence

from cpsr_ds.planning.failure_mix import CLASSES, check_shares

# A pause between two journal lines longer than this many median iterations is a restart, not running time.
RESTART_GAP = 50


def class_rates_per_hour(prior_per_hour: float, shares: dict, by_class: Counter, hours: float) -> dict:
    """Each failure class's posterior mean rate, per hour: (s_c (1 + u) + n_c) / (1 / rate + H).

    The prior is a Gamma distribution worth one failure observed over 1 / rate hours (the configured
    ``planner.failure_rate_per_hour``), split by the configured ``shares`` s_c; the job then saw n_c failures of
    class c, and u whose class no restart could observe (``by_class[None]``, split alike), in H hours of running.
    With no history it is the configured rate and mix; after many hours each class's tends to n_c / H (their sum
    to (1 + n) / (1 / rate + H), n all the failures). A prior rate that is not positive and finite has no
    posterior: the configured split of it is returned unchanged.
    """
    shares = check_shares(shares)
    if not (math.isfinite(prior_per_hour) and prior_per_hour > 0):
        return {c: prior_per_hour * shares[c] for c in CLASSES}
    hours = hours if math.isfinite(hours) and hours > 0 else 0.0
    unobserved = 1 + max(0, by_class.get(None, 0))
    return {c: (shares[c] * unobserved + max(0, by_class.get(c, 0))) / (1 / prior_per_hour + hours) for c in CLASSES}


def failures(starts: Sequence[tuple[Optional[int], Optional[str]]], finished: Sequence[int] = ()) -> Counter:
    """The job's failures by class (None: not observed), from each start's recovery report (``reached``, the class
    its restart observed): a start after progress ended an attempt, but for one start at each iteration where an
    attempt ended cleanly (``finished``, journal.finished_iterations): that start resumed a job that had finished,
    not failed."""
    clean, counted = Counter(finished), Counter()
    for reached, cls in starts:
        if reached is None:
            continue
        if clean[reached]:
            clean[reached] -= 1
        else:
            counted[cls] += 1
    return counted


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
