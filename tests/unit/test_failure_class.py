"""The failure class a restart observes: whether every rank's node kept its mark in node memory."""

import shutil

from cpsr_ds.config import CheckpointConfig
from cpsr_ds.recovery.failure_class import mark, observed_class


def config(tmp_path, run="run", **settings) -> CheckpointConfig:
    (tmp_path / run).mkdir(exist_ok=True)
    return CheckpointConfig(dir=str(tmp_path / run), survivor_dir=str(tmp_path / "memory"), **settings)


def test_a_node_that_kept_the_ranks_mark_crashed_one_that_lost_it_was_lost(tmp_path):
    cfg = config(tmp_path)
    assert observed_class(cfg, 0, 2) == "node_lost"  # nothing marked: a node new to the run
    mark(cfg, 0, 1)  # what the attempt before did at its start
    assert observed_class(cfg, 0, 2) == "process_crash"
    assert observed_class(cfg, 0, 1) is None  # a first attempt follows no failure
    assert observed_class(cfg, 1, 2) == "node_lost"  # rank 1 left no mark here: it ran on another node
    shutil.rmtree(tmp_path / "memory")
    assert observed_class(cfg, 0, 3) == "node_lost"


def test_a_run_that_keeps_nothing_in_node_memory_cannot_tell(tmp_path):
    cfg = config(tmp_path, survivor=False)
    mark(cfg, 0, 1)
    assert not (tmp_path / "memory").exists()
    assert observed_class(cfg, 0, 2) is None
    snapshots = config(tmp_path, survivor=False, memory_interval=4)
    mark(snapshots, 0, 1)
    assert observed_class(snapshots, 0, 2) == "process_crash"


def test_another_runs_mark_is_not_this_runs(tmp_path):
    mark(config(tmp_path, run="other"), 0, 1)
    assert observed_class(config(tmp_path), 0, 2) == "node_lost"
