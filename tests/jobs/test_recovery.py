"""Predicting-based recovery (PB-R): the predicted state is what the engine holds, and
training resumes at the failure point's batch. 4 processes: PP = 2 x DP = 2, ZeRO-1; and
one process with bf16 and ZeRO-1 (on one GPU only one NCCL rank fits), which
benchmarks/gpu/run.sh runs on CUDA."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from benchmarks.common.processes import free_port, tiny_config
from conftest import ROOT, run_job
from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal

F = 33  # the failure point: rank 3 is killed right after this iteration


def pbr_config(run_dir, stages: int, kill_rank: int) -> dict:
    """ZeRO-1, a checkpoint every 5 iterations, ``kill_rank`` killed after iteration F, PB-R forced with linear."""
    config = tiny_config(run_dir, stages=stages, zero_stage=1,
                         faults={"kill_rank": kill_rank, "kill_at_iteration": F},
                         predictor={"name": "linear", "history": 3},
                         recovery={"mode": "predict"})  # fmt: skip
    config["cpsr"]["checkpoint"]["interval"] = 5
    return config


def assert_journals_resume_at_f(run_dir, ranks: int) -> None:
    """Every rank journaled each iteration once, F's included, on to the end; rank 0's losses are finite."""
    for rank in range(ranks):
        iterations = [e.iteration for e in read_journal(journal_path(str(run_dir), rank))]
        assert iterations == list(range(1, F + 1)) + list(range(F + 1, 46))
    losses = [e.loss for e in read_journal(journal_path(str(run_dir), 0))]
    assert all(loss == loss and loss < 10 for loss in losses)  # finite, no blow-up


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pbr")
    run_dir = tmp / "run"
    config = pbr_config(run_dir, stages=2, kill_rank=3)
    # Every stage predicted: no survivor dumps (with them, stage 0's ranks would resume from theirs: test_survivor.py).
    # The probe loads the checkpoints the predictor learned from after training on.
    config["cpsr"]["checkpoint"].update(survivor=False, keep_last=8)
    result = run_job(tmp, config, "--train-iters", 45, "--eval-interval", 45, nprocs=4, check=False)
    assert result.returncode != 0, "the injected failure did not stop the job"
    return tmp, config, run_dir


@pytest.fixture(scope="module")
def restarted(failed_run):
    """The failed run restarted by pbr_probe.py, which records what recovery wrote into the DeepSpeed engine on
    every rank and trains on to the end: (the restart's output, each rank's record)."""
    tmp, config, run_dir = failed_run
    out = tmp / "probe"
    out.mkdir()
    result = run_job(tmp, config, "--train-iters", 45, "--eval-interval", 45, nprocs=4,
                     script=os.path.join(ROOT, "tests", "jobs", "pbr_probe.py"), env={"PROBE_OUT": str(out), "PROBE_RESUME": "1"})
    return result, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


def assert_linear_prediction(rank: int, p: dict, module_rtol: float) -> None:
    """What recovery put into the engine of ``rank`` (``p``, from pbr_probe.py) is the linear prediction from its
    checkpoints: in the fp32 masters, Adam's moments kept, and in the module's weights within ``module_rtol``."""
    report = p["report"]
    assert report.method == "predict" and report.reached == F and report.predictor == "linear"
    c = report.checkpoint
    assert c < F and c % 5 == 0
    prev = max(i for i in p["history"] if i < c)
    x_c, x_prev = p["history"][c], p["history"][prev]
    assert p["recovered"].keys() == x_c.keys()
    moved = 0
    for key, value in p["recovered"].items():
        if key.startswith("param/"):
            expected = x_c[key] + (F - c) / (c - prev) * (x_c[key] - x_prev[key])
            moved += int(not torch.equal(value, x_c[key]))
            # Under ZeRO-1 the forward pass uses the module's weights: they must be the prediction too.
            assert torch.allclose(p["module"][key[len("param/"):]], expected, rtol=module_rtol, atol=1e-6), key
        else:  # Adam's moments are kept from the checkpoint by default
            expected = x_c[key]
        assert torch.allclose(value, expected, rtol=1e-5, atol=1e-6), (rank, key)
    assert moved > 0
    # Counters as if the lost iterations had run: training resumes at batch F.
    assert p["global_steps"] == F
    assert p["scheduler"]["last_batch_iteration"] == F - 1
    assert p["optimizer_steps"] == [F]


def test_pbr_writes_the_linear_prediction_into_every_stage_and_replica(restarted):
    _, probe = restarted
    for rank, p in enumerate(probe):
        assert_linear_prediction(rank, p, module_rtol=1e-5)
    # Data-parallel replicas of a stage hold the same state; the two stages differ.
    assert probe[0]["recovered"].keys() == probe[1]["recovered"].keys()
    assert all(torch.equal(probe[0]["recovered"][k], probe[1]["recovered"][k]) for k in probe[0]["recovered"])
    assert probe[0]["recovered"].keys() != probe[2]["recovered"].keys()


def test_under_zero_each_replica_keeps_its_own_partition_and_nothing_gathers_a_stage(restarted):
    """Recovery keeps, of each checkpoint, exactly the rank's ZeRO partition for the predictor, and writes the
    prediction back into it; neither recovery nor the checkpoints after it gather a full tensor."""
    _, probe = restarted
    for rank, p in enumerate(probe):
        assert p["kept_shares"] and set(p["kept_shares"]) == {p["partition"]}, rank
        assert p["gathered_in_recovery"] == 0 and p["gathered_in_training"] == 0, rank
    for stage in (0, 1):
        replicas = probe[2 * stage:2 * stage + 2]
        assert sum(p["partition"] for p in replicas) == replicas[0]["stage_values"]
        assert replicas[0]["partition"] < replicas[0]["stage_values"]


def test_restarted_job_resumes_at_the_failure_point(failed_run, restarted):
    _, _, run_dir = failed_run
    result, _ = restarted
    assert f"predict (PB-R) with linear: resuming at iteration {F}" in result.stdout
    assert_journals_resume_at_f(run_dir, ranks=4)


def single_process_job(tmp, config: dict, script: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``script`` on ``config`` as one process with no launcher, in the environment DeepSpeed's launcher would set."""
    path = tmp / f"ds_config_{free_port()}.json"
    path.write_text(json.dumps(config))
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, script, "--deepspeed_config", str(path), "--valid-sequences", "16",
                           "--train-iters", "45", "--eval-interval", "45"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def single_bf16(tmp_path_factory):
    """One process, bf16 + ZeRO-1: killed after iteration F, then restarted by pbr_probe.py, which records what
    recovery wrote and trains on to the end."""
    tmp = tmp_path_factory.mktemp("pbr_bf16")
    run_dir = tmp / "run"
    config = pbr_config(run_dir, stages=1, kill_rank=0)
    config["bf16"] = {"enabled": True}
    # The probe loads the checkpoints the predictor learned from after training on.
    config["cpsr"]["checkpoint"].update(keep_last=8)
    failed = single_process_job(tmp, config, os.path.join(ROOT, "examples", "gpt", "train_gpt.py"))
    assert failed.returncode != 0, f"the injected failure did not stop the job:\n{failed.stdout[-3000:]}"
    out = tmp / "probe"
    out.mkdir()
    resumed = single_process_job(tmp, config, os.path.join(ROOT, "tests", "jobs", "pbr_probe.py"),
                                 env={"PROBE_OUT": str(out), "PROBE_RESUME": "1"})
    assert resumed.returncode == 0, f"{resumed.stdout[-3000:]}\n{resumed.stderr[-3000:]}"
    return run_dir, resumed, torch.load(out / "rank0.pt", weights_only=False)


