"""CPSRTrainer's route to cpsr_ds.initialize: only inside its block, DeepSpeed's own back after it, raised or not."""

import deepspeed
import pytest

from cpsr_ds.integration.huggingface import deepspeed_initialize_through_cpsr


def test_deepspeed_initialize_leads_to_cpsr_ds_only_inside_the_block():
    original = deepspeed.initialize
    with deepspeed_initialize_through_cpsr():
        assert deepspeed.initialize is not original
    assert deepspeed.initialize is original
    with pytest.raises(KeyError), deepspeed_initialize_through_cpsr():
        raise KeyError("a failed train()")
    assert deepspeed.initialize is original


def test_cpsr_ds_call_reaches_deepspeeds_own_initialize_and_the_route_is_back_after_it():
    # Without a "cpsr" block cpsr_ds.initialize calls deepspeed.initialize: DeepSpeed's own, whose error about the
    # missing model comes back (the route again would recurse), and after it the block's route is in place again.
    with deepspeed_initialize_through_cpsr():
        routed = deepspeed.initialize
        with pytest.raises(Exception, match="requires a model"):
            deepspeed.initialize(model=None, config={"train_micro_batch_size_per_gpu": 1})
        assert deepspeed.initialize is routed
