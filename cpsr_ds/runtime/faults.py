"""Fault injection: SIGKILL a rank at a given iteration, or at Poisson-distributed times.

An injected failure fires once per run directory: a marker file is made durable
before the kill, so the restarted job does not fail again at the same point.
Poisson failures (the paper's Eq. 3, rate lambda per hour of wall time) draw their
time and victim rank from ``(seed, number of failures already fired)``, so every
rank draws the same failure and each restart draws the next one.
"""

from __future__ import annotations

import glob
import logging
import os
import signal
import time

import numpy as np

from cpsr_ds.config import ConfigError, FaultConfig
from cpsr_ds.runtime.hooks import Hook, Step

logger = logging.getLogger(__name__)

FAULTS_DIR = "faults"


def poisson_failure(rate_per_hour: float, seed: int, index: int, world_size: int) -> tuple[float, int]:
    """The ``index``-th Poisson failure: (seconds after the job starts, rank it kills)."""
    rng = np.random.default_rng([seed, index])
    return float(rng.exponential(3600.0 / rate_per_hour)), int(rng.integers(world_size))


def check_kill_rank(cfg: FaultConfig, world_size: int) -> None:
    """Reject a ``kill_rank`` that is no rank of the job: its failure would never fire."""
    if cfg.kill_rank >= world_size:
        raise ConfigError(f"cpsr.faults.kill_rank: {cfg.kill_rank} is not a rank of this job "
                          f"(world size {world_size}: ranks 0 to {world_size - 1})")


def kill_marker(directory: str, iteration: int, rank: int) -> str:
    """The marker file of the failure injected into ``rank`` after ``iteration`` in run directory ``directory``:
    made durable just before the SIGKILL, so its time is the kill's."""
    return os.path.join(directory, FAULTS_DIR, f"iteration-{iteration}-rank-{rank}")


class FaultInjector(Hook):
    def __init__(self, cfg: FaultConfig, directory: str, rank: int, world_size: int):
        check_kill_rank(cfg, world_size)
        self.cfg = cfg
        self.rank = rank
        at = cfg.kill_at_iteration
        self.kill_at = frozenset([] if at is None else [at] if isinstance(at, int) else at)
        self.directory = directory
        self.markers = os.path.join(directory, FAULTS_DIR)
        os.makedirs(self.markers, exist_ok=True)
        self.poisson = None
        if cfg.poisson_rate_per_hour > 0:
            index = len(glob.glob(os.path.join(self.markers, "poisson-*")))
            after_s, victim = poisson_failure(cfg.poisson_rate_per_hour, cfg.seed, index, world_size)
            self.poisson = (f"poisson-{index}", time.monotonic() + after_s, victim)

    def after_iteration(self, step: Step) -> None:
        """May not return."""
        self.check(step.iteration)

    def check(self, iteration: int) -> None:
        """Fire the failure due after ``iteration`` on this rank, if any; may not return."""
        if iteration in self.kill_at and self.rank == self.cfg.kill_rank:
            self._fire(kill_marker(self.directory, iteration, self.rank), iteration)
        if self.poisson is not None:
            name, deadline, victim = self.poisson
            if self.rank == victim and time.monotonic() >= deadline:
                self._fire(os.path.join(self.markers, name), iteration)

    def _fire(self, marker: str, iteration: int) -> None:
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return
        os.write(fd, f"{iteration}\n".encode())
        os.fsync(fd)
        os.close(fd)
        dir_fd = os.open(self.markers, os.O_RDONLY)
        os.fsync(dir_fd)
        os.close(dir_fd)
        logger.warning("cpsr fault injection: SIGKILL rank %d after iteration %d (%s)", self.rank, iteration,
                       os.path.basename(marker))
        os.kill(os.getpid(), signal.SIGKILL)
