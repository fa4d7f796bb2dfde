"""The planner's unit, the iteration, and the checks its inputs pass.

T_c, T_s, the persist time and t are counted in iterations, lambda in failures per
iteration; these convert measured seconds and failures per hour. An input that is not
finite, or not positive where the paper needs it positive, is a ValueError naming it.
"""

from __future__ import annotations

import math


def finite(name: str, value: float) -> float:
    """``value`` as a float; a ValueError naming ``name`` where it is not finite."""
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def positive(name: str, value: float) -> float:
    """``value`` where finite and above 0, else a ValueError naming ``name``."""
    if finite(name, value) <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return float(value)


def non_negative(name: str, value: float) -> float:
    """``value`` where finite and not below 0, else a ValueError naming ``name``."""
    if finite(name, value) < 0:
        raise ValueError(f"{name} must not be negative, got {value!r}")
    return float(value)


def whole(name: str, value) -> int:
    """``value`` as an int where it is a positive whole number, else a ValueError naming ``name``."""
    if positive(name, value) != int(value):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return int(value)


def iterations(seconds_: float, iteration_time_s: float) -> float:
    """A duration in seconds as iterations of ``iteration_time_s`` seconds."""
    return non_negative("seconds", seconds_) / positive("iteration_time_s", iteration_time_s)


def seconds(iterations_: float, iteration_time_s: float) -> float:
    """A duration in iterations as seconds."""
    return non_negative("iterations", iterations_) * positive("iteration_time_s", iteration_time_s)


def failure_rate_per_iteration(failures_per_hour: float, iteration_time_s: float) -> float:
    """lambda per iteration from failures per hour (the paper's 0.08 / h: one failure in 12.5 h)."""
    return positive("failures_per_hour", failures_per_hour) * positive("iteration_time_s", iteration_time_s) / 3600
