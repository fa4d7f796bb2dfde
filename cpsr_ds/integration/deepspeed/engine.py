"""The pipeline engine ``cpsr_ds.initialize`` builds: DeepSpeed's ``PipelineEngine`` with CPSR's runtime
(``engine.cpsr``) called around each iteration, its checkpoints committed before the optimizer steps, and
the predictor's work run in the pipeline's bubbles.

Checked against DeepSpeed 0.19.8 (runtime/engine.py DeepSpeedEngine, runtime/pipe/engine.py PipelineEngine):
each override of a private method names the one it replaces.
"""

from __future__ import annotations

import os
from functools import partial
from typing import TYPE_CHECKING, Optional

from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from cpsr_ds.runtime import ending
from cpsr_ds.checkpoint.capture import exiting, rng
from cpsr_ds.coordinator import BubbleSchedule, PredictorWork
from cpsr_ds.integration.deepspeed.adam_steps import align_bias_correction, stepped
from cpsr_ds.integration.deepspeed.engine_state import base_optimizer
from cpsr_ds.integration.deepspeed.load_hooks import reading_each_file_once, replicas_read_once, weights_from_partitions

if TYPE_CHECKING:
    from cpsr_ds.runtime.runtime import Runtime


class CPSRPipelineEngine(PipelineEngine):
    # The only attribute CPSR sets on an engine; None until initialize attaches it.
    cpsr: Optional[Runtime] = None

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        # DeepSpeed's SDLoader reads each model-states file twice; the second read reuses the first. Under ZeRO
        # the weights come from the optimizer's partitions rather than from the layer files; without ZeRO one
        # data-parallel replica reads the stage's files for all.
        with reading_each_file_once(), weights_from_partitions(self, load_optimizer_states, load_module_only), \
                replicas_read_once(self):
            load_path, client_state = super().load_checkpoint(load_dir, tag, load_module_strict, load_optimizer_states,
                                                              load_lr_scheduler_states, load_module_only, custom_load_fn)
        if load_path is not None and not load_module_only:
            rng.load(self, os.path.dirname(load_path))
        return load_path, client_state

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        # Each rank's random-number state goes with every checkpoint, the user's own saves too (rng.py).
        saved = super().save_checkpoint(save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        rng.save(self, os.path.join(save_dir, str(tag if tag is not None else f"global_step{self.global_steps}")))
        return saved

    def _take_model_step(self, lr_kwargs):
        # Replaces DeepSpeedEngine._take_model_step (runtime/engine.py), the optimizer step of every train_batch.
        # The survivor dump never reads a state this step has half updated (Runtime.stepping).
        self.cpsr.stepping(partial(self._model_step, lr_kwargs))()

    def _model_step(self, lr_kwargs):
        # The fused CPU Adam's bias correction follows a restored step count (adam_steps.py); the random-number
        # state the next iteration starts from is recorded with the step (rng.py).
        optimizer = base_optimizer(self)
        align_bias_correction(optimizer)
        super()._take_model_step(lr_kwargs)
        stepped(optimizer)
        rng.record(self)

    def destroy(self):
        # The run directory is another job's to take only once pending checkpoints are done
        # (bounded: cleanup waits for no other rank once this process is failing).
        runtime = self.cpsr
        with ending.running(0.0 if runtime is None else runtime.end_bound_s()):
            try:
                super().destroy()
            finally:
                if runtime is not None:
                    runtime.close()

    def _coordinator(self):
        """Where the predictor's work goes in the pipeline's bubbles; None where it does not."""
        return None if self.cpsr is None else self.cpsr.work.coordinator

    def _train_schedule(self):
        # Replaces PipelineEngine._train_schedule (runtime/pipe/engine.py), which train_batch runs.
        if self._coordinator() is None:
            return super()._train_schedule()
        return BubbleSchedule(micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id)

    def _exec_predictor_work(self, slot):
        self.cpsr.work.coordinator.slot(slot)

    def _bubble_ended(self):
        coordinator = self._coordinator()
        if coordinator is not None:
            coordinator.waited()

    def _exec_recv_activations(self, buffer_id):
        # Extends PipelineEngine._exec_recv_activations (runtime/pipe/engine.py).
        PipelineEngine._exec_recv_activations(self, buffer_id)
        self._bubble_ended()

    def _exec_recv_grads(self, buffer_id):
        # Extends PipelineEngine._exec_recv_grads (runtime/pipe/engine.py).
        PipelineEngine._exec_recv_grads(self, buffer_id)
        self._bubble_ended()

    def train_batch(self, data_iter=None):
        # A peer's death shows here as a gloo error: from then on no wait at exit is for other ranks.
        with exiting.marks_failure("train_batch"):
            try:
                self.cpsr.before_iteration()
                loss = super().train_batch(data_iter)
                self.cpsr.after_iteration(self, float(loss))
            except Exception as err:
                self.cpsr.failed(f"{type(err).__name__} in train_batch: {err}")
                raise
        return loss

    def _get_all_ckpt_names(self, checkpoints_path, tag):
        # Extends DeepSpeedEngine._get_all_ckpt_names (runtime/engine.py), which _load_checkpoint reads the
        # model-state files by: one per model-parallel rank, this rank's among them. A checkpoint of some stages
        # (checkpoint.per_stage) holds only theirs: this rank's stands for each.
        names = super()._get_all_ckpt_names(checkpoints_path, tag)
        own = self._get_ckpt_name(checkpoints_path, tag)
        return [own] * self.mp_world_size if len(names) != self.mp_world_size and own in names else names

    def eval_batch(self, *args, **kwargs):
        # A restart does not redo an evaluation: it must not move the training's random-number streams.
        with exiting.marks_failure("eval_batch"), rng.preserved(self.module):
            return super().eval_batch(*args, **kwargs)

    def _exec_optimizer_step(self, lr_kwargs=None):
        # Extends PipelineEngine._exec_optimizer_step (runtime/pipe/engine.py), which never commits a decoupled
        # checkpoint engine (DeepSpeedEngine._commit_decoupled_checkpoint, runtime/engine.py). The snapshot of
        # the last checkpoint must be complete before the optimizer overwrites the state it copies; this wait
        # is the checkpoint's training stall.
        if self.checkpoint_engine.is_decoupled():
            self._commit_decoupled_checkpoint()
        super()._exec_optimizer_step(lr_kwargs)
        self._bubble_ended()

    # PipelineEngine._exec_schedule (runtime/pipe/engine.py) runs each instruction through this class-level map
    # of plain functions, so an override takes effect only once it is mapped here.
    _INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP, schedule.OptimizerStep: _exec_optimizer_step,
                        schedule.RecvActivation: _exec_recv_activations, schedule.RecvGrad: _exec_recv_grads,
                        PredictorWork: _exec_predictor_work}
