"""RB-R is exact with dropout on: a PP = 2 job killed after a checkpoint recomputes, from it, the losses it
journaled before the kill, bit for bit, with DeepSpeed's default (fused) Adam and with torch's."""

import pytest

from benchmarks.common.processes import tiny_config
from conftest import recomputed_from, run_job

KILLED_AT = 14  # rank 1 is killed right after this iteration
ITERS = 15


def dropout_config(run_dir, torch_adam: bool) -> dict:
    """The tiny GPT with dropout, a checkpoint every 5 iterations, rank 1 killed after KILLED_AT, RB-R forced."""
    config = tiny_config(run_dir, stages=2, faults={"kill_rank": 1, "kill_at_iteration": KILLED_AT},
                         recovery={"mode": "recompute"})
    config["cpsr"]["checkpoint"]["interval"] = 5
    config["gpt"].update(hidden_dropout=0.2, attention_dropout=0.2)
    params = config["optimizer"]["params"]
    if torch_adam:
        params["torch_adam"] = True
    else:
        params.pop("torch_adam", None)
    return config


@pytest.mark.parametrize("torch_adam", [False, True], ids=["fused_adam", "torch_adam"])
def test_recomputed_losses_with_dropout_equal_the_failure_free_ones_bit_for_bit(tmp_path, torch_adam):
    run_dir = tmp_path / "run"
    result = run_job(tmp_path, dropout_config(run_dir, torch_adam), "--train-iters", ITERS,
                     "--eval-interval", 5, supervised=True)
    c = recomputed_from(result.stdout, run_dir, KILLED_AT, ITERS)
    assert c in (5, 10)
