"""Bounded exit: a failing process waits for no other rank's checkpoint part, and for its own only briefly."""

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from benchmarks.common.processes import free_port, tiny_config
from conftest import ROOT, probe_rows, run_job
from cpsr_ds.checkpoint.capture import exiting
from support.checkpoints import (checkpoint, engines, hung_storage, open_checkpoint,  # noqa: F401 (fixtures)
                                 states, timed_cleanup)
from cpsr_ds.checkpoint.storage import catalog, records


@pytest.fixture
def failing(monkeypatch):
    """Mark this process failing for one test, as an exception out of train_batch would."""
    monkeypatch.setattr(exiting, "_reason", None)
    return lambda: exiting.mark("RuntimeError in train_batch: Connection closed by peer")


@pytest.mark.parametrize("strategy", ["cpsr", "pccheck", "torch"])
def test_failing_rank_0_does_not_wait_for_a_dead_ranks_manifest(tmp_path, engines, failing, strategy, caplog):
    d = str(tmp_path)
    rank0 = engines(d, 0, 2, strategy=strategy, commit_timeout_s=600.0)
    rank1 = engines(d, 1, 2, strategy=strategy, commit_timeout_s=600.0)
    checkpoint(rank1, d, 5, states(), rank=1)
    checkpoint(rank0, d, 5, states(), rank=0)
    if strategy != "torch":  # the asynchronous engines persist in the background
        assert rank1.flush(10) and rank0.flush(10)
    assert records.read_latest(d) == "global_step5"
    open_checkpoint(rank0, d, 10)  # rank 1 died before its part of global_step10
    failing()
    with caplog.at_level(logging.INFO):
        took = timed_cleanup(rank0)
    assert took < exiting.EXIT_GRACE_S + 1
    assert "this process is failing" in caplog.text and "Connection closed by peer" in caplog.text
    assert records.read_latest(d) == "global_step5"
    assert [(c.tag, c.valid) for c in catalog.list_checkpoints(d)] == [("global_step5", True)]


def test_a_failing_process_still_commits_what_every_rank_finished(tmp_path, engines, failing):
    d = str(tmp_path)
    rank0, rank1 = engines(d, 0, 2, commit_timeout_s=600.0), engines(d, 1, 2, commit_timeout_s=600.0)
    checkpoint(rank1, d, 5, states(), rank=1)
    assert rank1.flush(10)
    checkpoint(rank0, d, 5, states(), rank=0)
    failing()
    timed_cleanup(rank0)
    assert records.read_latest(d) == "global_step5"


def test_a_failing_process_gives_its_own_writes_the_exit_grace_only(tmp_path, engines, failing, hung_storage, caplog):
    d = str(tmp_path)
    eng = engines(d, commit_timeout_s=600.0)
    checkpoint(eng, d, 5, states())
    assert eng.flush(10)
    hung_storage()
    checkpoint(eng, d, 10, states())
    failing()
    with caplog.at_level(logging.ERROR):
        took = timed_cleanup(eng)
    assert exiting.EXIT_GRACE_S - 0.1 < took < exiting.EXIT_GRACE_S + 1
    assert "global_step10" in caplog.text and "abandoned" in caplog.text
    assert records.read_latest(d) == "global_step5"


def test_a_healthy_exit_still_waits_for_the_other_ranks(tmp_path, engines, monkeypatch):
    monkeypatch.setattr(exiting, "_reason", None)
    d = str(tmp_path)
    rank0 = engines(d, 0, 2, commit_timeout_s=600.0)
    checkpoint(rank0, d, 5, states(), rank=0)
    assert not rank0.flush(0.5)  # rank 1's manifest may still come
    rank1 = engines(d, 1, 2, commit_timeout_s=600.0)
    checkpoint(rank1, d, 5, states(), rank=1)
    assert rank1.flush(10) and rank0.flush(10)
    assert records.read_latest(d) == "global_step5"


def test_at_exit_closes_what_still_lives_and_keeps_nothing_alive(monkeypatch):
    registered = []
    monkeypatch.setattr(exiting.atexit, "register", registered.append)

    class Owner:
        closed = 0

        def close(self):
            Owner.closed += 1

    kept, dropped = Owner(), Owner()
    exiting.at_exit(kept, "close")
    exiting.at_exit(dropped, "close")
    del dropped  # the hook holds no reference: the object goes, and its hook does nothing
    for hook in registered:
        hook()
    assert Owner.closed == 1 and kept is not None


