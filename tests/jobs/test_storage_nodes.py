"""Two nodes on one machine, each with a checkpoint directory of its own: a whole node lost (its process, its
shared memory and its directory), or a node the job restarts without, loses no committed checkpoint, its ranks'
parts come back from the replicas."""

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys

from functools import partial

import pytest

from benchmarks.common.processes import finish, free_port, tiny_config
from conftest import ROOT, run_job
from cpsr_ds.checkpoint.storage import agreement, catalog, ondisk, records
from cpsr_ds.checkpoint.capture.exiting import EXIT_RESTART_CANNOT_HELP
from cpsr_ds.config import CPSRConfig
from cpsr_ds.recovery import REPORTS, read_reports
from cpsr_ds.runtime.rundir import recorded_attempt

KILL_AT = 17
INTERVAL = 6
ITERATIONS = 24


def start_node(node: int, config_path, port: int, ckpt_dir, log_path, world_size: int = 2):
    """Node ``node``'s one process, started as its own launcher would (rank = node)."""
    env = dict(os.environ, RANK=str(node), LOCAL_RANK="0", WORLD_SIZE=str(world_size), LOCAL_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    command = [sys.executable, os.path.join(ROOT, "examples", "gpt", "train_gpt.py"), "--deepspeed_config", str(config_path),
               "--checkpoint-dir", str(ckpt_dir), "--train-iters", str(ITERATIONS), "--eval-interval", "1000",
               "--valid-sequences", "16"]
    with open(log_path, "a") as out:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def run_nodes(tmp_path, config_path, dirs, name) -> list[int]:
    """Both nodes' processes to their end; ``config_path``: one config, or one per node."""
    port = free_port()
    paths = config_path if isinstance(config_path, list) else [config_path] * 2
    procs = [start_node(n, paths[n], port, dirs[n], tmp_path / f"{name}-node{n}.log") for n in (0, 1)]
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


def write_config(tmp_path, config: dict, name: str = "ds_config"):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


def newest_commit(dirs) -> str:
    """The newest checkpoint either node's ``latest`` names: the kill comes KILL_AT - 12 = 5 iterations after
    global_step12 starts persisting, so on a busy machine its commit may not have come; global_step6's has."""
    tags = [tag for tag in (records.read_latest(str(d)) for d in dirs) if tag is not None]
    newest = max(tags, key=ondisk.tag_iteration, default=None)
    assert newest in {f"global_step{i}" for i in range(INTERVAL, KILL_AT, INTERVAL)}, tags
    return newest


def logs(tmp_path, name) -> str:
    return "".join((tmp_path / f"{name}-node{n}.log").read_text()[-3000:] for n in (0, 1))


@pytest.mark.serial  # with two workers no checkpoint had committed 11 iterations after the first began persisting
def test_a_whole_node_sigkilled_its_disk_and_memory_gone_the_job_recovers_from_storage_losing_no_commit(tmp_path):
    """Node 1 goes whole: its rank SIGKILLed (no dump), its shared memory (host snapshots) and its directory
    lost. Node 0's rank keeps its own snapshot and dump, which alone make no consistent state: the restart takes
    the newest checkpoint whole on node 0 (the newest commit or later), node 1's part of it from node 0's replicas."""
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    shm = [tmp_path / "node0-shm", tmp_path / "node1-shm"]
    config = node_local_config(dirs[0], stages=2, kill_rank=1)
    config["cpsr"]["checkpoint"]["memory_interval"] = 2

    def write_configs() -> list:
        for n in (0, 1):
            config["cpsr"]["checkpoint"]["survivor_dir"] = str(shm[n])
            write_config(tmp_path, config, f"ds_config_node{n}")
        return [tmp_path / f"ds_config_node{n}.json" for n in (0, 1)]

    paths = write_configs()
    codes = run_nodes(tmp_path, paths, dirs, "first")
    assert codes[1] == -9 and codes[0] != 0, logs(tmp_path, "first")
    committed = newest_commit(dirs)
    assert committed == records.read_latest(str(dirs[0])), logs(tmp_path, "first")
    # Rank 1's part of it lives on node 0 too: a commit waits for the replicas.
    replicas = {c.tag: c for c in catalog.list_checkpoints(str(dirs[0] / ondisk.REPLICAS), ranks={1})}
    assert replicas[committed].valid, replicas
    # A newer one may be whole on node 0 too, its replication done but not yet confirmed when node 1 went.
    newest_whole = max((c.tag for c in replicas.values() if c.valid), key=ondisk.tag_iteration)
    assert any(shm[0].rglob("*")), "node 0 took host snapshots"

    for lost in (dirs[1], shm[1]):
        shutil.rmtree(lost)
    del config["cpsr"]["faults"]  # its marker was on the node that went
    write_configs()
    codes = run_nodes(tmp_path, paths, dirs, "second")
    assert codes == [0, 0], logs(tmp_path, "second")
    *_, report = read_reports(str(dirs[0]))
    assert report.method == "recompute" and report.checkpoint == ondisk.tag_iteration(newest_whole), report
    assert report.sources is None, report  # node 0's own snapshot was not taken alone
    assert report.reached in (KILL_AT - 1, KILL_AT), report
    assert "restored from the replica" in (tmp_path / "second-node1.log").read_text()
    assert [recorded_attempt(str(d)) for d in dirs] == [2, 2]  # node 1 counts on from node 0's record
    # Node 1 trains on and commits again, with its own latest.
    assert records.read_latest(str(dirs[0])) == records.read_latest(str(dirs[1])) == f"global_step{ITERATIONS}"


def test_a_job_restarted_on_the_node_left_resumes_from_its_parts_and_replicas(tmp_path):
    """Data parallel with ZeRO-1: node 0 goes, the job restarts as one rank on node 1's directory."""
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    config = node_local_config(dirs[0], stages=1, zero_stage=1, kill_rank=0)
    config_path = write_config(tmp_path, config)
    codes = run_nodes(tmp_path, config_path, dirs, "first")
    assert codes[0] == -9 and codes[1] != 0, logs(tmp_path, "first")
    committed = newest_commit(dirs)
    # A commit waits for the replicas, so node 1 keeps rank 0's part of the newest commit, on node 0's record
    # too (rank 0 may have written it before node 1 heard of the decision), or of a newer checkpoint whose
    # replication was done when node 0 went.
    replicated = [c.tag for c in catalog.list_checkpoints(str(dirs[1] / ondisk.REPLICAS), ranks={0}) if c.valid]
    assert replicated and ondisk.tag_iteration(replicated[-1]) >= ondisk.tag_iteration(committed), logs(tmp_path, "first")

    del config["cpsr"]["faults"]  # its marker was on the node that went
    write_config(tmp_path, config)
    log_path = tmp_path / "shrunk.log"
    proc = start_node(0, config_path, free_port(), dirs[1], log_path, world_size=1)
    assert finish([proc], 240) == [0], log_path.read_text()[-3000:]
    *_, report = read_reports(str(dirs[1]))
    assert (report.method, report.checkpoint) == ("recompute", ondisk.tag_iteration(replicated[-1])), report
    assert report.reached in (KILL_AT - 1, KILL_AT) and "data-parallel degree 2 -> 1" in report.world_change, report
    assert "restored from this node's replicas" in log_path.read_text()
    assert records.read_latest(str(dirs[1])) == f"global_step{ITERATIONS}"


@contextlib.contextmanager
def small_tmpfs(path, size: str):
    """A file system of ``size`` mounted at ``path``: a disk that fills up."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def part_bytes(directory, tag: str, page: int = 4096) -> int:
    """What rank 0's part of ``tag`` in ``directory`` takes on a tmpfs: its files, manifest and commit record, each
    in whole pages."""
    files = records.read_manifests(str(directory / tag))[0]["files"].values()
    return sum(-(-entry["size"] // page) * page for entry in files) + 2 * page


def fill(path, leave: int) -> None:
    """Fill the file system of ``path``'s directory with ``path`` until ``leave`` bytes are free."""
    free = os.statvfs(path.parent).f_bavail * os.statvfs(path.parent).f_frsize
    with open(path, "wb") as f:
        try:
            f.write(bytes(max(0, free - leave)))
        except OSError as err:
            assert err.errno == errno.ENOSPC, err


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs (a disk that fills up) needs root")
@pytest.mark.serial  # with two workers only one checkpoint had replicated before the kill
def test_a_restart_that_cannot_restore_a_replica_onto_a_full_disk_stops_named_and_is_not_restarted(tmp_path):
    """As above, node 0 goes and the job restarts as one rank on node 1, now under DeepSpeed's launcher and
    resilient.sh, but node 1's disk is full: rank 0's parts cannot be copied from the replicas. The restart stops
    with RestartCannotHelp, whose exit status the launcher passes on and resilient.sh does not restart. With room
    for the older checkpoints only, recovery takes the newest of those (checked in this process); with space
    freed the next start restores every part and resumes from the newest, no commit lost."""
    with small_tmpfs(tmp_path / "disk", "64m") as disk:
        dirs = [tmp_path / "node0", disk / "node1"]
        config = node_local_config(dirs[0], stages=1, zero_stage=1, kill_rank=0)
        codes = run_nodes(tmp_path, write_config(tmp_path, config), dirs, "first")
        assert codes[0] == -9 and codes[1] != 0, logs(tmp_path, "first")
        replicated = [c.tag for c in catalog.list_checkpoints(str(dirs[1] / ondisk.REPLICAS), ranks={0}) if c.valid]
        assert replicated, logs(tmp_path, "first")

        del config["cpsr"]["faults"]
        config["cpsr"]["checkpoint"]["dir"] = str(dirs[1])
        fill(disk / "filler", leave=64 << 10)
        stopped = run_job(tmp_path, config, "--train-iters", ITERATIONS, supervised=True, nprocs=1, check=False)
        output = stopped.stdout + stopped.stderr
        assert stopped.returncode == EXIT_RESTART_CANNOT_HELP, output[-4000:]
        assert "RestartCannotHelp" in output and "ENOSPC" in output and "not restarting" in output, output[-4000:]
        assert "restart 1 of" not in output
        assert not (dirs[1] / REPORTS).exists()  # no resumption reported

        # Room for rank 0's parts of the older checkpoints alone: the newest is left out, the next newest serves.
        assert len(replicated) >= 2, replicated
        part = partial(part_bytes, dirs[1] / ondisk.REPLICAS)
        os.unlink(disk / "filler")
        fill(disk / "filler", leave=sum(map(part, replicated[:-1])) + part(replicated[-1]) // 2)
        restorable = agreement.agreed_checkpoints(CPSRConfig.parse_block(config["cpsr"]).checkpoint)
        assert [c.tag for c in restorable] == replicated[:-1], (restorable, replicated)

        os.unlink(disk / "filler")
        run_job(tmp_path, config, "--train-iters", ITERATIONS, supervised=True, nprocs=1)
        *_, report = read_reports(str(dirs[1]))
        assert (report.method, report.checkpoint) == ("recompute", ondisk.tag_iteration(replicated[-1])), report
        assert records.read_latest(str(dirs[1])) == f"global_step{ITERATIONS}"
