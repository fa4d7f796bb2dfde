"""``python -m cpsr_ds inspect`` on node-local directories: each node's ranks, their newest valid parts and
replicas, and the checkpoint c and failure point f the ranks would agree on, also with a node's directory lost."""

import json
import os
import shutil


from cpsr_ds.cli import main
from cpsr_ds.checkpoint.storage import ondisk, topology
from cpsr_ds.node_view import held_ranks
from support.checkpoints import node_engines, start_token, two_nodes  # noqa: F401 (fixtures)


def inspect(capsys, *dirs):
    """The table and the JSON report of ``inspect DIRS``."""
    assert main(["inspect", *dirs]) == 0
    table = capsys.readouterr().out
    assert main(["inspect", *dirs, "--json"]) == 0
    return table, json.loads(capsys.readouterr().out)


def test_every_node_s_table_its_replicas_and_the_agreed_c_and_f(two_nodes, capsys):
    table, report = inspect(capsys, *two_nodes)
    node0, node1 = report["nodes"]
    assert (node0["ranks"], node1["ranks"]) == ([0], [1]) and report["missing"] == []
    for node in (node0, node1):
        # Its own parts are all a node holds: each checkpoint is valid there, the newest loads.
        assert [(r["tag"], r["valid"]) for r in node["checkpoints"]] == [("global_step5", True), ("global_step10", True)]
        assert node["usable"] == node["latest"] == "global_step10"
    assert node0["parts"] == [{"rank": 0, "newest_valid": "global_step10", "replica_node": 1, "replica_dir": two_nodes[1],
                               "replica_newest_valid": "global_step10"}]
    assert node1["replicas_kept"] == {"0": "global_step10"} and node0["replicas_kept"] == {"1": "global_step10"}
    assert node0["journal_iteration"] == 12 and node1["journal_iteration"] == 11
    assert report["agreed"] == {"checkpoint": "global_step10", "iteration": 10, "from_replica": {}, "reached": 11,
                                "problems": []}
    assert "agreed: checkpoint global_step10 (c = 10)" in table and "journals reached iteration 11 (f)" in table


def test_a_lost_node_s_ranks_come_from_the_newest_sound_replica(two_nodes, capsys):
    node0, node1 = two_nodes
    os.truncate(os.path.join(node1, ondisk.REPLICAS, "global_step10", "mp_rank_00_model_states.pt"), 10)
    _, report = inspect(capsys, node0, node1)
    assert report["nodes"][0]["parts"][0]["replica_newest_valid"] == "global_step5"
    assert report["agreed"]["checkpoint"] == "global_step10"  # rank 0's own part is still there

    shutil.rmtree(node0)
    table, report = inspect(capsys, node0, node1)
    assert report["missing"] == [node0] and [n["ranks"] for n in report["nodes"]] == [[1]]
    # Rank 0's newest sound part is its replica of global_step5, kept by rank 1; f from rank 1's journal alone.
    assert report["agreed"] == {"checkpoint": "global_step5", "iteration": 5, "from_replica": {"0": 1}, "reached": 11,
                                "problems": []}
    assert "rank 0's part from the replica on rank 1" in table and f"== {node0}: missing" in table


def test_one_node_s_directory_names_its_ranks_and_asks_for_the_others(two_nodes, capsys):
    table, report = inspect(capsys, two_nodes[1])
    assert report["storage"] == "node_local" and report["ranks"] == [1] and report["world_size"] == 2
    assert report["usable"] == "global_step10" and report["agreed"] is None
    assert report["parts"][0]["replica_dir"] is None and report["replicas_kept"] == {"0": "global_step10"}
    assert "node-local directory of node 1: ranks [1] of 2" in table and "node 0's directory not given" in table
    assert "need every node's directory" in table


def test_a_directory_s_ranks_are_its_newest_start_s_and_one_every_rank_started_in_is_shared(two_nodes, capsys):
    node0 = two_nodes[0]
    start_token(node0, 1, run="run-0")  # an older start that saw rank 1's files here too
    os.utime(os.path.join(node0, topology.TOKENS, "rank00001"), (1, 1))
    assert held_ranks(node0) == [0]
    shutil.rmtree(os.path.join(node0, ondisk.REPLICAS))
    _, report = inspect(capsys, node0)
    # Every rank started here and no replicas: one shared directory, where rank 1's part is missing.
    assert "storage" not in report and not any(r["valid"] for r in report["checkpoints"])
    assert "rank 1 manifest" in report["checkpoints"][-1]["problems"][0]
