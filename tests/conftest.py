"""What every tier shares: the repository's root, each test's process state reset, a fresh directory in shared
memory, the tiny GPT trained on random tokens, and a multi-process job launched as a user launches one.

Helpers and fixtures that only some modules share are in ``support/``; the tiny GPT's config and the processes a
test starts by hand are the benchmarks' too (``benchmarks.common.processes``)."""

import base64
import glob
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from benchmarks.common.processes import TEST_MODEL, free_port
from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Every job's processes share the machine's cores: one thread each (the ranks inherit it).
os.environ.setdefault("OMP_NUM_THREADS", "1")


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


def train_on_random_tokens(engine, iterations: int, between=None) -> None:
    """``iterations`` of the tiny GPT (TEST_MODEL) on random tokens, inputs as labels: the same for every engine;
    ``between()``, where given, after each iteration."""
    import torch

    from examples.gpt.model import GPTConfig

    gpt = GPTConfig(**TEST_MODEL)
    gen = torch.Generator().manual_seed(0)
    shape = (engine.train_micro_batch_size_per_gpu(), gpt.seq_length)
    for _ in range(iterations):
        engine.train_batch(iter([(torch.randint(0, gpt.vocab_size, shape, generator=gen),) * 2
                                 for _ in range(engine.gradient_accumulation_steps())]))
        if between is not None:
            between()


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


def recomputed_from(stdout: str, run_dir, killed_at: int, iters: int, ranks=(0, 1)) -> int:
    """The checkpoint c a job killed after ``killed_at`` recomputed from, checked: each rank journaled 1..killed_at,
    then c + 1..iters, and the recomputed iterations' losses equal the failure-free ones bit for bit."""
    found = re.search(rf"job reached iteration {killed_at}, last checkpoint (\d+); recompute", stdout)
    assert found, stdout[-3000:]
    c = int(found.group(1))
    for rank in ranks:
        entries = read_journal(journal_path(str(run_dir), rank))
        assert [e.iteration for e in entries] == list(range(1, killed_at + 1)) + list(range(c + 1, iters + 1))
        before = {e.iteration: e.loss for e in entries[:killed_at]}
        recomputed = {e.iteration: e.loss for e in entries[killed_at:] if e.iteration <= killed_at}
        assert recomputed == {i: before[i] for i in range(c + 1, killed_at + 1)}
    return c


def probe_rows(stdout: str) -> list[dict]:
    """tests/jobs/end_probe.py's row of each rank (another rank's unfinished line may run into it)."""
    return [json.loads(row) for row in re.findall(r"probe (\{[^{}]*\})", stdout)]
