"""bench_multinode's pure parts: the scenario matrix, and a run's outcome and restart time from its journal,
recovery and commit records."""

import json
import os
import sys

import pytest

from cpsr_ds.checkpoint.storage import ondisk
from cpsr_ds.checkpoint.storage.filesystem import fs
from cpsr_ds.checkpoint.capture.journal import Entry, journal_path
from cpsr_ds.recovery import RecoveryReport, append_report

from benchmarks import bench_multinode as bench
from benchmarks.common import lose_node_dir


def test_the_matrix_covers_every_layout_launch_and_failure_and_marks_what_cannot_apply():
    matrix = bench.scenarios()
    assert len(matrix) == len({s.name for s in matrix}) == 2 * 2 * 3
    assert [s.name for s in matrix if s.not_applicable] == ["shared-torchrun-dir_lost", "shared-ssh-dir_lost"]
    shrunk = [s for s in matrix if s.failure == "shrunk"]
    # One rank must hold the whole model after the shrink, with ZeRO-1's partitions reassembled.
    assert all((s.stages, s.zero_stage, s.killed_rank) == (1, 1, 0) for s in shrunk)
    assert all((s.stages, s.killed_rank) == (2, 1) for s in matrix if s.failure != "shrunk")
    assert [s.name for s in bench.scenarios(["node_local"], ["ssh"], ["dir_lost"])] == ["node_local-ssh-dir_lost"]


def entries(rows):
    return [Entry(i, 1.0, t) for i, t in rows]


def test_restart_time_runs_from_the_killed_rank_s_last_line_to_its_restart_s_first():
    journal = entries([(8, 100.0), (9, 101.0), (10, 102.0), (9, 131.5), (10, 132.0)])
    failed = bench.failure_time(journal, 10)
    assert (failed, bench.restart_time(journal, failed)) == (102.0, 131.5)
    with pytest.raises(ValueError, match="no line of iteration 11"):
        bench.failure_time(journal, 11)
    with pytest.raises(ValueError, match="journaled no iteration"):
        bench.restart_time(journal[:3], failed)


def test_progress_is_lost_when_the_restart_resumes_before_the_newest_commit():
    report = RecoveryReport("recompute", 10, 8, 8)
    kept = bench.outcome(True, report, 8)
    assert (kept["outcome"], kept["c"], kept["f"], kept["resume"], kept["progress_lost"]) == ("recovered", 8, 10, 8, False)
    assert bench.outcome(True, report, 12)["progress_lost"]
    from_scratch = bench.outcome(True, RecoveryReport("restart", 10, None, 0), 8)
    assert from_scratch["outcome"] == "not recovered" and from_scratch["progress_lost"]
    assert bench.outcome(False, report, 8)["outcome"] == "launcher failed"
    assert not bench.outcome(True, RecoveryReport("predict", 10, 8, 10), None)["progress_lost"]


def commit(d, tag, iteration, written):
    os.makedirs(os.path.join(d, tag), exist_ok=True)
    path = os.path.join(d, tag, ondisk.COMMIT)
    with open(path, "w") as f:
        json.dump({"tag": tag, "world_size": 2, "iteration": iteration}, f)
    os.utime(path, (written, written))


def test_a_lost_directory_s_commits_are_listed_before_it_goes_and_count(tmp_path, monkeypatch):
    assert lose_node_dir.COMMIT == ondisk.COMMIT
    run = bench.Run(bench.Scenario("node_local", "torchrun", "dir_lost"), str(tmp_path), None)
    node0, node1 = run.node_dir(0), run.node_dir(1)
    commit(node0, "global_step4", 4, 90.0)
    commit(node0, "global_step8", 8, 99.0)  # node 1 never wrote its record of 8
    commit(node1, "global_step4", 4, 90.0)
    commit(os.path.join(node1, ondisk.REPLICAS), "global_step4", 4, 90.5)
    marker = os.path.join(node1, "faults", "iteration-10-rank-1")
    args = (node0, marker, run.lost_record)
    monkeypatch.setenv("RANK", "0")
    assert not lose_node_dir.lose(*args) and os.path.isdir(node0)  # no failure yet
    os.makedirs(os.path.dirname(marker))
    open(marker, "w").close()
    monkeypatch.setenv("RANK", "1")
    assert not lose_node_dir.lose(*args)
    monkeypatch.setenv("RANK", "0")
    assert lose_node_dir.lose(*args) and not os.path.exists(node0)
    assert not lose_node_dir.lose(*args)  # the next restart keeps what it has
    # As DeepSpeed's launcher starts it: its --local_rank first, for the script.
    assert lose_node_dir.command(["--local_rank=0", *args, "train.py", "--x", "1"]) == \
        (args, [sys.executable, "-u", "train.py", "--local_rank=0", "--x", "1"])

    # The restart: recovered from 8, first journaled 20 s after the kill; then committed 12.
    os.makedirs(node0)
    append_report(node0, RecoveryReport("recompute", 10, 8, 8))
    os.makedirs(os.path.dirname(journal_path(node1, 1)))
    with open(journal_path(node1, 1), "w") as f:
        f.write("9,1.0,101.0\n10,1.0,102.0\n9,1.0,122.0\n")
    commit(node1, "global_step12", 12, 125.0)
    measured = run.measure(True)
    assert measured["restart_s"] == pytest.approx(20.0)
    assert (measured["committed_before_failure"], measured["resume"], measured["progress_lost"]) == (8, 8, False)


def test_a_scenario_s_record_summarises_its_runs():
    scenario = bench.Scenario("node_local", "ssh", "killed")
    runs = [{**bench.outcome(True, RecoveryReport("recompute", 10, 8, 8), 8), "restart_s": s} for s in (20.0, 24.0, 22.0)]
    record = bench.summary(scenario, runs)
    assert record["outcome"] == "recovered" and record["repeats"] == 3 and not record["progress_lost"]
    assert record["c"] == [8, 8, 8] and record["restart_s"]["median"] == 22.0
    assert record["restart_s"]["ci95"][0] < 22.0 < record["restart_s"]["ci95"][1]
    runs[1] = {**bench.outcome(True, RecoveryReport("restart", 10, None, 0), 8), "restart_s": None}
    record = bench.summary(scenario, runs)
    assert record["outcome"] == "1 of 3 not recovered" and record["progress_lost"]
    assert bench.summary(bench.Scenario("shared", "ssh", "dir_lost"), [])["outcome"] == "n/a"
    assert bench.summary(scenario, [], skipped="no sshd")["outcome"] == "skipped"


def test_a_replica_s_record_is_no_commit(tmp_path):
    """A replica carries rank 0's decision before the nodes commit: only the nodes' own records count."""
    for where in ("node0/global_step4", "node0/replicas/global_step8", "node1/global_step4"):
        (tmp_path / where).mkdir(parents=True)
        fs.write_json_atomic(str(tmp_path / where / ondisk.COMMIT), {"iteration": int(where[-1])})
    assert lose_node_dir.REPLICAS == ondisk.REPLICAS and lose_node_dir.COMMIT == ondisk.COMMIT
    assert sorted(r["iteration"] for r in lose_node_dir.commit_records(str(tmp_path))) == [4, 4]
