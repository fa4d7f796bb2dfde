import base64
import contextlib
import glob
import importlib.util
import json
import os
import pathlib
import re
import signal
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Every job's processes share the machine's cores: one thread each (the ranks inherit it).
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, ROOT)
# Tests share fixtures across tiers by importing each other's modules.
for _tier in ("unit", "jobs", "benchmarks"):
    sys.path.insert(0, os.path.join(ROOT, "tests", _tier))

# What every process of a multi-process job started by hand needs.
JOB_ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1"}

# Small enough that a 2-process run takes seconds, big enough to learn something.
TEST_MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64}


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (the benchmarks directory on the import path, for their own imports)."""
    benchmarks = os.path.join(ROOT, "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    spec = importlib.util.spec_from_file_location(name, os.path.join(benchmarks, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def not_failing():
    """Each test starts in a process not marked failing: the mark (exiting.py) is per process, and a test that
    raised out of train_batch would otherwise shorten the exit waits of the next test on the same worker."""
    from cpsr_ds.checkpoint.capture import exiting
    exiting._reason = None
    yield


@pytest.fixture
def shm_path(tmp_path):
    """A fresh directory in shared memory (/dev/shm, where survivor dumps and host snapshots go by default),
    removed after the test; ``tmp_path`` where there is none. On disk, their durable writes wait for a disk the
    other tests share, and a snapshot still being written when the next one is due is skipped."""
    if not os.path.isdir("/dev/shm"):
        yield tmp_path
        return
    path = tempfile.mkdtemp(prefix="cpsr-test-", dir="/dev/shm")
    try:
        yield pathlib.Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_on_random_tokens(engine, iterations: int) -> None:
    """``iterations`` of the tiny GPT (TEST_MODEL) on random tokens, inputs as labels: the same for every engine."""
    import torch

    from examples.gpt.model import GPTConfig

    gpt = GPTConfig(**TEST_MODEL)
    gen = torch.Generator().manual_seed(0)
    shape = (engine.train_micro_batch_size_per_gpu(), gpt.seq_length)
    for _ in range(iterations):
        engine.train_batch(iter([(torch.randint(0, gpt.vocab_size, shape, generator=gen),) * 2
                                 for _ in range(engine.gradient_accumulation_steps())]))


def tiny_config(run_dir, stages=2, zero_stage=0, **cpsr) -> dict:
    with open(os.path.join(ROOT, "configs", "gpt_tiny_cpu.json")) as f:
        config = json.load(f)
    config.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    config["pipeline"] = {"stages": stages}
    config["zero_optimization"] = {"stage": zero_stage}
    config["gpt"] = dict(TEST_MODEL)
    config["cpsr"] = {"checkpoint": {"dir": str(run_dir), "interval": 10}, **cpsr}
    return config


def run_job(tmp_path, config: dict, *args, supervised: bool = False, nprocs: int = 2, timeout: int = 300,
            script: str = os.path.join(ROOT, "examples", "gpt", "train_gpt.py"), env: dict | None = None, check: bool = True):
    """Launch ``script`` (default examples/gpt/train_gpt.py) under DeepSpeed's launcher (and the supervisor).

    A supervised job goes through DeepSpeed's runner, ``deepspeed --num_gpus N``, as the README's command does.
    Others start the runner's per-node launcher, ``deepspeed.launcher.launch``, as the runner starts it on one node:
    the runner adds nothing else there but an interpreter start, seconds per job over dozens of jobs. With
    ``check`` a failed job fails the test; the result is returned either way.
    """
    config_path = tmp_path / f"ds_config_{free_port()}.json"
    config_path.write_text(json.dumps(config))
    port = free_port()
    if supervised:
        launcher = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", str(nprocs),
                    "--master_port", str(port)]
    else:
        world_info = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(nprocs))}).encode()).decode()
        launcher = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}",
                    "--master_addr=127.0.0.1", f"--master_port={port}"]
    command = [*launcher, script, "--deepspeed_config", str(config_path), "--valid-sequences", "16", *map(str, args)]
    if supervised:
        command = [os.path.join(ROOT, "launch", "resilient.sh"), "--max-restarts", "2", "--", *command]
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1", **(env or {}))
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        pytest.fail(f"job failed with exit code {result.returncode}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    # Every rank, killed ones included, released DeepSpeed's shared-memory buffer at start.
    assert result.returncode != 0 or not glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"), "a job left its /dev/shm buffers behind"
    return result


def probe_rows(stdout: str) -> list[dict]:
    """tests/jobs/end_probe.py's row of each rank (another rank's unfinished line may run into it)."""
    return [json.loads(row) for row in re.findall(r"probe (\{[^{}]*\})", stdout)]


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