def test_single_process_bf16_zero1_pbr_writes_the_prediction(single_bf16):
    _, _, p = single_bf16
    assert p["module_dtypes"] == {"torch.bfloat16"}
    # The bf16 weights are the fp32 masters rounded: within bf16's precision of the prediction.
    assert_linear_prediction(0, p, module_rtol=2**-7)


def test_single_process_bf16_zero1_resumes_at_the_failure_point(single_bf16):
    run_dir, resumed, _ = single_bf16
    assert f"predict (PB-R) with linear: resuming at iteration {F}" in resumed.stdout + resumed.stderr
    assert_journals_resume_at_f(run_dir, ranks=1)


@pytest.fixture(scope="module")
def trend_restarts(tmp_path_factory):
    """One process, trend forced, killed after iteration F; restarted by pbr_probe.py from copies of the failed
    run: as it is (with the predictor's summaries), with checkpoint c's summary damaged, and under recovery.mode
    auto with a held-out limit that trend's error reaches (the loss-excess guard out of the way)."""
    tmp = tmp_path_factory.mktemp("summaries")
    run_dir = tmp / "run"
    config = pbr_config(run_dir, stages=1, kill_rank=0)
    config["cpsr"]["predictor"] = {"name": "trend", "history": 4}
    config["cpsr"]["checkpoint"].update(keep_last=4, survivor=False)
    # The predictor's work inline at each checkpoint: on the background thread of a loaded machine c's summary
    # could still be pending when the job is killed three iterations later.
    config["cpsr"]["coordinator"] = {"enabled": False}
    failed = single_process_job(tmp, config, os.path.join(ROOT, "examples", "gpt", "train_gpt.py"))
    assert failed.returncode != 0, f"the injected failure did not stop the job:\n{failed.stdout[-3000:]}"
    probes = {}
    for case in ("summary", "damaged", "diverging"):
        case_dir = tmp / case
        shutil.copytree(run_dir, case_dir)
        if case == "damaged":
            newest = max((case_dir / "predictor_summaries" / "rank00000").glob("*.pt"))
            data = bytearray(newest.read_bytes())
            data[-10] ^= 0xFF
            newest.write_bytes(bytes(data))
        case_config = json.loads(json.dumps(config))
        case_config["cpsr"]["checkpoint"]["dir"] = str(case_dir)
        if case == "diverging":
            case_config["cpsr"]["recovery"] = {"mode": "auto", "max_relative_error": 1e-3, "max_loss_excess": 1.0}
        out = tmp / f"probe_{case}"
        out.mkdir()
        resumed = single_process_job(tmp, case_config, os.path.join(ROOT, "tests", "jobs", "pbr_probe.py"),
                                     env={"PROBE_OUT": str(out)})
        assert resumed.returncode == 0, f"{resumed.stdout[-3000:]}\n{resumed.stderr[-3000:]}"
        probes[case] = (torch.load(out / "rank0.pt", weights_only=False), resumed.stdout + resumed.stderr)
    return probes


