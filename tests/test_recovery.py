"""Predicting-based recovery (PB-R): the predicted state is what the engine holds, and
training resumes at the failure point's batch. 4 processes: PP = 2 x DP = 2, ZeRO-1."""

import os
import shutil

import pytest
import torch

from conftest import ROOT, run_job, tiny_config
from cpsr_ds.checkpoint.journal import journal_path, read_journal

F = 33  # the failure point: rank 3 is killed right after this iteration


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pbr")
    run_dir = tmp / "run"
    config = tiny_config(run_dir, stages=2, zero_stage=1,
                         faults={"kill_rank": 3, "kill_at_iteration": F},
                         predictor={"name": "linear", "history": 3},
                         recovery={"mode": "predict"})  # fmt: skip
    # Every stage predicted: no survivor dumps (with them, stage 0's ranks would resume from theirs: test_survivor.py).
    config["cpsr"]["checkpoint"].update(interval=5, survivor=False)
    result = run_job(tmp, config, "--train-iters", 45, "--eval-interval", 45, nprocs=4, check=False)
    assert result.returncode != 0, "the injected failure did not stop the job"
    return tmp, config, run_dir


@pytest.fixture(scope="module")
def probe(failed_run):
    """What recovery wrote into a DeepSpeed engine, read back on every rank (on a copy of the run)."""
    tmp, config, run_dir = failed_run
    copy = tmp / "copy"
    shutil.copytree(run_dir, copy)
    config = {**config, "cpsr": {**config["cpsr"], "checkpoint": {**config["cpsr"]["checkpoint"], "dir": str(copy)}}}
    out = tmp / "probe"
    out.mkdir()
    run_job(tmp, config, "--train-iters", 45, nprocs=4, script=os.path.join(ROOT, "tests", "pbr_probe.py"),
            env={"PROBE_OUT": str(out)})
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


def test_pbr_writes_the_linear_prediction_into_every_stage_and_replica(probe):
    for rank, p in enumerate(probe):
        report = p["report"]
        assert report.method == "predict" and report.reached == F and report.predictor == "linear"
        c = report.checkpoint
        assert c < F and c % 5 == 0
        prev = max(i for i in p["history"] if i < c)
        x_c, x_prev = p["history"][c], p["history"][prev]
        assert p["recovered"].keys() == x_c.keys()
        moved = 0
        for key, value in p["recovered"].items():
            if key.startswith("param/"):
                expected = x_c[key] + (F - c) / (c - prev) * (x_c[key] - x_prev[key])
                moved += int(not torch.equal(value, x_c[key]))
                # Under ZeRO-1 the forward pass uses the module's weights: they must be the prediction too.
                assert torch.allclose(p["module"][key[len("param/"):]], expected, rtol=1e-5, atol=1e-6), key
            else:  # Adam's moments are kept from the checkpoint by default
                expected = x_c[key]
            assert torch.allclose(value, expected, rtol=1e-5, atol=1e-6), (rank, key)
        assert moved > 0
        # Counters as if the lost iterations had run: training resumes at batch F.
        assert p["global_steps"] == F
        assert p["scheduler"]["last_batch_iteration"] == F - 1
        assert p["optimizer_steps"] == [F]
    # Data-parallel replicas of a stage hold the same state; the two stages differ.
    assert probe[0]["recovered"].keys() == probe[1]["recovered"].keys()
    assert all(torch.equal(probe[0]["recovered"][k], probe[1]["recovered"][k]) for k in probe[0]["recovered"])
    assert probe[0]["recovered"].keys() != probe[2]["recovered"].keys()


def test_restarted_job_resumes_at_the_failure_point(failed_run):
    tmp, config, run_dir = failed_run
    result = run_job(tmp, config, "--train-iters", 45, "--eval-interval", 45, nprocs=4)
    assert f"predict (PB-R) with linear: resuming at iteration {F}" in result.stdout
    for rank in range(4):
        iterations = [e.iteration for e in read_journal(journal_path(str(run_dir), rank))]
        assert iterations == list(range(1, F + 1)) + list(range(F + 1, 46))
    losses = [e.loss for e in read_journal(journal_path(str(run_dir), 0))]
    assert all(loss == loss and loss < 10 for loss in losses)  # finite, no blow-up
