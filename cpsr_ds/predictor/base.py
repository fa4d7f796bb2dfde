"""The common predictor interface (Sec. III-A, IV-B).

A predictor observes the checkpoints of one rank's shard and predicts the full
training state at a later iteration, the failure point f, for predicting-based
recovery (PB-R). Its validation error, the error of predicting the newest
checkpoint from the older ones, is the measured counterpart of the prediction
deviation behind Eq. 9-10; the recovery decision compares it with restarting
from the checkpoint.

Parameters and Adam's moments are treated separately: a pilot on a small GPT
found that extrapolating the moments hurts, so by default ``exp_avg`` and
``exp_avg_sq`` are kept from the last checkpoint and only parameters are
predicted; ``exp_avg_sq`` is clamped non-negative whenever it is predicted.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator

import torch

from cpsr_ds.planning.fitter import squared_distance
from cpsr_ds.predictor.state import KINDS, MOMENTS, History, Layout

TREATMENTS = ("predict", "keep")


class NotReady(RuntimeError):
    """The predictor has too little history (or training) to predict."""


@dataclass(frozen=True)
class ValidationResult:
    """Error of predicting a held-out checkpoint (``iteration``) ``horizon`` iterations ahead.

    ``relative`` is ||x_hat - x|| / ||x_prev - x|| over the predicted kinds: the
    error relative to restarting from the previous checkpoint (< 1 beats it;
    exactly 1 when nothing is predicted). ``mse`` is Eq. 9 per predicted kind and for the
    parameters (Eq. 9's own), predicted or not.
    """

    iteration: int
    horizon: int
    relative: float
    mse: dict[str, float]


class Predictor(ABC):
    """Observes checkpoints, predicts the state at a later iteration.

    ``history``: how many checkpoints to keep. ``params`` / ``moments``:
    ``"predict"`` or ``"keep"`` (copy from the last checkpoint) for parameters and
    for the Adam moments. Keys without a known kind prefix, and non-floating
    tensors, are always kept.
    """

    name: str
    min_history: int = 1
    align: int = 1
    summarizes: bool = False  # True: summary() gives what a restart needs beside the newest checkpoint

    def __init__(self, history: int = 8, params: str = "predict", moments: str = "keep"):
        for what, value in (("params", params), ("moments", moments)):
            if value not in TREATMENTS:
                raise ValueError(f"{what} must be one of {TREATMENTS}, got {value!r}")
        if history < self.min_history:
            raise ValueError(f"{self.name} needs a history of at least {self.min_history}, got {history}")
        self.params = params
        self.moments = moments
        self.history = History(history, self.align)

    @property
    def options(self) -> dict:
        return {"history": self.history.capacity, "params": self.params, "moments": self.moments}

    @property
    def layout(self) -> Layout:
        if self.history.layout is None:
            raise NotReady(f"{self.name}: nothing observed yet")
        return self.history.layout

    def predicts(self, kind: str) -> bool:
        return (self.moments if kind in MOMENTS else self.params) == "predict"

    @property
    def predicted_kinds(self) -> tuple[str, ...]:
        return tuple(k for k in self.layout.kinds if self.predicts(k))

    def observe(self, iteration: int, state: dict[str, torch.Tensor]) -> None:
        """Append a checkpoint (copied) to the bounded history."""
        self.history.append(iteration, state)

    def observing(self, iteration: int, state: dict[str, torch.Tensor]) -> Iterator[None]:
        """:meth:`observe` a piece at a time (:meth:`History.appending`), for the coordinator's slots."""
        return self.history.appending(iteration, state)

    def ready(self) -> bool:
        return len(self.history) >= self.min_history

    def predict(self, target_iteration: int, kept_views: bool = False) -> dict[str, torch.Tensor]:
        """The full state at ``target_iteration``: the observed keys, shapes and dtypes.

        ``kept_views``: the kinds kept from the newest checkpoint (not predicted) are views of the
        history, not copies, for a caller that only reads them (recovery, which writes them into the
        engine, at a peak the size of those kinds lower); changing them would change the history."""
        if not self.ready():
            raise NotReady(f"{self.name}: not ready ({len(self.history)} checkpoints observed)")
        last = self.history.iterations[-1]
        if target_iteration < last:
            raise ValueError(f"target iteration {target_iteration} is before the last checkpoint {last}")
        flats = self._predict_flats(list(self.history.iterations), list(self.history.flats), target_iteration)
        kept = set(self.layout.kinds) - set(self.predicted_kinds)
        copies = set() if kept_views else kept
        return self.layout.unflatten({k: v.clone() if k in copies else v for k, v in flats.items()}, self.history.others)

    def _predict_flats(self, iterations: list[int], flats: list[dict[str, torch.Tensor]], target: int) -> dict[str, torch.Tensor]:
        out = dict(flats[-1])
        for kind in self.predicted_kinds:
            series = [f[kind] for f in flats]
            pred = series[-1].clone() if target == iterations[-1] else self._extrapolate(kind, iterations, series, target)
            out[kind] = pred.clamp_(min=0.0) if kind == "exp_avg_sq" else pred
        return out

    @abstractmethod
    def _extrapolate(self, kind: str, iterations: list[int], series: list[torch.Tensor], target: int) -> torch.Tensor:
        """A new flat vector of ``kind`` at ``target`` from its history ``series`` (oldest first)."""

    def can_hold_out(self) -> bool:
        """Whether the checkpoints before the newest are enough to predict it."""
        return len(self.history) >= self.min_history + 1

    def validation_error(self) -> ValidationResult | None:
        """Predict the newest checkpoint from the older ones; None without enough history."""
        if not self.can_hold_out():
            return None
        iterations, flats = list(self.history.iterations), list(self.history.flats)
        pred = self._predict_flats(iterations[:-1], flats[:-1], iterations[-1])
        return holdout_error(iterations[-1], iterations[-1] - iterations[-2], pred, flats[-1], flats[-2], self.predicted_kinds)

    def summary(self, held_out: ValidationResult | None) -> dict | None:
        """What this predictor needs of the history besides its newest checkpoint, small enough to keep with
        every checkpoint (``held_out``: its validation error now); None: it needs the history itself."""
        return None

    def load_summary(self, summary: dict) -> bool:
        """Predict from the one observed checkpoint and ``summary`` (written for it); False where it does not fit."""
        return False

    def state_dict(self, include_history: bool = True) -> dict:
        """Options, fitted state and (unless ``include_history`` is False) the history.

        Without the history the dict is small enough to save with every checkpoint;
        the history is then observed again from the stored checkpoints.
        """
        history = self.history.state_dict()
        if not include_history:
            history.update(iterations=[], flats=[], others={})
        return {"name": self.name, "options": self.options, "history": history}

    def load_state_dict(self, sd: dict) -> None:
        if sd["name"] != self.name:
            raise ValueError(f"state dict of predictor {sd['name']!r} loaded into {self.name!r}")
        self.history.load_state_dict(sd["history"])


def holdout_error(iteration: int, horizon: int, pred: dict[str, torch.Tensor], truth: dict[str, torch.Tensor],
                  prev: dict[str, torch.Tensor], kinds: tuple[str, ...]) -> ValidationResult:
    err = base = 0.0
    mse = {}
    for kind in KINDS:
        # A kind kept from the newest checkpoint costs two passes over its share for nothing but the parameters'.
        if kind not in truth or (kind not in kinds and kind != "param"):
            continue
        e = squared_distance(pred[kind], truth[kind])
        mse[kind] = e / max(truth[kind].numel(), 1)
        if kind in kinds:
            err += e
            base += squared_distance(prev[kind], truth[kind])
    relative = 1.0 if not kinds else (math.sqrt(err / base) if base > 0 else (0.0 if err == 0 else math.inf))
    return ValidationResult(iteration, horizon, relative, mse)
