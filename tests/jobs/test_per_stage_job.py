"""checkpoint.per_stage on two nodes whose storage writes at different rates (checkpoint.write_mbps per node):
the slower stage checkpoints less often, and a failure between full cuts loses no committed progress, recovered
by recomputing from the newest full cut or by predicting each stage from its own newest checkpoint."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from statistics import median

import pytest

from benchmarks.common.processes import free_port, tiny_config
from conftest import ROOT
from cpsr_ds import runlog
from cpsr_ds.checkpoint.storage import catalog, records
from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal
from cpsr_ds.recovery import read_reports

# The kill must fall between a checkpoint of the fast stage alone, committed within 3 iterations, and the slow stage's
# next full cut, whose interval comes from the persist times measured: with another test's jobs on the same cores the
# slow stage's persist took 6-10 iterations and its interval went from 3N to 2N, and the kill fell before either.
pytestmark = pytest.mark.serial

N = 4  # checkpoint.interval: the fast stage's
# The per-stage intervals come once 3 checkpoints' costs are bracketed, at the full cut at 20 or 24 (on an idle
# machine the slow stage's is 5N); the kill falls after the fast stage's checkpoint at 40, before the slow stage's
# next full cut (44 there).
KILL_AT = 43
ITERATIONS = 46
# Stage 0 holds the embedding and 1 block, stage 1 two blocks and the head: about 1.7 times the bytes.
WRITE_MBPS = (8.0, 4.0)


def node_config(tmp_path, run_dir, node: int, mode: str):
    config = tiny_config(run_dir, stages=2, faults={"kill_rank": 1, "kill_at_iteration": KILL_AT},
                         recovery={"mode": mode})
    config["gpt"]["num_layers"] = 3
    config["cpsr"]["checkpoint"].update(interval=N, per_stage=True, write_mbps=WRITE_MBPS[node], keep_last=10)
    path = tmp_path / f"ds_config_{run_dir.name}_{mode}_{node}.json"
    path.write_text(json.dumps(config))
    return path


@pytest.fixture
def started():
    """The processes a test starts; any still running at its end are killed with their process groups."""
    procs = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def start_nodes(started, tmp_path, run_dir, name: str, mode: str) -> list:
    """One process per node, as each node's launcher starts it."""
    port = free_port()
    procs = []
    for node in (0, 1):
        env = dict(os.environ, RANK=str(node), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
                   PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
        command = [sys.executable, os.path.join(ROOT, "examples", "gpt", "train_gpt.py"),
                   "--deepspeed_config", str(node_config(tmp_path, run_dir, node, mode)),
                   "--train-iters", str(ITERATIONS), "--eval-interval", "1000", "--valid-sequences", "16",
                   "--layers-per-stage", "1", "2"]
        with open(tmp_path / f"{name}-node{node}.log", "a") as out:
            procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    started.extend(procs)
    return procs


def exit_codes(procs) -> list[int]:
    return [proc.wait(timeout=180) for proc in procs]


def logs(tmp_path, name) -> str:
    return "".join((tmp_path / f"{name}-node{n}.log").read_text()[-3000:] for n in (0, 1))


def stage_checkpoints(run_dir) -> dict[int, list[int]]:
    """The iterations of each stage's committed checkpoints, from their commit records."""
    held = {0: [], 1: []}
    for ckpt in catalog.list_checkpoints(str(run_dir), read_data=False):
        if ckpt.valid:
            record = records.read_commit(os.path.join(run_dir, ckpt.tag))
            for stage in record.get("stages") or (0, 1):
                held[stage].append(ckpt.iteration)
    return {stage: sorted(its) for stage, its in held.items()}


def losses(run_dir) -> dict[int, float]:
    """Rank 0's journaled losses by iteration, the newest attempt's where iterations repeat."""
    return {e.iteration: e.loss for e in read_journal(journal_path(str(run_dir), 0))}


def test_the_slower_stage_checkpoints_less_often_and_both_recoveries_lose_nothing(tmp_path, started):
    run = tmp_path / "run"
    codes = exit_codes(start_nodes(started, tmp_path, run, "first", "predict"))
    assert codes[1] == -9 and codes[0] != 0, logs(tmp_path, "first")

    # The slower storage's stage persists longer, and checkpoints at a multiple > 1 of the faster one's interval.
    rows, _ = runlog.read_measurements(str(run))
    persist = {s: median(r.persist_s for r in rows if isinstance(r, runlog.CostRow) and r.stage == s) for s in (0, 1)}
    assert persist[1] > 1.5 * persist[0], persist
    held = stage_checkpoints(run)
    assert set(held[1]) < set(held[0]) and all(i % N == 0 for i in held[0]), held
    cut, fast = held[1][-1], held[0][-1]
    assert cut < fast < KILL_AT and held[0][-2] == fast - N, held
    plans = [tuple(map(int, p)) for p in re.findall(r"per-stage checkpoint intervals from iteration (\d+): stage 0 (\d+), "
                                                    r"stage 1 (\d+)", (tmp_path / "first-node0.log").read_text())]
    (*_, (_, fast_interval, slow_interval)) = plans
    assert fast_interval == N and slow_interval % N == 0 and slow_interval > N, plans
    # Each stage's intervals count from the full cut where they were chosen.
    for at, *intervals in plans:
        for stage, interval in enumerate(intervals):
            after = [i for i in held[stage] if i > at]
            assert not after or after[0] == at + interval, (plans, held)
    # The layer split: stage 0's checkpoints hold the embedding and one block, a full cut all five layers.
    layers = sorted(n for n in os.listdir(run / f"global_step{fast}") if n.startswith("layer_"))
    assert layers == ["layer_00-model_states.pt", "layer_01-model_states.pt"], layers
    assert len([n for n in os.listdir(run / f"global_step{cut}") if n.startswith("layer_")]) == 5
    before = losses(run)

    predicted = tmp_path / "predicted"
    shutil.copytree(run, predicted)
    # One restart after the other, each on its own copy of the failed run: two jobs at once can race for a
    # port (a free port found for one, then taken by the other's gloo connections).
    recomputing = start_nodes(started, tmp_path, run, "recompute", "recompute")

    # Recompute-based: from the newest full cut, both stages at one iteration.
    assert exit_codes(recomputing) == [0, 0], logs(tmp_path, "recompute")
    (_, report) = read_reports(str(run))
    assert report.method == "recompute" and report.checkpoint == cut, report
    assert report.reached in (KILL_AT - 1, KILL_AT) and report.stage_checkpoints is None, report
    after = losses(run)
    assert max(after) == ITERATIONS
    # Recomputing from the cut redoes the failure-free run's iterations exactly.
    assert all(abs(after[i] - before[i]) < 1e-4 for i in range(cut + 1, report.reached + 1)), (before, after)

    # Predicting-based: each stage from its own newest checkpoint, the counters at f.
    predicting = start_nodes(started, tmp_path, predicted, "predict", "predict")
    assert exit_codes(predicting) == [0, 0], logs(tmp_path, "predict")
    (_, report) = read_reports(str(predicted))
    f = report.reached
    assert report.method == "predict" and report.resume_iteration == f, report
    assert report.stage_checkpoints == [fast, cut] and report.checkpoint == cut, report
    after = losses(predicted)
    assert max(after) == ITERATIONS
    resumed = [after[i] for i in range(f + 1, ITERATIONS + 1)]
    assert all(loss < 1.5 * before[f] for loss in resumed), (before[f], resumed)
