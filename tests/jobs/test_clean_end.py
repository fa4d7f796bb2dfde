"""A clean end is clean: every rank of a job that trained to its end exits 0, and a restart of a finished job
trains nothing and counts no failure."""

import json
import os
import subprocess
import sys
import time

from benchmarks.common.processes import tiny_config
from conftest import ROOT, run_job
from cpsr_ds.checkpoint.storage import records
from cpsr_ds.checkpoint.capture.journal import finished_iterations, finished_run, record_finished
from cpsr_ds.recovery.report import read_reports

CLEAN_ENDS = 20
ITERS = 4  # checkpoints at 2 and 4: the last one's predictor work is still queued at the end, as in the job
ENDS = "collected,train,main"  # tests/jobs/clean_ends.py


def test_twenty_clean_ends_of_a_pipeline_job_all_exit_0(tmp_path):
    """PP = 2, the predictor's work of the last checkpoint still queued at the end. Each job ends in one of three
    ways (tests/jobs/clean_ends.py): train_gpt.main's explicit end; the script returning with everything left to the
    interpreter's exit, as DeepSpeed's examples end; and the same with the engine collected on another thread as
    the script returns, where the engine's end, cut off by the interpreter's teardown, aborted a rank
    ("terminate called without an active exception") or left its last checkpoint uncommitted."""
    config = tiny_config("unused", stages=2)
    config["cpsr"]["checkpoint"].update(interval=2)
    config_path = tmp_path / "ds_config.json"
    config_path.write_text(json.dumps(config))
    out = tmp_path / "jobs"
    started = time.monotonic()
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "jobs", "clean_ends.py"), "--config", str(config_path),
                             "--out", str(out), "--jobs", str(CLEAN_ENDS), "--at-once", "2", "--limit-s", "120",
                             "--ends", ENDS, "--", "--train-iters", str(ITERS), "--eval-interval", "1000",
                             "--valid-sequences", "16"],
                            cwd=ROOT, capture_output=True, text=True, timeout=900)
    print(f"{CLEAN_ENDS} clean ends in {time.monotonic() - started:.1f} s")
    assert result.returncode == 0, result.stderr[-3000:]
    exits = [json.loads(line) for line in result.stdout.splitlines()]
    assert sorted((e["job"], e["rank"]) for e in exits) == [(j, r) for j in range(CLEAN_ENDS) for r in (0, 1)]
    for e in exits:
        log = (out / f"job{e['job']}" / f"rank{e['rank']}.log").read_text()
        assert e["code"] == 0 and "terminate called" not in log, (e, log[-3000:])
    for job in range(CLEAN_ENDS):
        assert records.read_latest(str(out / f"job{job}" / "run")) == f"global_step{ITERS}", job


def test_a_restart_of_a_finished_job_exits_0_at_once_without_training_or_a_failure(tmp_path):
    """The supervisor's restart of a job that finished (train_gpt.py's clean end records it in the journal): exit
    0 before any engine exists, no iteration trained, no recovery report (the planner's failure count reads
    those), no attempt counted."""
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, stages=2)
    config["cpsr"]["checkpoint"].update(interval=3)  # the last checkpoint (3) is before the end (4)
    args = ["--train-iters", ITERS, "--eval-interval", 1000]
    run_job(tmp_path, config, *args)
    assert finished_run(str(run_dir)) == ITERS
    journal = (run_dir / "journal" / "rank00000.csv").read_text()
    reports = read_reports(str(run_dir))
    attempt = (run_dir / "cpsr_attempt.json").read_text()

    again = run_job(tmp_path, config, *args)
    assert f"finished at iteration {ITERS}" in again.stdout and "nothing to train" in again.stdout, again.stdout[-3000:]
    assert (run_dir / "journal" / "rank00000.csv").read_text() == journal
    assert read_reports(str(run_dir)) == reports
    assert (run_dir / "cpsr_attempt.json").read_text() == attempt
    assert finished_iterations(str(run_dir)) == [ITERS]


def test_a_run_that_trained_on_after_its_clean_end_has_not_finished(tmp_path):
    from support.training import write_journal

    for rank in (0, 1):
        write_journal(tmp_path, rank, range(1, 5))
    assert finished_run(str(tmp_path)) is None
    record_finished(str(tmp_path), 4)
    assert finished_run(str(tmp_path)) == 4
    write_journal(tmp_path, 0, [5])
    write_journal(tmp_path, 1, [5])
    assert finished_run(str(tmp_path)) is None
    assert finished_iterations(str(tmp_path)) == [4]
