"""Host snapshots (checkpoint.memory_interval): each rank's exact state in shared memory every few iterations,
and a restart after a process crash resuming from them rather than from the last checkpoint."""

import dataclasses
import os

import pytest
import torch

import cpsr_ds
from benchmarks.common.processes import TEST_MODEL, tiny_config
from conftest import run_job
from cpsr_ds.checkpoint.capture import dumps, host_snapshot
from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal
from cpsr_ds.config import ConfigError, CPSRConfig
from cpsr_ds.recovery import engine_state, read_reports
from cpsr_ds.recovery.sources import host_snapshot as snapshot_source
from examples.gpt.model import GPTConfig, gpt_pipeline
from support.checkpoints import landed_snapshots
from support.training import process_group, trained  # noqa: F401 (a fixture; process_group is autouse)


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_every_memory_interval_the_rank_s_exact_state_is_in_shared_memory(tmp_path, zero_stage):
    engine, batches = trained(tmp_path, zero_stage, iterations=4, memory_interval=2)
    at_4 = engine_state(engine)
    engine.train_batch(iter(batches))  # iteration 5: no snapshot due, the state moves on
    engine.cpsr.host_snapshots.wait(30)
    found = host_snapshot.read_snapshots(engine.cpsr.cfg.checkpoint, 0, attempt=1)
    assert sorted(snap.iteration for snap in found) == [2, 4]  # the one before is kept too
    (snap,) = [snap for snap in found if snap.iteration == 4]
    assert snap.reason == host_snapshot.WHAT
    assert all(torch.equal(snap.state[k], at_4[k]) for k in at_4)
    assert any(not torch.equal(v, at_4[k]) for k, v in engine_state(engine).items())
    assert engine.cpsr.host_snapshots.written == 2


def test_ranks_whose_newest_snapshots_differ_resume_from_the_newest_they_all_hold(tmp_path, monkeypatch):
    """The killed rank's snapshot of iteration 6 was cut off: it holds 4 (and 2); its peer holds 6 and 4."""
    engine, batches = trained(tmp_path, 0, iterations=6, memory_interval=2)
    engine.cpsr.host_snapshots.wait(30)
    cfg = engine.cpsr.cfg.checkpoint
    assert sorted(s.iteration for s in host_snapshot.read_snapshots(cfg, 0, attempt=1)) == [4, 6]
    monkeypatch.setattr(snapshot_source, "gathered", lambda mine: [mine, [2, 4]])
    assert snapshot_source.agreed_snapshot(cfg, engine, attempt=2, c=0, f=6).iteration == 4
    assert snapshot_source.agreed_snapshot(cfg, engine, attempt=2, c=4, f=6) is None  # none after c in common
    monkeypatch.setattr(snapshot_source, "gathered", lambda mine: [mine, [2]])
    assert snapshot_source.agreed_snapshot(cfg, engine, attempt=2, c=0, f=6) is None


