"""RB-R is exact with dropout on: a PP = 2 job killed after a checkpoint recomputes, from it, the losses it
journaled before the kill, bit for bit, with DeepSpeed's default (fused) Adam and with torch's."""

import re

import pytest

from benchmarks.common.processes import tiny_config
from conftest import run_job
from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal

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
    found = re.search(rf"job reached iteration {KILLED_AT}, last checkpoint (\d+); recompute", result.stdout)
    assert found, result.stdout[-3000:]
    c = int(found.group(1))
    assert c in (5, 10)
    for rank in (0, 1):
        entries = read_journal(journal_path(str(run_dir), rank))
        # Before the kill: 1..KILLED_AT, failure-free; then the restart's c + 1..ITERS.
        assert [e.iteration for e in entries] == list(range(1, KILLED_AT + 1)) + list(range(c + 1, ITERS + 1))
        before = {e.iteration: e.loss for e in entries[:KILLED_AT]}
        recomputed = {e.iteration: e.loss for e in entries[KILLED_AT:] if e.iteration <= KILLED_AT}
        assert recomputed == {i: before[i] for i in range(c + 1, KILLED_AT + 1)}
