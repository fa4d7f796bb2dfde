"""``python -m cpsr_ds ... --json`` as a process: its stdout is the JSON report alone (``| jq`` works), every log
line goes to stderr."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from cpsr_ds import runlog
from cpsr_ds.checkpoint.capture.journal import ProgressJournal
from cpsr_ds.runlog import PlanRow

WHAT_IF = ["--lambda", "1e-5", "--ts", "0.5", "--alpha1", "1e-4", "--alpha2", "1", "--tau1", "0.1", "--tau2", "-5",
           "--xi", "1e-8", "--np", "3.5e8"]


@pytest.fixture
def run_dir(tmp_path):
    """A run of 20 iterations with one plan."""
    directory = str(tmp_path / "run")
    journal = ProgressJournal(directory, rank=0)
    for i in range(1, 21):
        journal.append(i, 3.0 - 0.01 * i)
    journal.close()
    runlog.append(runlog.plans_path(directory), PlanRow(0, 0, 1.0, "warm-up", 0, "empirical", "recompute", 10))
    return directory


def cli(*args: str) -> subprocess.CompletedProcess:
    """Run the command line as a user would: no accelerator chosen or visible, so DeepSpeed's import warns."""
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "cpsr_ds", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)


@pytest.mark.parametrize("command", [["plan", "{run}", "--json"], ["plan", *WHAT_IF, "--json"],
                                     ["inspect", "{run}", "--json"]], ids=["plan-run", "plan-what-if", "inspect"])
def test_json_alone_on_stdout_and_the_logs_on_stderr(run_dir, command):
    done = cli(*(arg.format(run=run_dir) for arg in command))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert isinstance(report, dict) and report
    assert "Setting accelerator to CPU" in done.stderr  # DeepSpeed's import warning, where it belongs


def test_the_table_is_on_stdout_and_a_usage_error_on_stderr(run_dir):
    table = cli("inspect", run_dir)
    assert table.returncode == 0 and table.stdout.startswith("tag ") and "journal reached iteration: 20" in table.stdout
    wrong = cli("plan", run_dir, "--lambda", "1e-5")
    assert wrong.returncode == 2 and wrong.stdout == "" and "not both" in wrong.stderr
