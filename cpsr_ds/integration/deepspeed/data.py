"""The data the engine itself feeds (``deepspeed.initialize(training_data=...)`` and ``engine.train_batch()`` with
no argument): after a restart its iterator is moved to the resumed iteration's first batch, so that the batches a
restarted job trains on are those the failure-free run would have, without the user's script having to make
batch i a function of i.

Checked against DeepSpeed 0.19.8, runtime/pipe/engine.py: ``PipelineEngine._build_data_iter`` wraps
``deepspeed_io(dataset)`` (a DistributedSampler over the data-parallel ranks, no shuffling) in a
``RepeatingLoader`` (``set_dataloader``: ``training_dataloader`` and ``data_iterator`` on the first and last
stages), and each ``train_batch`` takes ``gradient_accumulation_steps()`` micro-batches from ``data_iterator``.
A DataLoader has no position to jump to, so the iterator reads past the skipped micro-batches (their loading,
no computation). The plain engine hands its ``training_dataloader`` to the user's own loop, whose position is
the user's.
"""

from __future__ import annotations


def fast_forward(engine, iterations: int) -> int:
    """Move the data iterator the engine built from ``training_data`` past ``iterations`` iterations' micro-batches;
    the micro-batches skipped (0 where the engine feeds no data of its own)."""
    if iterations <= 0 or getattr(engine, "training_dataloader", None) is None \
            or getattr(engine, "data_iterator", None) is None:
        return 0
    skipped = iterations * engine.gradient_accumulation_steps()
    for _ in range(skipped):
        next(engine.data_iterator)
    return skipped
