"""cpsr_ds.initialize in one process (world size 1, gloo): pass-through and installation."""

import json
import math
import os
import re
import socket
import subprocess
import sys
import time

import deepspeed
import pytest
import torch
from deepspeed.runtime.pipe.engine import PipelineEngine

from benchmarks.common.processes import tiny_config
from conftest import ROOT
import cpsr_ds
from cpsr_ds import runlog
from cpsr_ds.integration.deepspeed.engine import CPSRPipelineEngine
from cpsr_ds.recovery import journal_losses
from cpsr_ds.runtime.rundir import LOCK, RunDirectoryBusy, acquire, recorded_attempt
from support.training import build, process_group, random_batches  # noqa: F401 (a fixture; process_group is autouse)


def test_without_a_block_it_is_deepspeed_initialize(tmp_path):
    config = tiny_config(tmp_path, stages=1)
    del config["cpsr"], config["gpt"]
    engine, optimizer, loader, scheduler = build(config)
    assert type(engine) is PipelineEngine
    assert not hasattr(engine, "cpsr")
    assert optimizer is engine.optimizer and scheduler is engine.lr_scheduler and loader is None
    assert deepspeed.PipelineEngine is PipelineEngine


def test_disabled_block_is_deepspeed_initialize(tmp_path):
    config = tiny_config(tmp_path / "run", stages=1)
    config["cpsr"]["enabled"] = False
    engine, *_ = build(config)
    assert type(engine) is PipelineEngine
    assert not (tmp_path / "run").exists()


def test_enabled_block_installs_the_engine_and_reports_a_fresh_start(tmp_path):
    engine, *_ = build(tiny_config(tmp_path / "run", stages=1))
    assert type(engine) is CPSRPipelineEngine
    assert engine.cpsr.recovery.method == "fresh" and engine.global_steps == 0
    assert deepspeed.PipelineEngine is PipelineEngine  # restored after initialize


def test_config_path_and_bad_block(tmp_path):
    config = tiny_config(tmp_path / "run", stages=1)
    config["cpsr"]["checkpoint"]["interval"] = "often"
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="cpsr.checkpoint.interval"):
        build(str(path))


def test_a_plain_module_is_refused_with_a_clear_error(tmp_path):
    with pytest.raises(TypeError, match="must be a deepspeed.pipe.PipelineModule"):
        cpsr_ds.initialize(model=torch.nn.Linear(2, 2), config=tiny_config(tmp_path, stages=1))


def test_the_pipeline_engine_commits_a_checkpoint_before_its_optimizer_step(tmp_path):
    """The snapshot must be complete before the optimizer overwrites what it copies."""
    engine, *_ = build(tiny_config(tmp_path / "run", stages=1))
    batches = random_batches(engine)
    open_at_step = []
    step = engine.optimizer.step

    def observed_step(*args, **kwargs):
        open_at_step.append(engine.checkpoint_engine.get_commit_info())
        return step(*args, **kwargs)

    engine.optimizer.step = observed_step
    for _ in range(3):  # past the warmup's zero learning rate
        engine.train_batch(iter(batches))
    saved = {k: v.clone() for k, v in engine.module.state_dict().items() if isinstance(v, torch.Tensor)}
    engine.save_checkpoint(str(tmp_path / "run"), tag="global_step1")
    engine.train_batch(iter(batches))
    assert open_at_step == [None] * 4
    assert engine.checkpoint_engine.flush(timeout_s=60)
    on_disk = engine.checkpoint_engine.load(str(tmp_path / "run" / "global_step1" / "layer_01-model_states.pt"))
    now = engine.module.state_dict()
    on_disk = {k: v for k, v in on_disk.items() if isinstance(v, torch.Tensor)}
    assert any(not torch.equal(saved[f"1.{k}"], now[f"1.{k}"]) for k in on_disk)  # the next step moved the weights
    assert all(torch.equal(v, saved[f"1.{k}"]) for k, v in on_disk.items())  # the checkpoint holds the saved ones


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_under_zero_a_load_gathers_the_weights_from_the_partitions_and_reads_no_layer_file(tmp_path, zero_stage):
    engine, *_ = build(tiny_config(tmp_path / "run", stages=1, zero_stage=zero_stage))
    batches = random_batches(engine)
    for _ in range(3):
        engine.train_batch(iter(batches))
    saved = {k: v.clone() for k, v in engine.module.state_dict().items() if v is not None}
    engine.save_checkpoint(str(tmp_path / "run"), tag="global_step3")
    assert engine.checkpoint_engine.flush(timeout_s=60)
    engine.train_batch(iter(batches))
    assert any(not torch.equal(engine.module.state_dict()[k], v) for k, v in saved.items())
    read = []
    load = engine.checkpoint_engine.load

    def noted(path, *args, **kwargs):
        read.append(os.path.basename(path))
        return load(path, *args, **kwargs)

    engine.checkpoint_engine.load = noted
    engine.load_checkpoint(str(tmp_path / "run"), tag="global_step3")
    assert all(torch.equal(engine.module.state_dict()[k], v) for k, v in saved.items())
    layer_files = [name for name in read if name.startswith("layer_")]
    assert (layer_files == []) == (zero_stage == 1), read
    if zero_stage == 1:
        # Without the partitions the weights would stay as they were: refused, not resumed from. DeepSpeed's
        # ZeRO loader says so (False) where _get_all_zero_checkpoints finds none (None); a missing
        # file raises.
        engine._get_all_zero_checkpoints = lambda *args: None
        with pytest.raises(RuntimeError, match="found no ZeRO partition files"):
            engine.load_checkpoint(str(tmp_path / "run"), tag="global_step3")
        del engine._get_all_zero_checkpoints
        for path in (tmp_path / "run" / "global_step3").glob("*optim_states.pt"):
            path.unlink()
        with pytest.raises(FileNotFoundError, match="optim_states.pt"):
            engine.load_checkpoint(str(tmp_path / "run"), tag="global_step3")


