"""Incremental VITP training in budgeted steps (Sec. III-A, III-B, V-A).

The coordinator hands the trainer slices of idle time (pipeline bubbles); each
:meth:`VITPTrainer.step` call trains until its step count or time budget is spent.
A step samples one window of the history and a batch of chunks, so memory does
not grow with the state size. Every chunk index divisible by ``holdout_every`` is
held out; after each call the trainer predicts the newest checkpoint of those
chunks from the window before it and records the loss, Eq. 9 in units of each
chunk's recent movement, against time: the loss_p(t) curve the fitter fits
tau_1 and tau_2 of Eq. 8 to.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from cpsr_ds.predictor import fdd, samples
from cpsr_ds.predictor.network import VITP, Prepared, advance, prepare
from cpsr_ds.predictor.state import KINDS, History


@dataclass(frozen=True)
class LossPoint:
    steps: int  # training steps so far
    seconds: float  # training time so far
    iteration: int  # newest checkpoint in the history
    train_loss: float
    val_loss: float
    val_relative: float  # error / error of the last checkpoint, held-out chunks


@dataclass(frozen=True)
class StepReport:
    steps: int
    seconds: float
    train_loss: float
    val_loss: float


class VITPTrainer:
    def __init__(self, model: VITP, history: History, kinds: tuple[str, ...], token_size: int,
                 batch_chunks: int = 256, lr: float = 1e-3, max_stride: int = 2, holdout_every: int = 10,
                 val_chunks: int = 256, seed: int = 0, device: str = "cpu"):
        self.model = model.to(device)
        self.history = history
        self.kinds = kinds
        self.token_size = token_size
        self.bands: fdd.Bands = model.bands
        self.batch_chunks = batch_chunks
        self.max_stride = max_stride
        self.holdout_every = holdout_every
        self.val_chunks = val_chunks
        self.device = device
        self.optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        self.generator = torch.Generator().manual_seed(seed)
        self.steps = 0
        self.seconds = 0.0
        self.curve: list[LossPoint] = []

    @property
    def window(self) -> int:
        return self.bands.window

    def trainable(self) -> bool:
        return len(self.history) > self.window and bool(self._kinds())

    def _kinds(self) -> list[str]:
        layout = self.history.layout
        return [] if layout is None else [k for k in self.kinds if k in layout.sizes]

    def _chunk_count(self, kind: str) -> int:
        return self.history.layout.sizes[kind] // self.token_size

    def run(self, p: Prepared, times: torch.Tensor, kind: str) -> torch.Tensor:
        """Prediction for a prepared window of chunks of ``kind``."""
        kinds = torch.full((p.last.shape[0],), KINDS.index(kind), device=self.device)
        return advance(p, self.model(p, times.to(self.device), kinds), self.bands)

    def _batch(self, kind: str, window: samples.Window, rows: torch.Tensor):
        series = self.history.series(kind)
        y = samples.gather(series, window.inputs, rows, self.token_size).to(self.device)
        target = samples.gather(series, (window.target,), rows, self.token_size)[:, 0].to(self.device)
        times, t = window.times(self.history.iterations)
        return prepare(y, self.bands), samples.time_features(times, t), target

    def _train_rows(self, kind: str) -> torch.Tensor:
        n = self._chunk_count(kind)
        rows = torch.randint(n, (self.batch_chunks,), generator=self.generator)
        # Shift held-out picks to their neighbour; fine with a single chunk too.
        held = rows % self.holdout_every == 0
        return torch.where(held & (n > 1), (rows + 1) % n, rows)

    def _val_rows(self, kind: str) -> torch.Tensor:
        held = torch.arange(0, self._chunk_count(kind), self.holdout_every)
        stride = max(len(held) // self.val_chunks, 1)
        return held[::stride][: self.val_chunks]

    def train_step(self) -> float:
        kinds = self._kinds()
        kind = kinds[int(torch.randint(len(kinds), (1,), generator=self.generator))]
        wins = samples.windows(len(self.history), self.window, self.max_stride)
        window = wins[int(torch.randint(len(wins), (1,), generator=self.generator))]
        p, times, target = self._batch(kind, window, self._train_rows(kind))
        self.model.train()
        loss = ((self.run(p, times, kind) - target) / p.scale).square().mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.steps += 1
        return float(loss.detach())

    @torch.no_grad()
    def validate(self) -> tuple[float, float, dict[str, tuple[float, float, int]]]:
        """(normalised loss, relative error, per kind (squared error, squared error of skip, count))."""
        n = len(self.history)
        window = samples.Window(tuple(range(n - 1 - self.window, n - 1)), n - 1)
        self.model.eval()
        losses, per_kind = [], {}
        for kind in self._kinds():
            p, times, target = self._batch(kind, window, self._val_rows(kind))
            pred = self.run(p, times, kind)
            losses.append(float(((pred - target) / p.scale).square().mean()))
            per_kind[kind] = (float((pred - target).double().square().sum()),
                              float((p.last - target).double().square().sum()), target.numel())
        err = sum(v[0] for v in per_kind.values())
        base = sum(v[1] for v in per_kind.values())
        relative = math.sqrt(err / base) if base > 0 else 0.0
        return sum(losses) / len(losses), relative, per_kind

    def step(self, budget_s: float | None = None, n_steps: int | None = None) -> StepReport:
        """Train for ``n_steps`` steps or until ``budget_s`` seconds are spent, whichever comes first, then validate."""
        if budget_s is None and n_steps is None:
            raise ValueError("step needs a time budget or a step count")
        if not self.trainable():
            return StepReport(0, 0.0, math.nan, math.nan)
        start = time.perf_counter()
        losses: list[float] = []
        last = 0.0
        while n_steps is None or len(losses) < n_steps:
            elapsed = time.perf_counter() - start
            # Stop before a step that would overrun the budget: the bubble ends on time.
            if budget_s is not None and losses and elapsed + last > budget_s:
                break
            t0 = time.perf_counter()
            losses.append(self.train_step())
            last = time.perf_counter() - t0
        val_loss, relative, _ = self.validate()
        seconds = time.perf_counter() - start
        self.seconds += seconds
        train_loss = sum(losses) / len(losses)
        self.curve.append(LossPoint(self.steps, self.seconds, self.history.iterations[-1], train_loss, val_loss, relative))
        return StepReport(len(losses), seconds, train_loss, val_loss)

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "steps": self.steps,
            "seconds": self.seconds,
            "curve": [asdict(p) for p in self.curve],
        }

    def load_state_dict(self, sd: dict) -> None:
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optimizer"])
        # A loaded tensor may be a view into a larger buffer; the generator needs its own bytes.
        self.generator.set_state(sd["generator"].clone())
        self.steps = sd["steps"]
        self.seconds = sd["seconds"]
        self.curve = [LossPoint(**p) for p in sd["curve"]]
