"""The CPSR predictor: FDD + VITP behind the common interface (Sec. III-A, Fig. 4).

Observed checkpoints feed a :class:`VITPTrainer` that the caller advances with
:meth:`VITPPredictor.step`; :meth:`predict` runs the network over every chunk of
the last W checkpoints, in batches, and assembles the state at the target
iteration. Its validation error is measured on chunks the network never trained
on.
"""

from __future__ import annotations

from typing import Generator, Iterator, Optional

import torch

from cpsr_ds.predictor import fdd, samples
from cpsr_ds.predictor.base import Predictor, ValidationResult
from cpsr_ds.predictor.network import VITP, prepare
from cpsr_ds.predictor.state import KINDS
from cpsr_ds.predictor.trainer import StepReport, VITPTrainer


class VITPPredictor(Predictor):
    """FDD + VITP. ``token_size`` values per chunk; a ``window`` of checkpoints split into
    ``low_bins`` kept, ``mid_bins`` fed to the network, the rest dropped; network size
    ``d_model``/``heads``/``layers``; trainer options ``batch_chunks``, ``lr``,
    ``max_stride``, ``holdout_every``, ``micro_chunks`` (chunks per micro-batch: a training step pauses after each,
    the piece of work a pipeline bubble must fit), ``fill_every`` (steps between the fill check's measurements)
    and ``fill_patience`` (checks in a row without a new best that end the filling, :meth:`filling`);
    ``ready()`` after ``min_train_steps`` steps;
    ``predict`` runs ``predict_batch`` chunks at a time on ``device``; ``memory_mb`` caps the footprint there
    (:mod:`cpsr_ds.predictor.memory`), by smaller batches where needed; ``val_chunks`` held-out chunks
    measure its validation error; ``shards``: see :meth:`split_work`."""

    name = "vitp"

    def __init__(self, token_size: int = 1024, window: int = 5, low_bins: int = 1, mid_bins: int = 1,
                 d_model: int = 64, heads: int = 4, layers: int = 2, batch_chunks: int = 256, lr: float = 1e-3,
                 max_stride: int = 2, holdout_every: int = 10, min_train_steps: int = 100,
                 predict_batch: int = 256, seed: int = 0, device: str = "cpu", memory_mb: float = 200.0,
                 val_chunks: int = 256, shards: int = 1, history: int = 16, micro_chunks: int = 64,
                 fill_every: int = 1, fill_patience: int = 3, **options):
        self.min_history = window + 1
        self.align = token_size
        super().__init__(history=history, **options)
        self._options = dict(token_size=token_size, window=window, low_bins=low_bins, mid_bins=mid_bins,
                             d_model=d_model, heads=heads, layers=layers, batch_chunks=batch_chunks, lr=lr,
                             max_stride=max_stride, holdout_every=holdout_every, min_train_steps=min_train_steps,
                             predict_batch=predict_batch, seed=seed, device=device, memory_mb=memory_mb,
                             val_chunks=val_chunks, shards=1, micro_chunks=micro_chunks,
                             fill_every=fill_every, fill_patience=fill_patience)
        self.bands = fdd.Bands(window, low_bins, mid_bins)
        # Seeded initialisation without touching the training job's global RNG stream.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = VITP(token_size, self.bands, d_model=d_model, heads=heads, layers=layers, d_ff=2 * d_model)
        kinds = tuple(k for k in KINDS if self.predicts(k))
        self.trainer = VITPTrainer(model, self.history, kinds, token_size, batch_chunks=batch_chunks, lr=lr,
                                   max_stride=max_stride, holdout_every=holdout_every, val_chunks=val_chunks,
                                   seed=seed, device=device, memory_mb=memory_mb, micro_chunks=micro_chunks)
        self.split_work(shards)

    @property
    def options(self) -> dict:
        return {**super().options, **self._options}

    def cap_memory(self, memory_mb: float) -> None:
        """Cap the footprint on the device at ``memory_mb`` MiB (``predictor.memory_mb``)."""
        self.trainer.cap(memory_mb)
        self._options["memory_mb"] = memory_mb

    def split_work(self, shards: int) -> None:
        """Split the stage's predictor work across its ``shards`` data-parallel replicas (Sec. III-B).

        Each replica observes only its share of the stage's state (recovery.own_share), so it
        trains on ``batch_chunks / shards`` chunks of it per step and validates on
        ``val_chunks / shards``: the replicas together sample as many chunks per step as one
        predictor of the whole stage, and each spends about 1 / shards of that predictor's time.
        """
        if not (isinstance(shards, int) and shards >= 1):
            raise ValueError(f"vitp: the work splits across a whole number of replicas >= 1, got {shards!r}")
        o = self._options
        self.trainer.batch_chunks = -(-o["batch_chunks"] // shards)
        self.trainer.val_chunks = -(-o["val_chunks"] // shards)
        o["shards"] = shards

    def step(self, budget_s: float | None = None, n_steps: int | None = None, validate: bool = True) -> StepReport:
        """Train in a budget of seconds or steps (see :meth:`VITPTrainer.step`)."""
        return self.trainer.step(budget_s=budget_s, n_steps=n_steps, validate=validate)

    def reserve_fill_check(self) -> None:
        """With ``coordinator.fill``: a second split of chunks held out, on which filling stops (see
        :meth:`VITPTrainer.filling`)."""
        self.trainer.reserve_fill_check()

    def filling(self) -> Iterator[Optional[str]]:
        """Training in the bubbles left until the next checkpoint while it helps (:meth:`VITPTrainer.filling`,
        checked every ``fill_every`` steps, ending after ``fill_patience`` checks without a new best)."""
        return self.trainer.filling(self._options["fill_every"], self._options["fill_patience"])

    def training(self, budget_s: float | None = None, n_steps: int | None = None,
                 validate: bool = True) -> Generator[Optional[str], None, StepReport]:
        """:meth:`step` a micro-batch at a time (see :meth:`VITPTrainer.training`)."""
        return self.trainer.training(budget_s=budget_s, n_steps=n_steps, validate=validate)

    def ready(self) -> bool:
        return super().ready() and self.trainer.steps >= self._options["min_train_steps"]

    @torch.no_grad()
    def _extrapolate(self, kind, iterations, series, target):
        token, w = self._options["token_size"], self.bands.window
        batch = min(self._options["predict_batch"], self.trainer.footprint.batch)
        inputs = tuple(range(len(series) - w, len(series)))
        times = samples.time_features(torch.tensor([float(iterations[i]) for i in inputs]), target)
        out = torch.empty_like(series[-1])
        rows_out = samples.chunks(out, token)
        self.trainer.model.eval()
        for lo in range(0, rows_out.shape[0], batch):
            rows = torch.arange(lo, min(lo + batch, rows_out.shape[0]))
            y = samples.gather(series, inputs, rows, token).to(self.trainer.device)
            rows_out[rows] = self.trainer.run(prepare(y, self.bands), times, kind).cpu()
        return out

    def validation_error(self) -> ValidationResult | None:
        """Error of predicting the newest checkpoint of the held-out chunks from the W before it."""
        if not self.trainer.trainable():
            return None
        _, relative, per_kind = self.trainer.validate()
        it = self.history.iterations
        return ValidationResult(it[-1], it[-1] - it[-2], relative, {k: e / n for k, (e, _, n) in per_kind.items()})

    def state_dict(self, include_history: bool = True) -> dict:
        return {**super().state_dict(include_history), "trainer": self.trainer.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        self.trainer.load_state_dict(sd["trainer"])