def test_vitp_trains_its_step_limit_after_each_checkpoint_once_it_has_a_window(tmp_path):
    config = tiny_config(tmp_path / "run", stages=1,
                         predictor={"name": "vitp", "history": 6, "train_budget_s": None, "train_steps": 3})
    config["cpsr"]["checkpoint"].update(interval=2, keep_last=6)
    engine, *_ = build(config)
    batches = random_batches(engine)
    for _ in range(14):
        engine.train_batch(iter(batches))
    # 7 checkpoints; an FFT window of 5 plus a target needs 6, so checkpoints 6 and 7 trained (the last on the
    # coordinator's background thread: one stage, no bubbles).
    engine.cpsr.work.coordinator.flush()
    assert engine.cpsr.work.predictor.trainer.steps == 6
    # A failure after one more iteration: the restart's predictor gets the six checkpoints' history and the
    # weights saved with the newest, those trained at checkpoint 6 (3 steps: 7 trains after it is saved).
    engine.train_batch(iter(batches))
    assert engine.checkpoint_engine.flush(timeout_s=60)
    engine.destroy()
    config["cpsr"]["recovery"] = {"mode": "predict"}
    restarted, *_ = build(config)
    predictor = restarted.cpsr.work.predictor
    assert restarted.cpsr.recovery.checkpoint == 14 and restarted.cpsr.recovery.reached == 15
    assert (list(predictor.history.iterations), predictor.trainer.steps) == ([4, 6, 8, 10, 12, 14], 3)
    restarted.destroy()


def test_a_second_job_on_a_run_directory_is_refused_until_the_first_is_gone(tmp_path):
    run_dir = tmp_path / "run"
    first, *_ = build(tiny_config(run_dir, stages=1))
    assert first.cpsr.lock.attempt == 1
    owner = rf"host {re.escape(socket.gethostname())} pid {os.getpid()} \(master 127\.0\.0\.1:\d+, started \S+, attempt 1\)"
    with pytest.raises(RunDirectoryBusy, match=rf"cpsr: run directory {re.escape(str(run_dir))} is in use by another job: {owner}"):
        build(tiny_config(run_dir, stages=1))
    first.destroy()
    second, *_ = build(tiny_config(run_dir, stages=1))
    assert second.cpsr.lock.attempt == 2
    assert json.loads((run_dir / LOCK).read_text())["attempt"] == 2
    second.destroy()


def test_an_attempt_follows_the_newest_any_node_recorded(tmp_path):
    """A node-local directory lost with its records (a replaced disk) does not count the job's attempts from 1 again."""
    lost = tmp_path / "node0"
    lock = acquire(str(lost), seen=3)
    try:
        assert lock.attempt == 4 and recorded_attempt(str(lost)) == 4
    finally:
        lock.release()
    again = acquire(str(lost), seen=2)  # its own record is newer than what the others saw
    again.release()
    assert again.attempt == 5


