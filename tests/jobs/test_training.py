"""End to end: 2-process DeepSpeed runs of examples/gpt/train_gpt.py, a failure, a restart."""

import glob
import os
import re
import statistics
import time

import pytest

from benchmarks.common.processes import tiny_config
from conftest import run_job
from cpsr_ds.checkpoint.storage.catalog import list_checkpoints
from cpsr_ds.checkpoint.storage.records import read_latest
from cpsr_ds.checkpoint.capture.journal import ProgressJournal, journal_path, read_journal, read_validation

ITERS = 40


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A failure-free PP = 2 run: the reference every recovered run is compared to."""
    tmp = tmp_path_factory.mktemp("reference")
    run_dir = tmp / "run"
    run_job(tmp, tiny_config(run_dir, stages=2), "--train-iters", ITERS, "--eval-interval", 20)
    return run_dir


def losses_by_iteration(run_dir, rank=0):
    """The last loss journaled for each iteration (a recomputed iteration overwrites the failed run's)."""
    return {e.iteration: e.loss for e in read_journal(journal_path(str(run_dir), rank))}


def test_pipeline_run_learns_and_journals_every_iteration(reference):
    val = read_validation(str(reference))
    assert sorted(val) == [0, 20, 40]
    assert val[40] < val[0] - 0.5
    for rank in (0, 1):
        assert sorted(losses_by_iteration(reference, rank)) == list(range(1, ITERS + 1))
    # The loss is broadcast to both stages: both journals hold the same numbers.
    assert losses_by_iteration(reference, 0) == losses_by_iteration(reference, 1)
    # The asynchronous engine kept the last keep_last = 4 checkpoints, all complete and verified.
    checkpoints = list_checkpoints(str(reference))
    assert [(c.tag, c.valid) for c in checkpoints] == [(f"global_step{i}", True) for i in (10, 20, 30, 40)]
    assert read_latest(str(reference)) == "global_step40"


def test_journal_costs_under_half_a_percent_of_an_iteration(reference, tmp_path):
    times = [e.wall_time for e in read_journal(journal_path(str(reference), 0))]
    iteration_s = statistics.median(b - a for a, b in zip(times, times[1:]))
    journal = ProgressJournal(str(tmp_path), rank=0)
    n = 2000
    start = time.perf_counter()
    for i in range(n):
        journal.append(i, 1.2345678)
    append_s = (time.perf_counter() - start) / n
    journal.close()
    assert append_s / iteration_s < 0.005, (append_s, iteration_s)


def test_data_parallel_zero1_run(tmp_path):
    run_dir = tmp_path / "run"
    run_job(tmp_path, tiny_config(run_dir, stages=1, zero_stage=1), "--train-iters", 20, "--eval-interval", 20)
    val = read_validation(str(run_dir))
    assert val[20] < val[0] - 0.5
    # The loss is averaged over the data-parallel group, so both ranks journal the same.
    assert losses_by_iteration(run_dir, 0) == losses_by_iteration(run_dir, 1)
    assert len(losses_by_iteration(run_dir, 0)) == 20
    # ZeRO-1: each data-parallel rank wrote its own optimizer partition.
    assert len(glob.glob(str(run_dir / "global_step20" / "*zero_pp_rank_*optim_states.pt"))) == 2


def test_plain_zero3_run_of_the_example_learns_with_each_rank_saving_its_own_partition(tmp_path):
    """train_gpt.py --plain: the GPT as one module on DeepSpeed's plain engine under ZeRO-3."""
    run_dir = tmp_path / "run"
    run_job(tmp_path, tiny_config(run_dir, stages=1, zero_stage=3), "--plain", "--train-iters", 20,
            "--eval-interval", 20)
    val = read_validation(str(run_dir))
    assert val[20] < val[0] - 0.5
    assert losses_by_iteration(run_dir, 0) == losses_by_iteration(run_dir, 1)
    assert len(losses_by_iteration(run_dir, 0)) == 20
    assert len(glob.glob(str(run_dir / "global_step20" / "*zero_pp_rank_*optim_states.pt"))) == 2


def test_killed_rank_restarts_and_recomputes_the_failure_free_losses(reference, tmp_path):
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, stages=2, faults={"kill_rank": 1, "kill_at_iteration": 27})
    result = run_job(tmp_path, config, "--train-iters", ITERS, "--eval-interval", 20, supervised=True)

    assert "restart 1 of 2" in result.stdout and "restart 2 of 2" not in result.stdout
    # Checkpoints persist in the background: the one of iteration 20 may or may not have
    # been durable on every rank when rank 1 died, and recovery must use the newest one that was.
    found = re.search(r"job reached iteration 27, last checkpoint (\d+); recompute \(RB-R\): (\d+) iterations to redo", result.stdout)
    assert found, result.stdout[-3000:]
    c = int(found.group(1))
    assert c in (10, 20) and int(found.group(2)) == 27 - c
    assert os.listdir(run_dir / "faults") == ["iteration-27-rank-1"]
    journal = [e.iteration for e in read_journal(journal_path(str(run_dir), 1))]
    assert journal == list(range(1, 28)) + list(range(c + 1, ITERS + 1))  # died after 27, resumed at c + 1

    expected, got = losses_by_iteration(reference), losses_by_iteration(run_dir)
    assert sorted(got) == sorted(expected)
    for iteration in range(c + 1, ITERS + 1):
        assert abs(got[iteration] - expected[iteration]) <= 1e-6 * abs(expected[iteration]), iteration
    assert read_validation(str(run_dir))[40] == pytest.approx(read_validation(str(reference))[40], rel=1e-6)
