"""Node-local checkpoints found by a job of another world size or rank numbering: each part comes from whichever
node keeps it (as its own or as a replica) to the nodes that load it; a manifest of model-states files alone
never counts as a part."""

import json
import os
import shutil

import torch.distributed as dist

from cpsr_ds.checkpoint.storage import agreement, catalog, layout, ondisk, replica, topology
from cpsr_ds.checkpoint.engines.factory import create_engine
from support.checkpoints import (MODEL, TWO_NODES, checkpoint, config, node_engines, optim,  # noqa: F401 (fixtures)
                                 states, two_nodes)


TAGS = ["global_step5", "global_step10"]


def manifest(d, tag, rank) -> dict:
    with open(os.path.join(d, tag, ondisk.manifest_name(rank))) as f:
        return json.load(f)


def test_a_two_rank_checkpoint_loads_on_one_rank_from_node_1_s_parts_and_replicas(two_nodes):  # noqa: F811
    node0, node1 = two_nodes
    shutil.rmtree(node0)  # node 0 lost; the job restarts as one rank on node 1's directory
    cfg = config(node1, storage="node_local")
    found = agreement.agreed_checkpoints(cfg)
    assert [(c.tag, c.world_size, c.full) for c in found] == [(tag, 2, True) for tag in TAGS]
    # Old rank 0's whole part came from the replica: the checkpoint verifies in full there, as DeepSpeed reads it.
    for c in catalog.list_checkpoints(node1):
        assert c.valid, c.problems
        assert manifest(node1, c.tag, 0)["files"].keys() == {MODEL, optim(0)}
    assert [c.tag for c in agreement.agreed_checkpoints(cfg)] == TAGS  # a second restart finds them in place


def test_swapped_rank_numbering_puts_each_rank_s_part_on_its_node(two_nodes, tmp_path):  # noqa: F811
    node0, node1 = two_nodes
    # Without replicas each part must come from the other node, over the channel a job of two nodes has.
    bare = [shutil.copytree(d, tmp_path / f"bare{n}", ignore=shutil.ignore_patterns(ondisk.REPLICAS))
            for n, d in enumerate(two_nodes)]
    reports = [agreement.holdings(str(d), rank, TWO_NODES) for rank, d in enumerate(reversed(bare))]
    moves = agreement.placement(agreement.agree(reports), TWO_NODES)
    assert {(m.owner, m.src, m.replica, m.dst) for m in moves} == {(0, 1, False, 0), (1, 0, False, 1)}

    dirs = [node1, node0]  # rank 0 now on node 1's directory, rank 1 on node 0's
    reports = [agreement.holdings(d, rank, TWO_NODES) for rank, d in enumerate(dirs)]
    agreed = agreement.agree(reports)
    assert [(a.tag, a.world_size) for a in agreed] == [(tag, 2) for tag in TAGS]
    moves = agreement.placement(agreed, TWO_NODES)
    # Each node keeps the other's replicas: copies on the node, no transfer, nothing to share (each node already
    # holds the other owner's whole part, model states included).
    assert sorted((m.tag, m.owner, m.src, m.replica, m.dst, m.only) for m in moves) == sorted(
        (tag, rank, rank, True, rank, False) for tag in TAGS for rank in (0, 1))
    for rank, d in enumerate(dirs):
        replica.restore(d, rank, TWO_NODES, moves)
    for rank, d in enumerate(dirs):
        for c in catalog.list_checkpoints(d, ranks={rank}):
            assert c.valid, c.problems
    assert [a.sources for a in agreement.agree([agreement.holdings(d, rank, TWO_NODES) for rank, d in enumerate(dirs)])] \
        == [{}, {}]


def test_model_states_shared_alone_are_not_a_part(two_nodes):  # noqa: F811
    node0, node1 = two_nodes
    tag = TAGS[-1]
    # What a restart at the same world size leaves on node 1: rank 0's model-states file, for DeepSpeed to read.
    replica.restore(node1, 1, TWO_NODES, [replica.Move(tag, 0, 1, True, 1, only=True)])
    shared = manifest(node1, tag, 0)
    assert shared[replica.PARTIAL] is True and list(shared["files"]) == [MODEL]
    shutil.rmtree(os.path.join(node1, ondisk.REPLICAS))
    shutil.rmtree(node0)
    # Node 1 holds rank 0's model states but not its optimizer partition: no checkpoint every rank's part of.
    assert agreement.holdings(node1, 0, topology.Nodes.single(1))["parts"].keys() == {1}
    assert agreement.agreed_checkpoints(config(node1, storage="node_local")) == []


def test_a_tag_written_again_on_the_smaller_world_is_the_newer_checkpoint(two_nodes):  # noqa: F811
    node0, node1 = two_nodes
    shutil.rmtree(node0)
    cfg = config(node1, storage="node_local")
    assert [c.tag for c in agreement.agreed_checkpoints(cfg)] == TAGS
    # The one-rank job resumed from global_step5 (say) and wrote global_step10 again: rank 1's part of the
    # two-rank global_step10 is still under the tag, rank 0's in the replicas.
    one = layout.make_layout(cfg, 0, 1, kv=dist.HashStore(), nodes=topology.Nodes.single(1))
    eng = create_engine(cfg, 0, 1, attempt=1, layout=one)
    checkpoint(eng, node1, 10, states(n=100))
    assert eng.flush(30)
    eng.cleanup()
    found = agreement.agreed_checkpoints(cfg)
    assert [(c.tag, c.world_size, c.attempt) for c in found] == [("global_step5", 2, 0), ("global_step10", 1, 1)]
    assert manifest(node1, "global_step10", 0)["attempt"] == 1  # not replaced by the earlier attempt's replica
