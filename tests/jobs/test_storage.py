"""Storage layouts: node-local directories commit through the job, each node keeps its own latest."""

import logging
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from cpsr_ds.checkpoint.capture import exiting
from cpsr_ds.checkpoint.storage import agreement, catalog, layout, records, topology
from cpsr_ds.checkpoint.engines.factory import create_engine
from cpsr_ds.checkpoint.capture.journal import Entry, Progress
from benchmarks.common.processes import free_port
from cpsr_ds.config import ConfigError
from support.checkpoints import (TWO_NODES, both, checkpoint, config, node_engines,  # noqa: F401 (a fixture)
                                 open_checkpoint, states, timed_cleanup)


def test_node_local_directories_commit_and_each_node_keeps_its_latest(node_engines):
    dirs, engines = node_engines()
    both(engines, dirs, 5)
    for rank, d in enumerate(dirs):
        assert records.read_latest(d) == "global_step5"
        (ckpt,) = catalog.list_checkpoints(d, ranks={rank})
        assert ckpt.valid and ckpt.committed
        # Only its own rank's part is on each node.
        assert sorted(records.read_manifests(os.path.join(d, "global_step5"))) == [rank]
    assert all(eng.stats.persisted == 1 and eng.stats.failed == 0 for eng in engines)


def test_shared_storage_on_node_local_directories_never_commits(tmp_path, caplog):
    """The reported failure: rank 0 looks for every manifest in its own directory."""
    dirs = [str(tmp_path / f"node{n}") for n in (0, 1)]
    engines = [create_engine(config(d, commit_timeout_s=0.5), rank, 2) for rank, d in enumerate(dirs)]
    for rank, (eng, d) in enumerate(zip(engines, dirs)):
        checkpoint(eng, d, 5, states(n=100), rank=rank)
    with caplog.at_level(logging.ERROR):
        assert all(eng.flush(30) for eng in engines)
    assert records.read_latest(dirs[0]) is None and "rank manifests [1] missing" in caplog.text
    for eng in engines:
        eng.cleanup()


def test_retention_runs_on_every_node(node_engines):
    dirs, engines = node_engines(keep_last=2)
    for step in range(1, 5):
        both(engines, dirs, step)
    for d in dirs:
        assert sorted(n for n in os.listdir(d) if n.startswith("global")) == ["global_step3", "global_step4"]
        assert records.read_latest(d) == "global_step4"


def test_a_part_given_up_on_one_node_is_given_up_on_every_node(node_engines, caplog):
    dirs, engines = node_engines()
    both(engines, dirs, 5)
    checkpoint(engines[0], dirs[0], 10, states(n=100), rank=0)
    checkpoint(engines[1], dirs[1], 10, states(scale=float("nan"), n=100), rank=1)
    with caplog.at_level(logging.ERROR):
        assert all(eng.flush(30) for eng in engines)
    assert "non-finite" in caplog.text
    for d in dirs:
        assert records.read_latest(d) == "global_step5" and not os.path.exists(os.path.join(d, "global_step10"))


def test_a_failing_follower_leaves_within_the_grace_and_keeps_its_part(node_engines, monkeypatch):
    monkeypatch.setattr(exiting, "_reason", None)
    dirs, (rank0, rank1) = node_engines(commit_timeout_s=600.0)
    open_checkpoint(rank1, dirs[1], 10, rank=1)
    rank1.commit(rank1.get_commit_info())  # rank 0 died before deciding on global_step10
    exiting.mark("RuntimeError in train_batch: Connection closed by peer")
    assert timed_cleanup(rank1) < exiting.EXIT_GRACE_S + 1
    assert records.read_manifests(os.path.join(dirs[1], "global_step10")).keys() == {1}


