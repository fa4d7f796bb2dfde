"""Incremental VITP training in budgeted steps (Sec. III-A, III-B, V-A).

The coordinator hands the trainer slices of idle time (pipeline bubbles); each
:meth:`VITPTrainer.step` call trains until its step count or time budget is spent.
A step samples one window of the history and a batch of chunks, so memory does
not grow with the state size. Every chunk index divisible by ``holdout_every`` is
held out; after each call the trainer predicts the newest checkpoint of those
chunks from the window before it and records the loss, Eq. 9 in units of each
chunk's recent movement, against time: the loss_p(t) curve the fitter fits
tau_1 and tau_2 of Eq. 8 to.

Its memory on its device is capped (``memory_mb``, :mod:`cpsr_ds.predictor.memory`):
batches of more chunks than fit run as micro-batches, and the history's samples are
streamed from host memory where they do not all fit.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass
from typing import Generator, Iterator, Optional

import torch

from cpsr_ds.predictor import fdd, samples
from cpsr_ds.predictor.memory import MIB, Costs, Footprint, allocated_bytes, fit, tensor_bytes
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


def forward(model: VITP, p: Prepared, times: torch.Tensor, kind: str) -> torch.Tensor:
    """The network's prediction for a prepared window of chunks of ``kind``."""
    kinds = torch.full((p.last.shape[0],), KINDS.index(kind), device=p.last.device)
    return advance(p, model(p, times.to(p.last.device), kinds), model.bands)


def descending(model: VITP, optimizer: torch.optim.Optimizer, kind: str, batches, values: int) -> Iterator[None]:
    """One optimizer step on the mean squared normalised error over ``values`` values of ``kind``, summed over
    ``batches`` ((prepared window, times, target), each made as it is consumed: one batch's activations at a time),
    pausing between them: the caller may stop at a yield (a bubble's end) and go on later, the gradients so far
    kept in the model. Returns the loss (the generator's value)."""
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for i, (p, times, target) in enumerate(batches):
        if i:
            yield
        model.train()  # a held-out check in the pause may have left it in eval mode
        loss = ((forward(model, p, times, kind) - target) / p.scale).square().sum() / values
        loss.backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return total


def to_end(pieces: Generator):
    """Run ``pieces`` without pausing; its value."""
    while True:
        try:
            next(pieces)
        except StopIteration as done:
            return done.value


def descend(model: VITP, optimizer: torch.optim.Optimizer, kind: str, batches, values: int) -> float:
    """:func:`descending` without pauses; the loss."""
    return to_end(descending(model, optimizer, kind, batches, values))


def significantly_lower(after: torch.Tensor, before: torch.Tensor, z: float = 2.0) -> bool:
    """Whether the summed squared error ``after`` (per chunk) is lower than ``before`` (the same chunks) by more
    than ``z`` standard errors of the paired per-chunk differences: a change of the weights that the check's own
    chunk-to-chunk spread cannot explain."""
    d = (after - before).double()
    if d.numel() < 2:
        return bool(d.sum() < 0)
    return bool(d.mean() < -z * d.std() / math.sqrt(d.numel()))


# The pieces of training that are not micro-batches, by the names the coordinator keeps their costs under.
HELD_OUT_PIECE = "held_out_check"
FILL_CHECK_PIECE = "fill_check"


class Clock:
    """Seconds spent while running, the pauses left out."""

    def __init__(self):
        self.seconds, self._since = 0.0, time.perf_counter()

    def now(self) -> float:
        return self.seconds + time.perf_counter() - self._since

    def pause(self, upcoming: Optional[str] = None) -> Iterator[Optional[str]]:
        """A yield that the clock does not count; it yields ``upcoming``, the name of the piece after it where that
        one is not a micro-batch (coordinator.PieceCost.named)."""
        self.seconds = self.now()
        yield upcoming
        self._since = time.perf_counter()


