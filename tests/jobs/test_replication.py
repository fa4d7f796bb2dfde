"""node_local replication: a checkpoint counts as committed only once every rank's part is on the next node too."""

import json
import os
import subprocess
import sys
import time

from benchmarks.common.processes import JOB_ENV, free_port
from conftest import ROOT
from cpsr_ds.checkpoint.storage import catalog, ondisk, records

SCRIPT = os.path.join(ROOT, "tests", "jobs", "replication_node.py")


def run_ranks(tmp_path, lose_at: int) -> tuple[list[str], list[int], list[str]]:
    """Both ranks of replication_node.py; (node directories, exit codes, outputs)."""
    dirs = [str(tmp_path / f"node{n}") for n in (0, 1)]
    port = free_port()
    procs = [subprocess.Popen([sys.executable, SCRIPT, str(rank), str(port), *dirs, str(lose_at)],
                              env={**os.environ, **JOB_ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for rank in (0, 1)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=120)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    return dirs, [proc.returncode for proc in procs], outputs


def replica_of(node_dir: str, owner: int, tag: str) -> catalog.Checkpoint:
    found = {c.tag: c for c in catalog.list_checkpoints(os.path.join(node_dir, ondisk.REPLICAS), ranks={owner})}
    return found[tag]


def test_a_committed_checkpoint_is_on_the_next_node_when_the_commit_returns(tmp_path):
    dirs, codes, outputs = run_ranks(tmp_path, lose_at=0)
    assert codes == [0, 0], outputs
    assert [json.loads(out.strip().splitlines()[-1])["flushed"] for out in outputs] == [[True, True]] * 2, outputs
    for rank, d in enumerate(dirs):
        assert records.read_latest(d) == "global_step10"
        assert replica_of(dirs[1 - rank], rank, "global_step10").valid


def test_a_node_lost_while_replicating_leaves_the_checkpoint_uncommitted_and_the_last_commit_whole(tmp_path):
    t0 = time.monotonic()
    dirs, codes, outputs = run_ranks(tmp_path, lose_at=10)
    assert codes == [0, 3], outputs
    # Replication broke, so rank 0 ends without waiting for the lost rank to release the store (commit_timeout_s 240):
    # both processes start, train and end in 5-15 s, 43 s seen at a load average of 15.
    assert time.monotonic() - t0 < 100, outputs[0]
    # Rank 0's part of global_step10 reached no other node: committing it would promise what losing
    # node 0 could not keep.
    assert records.read_latest(dirs[0]) == "global_step5", outputs[0]
    assert records.read_commit(os.path.join(dirs[0], "global_step10")) is None
    assert "not replicated to the next node" in outputs[0]
    # Its part stays, for a recovery that finds every rank's part sound; global_step5 is whole on both nodes.
    assert sorted(records.read_manifests(os.path.join(dirs[0], "global_step10"))) == [0]
    assert replica_of(dirs[1], 0, "global_step5").valid and replica_of(dirs[0], 1, "global_step5").valid