def test_rank_0_ends_only_once_the_other_ranks_no_longer_need_the_store_it_holds(node_engines):
    dirs, (rank0, rank1) = node_engines(commit_timeout_s=30.0)
    both((rank0, rank1), dirs, 5)
    closing = threading.Thread(target=rank0.cleanup, daemon=True)
    closing.start()
    closing.join(0.5)
    assert closing.is_alive(), "rank 0 ended while rank 1 could still be waiting for its decisions"
    timed_cleanup(rank1)
    closing.join(5)
    assert not closing.is_alive()


def test_rank_0_waits_for_the_others_no_longer_than_the_commit_timeout(node_engines, caplog):
    dirs, (rank0, _) = node_engines(commit_timeout_s=1.0)
    with caplog.at_level(logging.WARNING):
        took = timed_cleanup(rank0)
    assert 0.9 < took < 5 and "1 of 2 ranks' checkpoints still needed the job after 1.0 s" in caplog.text


@pytest.fixture
def store_process():
    """A TCPStore served by a process of its own, as rank 0's process serves DeepSpeed's: (port, kill it)."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, torch.distributed as dist\n"
        f"s = dist.TCPStore('127.0.0.1', {port}, None, True, wait_for_workers=False)\n"
        "print('serving', flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "serving"

    def kill():
        server.kill()
        server.wait()

    yield port, kill
    kill()


@pytest.mark.parametrize("gone", ["before its manifest", "before the decision"])
def test_a_rank_that_loses_the_store_keeps_its_part_for_recovery(tmp_path, store_process, gone, caplog):
    """Rank 0 SIGKILLed with the store its process held: rank 0 may have committed the checkpoint (on its own
    node) before this rank heard so, so this rank's part must stay for a recovery that finds every part sound."""
    port, kill_store = store_process
    kv = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=10))
    d = str(tmp_path / "node1")
    cfg = config(d, storage="node_local", commit_timeout_s=600.0)
    rank1 = create_engine(cfg, 1, 2, layout=layout.make_layout(cfg, 1, 2, kv=kv, nodes=TWO_NODES))
    keys = kv.num_keys()
    if gone == "before its manifest":
        kill_store()
    open_checkpoint(rank1, d, 10, rank=1)
    rank1.commit(rank1.get_commit_info())
    if gone == "before the decision":
        deadline = time.monotonic() + 30
        while kv.num_keys() == keys:  # its summary is in the store, rank 0 could decide now
            assert time.monotonic() < deadline, "rank 1 never published its manifest"
            time.sleep(0.02)
        kill_store()
    with caplog.at_level(logging.INFO):
        assert rank1.flush(30), "rank 1's checkpoint still pending 30 s after the store went"
        assert timed_cleanup(rank1) < 5
    assert records.read_manifests(os.path.join(d, "global_step10")).keys() == {1}
    assert records.read_latest(d) is None and "its part here stays, uncommitted on this node" in caplog.text


class DiesAfterSetting:
    """A real store client whose server is killed right after a key ending in ``suffix`` is set through it."""

    def __init__(self, kv, suffix: str, kill):
        self._kv, self._suffix, self._kill = kv, suffix, kill

    def set(self, key, value):
        self._kv.set(key, value)
        if key.endswith(self._suffix):
            self._kill()

    def __getattr__(self, name):
        return getattr(self._kv, name)


def test_rank_0_that_loses_the_store_after_announcing_a_commit_keeps_its_part(tmp_path, store_process, caplog):
    """The other ranks may have read the decision and committed their parts: rank 0's part may be what a
    recovery needs, as a follower's is."""
    port, kill_store = store_process
    dirs = [str(tmp_path / f"node{n}") for n in (0, 1)]
    engines = []
    for rank, d in enumerate(dirs):
        kv = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=10))
        if rank == 0:
            kv = DiesAfterSetting(kv, "/decision", kill_store)
        cfg = config(d, storage="node_local", commit_timeout_s=600.0)
        engines.append(create_engine(cfg, rank, 2, layout=layout.make_layout(cfg, rank, 2, kv=kv, nodes=TWO_NODES)))
    for rank, (eng, d) in enumerate(zip(engines, dirs)):
        open_checkpoint(eng, d, 10, rank=rank)
        eng.commit(eng.get_commit_info())
    with caplog.at_level(logging.INFO):
        assert engines[0].flush(30), "rank 0's checkpoint still pending 30 s after the store went"
        for eng in reversed(engines):
            assert timed_cleanup(eng) < 15
    assert records.read_manifests(os.path.join(dirs[0], "global_step10")).keys() == {0}
    assert "its part here stays, uncommitted on this node" in caplog.text