def test_a_restart_reads_only_the_snapshot_it_takes_or_the_one_before_where_that_is_damaged(tmp_path, monkeypatch):
    engine, _ = trained(tmp_path, 0, iterations=6, memory_interval=2)
    engine.cpsr.host_snapshots.wait(30)
    cfg = engine.cpsr.cfg.checkpoint
    loaded, load = [], host_snapshot.load
    monkeypatch.setattr(host_snapshot, "load", lambda found: loaded.append(found[1]["iteration"]) or load(found))
    assert snapshot_source.agreed_snapshot(cfg, engine, attempt=2, c=0, f=6).iteration == 6
    assert loaded == [6]
    state_file = os.path.join(host_snapshot.snapshot_manifests(cfg, 0, attempt=1)[6][0], dumps.STATE_FILE)
    with open(state_file, "r+b") as f:
        f.seek(os.path.getsize(state_file) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    loaded.clear()
    assert snapshot_source.agreed_snapshot(cfg, engine, attempt=2, c=0, f=6).iteration == 4
    assert loaded == [6, 4]


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_a_fresh_engine_resumes_from_a_snapshot_alone_as_the_run_would_have_gone_on(tmp_path, zero_stage):
    """No checkpoint under it: the snapshot's state, counters, Adam step and learning rate (mid-warm-up, so that a
    rate left at the fresh engine's would show) continue the run exactly."""
    engine, batches = trained(tmp_path, zero_stage, iterations=6, memory_interval=3)
    (snap,) = [s for s in host_snapshot.read_snapshots(engine.cpsr.cfg.checkpoint, 0, attempt=1) if s.iteration == 6]
    config = tiny_config(tmp_path / "fresh", stages=1, zero_stage=zero_stage)
    model = gpt_pipeline(GPTConfig(**TEST_MODEL), num_stages=1, seed=2)
    fresh, *_ = cpsr_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert snapshot_source.resume_alone(fresh, snap) == 6
    assert (fresh.global_steps, fresh.global_samples) == (engine.global_steps, engine.global_samples)
    assert [g["lr"] for g in fresh.optimizer.param_groups] == [g["lr"] for g in engine.optimizer.param_groups]
    losses = [float(e.train_batch(iter(batches))) for e in (engine, fresh)]
    assert losses[0] == losses[1]
    after, resumed = engine_state(engine), engine_state(fresh)
    assert all(torch.equal(after[k], resumed[k]) for k in after)


def test_a_snapshot_without_the_optimizer_settings_is_not_resumed_from_alone(tmp_path):
    engine, _ = trained(tmp_path, 0, iterations=2, memory_interval=2)
    (snap,) = host_snapshot.read_snapshots(engine.cpsr.cfg.checkpoint, 0, attempt=1)
    older = dataclasses.replace(snap, counters={k: v for k, v in snap.counters.items() if k != "param_groups"})
    assert snapshot_source.resume_alone(engine, older) is None


def test_memory_interval_is_checked():
    with pytest.raises(ConfigError, match="checkpoint.memory_interval"):
        CPSRConfig.parse_block({"checkpoint": {"memory_interval": 0}})


@pytest.mark.serial  # under load the checkpoint of 8 may not commit by the kill at 13, and no snapshot is used then
@pytest.mark.parametrize("interval", [8, 100])
def test_a_crashed_process_on_a_surviving_node_resumes_from_the_newest_snapshot_every_rank_holds(tmp_path, shm_path,
                                                                                               interval):
    """PP = 2: rank 1 is SIGKILLed after iteration 13 (no dump), host snapshots every 2, checkpoints every 8 or
    none yet: the restart recomputes from the newest snapshot both ranks hold, that of 12 (or, where the kill came
    while it was still being written, that of 10), exactly as the failed job had computed."""
    kill_at, memory_interval = 13, 2
    config = tiny_config(tmp_path / "run", stages=2, recovery={"mode": "recompute"})
    config["cpsr"]["checkpoint"].update(survivor_dir=str(shm_path), interval=interval, memory_interval=memory_interval)
    failed = run_job(tmp_path, config, "--train-iters", 16, "--kill-rank", 1, "--kill-at-iteration", kill_at,
                     check=False)
    assert failed.returncode != 0
    newest = kill_at - kill_at % memory_interval
    common = max(landed_snapshots(config, 0) & landed_snapshots(config, 1))
    assert common in (newest, newest - memory_interval), common
    run_job(tmp_path, config, "--train-iters", 16)
    report = read_reports(str(tmp_path / "run"))[-1]
    assert (report.method, report.reached) == ("recompute", kill_at), report
    assert report.checkpoint == report.resume_iteration == common, (report, common)
    assert report.sources == {"0": "host snapshot", "1": "host snapshot"}, report
    assert report.failure_class == "process_crash"  # both ranks' node memory was still there
    for rank in (0, 1):
        entries = read_journal(journal_path(str(tmp_path / "run"), rank))
        first = {e.iteration: e.loss for e in entries[:kill_at]}
        redone = [e for e in entries[kill_at:] if e.iteration <= kill_at]
        assert [e.iteration for e in redone] == list(range(common + 1, kill_at + 1))
        assert all(e.loss == first[e.iteration] for e in redone)  # the exact state at common: the same iterations
