"""The Hugging Face ``Trainer`` with cpsr_ds: :class:`CPSRTrainer`, a ``transformers.Trainer`` whose
``--deepspeed`` engine is built by ``cpsr_ds.initialize``.

The Trainer offers no hook for the call that builds its engine: ``Trainer.train`` prepares the model through
accelerate, whose ``Accelerator._prepare_deepspeed`` calls ``deepspeed.initialize``, looked up in the deepspeed
module at call time, and a callback's first event (``on_train_begin``) comes only after it. So ``train`` points
that one name at ``cpsr_ds.initialize`` while it prepares and trains, and puts DeepSpeed's back after.

After a recovery the engine resumes at an iteration the Trainer does not know: it would count its steps and draw
its batches from zero. The Trainer's own resume (``resume_from_checkpoint``) is how it continues at a step, data
skipped; ``train`` takes that path with a directory holding only the Trainer's state at the engine's step, written
once the engine is recovered (``_load_optimizer_and_scheduler``, the first call after it), and DeepSpeed's load of
that directory skipped (the engine already holds the recovered state). Checked against transformers 4.57.6
(trainer.py ``train``, ``_inner_training_loop``) and accelerate 1.15.0 (accelerator.py ``_prepare_deepspeed``).
"""

from __future__ import annotations

import os
import tempfile
from contextlib import ExitStack, contextmanager

import deepspeed
import transformers.trainer
from transformers import Trainer, TrainerState
from transformers.trainer import TRAINER_STATE_NAME

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


@contextmanager
def deepspeed_load_skipped(directory: str):
    """The Trainer's ``deepspeed_load_checkpoint`` does nothing for ``directory`` inside the block."""
    original = transformers.trainer.deepspeed_load_checkpoint

    def unless_recovered(engine, path, *args, **kwargs):
        if path != directory:
            return original(engine, path, *args, **kwargs)

    transformers.trainer.deepspeed_load_checkpoint = unless_recovered
    try:
        yield
    finally:
        transformers.trainer.deepspeed_load_checkpoint = original


class CPSRTrainer(Trainer):
    """A ``Trainer`` whose DeepSpeed engine has cpsr_ds's runtime (the ``"cpsr"`` block of ``--deepspeed``'s
    config). After a recovery it continues at the engine's step, with the batches it would have drawn there. The
    script ends the engine once done with it (``trainer.model_wrapped.destroy()``, after its own saves), as a
    DeepSpeed script does: its pending checkpoints are committed there."""

    _recovered_state_dir: str | None = None

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """``Trainer.train``; without the user's own ``resume_from_checkpoint``, from where recovery put the engine
        (at step 0 on a first start)."""
        with ExitStack() as stack:
            stack.enter_context(deepspeed_initialize_through_cpsr())
            if resume_from_checkpoint is None:
                resume_from_checkpoint = stack.enter_context(tempfile.TemporaryDirectory(prefix="cpsr_trainer_"))
                TrainerState().save_to_json(os.path.join(resume_from_checkpoint, TRAINER_STATE_NAME))
                stack.enter_context(deepspeed_load_skipped(resume_from_checkpoint))
                self._recovered_state_dir = resume_from_checkpoint
            try:
                return super().train(resume_from_checkpoint, *args, **kwargs)
            finally:
                self._recovered_state_dir = None

    def _load_optimizer_and_scheduler(self, checkpoint):
        # Called right after the engine is built: its optimizer and scheduler are recovered already.
        if checkpoint is None or checkpoint != self._recovered_state_dir:
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.state.global_step = self.model_wrapped.global_steps
        self.state.save_to_json(os.path.join(checkpoint, TRAINER_STATE_NAME))
