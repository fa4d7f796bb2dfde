"""DeepSpeed's fused CPU Adam restored mid-run steps on as the uninterrupted one (cpsr_ds/integration/deepspeed/adam_steps.py). Its
C++ op is built by ninja's compiler processes on first use, a minute where no build is cached, so the test is here
rather than in the unit tier."""

import copy

import torch
from deepspeed.ops.adam import FusedAdam

from cpsr_ds.integration.deepspeed.adam_steps import align_bias_correction, stepped


def adam_steps(optimizer, param, grads) -> None:
    for grad in grads:
        param.grad = grad
        align_bias_correction(optimizer)
        optimizer.step()
        stepped(optimizer)


def test_fused_cpu_adam_restored_at_step_t_steps_on_as_the_uninterrupted_one():
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(1000, generator=gen) for _ in range(20)]

    def fresh():
        param = torch.nn.Parameter(torch.ones(1000))
        return param, FusedAdam([param], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)

    param, optimizer = fresh()
    adam_steps(optimizer, param, grads[:10])
    saved = param.detach().clone(), copy.deepcopy(optimizer.state_dict())
    adam_steps(optimizer, param, grads[10:])
    # The same process's C++ optimizer last saw step 20: a state restored at step 10 jumps back, as a restarted
    # process's fresh one jumps forward.
    restored, again = fresh()
    with torch.no_grad():
        restored.copy_(saved[0])
    again.load_state_dict(saved[1])
    adam_steps(again, restored, grads[10:])
    assert torch.equal(restored, param)
