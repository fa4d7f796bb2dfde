"""One plan for both levels of state: the host-snapshot interval k and the storage interval n, chosen together.

Two failure classes (failure_mix.py) and two levels: a process crash (rate lambda_c) resumes from the
newest host snapshot, losing the iterations since it; a lost node (lambda_n) takes its host memory,
and its ranks resume from the newest storage checkpoint, where prediction saves a share rho of the
iterations lost since it (cpsr; 0 for recomputing), the survivors from their dumps. Each failure also
costs its class's restart. Without snapshots a crash resumes from storage as a lost node does.

The first-order cost rate (iterations lost per iteration, the SCR multi-level model of Moody et al.,
SC'10, with each level serving the class it survives, as in Di et al.'s multi-level optimisation) is

    F(k, n) = c_m / k + lambda_c (k / 2 + R_c) + c_s / n + lambda_n ((1 - rho) n / 2 + R_n),

separable, so each level's interval has Young's closed form: k = sqrt(2 c_m / lambda_c),
n = sqrt(2 c_s / ((1 - rho) lambda_n)). The numerical plan minimises each level's exact Eq. 15 cost
(fault_tolerance_cost.checkpoint_and_lost: exponential failure times, the write floor) beside it.
All times are in iterations, rates per iteration.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from cpsr_ds.planning.failure_mix import NODE_LOST, PROCESS_CRASH
from cpsr_ds.planning.fault_tolerance_cost import checkpoint_and_lost
from cpsr_ds.planning.planner import MAX_INTERVAL, SMALL, clamp_interval, minimize_interval, young_interval
from cpsr_ds.planning.units import finite, non_negative, positive, whole


@dataclass(frozen=True)
class LevelCosts:
    """Each level's cost, iterations: ``snapshot`` a host snapshot's stall and ``snapshot_write`` its write
    into shared memory (a snapshot due while one is written is skipped); ``checkpoint`` a storage checkpoint's
    T_s, ``persist`` its write, ``in_flight`` how many persist at once; ``restart_crash``, ``restart_storage``
    and ``restart_node`` a restart's time after a crash from a host snapshot, after a crash from storage (no
    snapshots; None: restart_crash) and after a lost node; ``rho`` the share of the iterations lost since
    the storage checkpoint that prediction saves."""

    snapshot: float
    checkpoint: float
    snapshot_write: float = 0.0
    persist: float = 0.0
    in_flight: int = 1
    restart_crash: float = 0.0
    restart_node: float = 0.0
    rho: float = 0.0
    restart_storage: Optional[float] = None

    def __post_init__(self):
        positive("snapshot", self.snapshot)
        positive("checkpoint", self.checkpoint)
        for name in ("snapshot_write", "persist", "restart_crash", "restart_node"):
            non_negative(name, getattr(self, name))
        if self.restart_storage is not None:
            non_negative("restart_storage", self.restart_storage)
        whole("in_flight", self.in_flight)
        if not 0 <= finite("rho", self.rho) < 1:
            raise ValueError(f"rho must be in [0, 1), got {self.rho!r}")


def young(cost: float, lam: float, max_interval: float = MAX_INTERVAL) -> float:
    """planner.young_interval, sqrt(2 cost / lambda); max_interval for a level whose failures never come."""
    if not non_negative("lambda", lam):
        return clamp_interval(math.inf, max_interval)
    return young_interval(lam, cost, max_interval)


def closed_form(rates: dict, c: LevelCosts, max_interval: float = MAX_INTERVAL) -> tuple[Optional[float], float]:
    """(k, n): each level's first-order optimum, at least its write floor; k None where the first-order cost
    is lower without snapshots (a crash then resumes from storage: n = sqrt(2 c_s / ((1 - rho) lambda)))."""
    k = max(young(c.snapshot, rates[PROCESS_CRASH], max_interval), min(c.snapshot_write, max_interval))
    floor = min(c.persist / c.in_flight, max_interval)
    n = max(young(c.checkpoint, (1 - c.rho) * rates[NODE_LOST], max_interval), floor)
    n_alone = max(young(c.checkpoint, (1 - c.rho) * (rates[NODE_LOST] + rates[PROCESS_CRASH]), max_interval), floor)
    return _better((k, n), (None, n_alone), rates, c, exact=False)


def _better(with_snapshots: tuple, without: tuple, rates: dict, c: LevelCosts, exact: bool) -> tuple:
    """The cheaper of two plans (k, n), the one with snapshots on a tie."""
    costs = [float(total(cost_rates(k, n, rates, c, exact))) for k, n in (with_snapshots, without)]
    return with_snapshots if costs[0] <= costs[1] else without


def level_terms(T, lam: float, stall: float, write: float = 0.0, in_flight: int = 1) -> tuple:
    """One level's checkpoint cost rate and the iterations lost per iteration to failures of rate lambda since
    its newest checkpoint (Eq. 15's terms, exact); lambda = 0: stall / (T + stall) and 0, their limits."""
    T = np.asarray(T, dtype=float)
    if non_negative("lambda", lam) == 0:
        return stall / (T + stall), np.zeros_like(T)
    return checkpoint_and_lost(T, lam, stall, write, in_flight)


def cost_rates(k, n, rates: dict, c: LevelCosts, exact: bool = True) -> dict:
    """Per term, iterations per iteration at snapshot interval k (None: no snapshots) and storage interval n:
    ``snapshots`` and ``checkpoints`` (their stalls), ``process_crash`` and ``node_lost`` (the work each class
    loses and its restarts). exact: Eq. 15's terms; else the first-order F(k, n)."""
    lam_c, lam_n = rates[PROCESS_CRASH], rates[NODE_LOST]
    storage_lam = lam_n if k is not None else lam_c + lam_n
    if exact:
        checkpoints, lost = level_terms(n, storage_lam, c.checkpoint, c.persist, c.in_flight)
    else:
        checkpoints, lost = c.checkpoint / np.asarray(n, float), storage_lam * np.asarray(n, float) / 2
    lost_per_failure = (1 - c.rho) * lost / storage_lam if storage_lam else 0 * lost
    restart = c.restart_crash
    if k is None:
        snapshots, crash_lost = 0.0, lam_c * lost_per_failure
        restart = c.restart_crash if c.restart_storage is None else c.restart_storage
    elif exact:
        snapshots, crash_lost = level_terms(k, lam_c, c.snapshot, c.snapshot_write)
    else:
        snapshots, crash_lost = c.snapshot / np.asarray(k, float), lam_c * np.asarray(k, float) / 2
    return {"snapshots": snapshots, "checkpoints": checkpoints,
            PROCESS_CRASH: crash_lost + lam_c * restart,
            NODE_LOST: lam_n * lost_per_failure + lam_n * c.restart_node}


def total(terms: dict):
    return sum(terms.values())


def numerical(rates: dict, c: LevelCosts, max_interval: float = MAX_INTERVAL) -> tuple[Optional[float], float]:
    """(k, n) minimising the exact cost rate (separable: each level's terms apart); k None where snapshots
    cost more than the crashes they save."""
    def storage(k):
        return minimize_interval(lambda n: _sum(cost_rates(k, n, rates, c), "checkpoints", NODE_LOST, PROCESS_CRASH),
                                 max_interval)

    n = storage(1.0)
    k = minimize_interval(lambda k: _sum(cost_rates(k, n, rates, c), "snapshots", PROCESS_CRASH), max_interval)
    return _better((k, n), (None, storage(None)), rates, c, exact=True)


def _sum(terms: dict, *names: str):
    return sum(terms[name] for name in names)


def violations(k: Optional[float], n: float, rates: dict, c: LevelCosts) -> list[str]:
    """The first-order approximations that do not hold at (k, n): lambda T << 1 and stall << T per level."""
    storage_lam = rates[NODE_LOST] + (rates[PROCESS_CRASH] if k is None else 0.0)
    levels = [("storage", n, storage_lam, c.checkpoint)]
    if k is not None:
        levels.insert(0, ("snapshot", k, rates[PROCESS_CRASH], c.snapshot))
    problems = []
    for name, T, lam, stall in levels:
        if lam * (T + stall) > SMALL:
            problems.append(f"{name}: lambda (T + stall) = {lam * (T + stall):.3g} is not << 1")
        if stall > SMALL * T:
            problems.append(f"{name}: stall / T = {stall / T:.3g} is not << 1")
    return problems


@dataclass(frozen=True)
class LevelPlan:
    """Both intervals (iterations; memory_interval None: no host snapshots), how they were chosen, and what
    each term costs per iteration at them (``terms``) and each failure class per failure (``per_failure``)."""

    memory_interval: Optional[int]
    storage_interval: int
    method: str  # "closed form", or "numerical" where its approximations fail
    closed: tuple
    numerical: tuple
    cost_rate: float
    cost_rate_closed: float
    cost_rate_numerical: float
    terms: dict
    per_failure: dict
    rates: dict
    violations: tuple

    def to_dict(self) -> dict:
        return asdict(self)


def _whole(T: Optional[float]) -> Optional[int]:
    return None if T is None else max(1, round(T))


def plan_levels(rates: dict, c: LevelCosts, max_interval: float = MAX_INTERVAL) -> LevelPlan:
    """The two intervals: the closed form where its approximations hold at it and at the numerical optimum,
    else the numerical one; rounded to whole iterations."""
    closed, exact = closed_form(rates, c, max_interval), numerical(rates, c, max_interval)
    problems = tuple(dict.fromkeys(violations(*closed, rates, c) + violations(*exact, rates, c)))
    method, best = ("numerical", exact) if problems else ("closed form", closed)
    k, n = _whole(best[0]), _whole(best[1])
    terms = {name: float(v) for name, v in cost_rates(k, n, rates, c).items()}
    per_failure = {cls: terms[cls] / rates[cls] if rates[cls] else 0.0 for cls in (PROCESS_CRASH, NODE_LOST)}
    return LevelPlan(memory_interval=k, storage_interval=n, method=method, closed=closed, numerical=exact,
                     cost_rate=total(terms), cost_rate_closed=float(total(cost_rates(*closed, rates, c))),
                     cost_rate_numerical=float(total(cost_rates(*exact, rates, c))), terms=terms,
                     per_failure=per_failure, rates=dict(rates), violations=problems)


def memory_interval(stall_s: float, iteration_s: float, crashes_per_hour: float,
                    max_interval: float = MAX_INTERVAL) -> int:
    """``checkpoint.memory_interval: auto``: the snapshot interval k = sqrt(2 c_m / lambda_c) in whole
    iterations, from a snapshot's measured stall and the iteration's time (seconds) and the crashes' rate.
    The memory level's closed form alone: F(k, n) is separable, so k does not depend on the storage interval."""
    lam = non_negative("crashes_per_hour", crashes_per_hour) * positive("iteration_s", iteration_s) / 3600
    stall = max(non_negative("stall_s", stall_s) / iteration_s, 1e-9)  # a free copy: the longest interval
    return max(1, round(young(stall, lam, max_interval)))
