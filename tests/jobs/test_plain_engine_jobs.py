"""The plain engine (a module that is not a PipelineModule) under ZeRO-3 in jobs of 2 processes: a rank killed and
the job restarted, recomputing in fp32, bf16 and fp16, or at world size 1 (tests/jobs/test_plain_engine_sources.py:
the other recovery sources)."""

import os
import re

import pytest

from conftest import ROOT, run_job
from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal
from cpsr_ds.recovery import read_reports
from support.plain import plain_config
from support.plain_jobs import ITERS, losses_by_iteration, reference

SCRIPT = os.path.join(ROOT, "tests", "jobs", "plain_job.py")


@pytest.fixture(scope="module")
def zero3_reference(tmp_path_factory):
    return reference(tmp_path_factory, SCRIPT, 3)


# fp16 with dynamic loss scaling: a step skipped for an overflow is not an iteration, and the scaler's state goes
# with each checkpoint.
PRECISIONS = {"float32": {}, "bfloat16": {"bf16": {"enabled": True}},
              "float16": {"fp16": {"enabled": True, "initial_scale_power": 16}}}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_zero3_killed_rank_restarts_and_recomputes_the_failure_free_losses(zero3_reference, tmp_path, dtype):
    """Rank 1 SIGKILLed after 8, the job restarted by the supervisor: it recomputes from the last checkpoint c
    the failed run's iterations, bit for bit, and in fp32 every loss from c on is the failure-free run's."""
    run_dir = tmp_path / "run"
    config = plain_config(run_dir, zero_stage=3, cpsr={"faults": {"kill_rank": 1, "kill_at_iteration": 8},
                                                       "recovery": {"mode": "recompute"}}, **PRECISIONS[dtype])
    result = run_job(tmp_path, config, "--train-iters", ITERS, "--dtype", dtype, script=SCRIPT, supervised=True)

    assert "restart 1 of 2" in result.stdout and "restart 2 of 2" not in result.stdout
    found = re.search(r"job reached iteration 8, last checkpoint (\d+); recompute \(RB-R\): (\d+) iterations to redo",
                      result.stdout)
    assert found, result.stdout[-3000:]
    c = int(found.group(1))
    assert c in (3, 6) and int(found.group(2)) == 8 - c
    # Each rank saved its own ZeRO-3 partition: nothing gathered onto one rank.
    assert len(list((run_dir / f"global_step{c}").glob("*zero_pp_rank_*optim_states.pt"))) == 2
    entries = read_journal(journal_path(str(run_dir), 1))
    killed = [e.iteration for e in entries].index(8) + 1
    first, after = entries[:killed], entries[killed:]
    # fp16's first steps overflow at the initial scale 2^16 and are skipped: they are not iterations, and
    # nothing is journaled for them.
    applied = [e.iteration for e in first]
    assert applied == list(range(applied[0], 9)) and (applied[0] > 1) == (dtype == "float16"), applied
    assert [e.iteration for e in after] == [i for i in applied if i > c] + list(range(9, ITERS + 1))
    before = {e.iteration: e.loss for e in first}
    assert all(e.loss == before[e.iteration] for e in after if e.iteration <= 8)
    if dtype == "float32":
        expected, got = losses_by_iteration(zero3_reference), losses_by_iteration(run_dir)
        assert sorted(got) == sorted(expected) == list(range(1, ITERS + 1))
        for iteration in range(c + 1, ITERS + 1):
            assert abs(got[iteration] - expected[iteration]) <= 1e-6 * abs(expected[iteration]), iteration


def test_zero3_job_restarted_at_world_size_1_reassembles_the_partitions_and_trains_the_same_batches(
        zero3_reference, tmp_path):
    """2 ranks under ZeRO-3, rank 1 killed; the job restarted alone: the checkpoint's two partitions reassembled
    into the one rank's, the global batch kept by gradient accumulation 2, the losses from c on the
    failure-free run's (to fp32 reduction order)."""
    run_dir = tmp_path / "run"
    failed = plain_config(run_dir, zero_stage=3, cpsr={"faults": {"kill_rank": 1, "kill_at_iteration": 8}})
    assert run_job(tmp_path, failed, "--train-iters", ITERS, script=SCRIPT, check=False).returncode != 0
    result = run_job(tmp_path, plain_config(run_dir, zero_stage=3, cpsr={"recovery": {"mode": "recompute"}}),
                     "--train-iters", ITERS, script=SCRIPT, nprocs=1)
    assert "reassembling its ZeRO partitions" in result.stdout, result.stdout[-3000:]
    report = read_reports(str(run_dir))[-1]
    assert report.method == "recompute" and report.world_change and report.checkpoint in (3, 6), report
    expected, got = losses_by_iteration(zero3_reference), losses_by_iteration(run_dir)
    for iteration in range(report.checkpoint + 1, ITERS + 1):
        assert got[iteration] == pytest.approx(expected[iteration], rel=1e-5), iteration
