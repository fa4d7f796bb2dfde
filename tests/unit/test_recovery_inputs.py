"""Recovery never trusts its inputs blindly: non-finite states, implausible journals, non-finite losses.

In one process (world size 1, gloo), on copies of one short run with checkpoints at
iterations 4, 6, 8 and 10 and a journal to iteration 11.
"""

import logging
import math
import shutil

import pytest
import torch

from benchmarks.common.processes import tiny_config
from cpsr_ds import recovery
from cpsr_ds.recovery.sources import checkpoint as checkpoint_source
from cpsr_ds.checkpoint.capture.journal import journal_path
from cpsr_ds.predictor.base import Predictor
from support.training import (build, cpsr_logs, process_group,  # noqa: F401 (fixtures; process_group is autouse)
                              random_batches)


F = 11  # the journal's last iteration


def config(run_dir, mode="predict"):
    cfg = tiny_config(run_dir, stages=1, predictor={"name": "linear", "history": 3}, recovery={"mode": mode})
    cfg["cpsr"]["checkpoint"].update(interval=2, keep_last=4)
    return cfg


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("inputs") / "run"
    engine, *_ = build(config(run_dir))
    batches = random_batches(engine)
    for _ in range(F):
        engine.train_batch(iter(batches))
    assert engine.checkpoint_engine.flush(timeout_s=60)
    engine.destroy()
    return run_dir


