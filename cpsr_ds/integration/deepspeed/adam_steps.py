"""The bias correction of DeepSpeed's FusedAdam on the CPU, brought in line with the optimizer's restored step.

DeepSpeed's default Adam (``FusedAdam``, without ``torch_adam``) runs on its CPU accelerator through the
``fused_adam`` op, one process-wide C++ ``Adam_Optimizer`` per AdamW mode (csrc/cpu/adam/fused_adam.cpp).
That object keeps beta1^t and beta2^t in fp32 and updates them incrementally
(``Adam_Optimizer::IncrementStep``, csrc/includes/cpu_adam.h): multiplied by beta once per step where the
step it is given is the one after its own, recomputed as ``std::pow(beta, step)`` otherwise. The step
itself is in the optimizer's state dict and load_checkpoint restores it, but the C++ object is not: a
restarted process's first step at t + 1 takes ``pow(beta, t + 1)``, which differs in the last bits from the
product of t + 1 betas the uninterrupted run holds, so every update after a restart differs from the
uninterrupted run's by about 1e-7 relative (1e-2 in the loss after 100 iterations). DeepSpeed's CUDA
kernel computes the correction from the step alone, and ``DeepSpeedCPUAdam`` (ZeRO-Offload) keeps the same
incremental product per optimizer id. The ``pow`` branch came with DeepSpeed's PR #564 (tracking the step in
cpu-adam when loading a checkpoint); we found no DeepSpeed issue on it being inexact.

Workaround: before an optimizer step whose step count is not the one the C++ object last saw, the steps
1..t are replayed through the op on a one-element tensor, which leaves the object's beta powers as t
uninterrupted steps left them (the first call sets beta^1 exactly on every branch; each later one multiplies):
3.6 us a step on the development host, 0.4 s for a state 100,000 steps in.
"""

from __future__ import annotations

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adam import FusedAdam

# The step count each C++ optimizer (by AdamW mode) last applied, as far as this process stepped it here.
_applied: dict[int, int] = {}


def group_step(optimizer, group: dict) -> int:
    """The step FusedAdam applies next to ``group``, less one: it counts steps on the last parameter's state
    only (the others keep the step they began with), so the largest count in the group."""
    return max((int(optimizer.state[p]["step"]) for p in group["params"] if "step" in optimizer.state[p]),
               default=0)


def replay(optimizer: FusedAdam, group: dict, steps: int) -> None:
    """Steps 1..``steps`` of ``group``'s hyperparameters through the op, on a one-element scratch tensor."""
    beta1, beta2 = group["betas"]
    scratch = [[torch.zeros(1)] for _ in range(4)]  # gradient, parameter, exp_avg, exp_avg_sq
    for step in range(1, steps + 1):
        optimizer.multi_tensor_adam(2048 * 32, optimizer._dummy_overflow_buf, scratch, group["lr"], beta1, beta2,
                                    group["eps"], step, optimizer.adam_w_mode, int(group["bias_correction"]),
                                    group["weight_decay"])


def cpu_fused(optimizer) -> bool:
    return isinstance(optimizer, FusedAdam) and get_accelerator().device_name() == "cpu"


def align_bias_correction(optimizer) -> None:
    """Before ``optimizer`` steps: where it is FusedAdam on the CPU and a group's step count is not the one its
    C++ optimizer last applied (a restored or advanced state, or a fresh process), replay that many steps."""
    if not cpu_fused(optimizer):
        return
    for group in optimizer.param_groups:
        steps = group_step(optimizer, group)
        if group["params"] and _applied.get(optimizer.adam_w_mode, 0) != steps:
            replay(optimizer, group, steps)
        _applied[optimizer.adam_w_mode] = steps


def stepped(optimizer) -> None:
    """After ``optimizer`` stepped: the step count its C++ optimizer applied last."""
    if cpu_fused(optimizer):
        for group in optimizer.param_groups:
            _applied[optimizer.adam_w_mode] = group_step(optimizer, group)
