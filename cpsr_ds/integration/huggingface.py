"""The Hugging Face ``Trainer`` with cpsr_ds: :class:`CPSRTrainer`, a ``transformers.Trainer`` whose
``--deepspeed`` engine is built by ``cpsr_ds.initialize``.

The Trainer offers no hook for the call that builds its engine: ``Trainer.train`` prepares the model through
accelerate, whose ``Accelerator._prepare_deepspeed`` calls ``deepspeed.initialize``, looked up in the deepspeed
module at call time, and a callback's first event (``on_train_begin``) comes only after it. So ``train`` points
that one name at ``cpsr_ds.initialize`` while it prepares and trains, and puts DeepSpeed's back after.
Checked against transformers 4.57.6 (trainer.py ``_inner_training_loop``) and accelerate 1.15.0
(accelerator.py ``_prepare_deepspeed``).
"""

from __future__ import annotations

from contextlib import contextmanager

import deepspeed
from transformers import Trainer

from cpsr_ds.runtime.session import initialize


@contextmanager
def deepspeed_initialize_through_cpsr():
    """``deepspeed.initialize`` is ``cpsr_ds.initialize`` inside the block; the call it makes in turn reaches
    DeepSpeed's own."""
    original = deepspeed.initialize

    def through_cpsr(*args, **kwargs):
        deepspeed.initialize = original
        try:
            return initialize(*args, **kwargs)
        finally:
            deepspeed.initialize = through_cpsr

    deepspeed.initialize = through_cpsr
    try:
        yield
    finally:
        deepspeed.initialize = original


class CPSRTrainer(Trainer):
    """A ``Trainer`` whose DeepSpeed engine has cpsr_ds's runtime (the ``"cpsr"`` block of ``--deepspeed``'s
    config). The script ends the engine once done with it (``trainer.model_wrapped.destroy()``, after its own
    saves), as a DeepSpeed script does: its pending checkpoints are committed there."""

    def train(self, *args, **kwargs):
        with deepspeed_initialize_through_cpsr():
            return super().train(*args, **kwargs)
