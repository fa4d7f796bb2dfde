import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from cpsr_ds.config import ConfigError, FaultConfig
from cpsr_ds.runtime.faults import FaultInjector, poisson_failure

CHILD = """
import sys
sys.path.insert(0, {root!r})
from cpsr_ds.config import FaultConfig
from cpsr_ds.runtime.faults import FaultInjector
cfg = FaultConfig(kill_rank={kill_rank}, kill_at_iteration={kill_at}, poisson_rate_per_hour={rate}, seed=3)
injector = FaultInjector(cfg, {directory!r}, rank={rank}, world_size=2)
for iteration in range(1, 200):
    injector.check(iteration)
    print(iteration, flush=True)
"""


def last_iteration(stdout: str) -> int:
    return max(int(line) for line in stdout.split("\n") if line.isdigit())


def run_child(directory, rank, kill_rank=1, kill_at=5, rate=0.0):
    code = CHILD.format(root=ROOT, directory=str(directory), rank=rank, kill_rank=kill_rank, kill_at=kill_at, rate=rate)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_kill_fires_once_per_run_directory(tmp_path):
    first = run_child(tmp_path, rank=1)
    assert first.returncode == -signal.SIGKILL
    assert last_iteration(first.stdout) == 4  # killed right after iteration 5, before reporting it
    assert "SIGKILL rank 1 after iteration 5" in first.stdout
    assert os.listdir(tmp_path / "faults") == ["iteration-5-rank-1"]
    second = run_child(tmp_path, rank=1)
    assert second.returncode == 0 and last_iteration(second.stdout) == 199


def test_a_failure_trace_fires_each_iteration_once_in_order(tmp_path):
    stops = [last_iteration(run_child(tmp_path, rank=1, kill_at=[7, 3, 12]).stdout) for _ in range(3)]
    assert stops == [2, 6, 11]
    assert sorted(os.listdir(tmp_path / "faults")) == ["iteration-12-rank-1", "iteration-3-rank-1", "iteration-7-rank-1"]
    assert run_child(tmp_path, rank=1, kill_at=[7, 3, 12]).returncode == 0


def test_other_ranks_are_not_killed(tmp_path):
    assert run_child(tmp_path, rank=0).returncode == 0


def test_poisson_failures_are_reproducible_and_have_the_right_rate():
    assert poisson_failure(2.0, seed=1, index=0, world_size=8) == poisson_failure(2.0, seed=1, index=0, world_size=8)
    draws = [poisson_failure(2.0, seed=1, index=i, world_size=8) for i in range(4000)]
    times = np.array([t for t, _ in draws])
    ranks = {r for _, r in draws}
    assert abs(times.mean() - 1800.0) / 1800.0 < 0.05  # mean inter-arrival 1/lambda
    assert ranks == set(range(8))


def test_poisson_failure_kills_and_the_next_one_is_drawn_after_restart(tmp_path):
    rate = 3600.0 * 1000  # one failure per millisecond on average: fires at once
    victim = poisson_failure(rate, seed=3, index=0, world_size=2)[1]
    assert run_child(tmp_path, rank=1 - victim, kill_at=None, rate=rate).returncode == 0
    assert run_child(tmp_path, rank=victim, kill_at=None, rate=rate).returncode == -signal.SIGKILL
    assert os.listdir(tmp_path / "faults") == ["poisson-0"]


def test_a_kill_rank_beyond_the_world_size_is_rejected_at_start(tmp_path):
    with pytest.raises(ConfigError, match=r"cpsr\.faults\.kill_rank: 2 is not a rank of this job \(world size 2"):
        FaultInjector(FaultConfig(kill_rank=2, kill_at_iteration=5), str(tmp_path), rank=0, world_size=2)
    FaultInjector(FaultConfig(kill_rank=1, kill_at_iteration=5), str(tmp_path), rank=0, world_size=2)
