"""The plain engine under ZeRO-2 and ZeRO-3 in jobs of 2 processes, a rank killed and the job restarted from each
source of state beside the checkpoint: the survivor's dump, the replicas' weights, a prediction of each rank's own
partition, host snapshots."""

import os

import pytest
import torch

from conftest import ROOT, run_job
from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal
from cpsr_ds.recovery import read_reports
from support.checkpoints import landed_snapshots
from support.plain import plain_config
from support.plain_jobs import ITERS, reference

SCRIPT = os.path.join(ROOT, "tests", "jobs", "plain_job.py")


@pytest.fixture(scope="module")
def zero3_reference(tmp_path_factory):
    return reference(tmp_path_factory, SCRIPT, 3)


def predicted_restart(tmp_path, zero_stage: int, f: int = 11):
    """A job whose rank 1 is SIGKILLed after f and restarted predicting with linear (parameters extrapolated from
    the last two checkpoints, moments kept); (the report of the restart, each rank's share where it resumed)."""
    run_dir, states = tmp_path / "run", tmp_path / "states"
    states.mkdir()
    config = plain_config(run_dir, zero_stage=zero_stage, cpsr={"faults": {"kill_rank": 1, "kill_at_iteration": f},
                                                                "recovery": {"mode": "predict"},
                                                                "predictor": {"name": "linear", "history": 2}})
    # Synchronous saves: the checkpoint of 9 is committed before the kill at 11, however loaded the machine.
    config["cpsr"]["checkpoint"]["strategy"] = "torch"
    run_job(tmp_path, config, "--train-iters", ITERS, "--dump-own", states, script=SCRIPT, supervised=True)
    report = read_reports(str(run_dir))[-1]
    assert (report.method, report.reached, report.checkpoint) == ("predict", f, 9), report
    journal = [e.iteration for e in read_journal(journal_path(str(run_dir), 1))]
    assert journal == list(range(1, ITERS + 1))  # resumed at f: nothing redone
    return report, [torch.load(states / f"rank{r}-start{f}.pt") for r in (0, 1)]


def assert_state(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys() and any(k.startswith("param/") for k in got)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6)


def extrapolated(before: dict, at_c: dict, ahead: float) -> dict:
    """linear's prediction: parameters extrapolated ``ahead`` intervals past c, moments kept."""
    return {k: v + (v - before[k]) * ahead if k.startswith("param/") else v for k, v in at_c.items()}


def test_zero3_killed_rank_restarts_predicting_its_own_partition_and_resumes_at_f(zero3_reference, tmp_path):
    """The survivor's partition from its dump, exact at f; the lost rank's predicted from its own partitions at the
    last two checkpoints and written back into its partition, nothing gathered."""
    report, (survivor, predicted) = predicted_restart(tmp_path, zero_stage=3)
    assert report.sources == {"0": "survivor", "1": "linear"} and report.predicted_share == pytest.approx(0.5, abs=0.02)
    states = zero3_reference.parent / "states"
    assert_state(survivor, torch.load(states / "rank0-at11.pt"))
    assert_state(predicted, extrapolated(*(torch.load(states / f"rank1-at{k}.pt") for k in (6, 9)), ahead=2 / 3))


def test_zero2_killed_rank_takes_its_parameters_exact_from_the_survivors_dump(tmp_path_factory, tmp_path):
    """ZeRO-2 replicates the parameters: the lost rank's partition of the fp32 masters comes exact from the
    survivor's dumped weights, only its moments from the predictor (kept from c by linear)."""
    report, (survivor, lost) = predicted_restart(tmp_path, zero_stage=2)
    assert report.sources == {"0": "survivor", "1": "replica+linear"}
    states = reference(tmp_path_factory, SCRIPT, 2).parent / "states"
    assert_state(survivor, torch.load(states / "rank0-at11.pt"))
    exact, at_c = torch.load(states / "rank1-at11.pt"), torch.load(states / "rank1-at9.pt")
    assert_state(lost, {k: exact[k] if k.startswith("param/") else at_c[k] for k in exact})


def test_zero3_crashed_rank_recomputes_from_the_newest_host_snapshot_of_each_partition(tmp_path, shm_path):
    """Host snapshots every 2 iterations, each rank's own ZeRO-3 partition; checkpoints every 6; rank 1 SIGKILLed
    after 11. The restart recomputes from the newest snapshot both ranks hold (10, or 8 where the kill cut the
    one of 10 off), not from the checkpoint of 6, and redoes the failed job's iterations exactly: the forward after
    the restore runs on the restored partitions, the persistent (small, whole on every rank) parameters included."""
    kill_at, memory_interval = 11, 2
    run_dir = tmp_path / "run"
    config = plain_config(run_dir, zero_stage=3, cpsr={"recovery": {"mode": "recompute"}})
    # Synchronous saves: the checkpoint of 6 is committed before the kill, however loaded the machine.
    config["cpsr"]["checkpoint"].update(survivor_dir=str(shm_path), interval=6, memory_interval=memory_interval,
                                        strategy="torch")
    failed = dict(config, cpsr=dict(config["cpsr"], faults={"kill_rank": 1, "kill_at_iteration": kill_at}))
    assert run_job(tmp_path, failed, "--train-iters", ITERS, script=SCRIPT, check=False).returncode != 0
    newest = kill_at - kill_at % memory_interval
    common = max(landed_snapshots(config, 0) & landed_snapshots(config, 1))
    assert common in (newest, newest - memory_interval), common

    run_job(tmp_path, config, "--train-iters", ITERS, script=SCRIPT)
    report = read_reports(str(run_dir))[-1]
    assert (report.method, report.reached, report.resume_iteration) == ("recompute", kill_at, common), report
    assert report.sources == {"0": "host snapshot", "1": "host snapshot"}, report
    for rank in (0, 1):
        entries = read_journal(journal_path(str(run_dir), rank))
        first = {e.iteration: e.loss for e in entries[:kill_at]}
        redone = [e for e in entries[kill_at:] if e.iteration <= kill_at]
        assert [e.iteration for e in redone] == list(range(common + 1, kill_at + 1))
        assert all(e.loss == first[e.iteration] for e in redone), [(e.iteration, e.loss, first[e.iteration]) for e in redone]
