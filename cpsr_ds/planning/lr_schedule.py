"""The learning-rate schedule's shape, which decides how a lag left at the failure counts at the end of training.

A prediction leaves the run some iterations behind the failure-free one. Where the rate stays constant to the end,
that lag stays what it is. Where it decays to a planned end, a lag taken at a high rate is read out at a low one:
the end-of-training charge depends on how much of the schedule is still ahead. Its coordinate is the share of the
run's learning-rate area (the sum of the rates over its iterations) still ahead of the failure,

    q(f) = (S_T - S_f) / S_T,  S_t = sum of lr over iterations 0..t-1,

which is nearly the same for cosine and linear decays at the same places (0.57, 0.24, 0.07 at 25, 50, 75 % of a
cosine decay to 10 %; 0.56, 0.25, 0.06 of a linear one to 0) and larger, at the same places, for a
warmup-stable-decay (0.72, 0.44, 0.17 where the last 20 % decays).
A schedule whose rate rises again after the failure (cyclic, a range test) has no such reading: :func:`shape`
calls it unknown, and recovery then recomputes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

DECAY, CONSTANT, UNKNOWN = "decay", "constant", "unknown"
# Relative change of the rate below which it counts as unchanged (float rounding in the schedulers' formulas).
FLAT = 1e-6


@dataclass(frozen=True)
class Shape:
    """The schedule from the failure on: ``kind`` (DECAY, CONSTANT or UNKNOWN, with ``reason``) and, for DECAY,
    ``remaining``: q at the failure, and ``place``: the failure's share of the planned iterations."""

    kind: str
    remaining: Optional[float] = None
    place: Optional[float] = None
    reason: str = ""


def shape(past: Sequence[float], ahead: Sequence[float]) -> Shape:
    """The shape of a schedule whose rates were ``past`` (iterations 0..f-1) and will be ``ahead`` (f..T-1, to the
    planned end; empty where the end is not known)."""
    if not ahead:
        return Shape(UNKNOWN, reason="the schedule's planned end is not known")
    rates = np.asarray(ahead, dtype=float)
    if not np.all(np.isfinite(rates)) or np.any(rates < 0):
        return Shape(UNKNOWN, reason="the schedule has a negative or non-finite rate ahead")
    rises = np.flatnonzero(rates[1:] > rates[:-1] * (1 + FLAT) + 1e-30)
    if rises.size:
        i = int(rises[0])
        return Shape(UNKNOWN, reason=f"the rate rises ahead of the failure ({rates[i]:.3g} to {rates[i + 1]:.3g}, "
                                     f"{i + 1} iterations on)")
    if rates[-1] >= rates[0] * (1 - FLAT):
        return Shape(CONSTANT)
    total = float(np.sum(past)) + float(np.sum(rates))
    return Shape(DECAY, remaining=float(np.sum(rates)) / total if total > 0 else 0.0,
                 place=len(past) / (len(past) + len(rates)))


def warmup_cosine(total: int, min_ratio: float) -> list[float]:
    """A cosine decay from 1 to ``min_ratio`` over ``total`` iterations (DeepSpeed's WarmupCosineLR without its
    warmup), the rates the end-of-training reductions were measured under (calibration.py)."""
    return [min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t / total)) for t in range(total)]


def remaining_at(rates: Sequence[float], place: float) -> float:
    """q at ``place`` (0..1) of the run whose rates are ``rates``, a decaying schedule."""
    f = int(round(place * len(rates)))
    return shape(rates[:f], rates[f:]).remaining if f < len(rates) else 0.0