@pytest.fixture
def copy(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def errors(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def assert_finite(engine):
    state = recovery.engine_state(engine)
    assert all(bool(torch.isfinite(t).all()) for t in state.values())
    return state


def recovered(run_dir, mode="predict"):
    engine, *_ = build(config(run_dir, mode))
    report = engine.cpsr.recovery
    state = assert_finite(engine)
    engine.destroy()
    return report, state


@pytest.mark.parametrize("mode", ["predict", "recompute"])
def test_a_checkpoint_with_a_nan_is_left_out_and_the_newest_finite_one_is_c(copy, monkeypatch, cpsr_logs, mode):
    """The issue's reproduction: one NaN in the newest checkpoint's tensor, files intact."""
    load = checkpoint_source.load

    def poisoned(engine, directory, tag):
        client_state = load(engine, directory, tag)
        if tag == "global_step10":
            with torch.no_grad():
                next(engine.module.parameters()).view(-1)[3] = math.nan
        return client_state

    monkeypatch.setattr(checkpoint_source, "load", poisoned)
    report, _ = recovered(copy, mode)
    assert report.checkpoint == 8 and report.reached == F
    assert (report.method, report.resume_iteration) == (("predict", F) if mode == "predict" else ("recompute", 8))
    assert any(f"checkpoint global_step10 in {copy} has non-finite values in param/" in e for e in errors(cpsr_logs))


@pytest.mark.parametrize("mode", ["predict", "recompute"])
def test_a_checkpoint_whose_bytes_changed_is_left_out_when_loaded_and_the_newest_sound_one_is_c(copy, cpsr_logs,
                                                                                                   mode):
    """A flipped byte keeps the file's size, so only its checksum tells: read when recovery loads it."""
    newest = max((p for p in (copy / "global_step10").rglob("*") if p.is_file() and p.suffix != ".json"),
                 key=lambda p: p.stat().st_size)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    report, _ = recovered(copy, mode)
    assert report.checkpoint == 8 and report.reached == F
    assert any(f"checkpoint global_step10 in {copy} is damaged, leaving it out" in e and str(newest) in e
               for e in errors(cpsr_logs)), errors(cpsr_logs)


def test_recomputing_reads_the_data_of_the_checkpoint_it_loads_only(copy, monkeypatch):
    read = []
    verify = checkpoint_source.catalog.verify

    def counted(ckpt_dir, ckpt, read_data=True, *args, **kwargs):
        if read_data:
            read.append(ckpt.tag)
        return verify(ckpt_dir, ckpt, read_data, *args, **kwargs)

    monkeypatch.setattr(checkpoint_source.catalog, "verify", counted)
    report, _ = recovered(copy, "recompute")
    assert report.checkpoint == 10 and read == ["global_step10"]


def test_a_prediction_with_a_nan_is_not_written(copy, monkeypatch):
    predict = Predictor.predict

    def poisoned(self, target, **options):
        predicted = predict(self, target, **options)
        key = next(k for k in predicted if k.startswith("param/"))
        predicted[key][0] = math.inf
        return predicted

    monkeypatch.setattr(Predictor, "predict", poisoned)
    report, state = recovered(copy)
    assert (report.method, report.checkpoint, report.resume_iteration) == ("recompute", 10, 10)
    assert "the predicted state has non-finite values in param/" in report.reason
    assert "non-finite values in param/" in report.describe()


def test_each_checkpoint_goes_to_the_predictor_as_it_is_loaded_and_a_nonfinite_one_never(copy, monkeypatch):
    """The predictor copies each share before the next load, so that recovery holds the history once: the
    loads and the predictor's copies alternate, and a checkpoint with a NaN is loaded and never handed over."""
    events, load, observe = [], checkpoint_source.load, Predictor.observe

    def noted_load(engine, directory, tag):
        client_state = load(engine, directory, tag)
        events.append(("load", engine.global_steps))
        if tag == "global_step8":
            with torch.no_grad():
                next(engine.module.parameters()).view(-1)[3] = math.nan
        return client_state

    def noted_observe(self, iteration, state):
        events.append(("observe", iteration))
        observe(self, iteration, state)

    monkeypatch.setattr(checkpoint_source, "load", noted_load)
    monkeypatch.setattr(Predictor, "observe", noted_observe)
    report, _ = recovered(copy)
    assert events == [("load", 6), ("observe", 6), ("load", 8), ("load", 10), ("observe", 10)]
    assert (report.method, report.checkpoint, report.resume_iteration) == ("predict", 10, F)


@pytest.mark.parametrize("bogus", [1000000, 99999999999])
def test_a_journal_entry_far_ahead_is_ignored_and_logged_with_its_file(copy, cpsr_logs, bogus):
    with open(journal_path(str(copy), 0), "a") as f:
        f.write(f"{bogus},2.9,1795340903.0\n")
    report, _ = recovered(copy)
    assert (report.method, report.reached, report.checkpoint, report.resume_iteration) == ("predict", F, 10, F)
    assert f"cpsr recovery: journal {journal_path(str(copy), 0)} line {F + 1} jumps from iteration {F} to {bogus}: " \
           "ignoring this line and every line after it" in errors(cpsr_logs)


def test_f_beyond_the_planned_training_length_recomputes(copy, cpsr_logs):
    cfg = config(copy)
    cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {"total_num_steps": F - 1, "warmup_num_steps": 2}}
    engine, *_ = build(cfg)
    report = engine.cpsr.recovery
    engine.destroy()
    assert (report.method, report.checkpoint, report.resume_iteration) == ("recompute", 10, 10)
    assert report.reason == f"the journal's iteration {F} is beyond the planned training length, {F - 1} " \
                            "iterations (the LR schedule's total_num_steps)"
    assert any(report.reason in e for e in errors(cpsr_logs))


def test_a_nonfinite_loss_is_reported_at_once_and_never_checkpointed(tmp_path, monkeypatch, cpsr_logs):
    engine, *_ = build(config(tmp_path / "run"))
    saved = []
    monkeypatch.setattr(engine, "save_checkpoint", lambda directory, client_state=None: saved.append(engine.global_steps))
    for iteration, loss in [(1, 2.5), (2, math.nan), (3, math.inf), (4, math.nan), (5, 2.4), (6, 2.3)]:
        engine.global_steps = iteration
        engine.cpsr.after_iteration(engine, loss)
    engine.destroy()
    assert saved == [6]
    assert errors(cpsr_logs) == ["cpsr: the training loss is nan at iteration 2: training diverged; no checkpoint is "
                            "saved at an iteration whose loss is not finite"]