def test_a_killed_jobs_lock_vanishes_with_it(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import sys, time; sys.path.insert(0, {ROOT!r}); from cpsr_ds.runtime.rundir import acquire; "
                               f"acquire({str(run_dir)!r}); print('locked', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(RunDirectoryBusy, match=f"pid {holder.pid} "):
            build(tiny_config(run_dir, stages=1))
    finally:
        holder.kill()
        holder.wait()
    engine, *_ = build(tiny_config(run_dir, stages=1))
    assert engine.cpsr.lock.attempt == 2
    engine.destroy()


def test_a_kill_rank_beyond_the_world_size_is_rejected_before_the_engine_is_built(tmp_path):
    config = tiny_config(tmp_path / "run", stages=1, faults={"kill_rank": 1, "kill_at_iteration": 5})
    with pytest.raises(ValueError, match=r"cpsr\.faults\.kill_rank: 1 is not a rank of this job \(world size 1"):
        build(config)
    assert not (tmp_path / "run").exists()


def checkpoint_iterations(rows, kind):
    return sorted({r.iteration for r in rows if isinstance(r, kind)})


def test_interval_auto_checkpoints_at_the_planned_intervals_and_records_plans_costs_and_states(tmp_path):
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, stages=1, predictor={"name": "linear", "history": 3},
                         planner={"first_interval": 3, "max_interval": 5, "failure_rate_per_hour": 3600.0})
    config["cpsr"]["checkpoint"]["interval"] = "auto"
    config["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "job"}
    engine, *_ = build(config)
    batches = random_batches(engine)
    for _ in range(30):
        engine.train_batch(iter(batches))
    assert engine.checkpoint_engine.flush(timeout_s=60)
    engine.train_batch(iter(batches))  # the costs are written once seen persisted and bracketed
    bracketing = [w.iteration for w in engine.cpsr.measurements.meter.pending]
    # The losses the plans fit, kept in memory, are the journal's over the newest plan's window on.
    newest = runlog.read_plans(str(run_dir))[0][-1].iteration
    assert engine.cpsr.planning.losses == {i: loss for i, loss in journal_losses(str(run_dir)).items() if i >= newest // 2}
    engine.destroy()

    plans, problems = runlog.read_plans(str(run_dir))
    rows, more = runlog.read_measurements(str(run_dir))
    assert not problems and not more
    assert (plans[0].reason, plans[0].iteration, plans[0].T_c) == ("warm-up", 0, 3)
    assert plans[1].reason == "first" and plans[1].model == "empirical"
    for name in ("lambda_per_hour", "lambda", "iteration_time_s", "T_s", "persist", "xi", "N_p"):
        assert plans[1].inputs[name] not in (None, [None]), name
    checkpoints = checkpoint_iterations(rows, runlog.StateRow)
    assert checkpoints[:2] == [3, 6]
    for before, after in zip(checkpoints, checkpoints[1:]):
        in_force = [p for p in plans if p.iteration <= before][-1]
        assert after - before == in_force.T_c, (before, after, plans)
    assert all(1 <= p.T_c <= 5 for p in plans)
    states = [r for r in rows if isinstance(r, runlog.StateRow)]
    assert all(r.xi > 0 and r.n_p > 0 and r.predictor == "linear" for r in states)
    # linear predicts from 2 checkpoints: a held-out error from the third on.
    assert [r.held_out_error is not None for r in states] == [False, False] + [True] * (len(states) - 2)
    assert all(r.relative_error > 0 for r in states[2:])
    costs = [r for r in rows if isinstance(r, runlog.CostRow)]
    # Every checkpoint has its cost, in order, but the newest ones: the newest waits for the iterations after its
    # persist, and one whose persist a loaded machine stretched past the next checkpoint waits with it.
    assert checkpoints[-1] in bracketing
    assert checkpoint_iterations(rows, runlog.CostRow) + bracketing == checkpoints
    assert len(costs) >= len(checkpoints) // 2
    assert all(c.stall_s > 0 and math.isfinite(c.slowdown_s) and c.persist_s > 0 and c.nbytes > 0
               and c.iteration_time_s > 0 for c in costs)
    monitored = tmp_path / "csv" / "job"
    for name in ("cpsr_plan_T_c", "cpsr_plan_lambda_per_hour", "cpsr_checkpoint_slowdown_s",
                 "cpsr_checkpoint_stall_s", "cpsr_checkpoint_persist_s"):
        lines = (monitored / f"{name}.csv").read_text().splitlines()
        assert len(lines) >= 3, name
    assert len((monitored / "cpsr_checkpoint_slowdown_s.csv").read_text().splitlines()) == len(costs) + 1


def test_a_fixed_interval_checkpoints_at_its_multiples_and_measures_each(tmp_path):
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, stages=1, recovery={"mode": "recompute"})
    config["cpsr"]["checkpoint"].update(interval=4, strategy="torch")
    engine, *_ = build(config)
    batches = random_batches(engine)
    for _ in range(13):
        engine.train_batch(iter(batches))
    engine.destroy()
    rows, _ = runlog.read_measurements(str(run_dir))
    # 12's cost waits for the iterations after it that bracket its baseline; 8's closed when 12 began.
    assert checkpoint_iterations(rows, runlog.CostRow) == [4, 8]
    assert not checkpoint_iterations(rows, runlog.StateRow)  # no predictor in use
    assert all(r.persist_s == 0 and r.stall_s > 0 and math.isfinite(r.slowdown_s) for r in rows)
    assert not (run_dir / runlog.PLANS).exists()


def test_time_the_training_loop_spends_between_iterations_is_no_checkpoints_cost(tmp_path):
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, stages=1, recovery={"mode": "recompute"})
    config["cpsr"]["checkpoint"].update(interval=4)
    engine, *_ = build(config)
    batches = random_batches(engine)
    took, pauses = [], []
    for _ in range(9):
        t0 = time.perf_counter()
        engine.train_batch(iter(batches))
        took.append(time.perf_counter() - t0)
        # An evaluation, say: longer than a checkpoint's window of iterations could take, however loaded the machine.
        pauses.append(max(0.2, 5 * max(took)))
        time.sleep(pauses[-1])
    engine.destroy()
    rows, _ = runlog.read_measurements(str(run_dir))
    assert checkpoint_iterations(rows, runlog.CostRow)[:1] == [4]
    assert all(r.iteration_time_s <= max(took) and r.slowdown_s < min(pauses) for r in rows), (rows, took, pauses)


