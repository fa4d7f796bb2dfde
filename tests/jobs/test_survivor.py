"""Survivor dumps (cpsr_ds/checkpoint/capture/survivor.py): written on failure, verified when read."""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from benchmarks.common.processes import tiny_config
from conftest import ROOT, run_job
from cpsr_ds.cli import inspect_report
from cpsr_ds.checkpoint.storage import ondisk
from cpsr_ds.checkpoint.storage.filesystem import fs
from cpsr_ds.checkpoint.capture import dumps, run_id, survivor
from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal
from cpsr_ds.config import ConfigError, CPSRConfig
from cpsr_ds.recovery import engine_state, read_reports
from cpsr_ds.recovery.sources.survivor import restore_dump
from support.training import process_group, trained  # noqa: F401 (a fixture; process_group is autouse)


def where(engine, tmp_path):
    return str(tmp_path / "survivors"), run_id.run_identity(str(tmp_path / "run"))


def read(engine, tmp_path, **kwargs):
    root, run = where(engine, tmp_path)
    return dumps.read_survivor(root, engine.global_rank, run, **kwargs)


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_the_dump_holds_exactly_the_engines_state_and_counters(tmp_path, zero_stage):
    engine, _ = trained(tmp_path, zero_stage)
    assert read(engine, tmp_path) is None  # nothing dumped yet
    assert engine.cpsr.survivor.dump("test")
    dumped = read(engine, tmp_path, attempt=1)
    expected = engine_state(engine)
    assert dumped.iteration == engine.global_steps == 2 and dumped.attempt == 1 and dumped.reason == "test"
    assert dumped.fragments == {}  # one data-parallel rank holds every partition whole
    assert dumped.weights is None  # and has no replica to give its weights to
    assert sorted(dumped.state) == sorted(expected)
    assert all(torch.equal(dumped.state[k], expected[k]) for k in expected)
    assert dumped.counters["global_steps"] == 2 and dumped.counters["optimizer_steps"] == [2]
    assert dumped.counters["lr_scheduler"] == engine.lr_scheduler.state_dict()
    assert read(engine, tmp_path, attempt=2) is None  # a dump of another attempt is not this restart's


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_a_dump_written_back_gives_the_engine_its_state_and_the_forward_pass_its_weights(tmp_path, zero_stage):
    engine, batches = trained(tmp_path, zero_stage)
    assert engine.cpsr.survivor.dump("test")
    expected, loss = engine_state(engine), engine.eval_batch(iter(batches))
    engine.train_batch(iter(batches))  # the state moves on
    assert any(not torch.equal(v, expected[k]) for k, v in engine_state(engine).items())
    restore_dump(engine, read(engine, tmp_path, attempt=1))
    assert all(torch.equal(v, expected[k]) for k, v in engine_state(engine).items())
    # Under ZeRO the module's weights the forward pass uses come from the restored partitions.
    assert engine.eval_batch(iter(batches)) == loss


