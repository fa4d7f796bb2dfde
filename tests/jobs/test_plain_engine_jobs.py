"""The plain engine (a module that is not a PipelineModule) under ZeRO-3 in jobs of 2 processes: a rank killed,
the job restarted by the supervisor, recovered from each rank's own partitions."""

import os
import re

import pytest

from conftest import ROOT, run_job
from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal
from support.plain import plain_config

ITERS = 12
SCRIPT = os.path.join(ROOT, "tests", "jobs", "plain_job.py")


def losses_by_iteration(run_dir, rank=0):
    """The last loss journaled for each iteration (a recomputed iteration overwrites the failed run's)."""
    return {e.iteration: e.loss for e in read_journal(journal_path(str(run_dir), rank))}


@pytest.fixture(scope="module")
def zero3_reference(tmp_path_factory):
    """A failure-free ZeRO-3 run of 2 data-parallel ranks."""
    tmp = tmp_path_factory.mktemp("reference")
    run_job(tmp, plain_config(tmp / "run", zero_stage=3), "--train-iters", ITERS, script=SCRIPT)
    return tmp / "run"


def test_zero3_killed_rank_restarts_and_recomputes_the_failure_free_losses(zero3_reference, tmp_path):
    run_dir = tmp_path / "run"
    config = plain_config(run_dir, zero_stage=3, cpsr={"faults": {"kill_rank": 1, "kill_at_iteration": 8},
                                                       "recovery": {"mode": "recompute"}})
    result = run_job(tmp_path, config, "--train-iters", ITERS, script=SCRIPT, supervised=True)

    assert "restart 1 of 2" in result.stdout and "restart 2 of 2" not in result.stdout
    found = re.search(r"job reached iteration 8, last checkpoint (\d+); recompute \(RB-R\): (\d+) iterations to redo",
                      result.stdout)
    assert found, result.stdout[-3000:]
    c = int(found.group(1))
    assert c in (3, 6) and int(found.group(2)) == 8 - c
    # Each rank saved its own ZeRO-3 partition: nothing gathered onto one rank.
    assert len(list((run_dir / f"global_step{c}").glob("*zero_pp_rank_*optim_states.pt"))) == 2
    journal = [e.iteration for e in read_journal(journal_path(str(run_dir), 1))]
    assert journal == list(range(1, 9)) + list(range(c + 1, ITERS + 1))

    expected, got = losses_by_iteration(zero3_reference), losses_by_iteration(run_dir)
    assert sorted(got) == sorted(expected) == list(range(1, ITERS + 1))
    for iteration in range(c + 1, ITERS + 1):
        assert abs(got[iteration] - expected[iteration]) <= 1e-6 * abs(expected[iteration]), iteration
