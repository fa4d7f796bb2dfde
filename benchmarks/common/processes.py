"""Jobs the benchmarks and the job tests start by hand: the tiny GPT's config, a free port, a command in a session of
its own and its reaping, the ranks started over ssh, and two nodes served by an sshd on 127.0.0.1."""

from __future__ import annotations

import base64
import contextlib
import glob
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

from benchmarks.common.paths import ROOT
from cpsr_ds.runtime.elastic import STORE_SETTING

# What every process of a multi-process job started by hand needs.
JOB_ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1"}

# Small enough that a 2-process run takes seconds, big enough to learn something.
TEST_MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64}


def tiny_config(run_dir, stages=2, zero_stage=0, **cpsr) -> dict:
    """configs/gpt_tiny_cpu.json at TEST_MODEL's size, ``stages`` pipeline stages, checkpoints in ``run_dir``."""
    with open(os.path.join(ROOT, "configs", "gpt_tiny_cpu.json")) as f:
        config = json.load(f)
    config.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    config["pipeline"] = {"stages": stages}
    config["zero_optimization"] = {"stage": zero_stage}
    config["gpt"] = dict(TEST_MODEL)
    config["cpsr"] = {"checkpoint": {"dir": str(run_dir), "interval": 10}, **cpsr}
    return config


def local_launch(nprocs: int, port: int) -> list[str]:
    """DeepSpeed's per-node launcher for ``nprocs`` ranks on this machine, as ``deepspeed --num_gpus N`` starts it
    (without the runner's own interpreter start); the training script and its arguments follow."""
    world = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(nprocs))}).encode()).decode()
    return [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}",
            "--master_addr=127.0.0.1", f"--master_port={port}"]


def elastic_launch(nnodes: int, nproc: int, node_rank: int, port: int, run_id: str, max_restarts: int) -> list[str]:
    """torchrun on this machine as node ``node_rank`` of ``nnodes``, its agent restarting the workers up to
    ``max_restarts`` times on a c10d rendezvous on 127.0.0.1:``port``; the training script and its arguments
    follow. Run it under :func:`elastic_env`."""
    return [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nnodes", str(nnodes), "--nproc-per-node",
            str(nproc), "--node_rank", str(node_rank), "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id]


def elastic_env(env: dict) -> dict:
    """``env`` with the setting that gives each of torchrun's restart rounds its own store
    (cpsr_ds.runtime.elastic), which a restarted worker needs."""
    return dict(env, **dict([STORE_SETTING.split("=")]))


def remove_shm_buffers(port: int) -> None:
    """DeepSpeed's shared-memory allreduce buffers of the job on ``port``, which a killed rank leaves behind."""
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command, log_path, env):
    """``command`` in a session of its own (so that :func:`finish` can kill all it started), output to ``log_path``."""
    with open(log_path, "w") as out:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def finish(procs, timeout_s):
    """Wait for every process; on a timeout, or once done, kill what is left of each one's process group."""
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs:
            proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return [proc.returncode for proc in procs]


def kill_tagged(tag: str) -> None:
    """SIGKILL the processes whose environment holds ``CPSR_LAUNCH_TEST=tag``: remote launchers and ranks started
    over ssh, in sessions of their own."""
    needle = f"CPSR_LAUNCH_TEST={tag}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    os.kill(int(pid), signal.SIGKILL)
        except (OSError, PermissionError):
            pass


class NoLoopbackSsh(Exception):
    """Nothing here can serve a launch over ssh (no pdsh, no sshd); the message says what is missing."""


@contextlib.contextmanager
def loopback_ssh(directory: pathlib.Path):
    """node0 and node1 served by an sshd on 127.0.0.1 (launch/loopback_ssh.sh) for the block; yields ``directory``,
    whose bin/ holds the ssh to put first on PATH. Raises NoLoopbackSsh where pdsh or sshd is missing."""
    if shutil.which("pdsh") is None:
        raise NoLoopbackSsh("pdsh is not installed (apt-get install pdsh): DeepSpeed's multi-node runner launches over it")
    sshd = subprocess.Popen([os.path.join(ROOT, "launch", "loopback_ssh.sh"), str(directory), str(free_port())],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    ssh = [str(directory / "bin" / "ssh"), "node1", "true"]
    try:
        deadline = time.monotonic() + 20
        while True:
            if sshd.poll() is not None:
                reason = sshd.stderr.read().decode().strip()
                if sshd.returncode == 3:
                    raise NoLoopbackSsh(f"no sshd to serve the nodes over ssh: {reason}")
                raise RuntimeError(f"launch/loopback_ssh.sh exited with {sshd.returncode}: {reason}")
            if (directory / "bin" / "ssh").exists() and subprocess.run(ssh, capture_output=True, timeout=10).returncode == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("sshd on 127.0.0.1 did not accept the key of launch/loopback_ssh.sh within 20 s")
            time.sleep(0.2)
        yield directory
    finally:
        os.killpg(sshd.pid, signal.SIGTERM)
        sshd.wait(10)