def test_the_predictors_weights_go_into_the_checkpoint_as_a_host_copy():
    from cpsr_ds.runtime.predictor_work import host_copy

    w, seed = torch.ones(3), torch.zeros(2, dtype=torch.uint8)
    state = {"model": {"w": w}, "curve": [{"loss": 1.0}], "steps": 2, "generator": (seed,)}
    saved = host_copy(state)
    w.add_(1)
    state["curve"][0]["loss"] = 5.0
    assert torch.equal(saved["model"]["w"], torch.ones(3)) and saved["curve"] == [{"loss": 1.0}]
    assert saved["steps"] == 2 and isinstance(saved["generator"], tuple)
    assert saved["generator"][0].device.type == "cpu" and saved["generator"][0].data_ptr() != seed.data_ptr()


def test_the_next_checkpoint_is_an_interval_after_the_newest_state_on_storage():
    from cpsr_ds.runtime.schedule import next_checkpoint_at

    assert next_checkpoint_at(40, 40, 12) == 52  # after a checkpoint, or a restart from one
    assert next_checkpoint_at(45, 40, 12) == 52  # a job resumed by prediction at 45 from checkpoint 40
    assert next_checkpoint_at(60, 40, 12) == 61  # ... at 60: its state on storage is already 20 iterations old


def test_after_a_predicting_restart_the_schedule_counts_from_the_checkpoint_predicted_from(tmp_path):
    run_dir = tmp_path / "run"
    # A failure rate this low plans the longest interval allowed: checkpoints every 4 iterations.
    config = tiny_config(run_dir, stages=1, predictor={"name": "linear", "history": 3}, recovery={"mode": "predict"},
                         planner={"first_interval": 4, "max_interval": 4, "failure_rate_per_hour": 1e-3})
    config["cpsr"]["checkpoint"]["interval"] = "auto"
    engine, *_ = build(config)
    batches = random_batches(engine)
    for _ in range(14):
        engine.train_batch(iter(batches))
    assert engine.checkpoint_engine.flush(timeout_s=60)
    engine.destroy()  # the journal is at 14, the newest checkpoint 12

    engine, *_ = build(config)
    report = engine.cpsr.recovery
    assert (report.method, report.checkpoint, report.resume_iteration) == ("predict", 12, 14), report
    assert engine.cpsr.scheduler.interval == 4 and engine.cpsr.scheduler.next_checkpoint == 16
    for _ in range(3):
        engine.train_batch(iter(batches))
    attempt = engine.cpsr.attempt
    engine.destroy()
    rows, _ = runlog.read_measurements(str(run_dir))
    assert [r.iteration for r in rows if isinstance(r, runlog.StateRow) and r.attempt == attempt] == [16]