def test_a_damaged_partial_or_foreign_dump_is_rejected(tmp_path, caplog):
    engine, _ = trained(tmp_path)
    assert engine.cpsr.survivor.dump("test")
    root, run = where(engine, tmp_path)
    directory = dumps.dump_dir(root, run, 0)
    path = os.path.join(directory, dumps.STATE_FILE)
    manifest = os.path.join(directory, ondisk.manifest_name(0))
    good = open(path, "rb").read()
    shutil.copytree(directory, dumps.dump_dir(root, "another-run", 0))  # another run's dump, where this one reads
    assert dumps.read_survivor(root, 0, "another-run") is None
    assert "not this run" in caplog.text
    with open(path, "r+b") as f:  # one flipped byte in the data
        f.seek(len(good) - 3)
        f.write(bytes([good[-3] ^ 0xFF]))
    assert read(engine, tmp_path) is None and "checksum mismatch" in caplog.text
    open(path, "wb").write(good[:len(good) // 2])
    assert read(engine, tmp_path) is None and "truncated" in caplog.text
    open(path, "wb").write(good)
    assert read(engine, tmp_path) is not None
    os.unlink(manifest)
    assert read(engine, tmp_path) is None and "partial dump" in caplog.text
    # Another run in the same run directory gets another identity: the old dump is not its.
    os.unlink(tmp_path / "run" / run_id.RUN_ID)
    assert run_id.run_identity(str(tmp_path / "run")) != run


def test_a_dump_past_its_time_limit_is_abandoned_and_never_committed(tmp_path, monkeypatch):
    engine, _ = trained(tmp_path, survivor_timeout_s=0.5)
    write = fs.write_atomic
    finished = threading.Event()

    def slow_write(*args, **kwargs):
        time.sleep(1.5)
        try:
            return write(*args, **kwargs)
        finally:
            finished.set()

    monkeypatch.setattr(fs, "write_atomic", slow_write)
    t0 = time.monotonic()
    assert not engine.cpsr.survivor.dump("test")
    assert time.monotonic() - t0 < 1.2
    assert finished.wait(10)
    time.sleep(0.2)  # the writer, past its file, would now commit
    root, run = where(engine, tmp_path)
    assert not os.path.exists(dumps.dump_dir(root, run, 0)) and read(engine, tmp_path) is None


def test_a_dump_waits_for_the_optimizer_step_and_refuses_a_torn_state(tmp_path):
    engine, batches = trained(tmp_path, survivor_timeout_s=0.5)
    dumper = engine.cpsr.survivor
    stepping, leave = threading.Event(), threading.Event()
    step = dumper.stepping(lambda: (stepping.set(), leave.wait(10)))
    thread = threading.Thread(target=step)
    thread.start()
    assert stepping.wait(10)
    assert not dumper._dump("mid-step")  # the step outlasts the time limit: no dump
    leave.set()
    thread.join()
    step = engine.optimizer.step

    def failing_step(*args, **kwargs):
        raise RuntimeError("Connection reset by peer")

    engine.optimizer.step = failing_step
    with pytest.raises(RuntimeError):
        engine.train_batch(iter(batches))  # raises in the step: dumps from train_batch, but the state is torn
    assert dumper.outcome is False and "raised" in dumper.torn
    engine.optimizer.step = step
    assert read(engine, tmp_path) is None


def test_a_failed_collective_in_train_batch_dumps_before_it_propagates(tmp_path, monkeypatch):
    engine, batches = trained(tmp_path)

    def failed_collective():
        raise RuntimeError("Connection reset by peer")

    monkeypatch.setattr(engine.cpsr, "before_iteration", failed_collective)  # inside train_batch
    with pytest.raises(RuntimeError, match="Connection reset"):
        engine.train_batch(iter(batches))
    dumped = read(engine, tmp_path)
    assert dumped.iteration == 2 and "Connection reset by peer" in dumped.reason


def test_sigterm_while_the_main_thread_is_blocked_still_dumps(tmp_path, monkeypatch):
    engine, _ = trained(tmp_path)
    died = threading.Event()
    monkeypatch.setattr(survivor, "die", lambda signum: died.set())
    # The signal goes to another thread, as when the main thread waits in a collective's C++ code.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert died.wait(30)  # a lock wait the signal cannot interrupt: the main thread stays blocked
        assert read(engine, tmp_path).reason == "SIGTERM received"
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def test_sigterm_handled_on_the_main_thread_inside_the_optimizer_step_dumps_once_the_step_ends(tmp_path, monkeypatch):
    engine, batches = trained(tmp_path, survivor_timeout_s=10)
    died = threading.Event()
    monkeypatch.setattr(survivor, "die", lambda signum: died.set())
    step = engine.optimizer.step

    def signalled_step(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)  # Python runs the signal's handler here, on the main thread, inside the step
        return step(*args, **kwargs)

    engine.optimizer.step = signalled_step
    started = time.monotonic()
    engine.train_batch(iter(batches))
    assert died.wait(30)
    assert time.monotonic() - started < 10, "the dump waited for a step that waited for the dump"
    assert read(engine, tmp_path).iteration == 3


def test_after_the_dump_the_process_ends_by_the_signal_even_with_a_python_handler_installed():
    """Launchers read the signal's meaning from the exit status: -SIGTERM, as without a dump."""
    script = ("import signal; from cpsr_ds.checkpoint.capture.survivor import die; "
              "signal.signal(signal.SIGTERM, lambda *_: None); die(signal.SIGTERM)")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGTERM, result.stderr


def test_a_restart_removes_its_ranks_earlier_dump_and_the_dumps_of_deleted_runs(tmp_path):
    engine, _ = trained(tmp_path / "a")
    assert engine.cpsr.survivor.dump("test")
    root, run = where(engine, tmp_path / "a")
    stale = tmp_path / "a" / "survivors" / "gone-run"
    stale.mkdir()
    fs.write_json_atomic(str(stale / dumps.OWNER), {"run_dir": str(tmp_path / "deleted")})
    survivor.install(engine, CPSRConfig.model_validate(tiny_config(tmp_path / "a" / "run")["cpsr"]).checkpoint.model_copy(
        update={"survivor_dir": root}), attempt=2)
    assert dumps.read_survivor(root, 0, run) is None and not stale.exists()


def test_the_survivor_keys_are_checked_and_can_turn_the_dump_off(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.survivor_timeout_s"):
        CPSRConfig.parse_block({"checkpoint": {"survivor_timeout_s": 0}})
    assert CPSRConfig.parse_block({}).checkpoint.survivor_dir is None
    assert dumps.default_root().startswith("/dev/shm/") and str(os.getuid()) in dumps.default_root()
    engine, _ = trained(tmp_path, survivor=False)
    assert engine.cpsr.survivor is None


KILL_AT = 10


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory):
    """PP = 2 on 2 processes, checkpoints every 3 iterations: rank 1 is SIGKILLed after iteration KILL_AT, the
    launcher stops rank 0, which dumps; the probe saved rank 0's state after every iteration."""
    tmp_path = tmp_path_factory.mktemp("survivor-job")
    config = tiny_config(tmp_path / "run", stages=2, predictor={"name": "linear", "history": 2},
                         recovery={"mode": "predict"})
    config["cpsr"]["checkpoint"].update(survivor_dir=str(tmp_path / "survivors"), interval=3)
    probes = tmp_path / "probes"
    probes.mkdir()
    result = run_job(tmp_path, config, "--train-iters", 12, "--kill-rank", 1, "--kill-at-iteration", KILL_AT,
                     script=os.path.join(ROOT, "tests", "jobs", "survivor_probe.py"), check=False,
                     env={"PROBE_OUT": str(probes)})
    assert result.returncode != 0
    return tmp_path, config, result


def test_the_rank_the_launcher_stops_after_its_peer_is_killed_dumps_its_exact_state(failed_run):
    tmp_path, _, result = failed_run
    run = run_id.run_identity(str(tmp_path / "run"))
    dumped = dumps.read_survivor(str(tmp_path / "survivors"), 0, run, attempt=1)
    assert dumped is not None, result.stdout[-4000:]
    assert dumped.iteration == KILL_AT and dumped.stage == 0 and dumped.world_size == 2, dumped.reason
    expected = torch.load(tmp_path / "probes" / f"rank0-iteration{KILL_AT}.pt")
    assert sorted(dumped.state) == sorted(expected)
    assert all(torch.equal(dumped.state[k], expected[k]) for k in expected)
    assert dumps.read_survivor(str(tmp_path / "survivors"), 1, run) is None  # SIGKILL leaves nothing


def test_the_restart_takes_the_surviving_stage_from_its_dump_and_predicts_only_the_lost_one(failed_run):
    tmp_path, config, _ = failed_run
    recovered = tmp_path / "recovered"
    recovered.mkdir()
    result = run_job(tmp_path, config, "--train-iters", 12, script=os.path.join(ROOT, "tests", "jobs", "survivor_probe.py"),
                     env={"PROBE_OUT": str(tmp_path / "probes"), "PROBE_RECOVERED": str(recovered)})
    report = read_reports(str(tmp_path / "run"))[-1]
    assert (report.method, report.reached, report.resume_iteration) == ("predict", KILL_AT, KILL_AT), report
    assert report.sources == {"0": "survivor", "1": "linear"} and report.predictor == "linear", report
    # Stage 1's parameters alone are predicted: the cost model's N_p / N.
    assert report.predicted_share is not None and 0.2 < report.predicted_share < 0.8, report
    assert "rank 0 exact from its survivor dump; rank 1 predicted with linear" in result.stdout
    assert inspect_report(str(tmp_path / "run"))["recoveries"][-1]["sources"] == report.sources
    # Stage 0 resumes with exactly the state it had at the failure; stage 1's is predicted from its checkpoints.
    expected = torch.load(tmp_path / "probes" / f"rank0-iteration{KILL_AT}.pt")
    state0 = torch.load(recovered / "rank0.pt")
    assert all(torch.equal(state0[k], expected[k]) for k in expected)
    state1 = torch.load(recovered / "rank1.pt")
    checkpoint = torch.load(recovered / "rank1-checkpoint.pt")
    assert any(not torch.equal(state1[k], checkpoint[k]) for k in checkpoint if k.startswith("param/"))


def dp2_job_failed_and_restarted(tmp_path, kill_at, iterations, zero_stage=0, **cpsr):
    """DP = 2, fp32: a failure-free reference run, and the same run with rank 1 SIGKILLed after ``kill_at``,
    restarted; the restart's output and recovery report."""

    def config(name):
        # The predictor's work inline at each checkpoint (no background thread), so that every summary is
        # written before the job ends.
        c = tiny_config(tmp_path / name, stages=1, zero_stage=zero_stage, coordinator={"enabled": False}, **cpsr)
        c["cpsr"]["checkpoint"].update(survivor_dir=str(tmp_path / "survivors"), interval=4)
        return c

    run_job(tmp_path, config("reference"), "--train-iters", iterations)
    failed = run_job(tmp_path, config("run"), "--train-iters", iterations, "--kill-rank", 1,
                     "--kill-at-iteration", kill_at, check=False)
    assert failed.returncode != 0
    result = run_job(tmp_path, config("run"), "--train-iters", iterations)
    return result, read_reports(str(tmp_path / "run"))[-1]


def losses_after(directory, rank: int, iteration: int) -> dict[int, float]:
    return {e.iteration: e.loss for e in read_journal(journal_path(str(directory), rank)) if e.iteration > iteration}


def test_dp2_without_zero_one_rank_killed_resumes_at_f_from_a_replica_as_if_nothing_had_failed(tmp_path):
    """DP = 2, fp32, no ZeRO: rank 1 is SIGKILLed after iteration 9; rank 0 dumps, and at the restart rank 1 takes
    rank 0's state: the job resumes at the failure point with the failure-free run's losses."""
    kill_at, iterations = 9, 14
    _, report = dp2_job_failed_and_restarted(tmp_path, kill_at, iterations)
    # Each replica keeps trend's summary of its own share beside every checkpoint, not only the first.
    for rank in (0, 1):
        assert os.listdir(tmp_path / "reference" / "predictor_summaries" / f"rank{rank:05d}"), rank
    assert report.sources == {"0": "survivor", "1": "replica"} and report.predictor is None, report
    assert report.method == "predict" and report.resume_iteration == report.reached >= kill_at - 1, report
    # One replica read checkpoint c's files for both.
    assert report.bytes_read <= 1.25 * report.checkpoint_bytes, report
    for rank in (0, 1):
        reference = losses_after(tmp_path / "reference", rank, 0)
        resumed = losses_after(tmp_path / "run", rank, report.reached)
        assert max(resumed) == iterations
        assert all(abs(loss - reference[i]) <= 1e-6 * abs(reference[i]) for i, loss in resumed.items())


@pytest.mark.serial  # with two workers c's summary came after the kill and recovery read the history (bytes_read)
def test_zero1_dp2_one_rank_killed_takes_its_parameters_from_a_replica_and_predicts_only_its_moments(tmp_path):
    """DP = 2 under ZeRO-1: each replica holds half of the fp32 masters and moments but the module's whole
    weights. Rank 1 is SIGKILLed; at the restart its masters come from rank 0's dumped weights, its moments are
    predicted: the first iteration after f, a function of the parameters alone, has the failure-free run's loss."""
    kill_at, iterations = 10, 12
    result, report = dp2_job_failed_and_restarted(tmp_path, kill_at, iterations, zero_stage=1,
                                                  predictor={"name": "trend"}, recovery={"mode": "predict"})
    assert report.sources == {"0": "survivor", "1": "replica+trend"} and report.predictor == "trend", report
    assert report.method == "predict" and report.resume_iteration == report.reached >= kill_at - 1, report
    # Rank 1's half of the stage, its moments, is all that was predicted.
    assert report.predicted_share == 0.5, report
    # Each replica read its own partition of c and no layer file, and its share of trend's summary.
    assert report.bytes_read <= 1.25 * report.checkpoint_bytes, report
    assert "rank 1 parameters exact from a data-parallel replica's dump, its moments from trend" in result.stdout
    f = report.reached
    for rank in (0, 1):
        reference = losses_after(tmp_path / "reference", rank, 0)
        resumed = losses_after(tmp_path / "run", rank, f)
        assert max(resumed) == iterations
        assert abs(resumed[f + 1] - reference[f + 1]) <= 1e-6 * abs(reference[f + 1]), (resumed, reference)
