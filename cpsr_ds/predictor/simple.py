"""Simple extrapolating predictors: baselines and fallbacks for VITP (Sec. III-A).

With checkpoints x_0..x_{n-1} at iterations t_0..t_{n-1}, increments
D_j = x_{j+1} - x_j over intervals I_j = t_{j+1} - t_j, and a target
f = t_{n-1} + d (the failure point):

- ``skip``:   x_hat = x_{n-1}
- ``linear``: x_hat = x_{n-1} + (d / I_{n-2}) D_{n-2}
- ``trend``:  x_hat = x_{n-1} + d s, s the least-squares slope of x over the last
  ``span`` checkpoints: the drift shared by consecutive checkpoints, with less of the
  checkpoint-to-checkpoint noise than a single increment carries.
- ``damped``: x_hat = x_{n-1} + g(kappa; I_{n-2}, d) D_{n-2}, where the velocity is
  taken to decay as exp(-kappa t); kappa is fitted per tensor by least squares
  over the history, predicting every D_j from D_{j-1}. kappa = 0 is ``linear``,
  kappa -> inf is ``skip``.
- ``ridge``:  x_hat = x_{n-1} + d sum_l w_l D_{m-l} / I_{m-l}: the next velocity as a
  ridge-regularised combination of the last ``lags`` velocities, w fitted per
  tensor on the history.

All fits need only inner products of increments, accumulated in slabs so that a
large tensor never gets a float64 copy of its whole history.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import asdict

import numpy as np
import torch

from cpsr_ds.predictor.base import Predictor, ValidationResult

_SLAB = 1 << 18


def increment_gram(series: list[torch.Tensor], span: slice = slice(None)) -> np.ndarray:
    """G[a, b] = <D_a, D_b> (float64) for the increments of ``series`` restricted to ``span``."""
    m = len(series) - 1
    gram = np.zeros((m, m))
    start, stop, _ = span.indices(series[0].numel())
    for lo in range(start, stop, _SLAB):
        hi = min(lo + _SLAB, stop)
        x = torch.stack([s[lo:hi] for s in series]).double()
        d = x[1:] - x[:-1]
        gram += (d @ d.T).numpy()
    return gram


def intervals(iterations: list[int]) -> np.ndarray:
    return np.diff(np.asarray(iterations, dtype=np.float64))


def damping_gain(kappa, prev_interval, horizon):
    """Change over ``horizon`` iterations relative to the change over the preceding
    ``prev_interval`` ones, when the velocity decays as exp(-kappa t)."""
    kappa, prev_interval, horizon = np.broadcast_arrays(*(np.asarray(a, dtype=np.float64) for a in (kappa, prev_interval, horizon)))
    with np.errstate(invalid="ignore", divide="ignore"):
        gain = np.exp(-kappa * prev_interval) * np.expm1(-kappa * horizon) / np.expm1(-kappa * prev_interval)
    return np.where(kappa > 0, gain, horizon / prev_interval)


def fit_damping(gram: np.ndarray, steps: np.ndarray) -> float:
    """kappa >= 0 minimising sum_j ||D_j - g(kappa; I_{j-1}, I_j) D_{j-1}||^2."""
    if len(steps) < 2:
        raise ValueError("fitting a damping needs at least two increments")
    j = np.arange(1, len(steps))
    rr, rb, bb = gram[j, j], gram[j, j - 1], gram[j - 1, j - 1]

    def loss(kappas: np.ndarray) -> np.ndarray:
        g = damping_gain(kappas[:, None], steps[j - 1][None, :], steps[j][None, :])
        return (rr - 2 * g * rb + g * g * bb).sum(axis=1)

    # The loss is smooth but not convex in kappa, hence a log grid before refining.
    scale = float(steps.mean())
    grid = np.concatenate([[0.0], np.geomspace(1e-4, 50.0, 241) / scale])
    best = int(np.argmin(loss(grid)))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    for _ in range(40):
        a, b = lo + (hi - lo) * 0.382, lo + (hi - lo) * 0.618
        la, lb = loss(np.array([a, b]))
        lo, hi = (lo, b) if la <= lb else (a, hi)
    candidates = np.array([grid[best], (lo + hi) / 2])
    return float(candidates[np.argmin(loss(candidates))])


def fit_ridge(gram: np.ndarray, steps: np.ndarray, lags: int, ridge: float) -> np.ndarray:
    """w minimising sum_j ||v_j - sum_l w_l v_{j-l}||^2 + ridge * tr(A)/lags * ||w||^2, v_j = D_j / I_j."""
    m = len(steps)
    if m <= lags:
        raise ValueError(f"fitting {lags} lags needs more than {lags} increments, got {m}")
    vg = gram / np.outer(steps, steps)
    rows = np.arange(lags, m)
    lag = np.arange(1, lags + 1)
    a = np.array([[vg[rows - k, rows - l].sum() for l in lag] for k in lag])
    b = np.array([vg[rows, rows - k].sum() for k in lag])
    reg = ridge * max(np.trace(a), 1e-300) / lags
    return np.linalg.solve(a + reg * np.eye(lags), b)


class SkipPredictor(Predictor):
    """The last checkpoint as is: what restarting without prediction gives."""

    name = "skip"
    min_history = 1

    def _extrapolate(self, kind, iterations, series, target):
        return series[-1].clone()


class LinearPredictor(Predictor):
    """Straight-line extrapolation from the last two checkpoints."""

    name = "linear"
    min_history = 2

    def _extrapolate(self, kind, iterations, series, target):
        gain = (target - iterations[-1]) / (iterations[-1] - iterations[-2])
        return series[-1] + gain * (series[-1] - series[-2])


class TrendPredictor(Predictor):
    """Extrapolation along the least-squares slope of the last ``span`` checkpoints."""

    name = "trend"
    min_history = 2
    summarizes = True

    def __init__(self, span: int = 4, **options):
        if span < 2:
            raise ValueError(f"trend needs a span of at least 2 checkpoints, got {span}")
        super().__init__(**options)
        self.span = span
        self._summary: dict | None = None  # load_summary's, for predicting from the newest checkpoint alone

    @property
    def options(self) -> dict:
        return {**super().options, "span": self.span}

    def _slope(self, iterations, series) -> torch.Tensor:
        t = torch.tensor(iterations[-self.span:], dtype=torch.float64)
        w = (t - t.mean()) / (t - t.mean()).square().sum()
        # Accumulated in place: a restart's peak memory holds one vector of the kind's size here, not three.
        slope = torch.zeros_like(series[-1])
        for wi, x in zip(w, series[-self.span:]):
            slope.add_(x, alpha=float(wi))
        return slope

    def _extrapolate(self, kind, iterations, series, target):
        # One checkpoint observed: a restart that read only the newest, with the slope kept beside it.
        slope = (self._summary["slope"][kind].to(torch.float32, copy=True) if len(series) == 1
                 else self._slope(iterations, series))
        return slope.mul_(target - iterations[-1]).add_(series[-1])

    def summary(self, held_out: ValidationResult | None) -> dict | None:
        """The slope over the last ``span`` checkpoints and the held-out error. The slope is kept in bf16: a
        restart adds d times it to the newest checkpoint, so its rounding is 2^-8 of the predicted step, far
        inside the prediction's own error, and the summary costs 2 bytes a parameter."""
        if len(self.history) < self.min_history:
            return None
        iterations = list(self.history.iterations)
        return {"name": self.name, "span": self.span, "iteration": iterations[-1],
                "slope": {kind: self._slope(iterations, self.history.series(kind)).to(torch.bfloat16)
                          for kind in self.predicted_kinds},
                "held_out": None if held_out is None else asdict(held_out)}

    def load_summary(self, summary: dict) -> bool:
        slope = summary.get("slope", {})
        fits = (summary.get("name") == self.name and summary.get("span") == self.span and len(self.history) == 1
                and summary.get("iteration") == self.history.iterations[-1]
                and set(slope) == set(self.predicted_kinds)
                and all(slope[k].numel() == self.layout.sizes[k] for k in slope))
        if fits:
            held_out = summary["held_out"]
            self._summary = {**summary, "held_out": None if held_out is None else ValidationResult(**held_out)}
        return fits

    def _from_summary(self) -> bool:
        return self._summary is not None and len(self.history) == 1

    def ready(self) -> bool:
        return super().ready() or self._from_summary()

    def can_hold_out(self) -> bool:
        # A restart read c alone with its slope: the first checkpoint after it is held out against that slope,
        # so that a failure before the second one may still predict.
        return super().can_hold_out() or (len(self.history) == 2 and self._summary is not None
                                          and self._summary["iteration"] == self.history.iterations[0])

    def validation_error(self) -> ValidationResult | None:
        return self._summary["held_out"] if self._from_summary() else super().validation_error()


