"""The plain engine ``cpsr_ds.initialize`` builds for a model that is not a ``PipelineModule``: DeepSpeed's
``DeepSpeedEngine`` (ZeRO 0-3) with CPSR's runtime (``engine.cpsr``) called where an iteration ends, at the
optimizer step of ``step()``; the user's loop ``loss = engine(batch); engine.backward(loss); engine.step()``
is unchanged.

To the runtime it is a pipeline of one stage whose ranks are all data-parallel replicas (:class:`OneStageGrid`).
Checked against DeepSpeed 0.19.8 (runtime/engine.py DeepSpeedEngine: ``forward``, ``backward``, ``step``,
``global_steps`` counted once per optimizer step, ``_step_applied`` False where fp16 skipped the step for an
overflow; runtime/pipe/topology.py PipeDataParallelTopology).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

from cpsr_ds.integration.deepspeed.engine import CPSREngine


class OneStageGrid:
    """The answers of DeepSpeed's ``PipelineParallelGrid`` for an engine without a pipeline: one stage, every rank
    a data-parallel replica in the engine's data-parallel group."""

    def __init__(self, engine: DeepSpeedEngine):
        if engine.mp_world_size != 1:
            raise ValueError(f"cpsr_ds: a plain engine with model parallelism ({engine.mp_world_size}) is not "
                             "supported: its model must be a deepspeed.pipe.PipelineModule")
        self.group = engine.data_parallel_group
        self._topo = PipeDataParallelTopology(num_pp=1, num_dp=engine.world_size)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.group)

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.group)

    def get_data_parallel_group(self):
        return self.group

    def get_slice_parallel_rank(self) -> int:
        return 0


class CPSRPlainEngine(CPSREngine, DeepSpeedEngine):
    # The pipeline engine's names for the one stage the runtime sees.
    stage_id = 0
    num_stages = 1

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.grid = OneStageGrid(self)
        self._micro_losses: list[torch.Tensor] = []  # the losses given to backward since the last optimizer step

    def forward(self, *inputs, **kwargs):
        # An iteration's time starts at its first training micro-batch.
        if self.module.training and not self._micro_losses and self.cpsr is not None:
            self.cpsr.before_iteration()
        with self._iteration_part("forward"):
            return super().forward(*inputs, **kwargs)

    def backward(self, loss, *args, **kwargs):
        self._micro_losses.append(loss.detach())
        with self._iteration_part("backward"):
            return super().backward(loss, *args, **kwargs)

    def step(self, lr_kwargs=None):
        # Extends DeepSpeedEngine.step: an iteration ends where the optimizer steps (the gradient accumulation
        # boundary, where global_steps advances); an fp16 step skipped for an overflow is not one.
        before = self.global_steps
        with self._iteration_part("step"):
            result = super().step(lr_kwargs)
            if self.global_steps != before:
                loss = self._iteration_loss()
                if self._step_applied and self.cpsr is not None:
                    self.cpsr.after_iteration(self, loss)
        return result

    def _iteration_loss(self) -> float:
        """The mean of this iteration's micro-batch losses over its micro-batches and the data-parallel ranks,
        as the pipeline engine's ``train_batch`` reports it; the losses are then let go."""
        losses, self._micro_losses = self._micro_losses, []
        if not losses:
            raise RuntimeError("cpsr_ds: the optimizer stepped without engine.backward(loss): the iteration's loss "
                               "is unknown (call engine.backward, not loss.backward)")
        mean = torch.stack([loss.float() for loss in losses]).mean()
        dist.all_reduce(mean, group=self.grid.group)
        return float(mean) / self.grid.get_data_parallel_world_size()
