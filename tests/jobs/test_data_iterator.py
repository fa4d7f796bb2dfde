"""The data the engine feeds itself (training_data=, train_batch() with no argument): a restarted job resumes the
engine's iterator at the resumed iteration's batch."""

import os

from conftest import ROOT, run_job
from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal

ITERS = 12
SCRIPT = os.path.join(ROOT, "tests", "jobs", "pipeline_data_job.py")


def config(run_dir, **cpsr) -> dict:
    """PP = 2, 4 micro-batches of 4 samples per iteration: 96 samples last 6 iterations, so the loader wraps."""
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4, "steps_per_print": 10 ** 9,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
            "cpsr": {"checkpoint": {"dir": str(run_dir), "interval": 3}, **cpsr}}


def losses(run_dir) -> dict[int, float]:
    """The last loss journaled for each iteration (a recomputed iteration overwrites the failed run's)."""
    return {e.iteration: e.loss for e in read_journal(journal_path(str(run_dir), 0))}


def test_a_restart_feeds_the_batches_the_failure_free_run_fed_from_the_resumed_iteration(tmp_path):
    reference = tmp_path / "reference"
    run_job(tmp_path, config(reference), "--train-iters", ITERS, script=SCRIPT)
    run_dir = tmp_path / "run"
    result = run_job(tmp_path, config(run_dir, faults={"kill_rank": 1, "kill_at_iteration": 8},
                                      recovery={"mode": "recompute"}),
                     "--train-iters", ITERS, script=SCRIPT, supervised=True)
    assert "restart 1 of 2" in result.stdout
    assert "the engine's training data moved past" in result.stdout, result.stdout[-3000:]
    expected, got = losses(reference), losses(run_dir)
    assert sorted(got) == sorted(expected) == list(range(1, ITERS + 1))
    for iteration in range(1, ITERS + 1):  # before the failure and after the restart alike
        assert abs(got[iteration] - expected[iteration]) <= 1e-6 * abs(expected[iteration]), iteration
