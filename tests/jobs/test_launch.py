"""A job-level restart of a two-node job on one machine: torch's elastic agent, and DeepSpeed's head-node launch over ssh."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from benchmarks.common.processes import (JOB_ENV, NoLoopbackSsh, elastic_env, elastic_launch, finish, free_port,
                                         kill_tagged, loopback_ssh, start, tiny_config)
from conftest import ROOT
from cpsr_ds.checkpoint.capture.exiting import EXIT_RESTART_CANNOT_HELP
from cpsr_ds.runtime.elastic import STORE_SETTING, restart_problem

TRAIN_ITERS = 14
# Six iterations after the checkpoint of 4 (interval 4): time for its commit on a machine the test shares with others.
KILL_AT = 10
BIN = os.path.dirname(sys.executable)


def test_a_shared_agent_store_with_restarts_is_refused_and_named():
    problem = restart_problem({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "2"})
    assert problem is not None and STORE_SETTING in problem and "connectFullMesh" in problem
    assert restart_problem({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_MAX_RESTARTS": "2"}) is None
    assert restart_problem({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert restart_problem({}) is None  # not under torchrun


def job_config(tmp_path):
    """A two-node job (one rank per node, two pipeline stages) whose rank 1 is killed after iteration KILL_AT."""
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, stages=2)
    config["cpsr"]["checkpoint"]["interval"] = 4
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return run_dir, ["examples/gpt/train_gpt.py", "--deepspeed_config", str(path), "--train-iters", str(TRAIN_ITERS),
                     "--eval-interval", "1000", "--valid-sequences", "16", "--kill-rank", "1",
                     "--kill-at-iteration", str(KILL_AT)]


def assert_recovered(run_dir, output: str) -> float:
    """The second attempt recovered the first's progress and finished; the restart's seconds (kill to resumed)."""
    reports = [json.loads(line) for line in (run_dir / "recovery.jsonl").read_text().splitlines()]
    assert [r["method"] for r in reports][0] == "fresh" and len(reports) == 2, reports
    assert reports[1]["method"] != "fresh" and reports[1]["reached"] == KILL_AT, reports[1]
    assert reports[1]["resume_iteration"] >= 4, reports[1]  # the checkpoint of iteration 4 was committed
    assert json.dumps({"final_iteration": TRAIN_ITERS, "recovery": reports[1]["method"]}) in output, output[-4000:]
    killed = os.path.getmtime(run_dir / "faults" / f"iteration-{KILL_AT}-rank-1")
    restart_s = os.path.getmtime(run_dir / "recovery.jsonl") - killed
    # The restart's parts, in order, from the new process's creation (after the kill) to the report.
    seconds = reports[1]["seconds"]
    # train_gpt.py marks its own imports, distributed init and model (cpsr_ds.mark_start).
    parts = ["process_start", "imports", "distributed_init", "model", "script", "run_directory", "deepspeed_init",
             "finding_state"]
    assert list(seconds)[:8] == parts and list(seconds)[-1] == "rest" and "reading" in seconds, seconds
    assert min(seconds.values()) >= 0 and sum(seconds.values()) <= restart_s + 0.05, (seconds, restart_s)
    return restart_s


def test_torchrun_elastic_agents_restart_every_node_and_the_job_recovers(tmp_path):
    run_dir, script = job_config(tmp_path)
    port = free_port()
    env = elastic_env(dict(os.environ, **JOB_ENV))
    procs = [start([*elastic_launch(2, 1, node, port, f"test-{port}", max_restarts=2), *script],
                   tmp_path / f"node{node}.log", env)
             for node in (0, 1)]
    codes = finish(procs, 300)
    output = "".join((tmp_path / f"node{node}.log").read_text() for node in (0, 1))
    assert codes == [0, 0], output[-6000:]
    print(f"torchrun: training resumed {assert_recovered(run_dir, output):.1f} s after rank 1 was killed")


# ---------------------------------------------------------------- deepspeed --hostfile over ssh


@pytest.fixture
def loopback_ssh_dir(tmp_path):
    """node0 and node1 served by an sshd on 127.0.0.1 (conftest.loopback_ssh); yields its directory."""
    directory = tmp_path / "ssh"
    directory.mkdir()
    try:
        with loopback_ssh(directory):
            yield directory
    except NoLoopbackSsh as reason:
        pytest.skip(str(reason))


def test_deepspeed_hostfile_over_ssh_under_resilient_restarts_the_whole_job(tmp_path, loopback_ssh_dir):
    run_dir, script = job_config(tmp_path)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    tag = uuid.uuid4().hex
    # The interpreter's bin/ last: a pip-installed ninja there is not the one the other jobs build DeepSpeed's shm op
    # with, and its other hash of the build commands would rebuild the op (about 40 s) here and again after.
    path = f"{loopback_ssh_dir / 'bin'}:{os.environ['PATH']}:{BIN}"
    # What the ranks on the other nodes need, as DeepSpeed's runner exports it to them over pdsh.
    env_file = tmp_path / "deepspeed_env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in {**JOB_ENV, "PATH": path, "CPSR_LAUNCH_TEST": tag}.items()))
    env = dict(os.environ, **JOB_ENV, PATH=path, DS_ENV_FILE=str(env_file))
    command = [os.path.join(ROOT, "launch", "resilient.sh"), "--max-restarts", "2", "--",
               os.path.join(BIN, "deepspeed"), "--hostfile", str(hostfile), "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), *script]
    try:
        codes = finish([start(command, tmp_path / "head.log", env)], 400)
    finally:
        kill_tagged(tag)
    output = (tmp_path / "head.log").read_text()
    assert codes == [0], output[-6000:]
    assert "node1: " in output and "[resilient] job finished after 1 restart(s)" in output, output[-6000:]
    print(f"deepspeed --hostfile over ssh: training resumed {assert_recovered(run_dir, output):.1f} s after rank 1 was killed")


# ---------------------------------------------------------------- the supervisor leaves nothing behind


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" in f.read().lower()
    except FileNotFoundError:
        return True


def test_resilient_takes_the_whole_attempt_down_when_stopped(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    attempt = tmp_path / "attempt.sh"
    attempt.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pid_file}\nwait\n")
    attempt.chmod(0o755)
    supervisor = subprocess.Popen([os.path.join(ROOT, "launch", "resilient.sh"), "--", str(attempt)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not (pid_file.exists() and pid_file.read_text().strip()):
            assert time.monotonic() < deadline, "the attempt did not start"
            time.sleep(0.05)
        grandchild = int(pid_file.read_text())
        supervisor.send_signal(signal.SIGTERM)
        output, _ = supervisor.communicate(timeout=10)
        # The supervisor signals the attempt's whole group and waits for its leader; the other
        # members got the signal at the same moment but may not have run yet on a loaded machine.
        deadline = time.monotonic() + 5
        while not _gone(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(grandchild), f"the attempt's process {grandchild} outlived the supervisor by 5 s"
        assert supervisor.returncode != 0 and "stopped by SIGTERM" in output, output
    finally:
        try:
            os.killpg(supervisor.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if pid_file.exists() and pid_file.read_text().strip() and os.path.exists(f"/proc/{int(pid_file.read_text())}"):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        supervisor.wait()



@pytest.mark.parametrize("error, attempts, code", [("exiting.RestartCannotHelp", 1, EXIT_RESTART_CANNOT_HELP),
                                                   ("RuntimeError", 3, 1)])
def test_resilient_restarts_a_failed_job_but_not_one_that_says_a_restart_cannot_help(tmp_path, error, attempts, code):
    """An uncaught RestartCannotHelp exits with EXIT_RESTART_CANNOT_HELP once the atexit handlers ran; resilient.sh
    stops there and says why, and restarts any other failure."""
    counter = tmp_path / "attempts"
    script = ("import atexit; from cpsr_ds.checkpoint.capture import exiting; exiting.install(); "
              f"open({str(counter)!r}, 'a').write('attempt '); atexit.register(print, 'atexit ran'); "
              f"raise {error}('no state left')")
    result = subprocess.run([os.path.join(ROOT, "launch", "resilient.sh"), "--max-restarts", "2", "--",
                             sys.executable, "-c", script], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                            capture_output=True, text=True, timeout=120)
    assert counter.read_text().split() == ["attempt"] * attempts, result.stderr
    assert result.returncode == code and "atexit ran" in result.stdout, result.stderr
    said = f"attempt 1 exited with code {code}: the job says a restart cannot help (see its last error); not restarting"
    assert (said in result.stderr) == (attempts == 1), result.stderr
