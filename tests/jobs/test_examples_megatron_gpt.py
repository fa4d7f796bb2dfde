"""examples/megatron_gpt/train.py, megatron-core's GPTModel as a plain module under ZeRO-3 with cpsr_ds, in a job of 2
processes under DeepSpeed's launcher and the supervisor: a rank killed, the job restarted, the lost iterations
recomputed."""

from support.examples import assert_killed_rank_recomputed


def test_killed_rank_restarts_and_recomputes_from_the_last_committed_checkpoint(tmp_path):
    assert_killed_rank_recomputed(tmp_path, "megatron_gpt")
