"""advance_counters on schedulers that are not DeepSpeed's: torch's step by step, megatron-core's by samples."""

from types import SimpleNamespace

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from cpsr_ds.integration.deepspeed.engine_state import advance_counters

BATCH = 8  # samples per iteration


def engine_with(make_scheduler):
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    return SimpleNamespace(global_steps=10, global_samples=10 * BATCH, train_batch_size=lambda: BATCH,
                           optimizer=optimizer, lr_scheduler=make_scheduler(optimizer))


def megatron(optimizer) -> OptimizerParamScheduler:
    """Megatron's schedule in samples: warm-up over 4 iterations, cosine decay to 0.1 over 100."""
    return OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1.0, min_lr=0.1, lr_warmup_steps=4 * BATCH,
                                   lr_decay_steps=100 * BATCH, lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
                                   wd_incr_steps=100 * BATCH, wd_incr_style="constant")


@pytest.mark.parametrize("make", [lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5), megatron])
def test_a_scheduler_advanced_by_k_iterations_sets_the_rate_k_steps_would(make):
    advanced, stepped = engine_with(make), engine_with(make)
    advance_counters(advanced, 7)
    for _ in range(7):
        if isinstance(stepped.lr_scheduler, OptimizerParamScheduler):
            stepped.lr_scheduler.step(increment=BATCH)  # Megatron-DeepSpeed's loop: the global batch's samples
        else:
            stepped.lr_scheduler.step()
    assert advanced.global_steps == 17 and advanced.global_samples == 17 * BATCH
    rates = [g["lr"] for g in advanced.optimizer.param_groups]
    assert rates == pytest.approx([g["lr"] for g in stepped.optimizer.param_groups])
    assert rates != pytest.approx([1.0])  # the schedule moved


def test_a_scheduler_whose_step_needs_other_arguments_is_refused_naming_it():
    class Tokens:
        def step(self, increment, token_num):
            raise AssertionError("not to be called")

    with pytest.raises(TypeError, match="scheduler Tokens by 3 iterations: its step.. requires increment, token_num"):
        advance_counters(engine_with(lambda o: Tokens()), 3)