class _PerTensor(Predictor):
    """Fits coefficients per tensor of a kind, from that tensor's own history."""

    def _extrapolate(self, kind, iterations, series, target):
        steps = intervals(iterations)
        out = series[-1].clone()
        for entry in self.layout.of_kind(kind):
            s = entry.span
            delta = self._delta(increment_gram(series, s), steps, [x[s] for x in series], target - iterations[-1])
            out[s] += delta
        return out

    @abstractmethod
    def _delta(self, gram: np.ndarray, steps: np.ndarray, series: list[torch.Tensor], horizon: int) -> torch.Tensor:
        """Change of one tensor from its last checkpoint over ``horizon`` iterations."""


class DampedPredictor(_PerTensor):
    """Linear extrapolation with an exponentially decaying velocity, kappa fitted per tensor."""

    name = "damped"
    min_history = 3

    def _delta(self, gram, steps, series, horizon):
        gain = damping_gain(fit_damping(gram, steps), steps[-1], horizon)
        return float(gain) * (series[-1] - series[-2])

    def fitted_damping(self) -> dict[str, float]:
        """kappa per predicted tensor, fitted on the current history."""
        steps = intervals(list(self.history.iterations))
        return {
            e.key: fit_damping(increment_gram(self.history.series(kind), e.span), steps)
            for kind in self.predicted_kinds
            for e in self.layout.of_kind(kind)
        }


class RidgePredictor(_PerTensor):
    """Next velocity as a ridge-regularised combination of the last ``lags`` velocities."""

    name = "ridge"

    def __init__(self, lags: int = 2, ridge: float = 1e-2, **options):
        if lags < 1 or ridge < 0:
            raise ValueError(f"ridge needs lags >= 1 and ridge >= 0, got lags={lags} ridge={ridge}")
        self.lags, self.ridge = lags, ridge
        self.min_history = lags + 2
        super().__init__(**options)

    @property
    def options(self) -> dict:
        return {**super().options, "lags": self.lags, "ridge": self.ridge}

    def _delta(self, gram, steps, series, horizon):
        w = fit_ridge(gram, steps, self.lags, self.ridge)
        m = len(steps)
        velocity = sum(float(w[l - 1] / steps[m - l]) * (series[m - l + 1] - series[m - l]) for l in range(1, self.lags + 1))
        return horizon * velocity
