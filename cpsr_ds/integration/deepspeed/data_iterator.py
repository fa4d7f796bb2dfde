"""The data iterator DeepSpeed owns, resumed at the resumed iteration's batch.

Checked against DeepSpeed 0.19.8. ``deepspeed.initialize(training_data=...)`` builds ``engine.training_dataloader``
(runtime/engine.py, ``deepspeed_io``), a DeepSpeedDataLoader (runtime/dataloader.py) that draws each pass's indices
from its ``data_sampler``: a DistributedSampler that is never given an epoch, so every pass has the same order. The
pipeline engine (runtime/pipe/engine.py, ``_build_data_iter``) wraps it in a RepeatingLoader, which is also its
``data_iterator``, and ``train_batch()`` reads one micro-batch per accumulation step from it. After ``global_steps``
steps the loader stands ``global_steps * gradient_accumulation_steps`` batches in, modulo its length; the next pass
skips that many batches' indices without loading or collating their samples.
"""

from __future__ import annotations

import itertools

from deepspeed.runtime.dataloader import DeepSpeedDataLoader, RepeatingLoader
from torch.utils.data import Sampler


class Skipping(Sampler):
    """``sampler`` whose next pass starts ``skip`` indices in; the passes after it are whole."""

    def __init__(self, sampler: Sampler, skip: int):
        self.sampler, self.skip = sampler, skip

    def __iter__(self):
        skip, self.skip = self.skip, 0
        return itertools.islice(iter(self.sampler), skip, None)

    def __len__(self) -> int:
        return len(self.sampler) - self.skip

    def __getattr__(self, name: str):
        # set_epoch and the rest of the wrapped sampler's interface.
        return getattr(self.__dict__["sampler"], name)


def batches_in(steps: int, accumulation: int, length: int) -> int:
    """How many batches into a pass of ``length`` batches a loader stands after ``steps`` optimizer steps."""
    return steps * accumulation % length


def resume_data(engine) -> int:
    """Start the engine's own loader (none: nothing to do) at the batch of iteration ``engine.global_steps + 1``;
    the batches skipped. A loader under curriculum learning keeps its DeepSpeedDataSampler, which DeepSpeed saves
    and loads with its checkpoints."""
    owned = getattr(engine, "training_dataloader", None)
    loader = owned.loader if isinstance(owned, RepeatingLoader) else owned
    if not isinstance(loader, DeepSpeedDataLoader) or loader.curriculum_learning_enabled or len(loader) == 0:
        return 0
    skipped = batches_in(engine.global_steps, engine.gradient_accumulation_steps(), len(loader))
    loader.data_sampler = Skipping(loader.data_sampler, skipped * loader.batch_size)
    if isinstance(owned, RepeatingLoader):
        owned.data_iter = iter(loader)
    return skipped
