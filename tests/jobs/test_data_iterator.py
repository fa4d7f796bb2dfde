"""The data DeepSpeed owns resumes where the failure left it: a job fed by ``training_data=`` (DeepSpeedExamples'
pipeline pattern, and the plain engine's loader), with a rank killed and the job restarted, recomputes from c the
losses the failure-free run journaled: the batches after the restart are the ones it saw at those iterations."""

import os

import pytest

from conftest import ROOT, recomputed_from, run_job
from support.plain import plain_config

SCRIPT = os.path.join(ROOT, "tests", "jobs", "data_iterator_job.py")
KILLED_AT, ITERS = 8, 9
# 72 samples in micro-batches of 4, 2 per step: a checkpoint at 3 or 6 is 6 or 12 micro-batches in, into a pass of 18
# (pipeline) or 9 (two data-parallel ranks): never at its start.


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipeline_train_batch", "plain_loader"])
def test_a_restart_resumes_the_engines_loader_at_the_resumed_iterations_batch(tmp_path, pipeline):
    run_dir = tmp_path / "run"
    config = plain_config(run_dir, accumulation=2, cpsr={"faults": {"kill_rank": 1, "kill_at_iteration": KILLED_AT},
                                                         "recovery": {"mode": "recompute"}})
    flags = ["--pipeline"] if pipeline else []
    result = run_job(tmp_path, config, "--train-iters", ITERS, *flags, script=SCRIPT, supervised=True)
    assert recomputed_from(result.stdout, run_dir, KILLED_AT, ITERS) in (3, 6)
