"""The fault-tolerance cost (Section V-C, Eq. 15) as a rate, and the PB-R cost of one failure (Eq. 10, 13, 14).

Time unit: the iteration (units.py). lambda is failures per iteration, alpha1 is per
iteration (Eq. 11) and tau1 per checkpoint (Eq. 8: t / T_c counts checkpoints). t counts
iterations from the origin of the fits (the start of the phase), as in Eq. 15, whose
failure time runs from 0.

A cost rate is the expected fault-tolerance cost per unit of training time
(iterations of cost per iteration, 0.02 = 2 %): lambda * T_l, T_l being Eq. 15's
expected cost of the checkpoints taken before a failure plus that failure's recovery,
and 1 / lambda the expected time between failures. Besides the paper's PB-R cost rate:
recomputing's (RB-R), and the empirical model's (T_p = (1 - rho) d), with and without
the loss-excess guard's bound on the distance a failure may be predicted over.

Storage is a constraint: with ``in_flight`` checkpoints persisting at once, a snapshot
may start only every ``persist / in_flight`` iterations; at a shorter T_c it waits the
difference, and the wait is charged as checkpoint cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cpsr_ds.planning.units import finite, non_negative, positive, whole

QUADRATURE_POINTS = 400  # log-spaced points of the expectation over the failure time


@dataclass(frozen=True)
class PbrParams:
    """The fitted inputs of the PB-R cost of one stage in one phase.

    alpha1 (per iteration), alpha2: the loss curve exp(-alpha1 t + alpha2) (Eq. 11);
    tau1 (per checkpoint), tau2: the predictor's error exp(-tau1 t / T_c + tau2) (Eq. 8);
    xi: the curvature estimate (Eq. 7); N_p: parameters of the stage being predicted.
    """

    alpha1: float
    alpha2: float
    tau1: float
    tau2: float
    xi: float
    N_p: float

    def __post_init__(self):
        for name in ("alpha1", "tau1", "xi", "N_p"):
            positive(name, getattr(self, name))
        for name in ("alpha2", "tau2"):
            finite(name, getattr(self, name))

    @property
    def log_excess0(self) -> float:
        """ln of exp(-alpha2) * Delta F at t = 0: the relative loss excess of a prediction at the phase start."""
        return math.log(self.xi) + math.log(self.N_p) + self.tau2 - self.alpha2 - math.log(2.0)

    @property
    def excess0(self) -> float:
        """exp(-alpha2) * Delta F at t = 0, capped: beyond the cap every cost is astronomically large anyway."""
        return math.exp(min(self.log_excess0, 700.0))


def prediction_deviation(t: float, T_c: float, p: PbrParams) -> float:
    """Delta F (Eq. 10): xi N_p exp(-tau1 t / T_c + tau2) / 2, in loss units, at iteration t."""
    exponent = -p.tau1 * non_negative("t", t) / positive("T_c", T_c) + p.tau2
    return p.xi * p.N_p * math.exp(min(exponent, 700.0)) / 2


def _intervals(T_c) -> np.ndarray:
    T_c = np.asarray(T_c, dtype=float)
    if not (np.isfinite(T_c) & (T_c > 0)).all():
        raise ValueError(f"T_c must be positive and finite, got {T_c!r}")
    return T_c


def _growth(T_c, lam: float, p: PbrParams) -> np.ndarray:
    """r = (alpha1 - tau1 / T_c) / lambda: the excess grows as exp(r lambda t)."""
    return (p.alpha1 - p.tau1 / _intervals(T_c)) / positive("lambda", lam)


def relative_excess(t: float, T_c: float, p: PbrParams) -> float:
    """exp(alpha1 t - alpha2) * Delta F: the deviation relative to the loss at t (Eq. 13's term)."""
    t = non_negative("t", t)
    return math.exp(min(p.alpha1 * t - p.tau1 * t / positive("T_c", T_c) + p.log_excess0, 700.0))


def pbr_cost(t: float, T_c: float, p: PbrParams) -> float:
    """T_p (Eq. 13), iterations: ln(1 + exp(alpha1 t - alpha2) Delta F) / alpha1, for a failure at t."""
    return math.log1p(relative_excess(t, T_c, p)) / p.alpha1


def pbr_cost_linear(t: float, T_c: float, p: PbrParams) -> float:
    """T_p (Eq. 14), iterations: Eq. 13 with ln(1 + x) ~ x, valid where x is small."""
    return relative_excess(t, T_c, p) / p.alpha1


def checkpoint_wait(T_c, persist: float = 0.0, in_flight: int = 1) -> np.ndarray:
    """Iterations a snapshot waits for a free persist slot: max(0, persist / in_flight - T_c)."""
    slot = non_negative("persist", persist) / whole("in_flight", in_flight)
    return np.maximum(0.0, slot - _intervals(T_c))


def _period_costs(T_c, lam, T_s, persist, in_flight):
    """lambda, T_s' = T_s + the wait, and the period T_c + T_s' between checkpoints."""
    T_s_eff = positive("T_s", T_s) + checkpoint_wait(T_c, persist, in_flight)
    return positive("lambda", lam), T_s_eff, _intervals(T_c) + T_s_eff


def expected_excess(T_c, lam: float, p: PbrParams) -> np.ndarray:
    """E[exp(alpha1 t - alpha2) Delta F] over failure times t ~ lambda exp(-lambda t): the relative
    excess that Eq. 14 linearises, on average; infinite where it grows faster than failures come."""
    r = _growth(T_c, lam, p)
    with np.errstate(divide="ignore", over="ignore"):
        return np.where(r < 1.0, p.excess0 / (1.0 - r), np.inf)


def expected_pbr_cost(T_c, lam: float, p: PbrParams, exact: bool = True) -> np.ndarray:
    """E[T_p] over a failure time t ~ lambda exp(-lambda t) (Eq. 15's recovery term), iterations.

    exact: T_p by Eq. 13, integrated numerically (trapezoid on a log grid of u = lambda t,
    which resolves both the decay over 1 / lambda and the faster one over T_c / tau1; 0.1 %
    accurate). Otherwise T_p by Eq. 14 in closed form (Eq. 17's second term), expected_excess
    / alpha1 = lambda C T_c / (tau1 - B T_c), C = exp(-alpha2) Delta F(0) / alpha1: infinite where
    theta = alpha1 - tau1 / T_c - lambda >= 0.
    """
    if not exact:
        return expected_excess(T_c, lam, p) / p.alpha1
    r = _growth(T_c, lam, p)
    u_min = 1e-4 / np.maximum(1.0, np.abs(r))[..., None]
    u = u_min * (60.0 / u_min) ** np.linspace(0.0, 1.0, QUADRATURE_POINTS)
    u = np.concatenate([np.zeros_like(u[..., :1]), u], axis=-1)
    f = np.logaddexp(0.0, p.log_excess0 + r[..., None] * u) * np.exp(-u)
    return np.sum(np.diff(u, axis=-1) * (f[..., 1:] + f[..., :-1]), axis=-1) / (2 * p.alpha1)


def pbr_cost_rate(T_c, lam: float, T_s: float, p: PbrParams, persist: float = 0.0, in_flight: int = 1,
                  exact: bool = True) -> np.ndarray:
    """The cost rate of predicting-based recovery at interval T_c (Eq. 15, summed and integrated).

    lambda (sum_i i T_s' P(failure in period i) + E[T_p]), periods of P = T_c + T_s' iterations,
    T_s' = T_s + checkpoint_wait; the sum is T_s' / (exp(lambda P) - 1). Eq. 17 writes it
    T_s' / (1 - exp(-lambda P)), charging the checkpoint under way at the failure too: T_s' more,
    which moves no optimum. exact: as in expected_pbr_cost.
    """
    lam, T_s_eff, period = _period_costs(T_c, lam, T_s, persist, in_flight)
    with np.errstate(over="ignore"):  # exp(lambda P) = inf: no checkpoint completes before a failure
        checkpoints = lam * T_s_eff / np.expm1(lam * period)
    return checkpoints + lam * expected_pbr_cost(T_c, lam, p, exact)


def checkpoint_and_lost(T_c, lam, T_s, persist, in_flight):
    """Eq. 15's two terms under recomputing: lambda T_s' / (exp(lambda P) - 1), the checkpoints, and
    1 - lambda P / (exp(lambda P) - 1), the work lost since the last one (P = T_c + T_s')."""
    lam, T_s_eff, period = _period_costs(T_c, lam, T_s, persist, in_flight)
    with np.errstate(over="ignore"):  # exp(lambda P) = inf: no checkpoint completes before a failure
        growth = np.expm1(lam * period)
        return lam * T_s_eff / growth, 1.0 - lam * period / growth


def recompute_cost_rate(T_c, lam: float, T_s: float, persist: float = 0.0, in_flight: int = 1) -> np.ndarray:
    """The cost rate of recomputing-based recovery at interval T_c (Eq. 15 with T_r = t - i P).

    Checkpoints plus the work lost since the last one: 1 - lambda T_c / (exp(lambda P) - 1),
    P = T_c + T_s'. Young's and Daly's intervals approximate its minimum.
    """
    return empirical_cost_rate(T_c, lam, T_s, 0.0, persist, in_flight)


def empirical_cost_rate(T_c, lam: float, T_s: float, rho: float, persist: float = 0.0,
                        in_flight: int = 1) -> np.ndarray:
    """The cost rate under the empirical recovery model T_p = (1 - rho) d: recompute_cost_rate's
    checkpoint term plus (1 - rho) times its lost-work term. rho = 0 is recompute_cost_rate; its
    minimum lies near Young's interval for lambda (1 - rho), sqrt(2 T_s / ((1 - rho) lambda)).
    """
    if not 0 <= finite("rho", rho) < 1:
        raise ValueError(f"rho must be in [0, 1), got {rho!r}")
    checkpoints, lost = checkpoint_and_lost(T_c, lam, T_s, persist, in_flight)
    return checkpoints + (1.0 - rho) * lost


def guarded_lost_per_failure(T_c, rho: float, d_max: float, persist: float = 0.0) -> np.ndarray:
    """The iterations one failure is expected to cost, E[cost(d)], where recovery predicts only the failures at
    most ``d_max`` iterations behind the newest durable checkpoint (the loss-excess guard's bound) and
    recomputes the rest.

    A checkpoint counts once it has persisted, P = ``persist`` iterations after it began, so a
    failure lies d ~ U[P, P + T_c] behind the newest durable one, not U[0, T_c]: at P = 19 and
    T_c = 60, d reaches 79, and a guard that passes at d = T_c / 2 refuses every failure beyond
    its bound. A failure costs (1 - rho) d up to d_max and d beyond it; d_max <= P recomputes every
    failure: T_c / 2 + P.
    """
    if not 0 <= finite("rho", rho) < 1:
        raise ValueError(f"rho must be in [0, 1), got {rho!r}")
    T = _intervals(T_c)
    lo = non_negative("persist", persist)
    hi = lo + T
    bound = np.clip(non_negative("d_max", d_max), lo, hi)
    return ((1.0 - rho) * (bound ** 2 - lo ** 2) + hi ** 2 - bound ** 2) / (2 * T)


def guarded_cost_rate(T_c, lam: float, T_s: float, rho: float, d_max: float, persist: float = 0.0,
                      in_flight: int = 1) -> np.ndarray:
    """The cost rate under the empirical model where recovery predicts only up to ``d_max`` iterations behind
    the newest durable checkpoint: recompute_cost_rate's checkpoints' term, and the failures' lambda
    E[cost(d)] (:func:`guarded_lost_per_failure`), first order in lambda as Young's."""
    checkpoints, _ = checkpoint_and_lost(T_c, lam, T_s, persist, in_flight)
    return checkpoints + lam * guarded_lost_per_failure(T_c, rho, d_max, persist)