def test_an_exception_marks_the_process_failing_first_reason_kept(monkeypatch):
    monkeypatch.setattr(exiting, "_reason", None)
    with pytest.raises(RuntimeError):
        with exiting.marks_failure("train_batch"):
            raise RuntimeError("Connection closed by peer")
    exiting.mark("later")
    assert exiting.reason() == "RuntimeError in train_batch: Connection closed by peer"


def test_the_excepthook_marks_the_process_failing_and_chains(monkeypatch):
    monkeypatch.setattr(exiting, "_reason", None)
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *info: seen.append(info[0]))
    exiting.install()
    exiting.install()  # once per process, however often initialize runs
    sys.excepthook(ValueError, ValueError("boom"), None)
    assert seen == [ValueError] and exiting.reason() == "uncaught ValueError: boom"


# ---------------------------------------------------------------- a rank killed during a checkpoint

KILL_AT = 9


def start_rank(rank: int, config_path, port: int, log_path):
    """One process of a 2-rank job, as a launcher of its own would start it (no launcher to stop the other)."""
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    command = [sys.executable, os.path.join(ROOT, "examples", "gpt", "train_gpt.py"), "--deepspeed_config", str(config_path),
               "--train-iters", "20", "--eval-interval", "1000", "--valid-sequences", "16"]
    with open(log_path, "w") as out:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_for_exit(proc, limit_s: float) -> float | None:
    """When (monotonic) ``proc`` exited, polling; None if it is still alive after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return time.monotonic()
        time.sleep(0.05)
    return None


def test_rank_killed_during_a_checkpoint_the_other_exits_within_seconds(tmp_path):
    run_dir = tmp_path / "run"
    # Persisting a checkpoint takes seconds (about 1.6 MB per rank at 0.5 MB/s), so the one of
    # iteration 8 is in flight when rank 1 dies after iteration 9; the one of iteration 4 is committed.
    config = tiny_config(run_dir, stages=2, faults={"kill_rank": 1, "kill_at_iteration": KILL_AT})
    config["cpsr"]["checkpoint"].update(interval=4, write_mbps=0.5, commit_timeout_s=600)
    config_path = tmp_path / "ds_config.json"
    config_path.write_text(json.dumps(config))
    port = free_port()
    procs = [start_rank(r, config_path, port, tmp_path / f"rank{r}.log") for r in (0, 1)]
    try:
        died = wait_for_exit(procs[1], 120)
        assert died is not None, "rank 1 was not killed"
        left = wait_for_exit(procs[0], 60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    log0 = (tmp_path / "rank0.log").read_text()
    assert procs[1].returncode == -9, (tmp_path / "rank1.log").read_text()[-3000:]
    assert left is not None, "rank 0 still waiting 60 s after rank 1 died:\n" + log0[-3000:]
    took = left - died
    print(f"rank 0 exited {took:.2f} s after rank 1 was killed")
    assert took < 10, log0[-3000:]
    assert procs[0].returncode != 0
    latest = records.read_latest(str(run_dir))
    valid = [c.tag for c in catalog.list_checkpoints(str(run_dir)) if c.valid]
    assert latest in valid and latest != f"global_step{KILL_AT - 1}", (latest, valid, log0[-3000:])


def test_a_job_that_trains_to_the_end_leaves_neither_process_group_nor_checkpoint_thread_to_the_teardown(tmp_path):
    """Gloo's threads left to the interpreter's teardown once aborted a rank that had finished cleanly
    ("terminate called without an active exception"); train_gpt.py's clean end destroys the engine, which commits
    the last checkpoint and stops its threads, then the process group."""
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, stages=1)
    config["cpsr"]["checkpoint"].update(interval=2)
    result = run_job(tmp_path, config, "--train-iters", 6, "--eval-interval", 100,
                     script=os.path.join(ROOT, "tests", "jobs", "end_probe.py"), env={"PROBE_END": "main"})
    rows = probe_rows(result.stdout)
    assert sorted(row["rank"] for row in rows) == [0, 1], result.stdout[-3000:]
    # The signal watcher reads a pipe, outside torch: nothing to abort there.
    assert all(not row["process_group"] and row["threads"] == ["cpsr-signals"] for row in rows), rows
    assert records.read_latest(str(run_dir)) == "global_step6"