def test_shared_storage_not_shared_is_refused_naming_the_setting(tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint.storage is shared.*rank 0 sees the files of ranks \[0\] only.*node_local"):
        topology.check_nodes("shared", "/ckpt", [[0], [1]], "run")
    assert topology.check_nodes("shared", "/ckpt", [[0, 1], [0, 1]], "run").groups == ((0, 1),)
    nodes = topology.check_nodes("node_local", "/ckpt", [[0, 1], [0, 1], [2, 3], [2, 3]], "run")
    assert nodes.groups == ((0, 1), (2, 3)) and nodes.leads(2) and not nodes.leads(3)
    with pytest.raises(ConfigError, match="checkpoint.storage.*rank 1 sees the files of ranks \\[0, 1\\]"):
        topology.check_nodes("node_local", "/ckpt", [[0], [0, 1]], "run")


def test_storage_node_local_refuses_the_synchronous_strategy(tmp_path):
    with pytest.raises(ValueError, match="node_local needs an asynchronous strategy"):
        config(str(tmp_path), storage="node_local", strategy="torch")


def part(key, committed=True, problems=()):
    return {"key": key, "committed": committed, "world_size": 2, "ranks": None, "problems": list(problems)}


def test_agreement_takes_the_newest_checkpoint_every_rank_holds_own_copy_or_replica():
    reports = [
        {"parts": {0: {"a": part((5, 1)), "b": part((10, 1)), "c": part((15, 1), committed=False)}}, "replicas": {}},
        # Rank 1's node lost its directory; rank 0's node keeps rank 1's replicas of a and b.
        {"parts": {}, "replicas": {}},
    ]
    reports[0]["replicas"] = {1: {"a": part((5, 1)), "b": part((10, 1), problems=["damaged"])}}
    assert [(a.tag, a.sources) for a in agreement.agree(reports)] == [("a", {1: 0})]
    reports[0]["replicas"][1]["b"] = part((10, 1))
    # c committed where node 0 had not written its record yet
    reports[1]["parts"][1] = {"c": part((15, 1), committed=True)}
    reports[0]["replicas"][1]["c"] = part((15, 1))
    assert [(a.tag, a.sources) for a in agreement.agree(reports)] == [("a", {1: 0}), ("b", {1: 0}), ("c", {})]


def test_a_checkpoint_whose_every_part_is_sound_is_agreed_before_its_record_is_written():
    """A node killed while the replicas were on their way: no node wrote the record, every part stands."""
    reports = [{"parts": {0: {"a": part((5, 1)), "b": part((10, 1), committed=False)}}, "replicas": {}},
               {"parts": {1: {"a": part((5, 1)), "b": part((10, 1), committed=False)}}, "replicas": {}}]
    assert [a.tag for a in agreement.agree(reports)] == ["a", "b"]
    # Rank 0 gave b up for rank 1's part (its non-finite tensor, say): not loadable, not agreed.
    reports[1]["parts"][1]["b"] = part((10, 1), committed=False, problems=["non-finite values in fp32"])
    assert [a.tag for a in agreement.agree(reports)] == ["a"]


def test_progress_combines_every_node_s_journals_f_the_slowest():
    node0 = Progress({0: [Entry(i, 1.0, 0.0) for i in range(1, 13)]}, 12)
    node1 = Progress({1: [Entry(i, 1.0, 0.0) for i in range(1, 12)]}, 11, ("a problem",))
    combined = agreement.combine_progress([node0, node1])
    assert combined.reached == 11 and set(combined.entries) == {0, 1} and combined.problems == ("a problem",)
