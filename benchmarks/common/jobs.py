"""Training jobs for the benchmarks, each run in a child forked from the benchmark's process.

The imports are done once, in the benchmark, so a job starts in seconds. The child is
one process of world size 1 on a free port; its output goes to a log file, and a
normal end runs what a normal exit runs (the engines commit their last checkpoint).
Importing this module sets what every job needs before torch is imported: one thread
(the benchmarks measure time on a few shared cores) and the CPU accelerator where no other
is set.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import time
import traceback

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("PYTHONWARNINGS", "ignore")

import torch  # noqa: E402

from benchmarks.common.processes import free_port  # noqa: E402

torch.set_num_threads(1)

JOB_TIMEOUT_S = 180


class Hang(Exception):
    """A job did not finish within its time."""


class Child:
    """A function run in a forked child, its output in ``log``."""

    def __init__(self, log: str, fn, *args):
        self.log = log
        self.started = time.monotonic()
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
                                  WORLD_SIZE="1")
                fn(*args)
                code = 0
            except SystemExit as err:
                code = err.code if isinstance(err.code, int) else 1
            except BaseException:
                traceback.print_exc()
            finally:
                # What a normal exit runs: the engines commit their last checkpoint at exit.
                atexit._run_exitfuncs()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        self.code: int | None = None

    def poll(self) -> int | None:
        if self.code is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.code = os.waitstatus_to_exitcode(status)
        return self.code

    def wait(self, timeout_s: float = JOB_TIMEOUT_S) -> int:
        deadline = self.started + timeout_s
        while self.poll() is None:
            if time.monotonic() > deadline:
                self.kill()
                raise Hang(f"hang: job did not finish within {timeout_s:.0f} s (log {self.log})")
            time.sleep(0.05)
        return self.code

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            _, status = os.waitpid(self.pid, 0)
            self.code = os.waitstatus_to_exitcode(status)

    def output(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()


def tail(text: str, n: int = 600) -> str:
    return " ".join(text[-n:].split())


def finish_benchmark(name: str, result: dict, json_path: str | None, plot_path: str | None, plot) -> None:
    """Print the benchmark's run time, write ``result`` as JSON and ``plot(result, path)`` where asked."""
    print(f"\n{name}: {result['seconds']:.0f} s")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    if plot_path:
        plot(result, plot_path)