class VITPTrainer:
    def __init__(self, model: VITP, history: History, kinds: tuple[str, ...], token_size: int,
                 batch_chunks: int = 256, lr: float = 1e-3, max_stride: int = 2, holdout_every: int = 10,
                 val_chunks: int = 256, seed: int = 0, device: str = "cpu", memory_mb: float = 200.0,
                 micro_chunks: int = 64):
        self.model = model.to(device)
        self.history = history
        self.kinds = kinds
        self.token_size = token_size
        self.bands: fdd.Bands = model.bands
        self.batch_chunks = batch_chunks
        self.max_stride = max_stride
        self.holdout_every = holdout_every
        self.fill_check = False  # reserve_fill_check: a second held-out split, the one filling stops on
        self.val_chunks = val_chunks
        self.micro_chunks = micro_chunks
        self.device = device
        self.optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        self.generator = torch.Generator().manual_seed(seed)
        self.steps = 0
        self.seconds = 0.0
        self.curve: list[LossPoint] = []
        self.costs = self._measure_costs(lr)
        self.cap(memory_mb)
        self._resident: tuple[tuple, dict[str, list[torch.Tensor]]] = ((), {})

    def cap(self, memory_mb: float) -> None:
        """Cap the footprint at ``memory_mb`` MiB; :class:`MemoryCapError` if not even one chunk fits under it."""
        fit(self.costs, memory_mb * MIB, self.batch_chunks, math.inf)
        self.cap_bytes = memory_mb * MIB

    def _measure_costs(self, lr: float) -> Costs:
        """The footprint's parts: a twin of the network and its optimizer take steps on random batches of one and
        two chunks (the trainer's own network, optimizer and generator are left as they are)."""
        twin = copy.deepcopy(self.model)
        optimizer = torch.optim.Adam(twin.parameters(), lr=lr)
        gen = torch.Generator().manual_seed(0)
        w, token = self.window, self.token_size
        times = samples.time_features(torch.arange(float(w)), float(w))

        def step(rows: int) -> int:
            y = torch.randn(rows, w, token, generator=gen).to(self.device)
            target = y[:, -1] + 1.0
            batches = ((prepare(y, self.bands), times, target) for _ in range(1))
            return allocated_bytes(lambda: descend(twin, optimizer, KINDS[0], batches, rows * token))

        step(1)  # the optimizer's state is made at the first step
        one, two = step(1), step(2)
        return Costs(weights=tensor_bytes(self.model.parameters()),
                     optimizer=tensor_bytes(v for state in optimizer.state.values() for v in state.values()),
                     step_fixed=2 * one - two, step_per_chunk=two - one,
                     sample_per_chunk=(w + 1) * token * torch.finfo(torch.float32).bits // 8)

    @property
    def footprint(self) -> Footprint:
        """The footprint on the device for the history's layout (before any checkpoint: with samples streamed)."""
        layout = self.history.layout
        itemsize = torch.finfo(torch.float32).bits // 8
        history = (math.inf if layout is None else
                   sum(self.history.capacity * layout.sizes[k] * itemsize for k in self._kinds()))
        return fit(self.costs, self.cap_bytes, self.batch_chunks, history)

    def _series(self, kind: str) -> list[torch.Tensor]:
        """The history of ``kind``: on the device where it fits (copied once per checkpoint), else in host memory."""
        series = self.history.series(kind)
        if self.footprint.streamed:
            return series
        key = tuple(self.history.iterations)
        if self._resident[0] != key:
            self._resident = (key, {})
        cached = self._resident[1]
        if kind not in cached:
            cached[kind] = [t.to(self.device) for t in series]
        return cached[kind]

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
        return forward(self.model, p, times, kind)

    def _batch(self, kind: str, window: samples.Window, rows: torch.Tensor):
        series = self._series(kind)
        y = samples.gather(series, window.inputs, rows, self.token_size).to(self.device)
        target = samples.gather(series, (window.target,), rows, self.token_size)[:, 0].to(self.device)
        times, t = window.times(self.history.iterations)
        return prepare(y, self.bands), samples.time_features(times, t), target

    def _train_rows(self, kind: str) -> torch.Tensor:
        n = self._chunk_count(kind)
        rows = torch.randint(n, (self.batch_chunks,), generator=self.generator)
        # Shift held-out picks to their neighbour, the one before for the last chunk (the one after, chunk 0, is
        # held out); a single chunk is trained on.
        held = rows % self.holdout_every == 0
        if self.fill_check:
            held |= rows % self.holdout_every == self.holdout_every // 2
        neighbour = torch.where(rows + 1 < n, rows + 1, rows - 1)
        return torch.where(held & (n > 1), neighbour, rows)

    def _val_rows(self, kind: str, offset: int = 0) -> torch.Tensor:
        held = torch.arange(offset, self._chunk_count(kind), self.holdout_every)
        stride = max(len(held) // self.val_chunks, 1)
        return held[::stride][: self.val_chunks]

    def reserve_fill_check(self) -> None:
        """Hold the chunks half way between the held-out ones out of training too: the check on which
        :meth:`filling` decides whether its extra steps help. Called before the first step (``coordinator.fill``);
        needs ``holdout_every`` >= 3, so that the two splits differ and leave chunks to train on."""
        if self.holdout_every < 3:
            raise ValueError(f"vitp: a fill check needs holdout_every >= 3, got {self.holdout_every}")
        self.fill_check = True

    def train_step(self) -> Iterator[None]:
        """One training step, pausing after each micro-batch of at most ``micro_chunks`` chunks (fewer where the
        memory cap says so): the piece of work a bubble fits. Returns the loss (the generator's value)."""
        kinds = self._kinds()
        kind = kinds[int(torch.randint(len(kinds), (1,), generator=self.generator))]
        wins = samples.windows(len(self.history), self.window, self.max_stride)
        window = wins[int(torch.randint(len(wins), (1,), generator=self.generator))]
        rows = self._train_rows(kind)
        batches = (self._batch(kind, window, part) for part in rows.split(min(self.footprint.batch, self.micro_chunks)))
        loss = yield from descending(self.model, self.optimizer, kind, batches, rows.numel() * self.token_size)
        self.steps += 1
        return loss

    def _held_out(self, kind: str, offset: int) -> Iterator[tuple[Prepared, torch.Tensor, torch.Tensor]]:
        """(prepared window, target, prediction) of the newest checkpoint's held-out chunks of ``kind`` (those of
        the fill check with ``offset`` holdout_every // 2), a batch at a time."""
        n = len(self.history)
        window = samples.Window(tuple(range(n - 1 - self.window, n - 1)), n - 1)
        self.model.eval()
        for part in self._val_rows(kind, offset).split(self.footprint.batch):
            p, times, target = self._batch(kind, window, part)
            yield p, target, self.run(p, times, kind)

    @torch.no_grad()
    def validate(self, check: bool = False) -> tuple[float, float, dict[str, tuple[float, float, int]]]:
        """(normalised loss, relative error, per kind (squared error, squared error of skip, count)) on the
        held-out chunks, or with ``check`` on the fill check's (:meth:`reserve_fill_check`)."""
        offset = self.holdout_every // 2 if check else 0
        losses, per_kind = [], {}
        for kind in self._kinds():
            loss, err, skip, n = 0.0, 0.0, 0.0, 0
            for p, target, pred in self._held_out(kind, offset):
                loss += float(((pred - target) / p.scale).square().sum())
                err += float((pred - target).double().square().sum())
                skip += float((p.last - target).double().square().sum())
                n += target.numel()
            losses.append(loss / n)
            per_kind[kind] = (err, skip, n)
        err = sum(v[0] for v in per_kind.values())
        base = sum(v[1] for v in per_kind.values())
        relative = math.sqrt(err / base) if base > 0 else 0.0
        return sum(losses) / len(losses), relative, per_kind

    @torch.no_grad()
    def check_errors(self) -> torch.Tensor:
        """The squared error of each of the fill check's chunks (every kind's, in turn), float64."""
        offset = self.holdout_every // 2
        return torch.cat([(pred - target).double().square().sum(dim=1) for kind in self._kinds()
                          for p, target, pred in self._held_out(kind, offset)])

    def step(self, budget_s: float | None = None, n_steps: int | None = None, validate: bool = True) -> StepReport:
        """Train for ``n_steps`` steps or until ``budget_s`` seconds are spent, whichever comes first, then validate
        (``validate`` false: not, and the learning curve gets no point; the report's val_loss is nan)."""
        if budget_s is None and n_steps is None:
            raise ValueError("step needs a time budget or a step count")
        return to_end(self.training(budget_s, n_steps, validate))

    def training(self, budget_s: float | None = None, n_steps: int | None = None, validate: bool = True,
                 then: Optional[str] = None) -> Generator[Optional[str], None, StepReport]:
        """:meth:`step` in pieces: it pauses after each micro-batch (:meth:`train_step`), so that the coordinator
        runs it a bubble at a time; the seconds it counts are those it ran. Without either limit it trains until
        the caller stops it. The pause after the last step names the piece that follows: the held-out check
        (HELD_OUT_PIECE) or, without it, the caller's ``then``."""
        if not self.trainable():
            return StepReport(0, 0.0, math.nan, math.nan)
        clock = Clock()
        losses: list[float] = []
        longest = 0.0

        def another_step() -> bool:
            # Stop before a step that would overrun the budget. The longest step so far, not the last, is the
            # estimate: a step the scheduler preempted is the one that overruns.
            return (n_steps is None or len(losses) < n_steps) and \
                not (budget_s is not None and losses and clock.now() + longest > budget_s)

        # A pause follows every piece, the last too: the coordinator times a piece up to its pause, and the
        # held-out check may be the largest piece.
        while another_step():
            t0 = clock.now()
            losses.append((yield from self._paused(self.train_step(), clock)))
            longest = max(longest, clock.now() - t0)
            yield from clock.pause(None if another_step() else HELD_OUT_PIECE if validate else then)
        val_loss, relative, _ = self.validate() if validate else (math.nan, math.nan, None)
        if validate:
            yield from clock.pause()
        seconds = clock.now()
        self.seconds += seconds
        train_loss = sum(losses) / len(losses)
        if validate:
            self.curve.append(LossPoint(self.steps, self.seconds, self.history.iterations[-1], train_loss, val_loss,
                                        relative))
        return StepReport(len(losses), seconds, train_loss, val_loss)

    def filling(self, every: int, patience: int) -> Iterator[Optional[str]]:
        """Training beyond the checkpoints' steps (``coordinator.fill``) while it helps, a piece at a time. Every
        ``every`` steps the error of each of the fill check's chunks (neither trained on nor in the held-out
        error) is measured; a block that lowers it below the best so far by more than its noise
        (:func:`significantly_lower`, paired over the chunks) is the new best; after ``patience`` blocks in a row
        that are not, filling ends and what followed the best is undone (the weights, the optimizer's state and the
        step count go back to it). Stopped from outside (the next checkpoint drops the job), it goes back to the
        best too.

        Short blocks and patience, not long blocks that stop at the first miss: a block the next checkpoint
        interrupts is undone unchecked, and at PP = 2 of ``bench_overhead`` (a checkpoint every 2 iterations)
        blocks of 4 steps rarely ended before it, so most of the steps filled were thrown away; one step's
        change of the check's error is noise-sized, so a single miss says little. The paired test: with a plain
        "lower", the steps kept at stage 0 of that benchmark raised the held-out error by 2 % (on / off over its
        checkpoints after the warm-up, 5 of 5 pairs)."""
        if not (self.fill_check and self.trainable()):
            return
        yield FILL_CHECK_PIECE
        best = (self.check_errors(), self._snapshot())
        misses = 0
        try:
            while misses < patience:
                yield
                yield from self.training(n_steps=every, validate=False, then=FILL_CHECK_PIECE)
                errors = self.check_errors()
                if significantly_lower(errors, best[0]):
                    best, misses = (errors, self._snapshot()), 0
                else:
                    misses += 1
        finally:
            self._restore(best[1])

    def _snapshot(self) -> dict:
        return copy.deepcopy({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                              "steps": self.steps})

    def _restore(self, snapshot: dict) -> None:
        self.model.load_state_dict(snapshot["model"])
        self.optimizer.load_state_dict(snapshot["optimizer"])
        self.steps = snapshot["steps"]

    @staticmethod
    def _paused(pieces: Generator, clock: Clock):
        """``pieces`` with each of its pauses left out of ``clock``; its value."""
        while True:
            try:
                next(pieces)
            except StopIteration as done:
                return done.value
            yield from clock.pause()

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