@pytest.mark.serial  # c's summary is written once c commits, three iterations before the kill: with two workers it came late
def test_a_predicting_restart_reads_one_checkpoint_and_the_trend_summary(trend_restarts):
    p, _ = trend_restarts["summary"]
    report = p["report"]
    assert (report.method, report.predictor, report.resume_iteration) == ("predict", "trend", F)
    assert report.checkpoint_bytes > 0 and report.bytes_read <= 1.25 * report.checkpoint_bytes, report


@pytest.mark.serial  # c's summary is written once c commits, three iterations before the kill: with two workers it came late
def test_a_diverging_predictor_falls_back_to_the_checkpoints_state_at_f_where_the_cost_model_says_so(trend_restarts):
    p, output = trend_restarts["diverging"]
    report = p["report"]
    assert (report.method, report.predictor, report.resume_iteration) == ("predict", "skip", F), report
    # The report keeps trend's held-out error, and says why skip predicted.
    assert report.relative_error >= 1e-3 and "trend's held-out error" in report.reason, report
    assert "skip, c's state at f" in report.reason and report.estimated_cost < F - report.checkpoint, report
    c = p["history"][report.checkpoint]
    assert all(torch.equal(p["recovered"][k], c[k]) for k in c), "skip resumes at f with c's state"
    assert p["global_steps"] == F


@pytest.mark.serial  # c's summary is written once c commits, three iterations before the kill: with two workers it came late
def test_a_damaged_summary_means_the_full_history_and_the_same_prediction_within_bf16(trend_restarts):
    (short, _), (full, output) = trend_restarts["summary"], trend_restarts["damaged"]
    assert "is damaged" in output
    report = full["report"]
    assert (report.method, report.predictor, report.resume_iteration) == ("predict", "trend", F)
    # Four checkpoints read, c and the three before it, against c and its summary (2 bytes a parameter, under
    # ZeRO a sixth of what a load reads: the partitions' 12) with the summary.
    assert report.bytes_read >= 3 * short["report"].bytes_read, (report, short["report"])
    assert short["report"].relative_error == pytest.approx(report.relative_error, rel=1e-9)
    c = full["history"][report.checkpoint]
    for key, predicted in full["recovered"].items():
        if not key.startswith("param/"):
            continue
        step = predicted - c[key]
        # The summary keeps the slope in bf16: the step d * slope is rounded to 8 bits.
        assert torch.all((short["recovered"][key] - predicted).abs() <= step.abs() * 2**-8 + 1e-7), key
        assert step.abs().max() > 0, key
