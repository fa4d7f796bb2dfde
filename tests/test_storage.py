"""Storage layouts: node-local directories commit through the job, each node keeps its own latest."""

import logging
import os

import pytest
import torch.distributed as dist

from cpsr_ds.checkpoint import exiting, layout, store
from cpsr_ds.checkpoint.factory import create_engine
from cpsr_ds.checkpoint.journal import Entry, Progress
from cpsr_ds.config import ConfigError
from test_checkpoint_engine import checkpoint, config, states
from test_exit import open_checkpoint, timed_cleanup

TWO_NODES = layout.Nodes(((0,), (1,)), run="test")


@pytest.fixture
def node_engines(tmp_path):
    """make(**kw): one engine per node, ranks 0 and 1, each on a directory of its own, talking through one store."""
    made = []
    kv = dist.HashStore()

    def make(**kw):
        dirs = [str(tmp_path / f"node{n}") for n in (0, 1)]
        for rank, d in enumerate(dirs):
            cfg = config(d, storage="node_local", **kw)
            made.append(create_engine(cfg, rank, 2, layout=layout.make_layout(cfg, rank, 2, kv=kv, nodes=TWO_NODES)))
        return dirs, made[-2:]

    yield make
    for eng in made:
        eng.cleanup()


def both(engines, dirs, step, st=None):
    for rank, (eng, d) in enumerate(zip(engines, dirs)):
        checkpoint(eng, d, step, st or states(n=100), rank=rank)
    assert all(eng.flush(30) for eng in engines)


def test_node_local_directories_commit_and_each_node_keeps_its_latest(node_engines):
    dirs, engines = node_engines()
    both(engines, dirs, 5)
    for rank, d in enumerate(dirs):
        assert store.read_latest(d) == "global_step5"
        (ckpt,) = store.list_checkpoints(d, ranks={rank})
        assert ckpt.valid and ckpt.committed
        # Only its own rank's part is on each node.
        assert sorted(store.read_manifests(os.path.join(d, "global_step5"))) == [rank]
    assert all(eng.stats.persisted == 1 and eng.stats.failed == 0 for eng in engines)


def test_shared_storage_on_node_local_directories_never_commits(tmp_path, caplog):
    """The reported failure: rank 0 looks for every manifest in its own directory."""
    dirs = [str(tmp_path / f"node{n}") for n in (0, 1)]
    engines = [create_engine(config(d, commit_timeout_s=0.5), rank, 2) for rank, d in enumerate(dirs)]
    for rank, (eng, d) in enumerate(zip(engines, dirs)):
        checkpoint(eng, d, 5, states(n=100), rank=rank)
    with caplog.at_level(logging.ERROR):
        assert all(eng.flush(30) for eng in engines)
    assert store.read_latest(dirs[0]) is None and "rank manifests [1] missing" in caplog.text
    for eng in engines:
        eng.cleanup()


def test_retention_runs_on_every_node(node_engines):
    dirs, engines = node_engines(keep_last=2)
    for step in range(1, 5):
        both(engines, dirs, step)
    for d in dirs:
        assert sorted(n for n in os.listdir(d) if n.startswith("global")) == ["global_step3", "global_step4"]
        assert store.read_latest(d) == "global_step4"


def test_a_part_given_up_on_one_node_is_given_up_on_every_node(node_engines, caplog):
    dirs, engines = node_engines()
    both(engines, dirs, 5)
    checkpoint(engines[0], dirs[0], 10, states(n=100), rank=0)
    checkpoint(engines[1], dirs[1], 10, states(scale=float("nan"), n=100), rank=1)
    with caplog.at_level(logging.ERROR):
        assert all(eng.flush(30) for eng in engines)
    assert "non-finite" in caplog.text
    for d in dirs:
        assert store.read_latest(d) == "global_step5" and not os.path.exists(os.path.join(d, "global_step10"))


def test_a_failing_follower_leaves_within_the_grace_and_keeps_its_part(node_engines, monkeypatch):
    monkeypatch.setattr(exiting, "_reason", None)
    dirs, (rank0, rank1) = node_engines(commit_timeout_s=600.0)
    open_checkpoint(rank1, dirs[1], 10, rank=1)
    rank1.commit(rank1.get_commit_info())  # rank 0 died before deciding on global_step10
    exiting.mark("RuntimeError in train_batch: Connection closed by peer")
    assert timed_cleanup(rank1) < exiting.EXIT_GRACE_S + 1
    assert store.read_manifests(os.path.join(dirs[1], "global_step10")).keys() == {1}


def test_shared_storage_not_shared_is_refused_naming_the_setting(tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint.storage is shared.*rank 0 sees the files of ranks \[0\] only.*node_local"):
        layout.check_nodes("shared", "/ckpt", [[0], [1]], "run")
    assert layout.check_nodes("shared", "/ckpt", [[0, 1], [0, 1]], "run").groups == ((0, 1),)
    nodes = layout.check_nodes("node_local", "/ckpt", [[0, 1], [0, 1], [2, 3], [2, 3]], "run")
    assert nodes.groups == ((0, 1), (2, 3)) and nodes.leads(2) and not nodes.leads(3)
    with pytest.raises(ConfigError, match="checkpoint.storage.*rank 1 sees the files of ranks \\[0, 1\\]"):
        layout.check_nodes("node_local", "/ckpt", [[0], [0, 1]], "run")


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
    assert [(a.tag, a.sources) for a in layout.agree(reports)] == [("a", {1: 0})]
    reports[0]["replicas"][1]["b"] = part((10, 1))
    # c committed where node 0 had not written its record yet
    reports[1]["parts"][1] = {"c": part((15, 1), committed=True)}
    reports[0]["replicas"][1]["c"] = part((15, 1))
    assert [(a.tag, a.sources) for a in layout.agree(reports)] == [("a", {1: 0}), ("b", {1: 0}), ("c", {})]


def test_a_checkpoint_whose_every_part_is_sound_is_agreed_before_its_record_is_written():
    """A node killed while the replicas were on their way: no node wrote the record, every part stands."""
    reports = [{"parts": {0: {"a": part((5, 1)), "b": part((10, 1), committed=False)}}, "replicas": {}},
               {"parts": {1: {"a": part((5, 1)), "b": part((10, 1), committed=False)}}, "replicas": {}}]
    assert [a.tag for a in layout.agree(reports)] == ["a", "b"]
    # Rank 0 gave b up for rank 1's part (its non-finite tensor, say): not loadable, not agreed.
    reports[1]["parts"][1]["b"] = part((10, 1), committed=False, problems=["non-finite values in fp32"])
    assert [a.tag for a in layout.agree(reports)] == ["a"]


def test_progress_combines_every_node_s_journals_f_the_slowest():
    node0 = Progress({0: [Entry(i, 1.0, 0.0) for i in range(1, 13)]}, 12)
    node1 = Progress({1: [Entry(i, 1.0, 0.0) for i in range(1, 12)]}, 11, ("a problem",))
    combined = layout.combine_progress([node0, node1])
    assert combined.reached == 11 and set(combined.entries) == {0, 1} and combined.problems == ("a problem",)
