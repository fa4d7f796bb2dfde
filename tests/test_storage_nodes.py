"""Two nodes on one machine, each with a checkpoint directory of its own: a node's directory lost between a
failure and the restart, or the whole node, loses no committed checkpoint, its ranks' parts come back from the
replicas."""

import json
import os
import shutil
import subprocess
import sys

from conftest import ROOT, finish, free_port, tiny_config
from cpsr_ds.checkpoint import store
from cpsr_ds.recovery import read_reports
from cpsr_ds.rundir import recorded_attempt

KILL_AT = 17
INTERVAL = 6
ITERATIONS = 24


def start_node(node: int, config_path, port: int, ckpt_dir, log_path, world_size: int = 2):
    """Node ``node``'s one process, started as its own launcher would (rank = node)."""
    env = dict(os.environ, RANK=str(node), LOCAL_RANK="0", WORLD_SIZE=str(world_size), LOCAL_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    command = [sys.executable, os.path.join(ROOT, "launch", "train_gpt.py"), "--deepspeed_config", str(config_path),
               "--checkpoint-dir", str(ckpt_dir), "--train-iters", str(ITERATIONS), "--eval-interval", "1000",
               "--valid-sequences", "16"]
    with open(log_path, "a") as out:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def run_nodes(tmp_path, config_path, dirs, name) -> list[int]:
    port = free_port()
    procs = [start_node(n, config_path, port, dirs[n], tmp_path / f"{name}-node{n}.log") for n in (0, 1)]
    try:
        return [proc.wait(timeout=240) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()


def node_local_config(run_dir, kill_rank: int, **shape) -> dict:
    """Node-local checkpoints every INTERVAL, rank ``kill_rank`` killed after KILL_AT, recovery by recompute."""
    config = tiny_config(run_dir, **shape, faults={"kill_rank": kill_rank, "kill_at_iteration": KILL_AT},
                         recovery={"mode": "recompute"})
    config["cpsr"]["checkpoint"].update(interval=INTERVAL, storage="node_local")
    return config


def write_config(tmp_path, config: dict):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return path


def logs(tmp_path, name) -> str:
    return "".join((tmp_path / f"{name}-node{n}.log").read_text()[-3000:] for n in (0, 1))


def test_a_node_s_directory_lost_after_a_failure_its_ranks_restore_from_the_replicas(tmp_path):
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    config_path = write_config(tmp_path, node_local_config(dirs[0], stages=2, kill_rank=1))

    codes = run_nodes(tmp_path, config_path, dirs, "first")
    assert codes[1] == -9 and codes[0] != 0, logs(tmp_path, "first")
    committed = store.read_latest(str(dirs[1]))
    assert committed == store.read_latest(str(dirs[0])) == f"global_step{KILL_AT // INTERVAL * INTERVAL}", \
        logs(tmp_path, "first")
    # Rank 0's part of it lives on node 1 too, where node 0's directory is about to be lost: replicated after
    # the commit, in the iterations before the kill.
    replicas = {c.tag: c for c in store.list_checkpoints(str(dirs[1] / store.REPLICAS), ranks={0})}
    assert replicas[committed].valid, replicas

    shutil.rmtree(dirs[0])
    codes = run_nodes(tmp_path, config_path, dirs, "second")
    assert codes == [0, 0], logs(tmp_path, "second")
    (report,) = read_reports(str(dirs[0]))
    assert report.method == "recompute" and report.checkpoint == store.tag_iteration(committed), report
    assert report.reached in (KILL_AT - 1, KILL_AT), report
    assert "restored from the replica" in (tmp_path / "second-node0.log").read_text()
    assert [recorded_attempt(str(d)) for d in dirs] == [2, 2]  # node 0 counts on from node 1's record
    # Node 0 trains on and commits again, with its own latest.
    assert store.read_latest(str(dirs[0])) == store.read_latest(str(dirs[1])) == f"global_step{ITERATIONS}"


def test_a_job_restarted_on_the_node_left_resumes_from_its_parts_and_replicas(tmp_path):
    """Data parallel with ZeRO-1: node 0 goes, the job restarts as one rank on node 1's directory."""
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    config = node_local_config(dirs[0], stages=1, zero_stage=1, kill_rank=0)
    config_path = write_config(tmp_path, config)
    codes = run_nodes(tmp_path, config_path, dirs, "first")
    assert codes[0] == -9 and codes[1] != 0, logs(tmp_path, "first")
    assert store.read_latest(str(dirs[1])) == f"global_step{KILL_AT // INTERVAL * INTERVAL}", logs(tmp_path, "first")
    # A commit waits for the replicas, so node 1 keeps rank 0's part of the newest commit (or of a newer
    # checkpoint whose replication was done when node 0 went).
    replicated = [c.tag for c in store.list_checkpoints(str(dirs[1] / store.REPLICAS), ranks={0}) if c.valid]
    assert replicated and store.tag_iteration(replicated[-1]) >= KILL_AT // INTERVAL * INTERVAL, logs(tmp_path, "first")

    del config["cpsr"]["faults"]  # its marker was on the node that went
    write_config(tmp_path, config)
    log_path = tmp_path / "shrunk.log"
    proc = start_node(0, config_path, free_port(), dirs[1], log_path, world_size=1)
    assert finish([proc], 240) == [0], log_path.read_text()[-3000:]
    *_, report = read_reports(str(dirs[1]))
    assert (report.method, report.checkpoint) == ("recompute", store.tag_iteration(replicated[-1])), report
    assert report.reached in (KILL_AT - 1, KILL_AT) and "data-parallel degree 2 -> 1" in report.world_change, report
    assert "restored from this node's replicas" in log_path.read_text()
    assert store.read_latest(str(dirs[1])) == f"global_step{ITERATIONS}"
