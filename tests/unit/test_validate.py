"""One validation of every state recovery resumes from (cpsr_ds/recovery/validate.py), and a source that fails it
or cannot be read left for the next one.

The restarts run in one process (world size 1, gloo): a run trained, its survivor dump, host snapshot or
predictor summary planted with what a failing disk or another user may leave (re-checksummed, so that only
the validation can tell), then the same run directory started again.
"""

import glob
import logging
import math
import os

import pytest
import torch

from benchmarks.common.processes import tiny_config
from cpsr_ds.checkpoint.capture import dumps, host_snapshot, run_id
from cpsr_ds.checkpoint.storage import records
from cpsr_ds.checkpoint.storage.fileformat import read_snapshot
from cpsr_ds.predictor.base import Predictor
from cpsr_ds.recovery import engine_state
from cpsr_ds.recovery.sources import summaries
from cpsr_ds.recovery.validate import Spec, clamp_second_moments, problem, specs_of
from support.training import (build, cpsr_logs, process_group,  # noqa: F401 (fixtures; process_group is autouse)
                              random_batches)


def a_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"param/w": torch.randn(3, 2, generator=gen), "exp_avg/w": torch.randn(3, 2, generator=gen),
            "exp_avg_sq/w": torch.rand(3, 2, generator=gen)}


def altered(key: str, change) -> dict[str, torch.Tensor]:
    state = a_state()
    state[key] = change(state[key].clone())
    return state


def with_value(value: float, at: int = 4):
    def change(t):
        t.view(-1)[at] = value
        return t
    return change


def test_a_state_of_the_engines_shapes_finite_with_non_negative_second_moments_passes():
    state = a_state()
    assert problem(state, specs_of(state)) is None and problem(state) is None
    # A first moment, a parameter may be negative; a second moment of exactly zero is one Adam holds.
    assert problem(altered("exp_avg_sq/w", torch.zeros_like), specs_of(state)) is None
    assert (a_state()["exp_avg/w"] < 0).any() and (a_state()["param/w"] < 0).any()


@pytest.mark.parametrize("key, change, reason", [
    ("param/w", with_value(math.nan), "non-finite values in param/w"),
    ("exp_avg/w", with_value(-math.inf), "non-finite values in exp_avg/w"),
    ("exp_avg_sq/w", torch.neg, "a negative second moment"),
    ("exp_avg_sq/w", with_value(-1e-30), "a negative second moment (-1e-30) in exp_avg_sq/w"),
    ("param/w", lambda t: t.t(), "shape (2, 3) and dtype torch.float32 in param/w, where the engine holds (3, 2)"),
    ("exp_avg/w", lambda t: t.half(), "dtype torch.float16 in exp_avg/w, where the engine holds (3, 2) and "
                                      "torch.float32"),
])
def test_each_fault_is_named_with_its_tensor(key, change, reason):
    expected = specs_of(a_state())
    found = problem(altered(key, change), expected)
    assert found is not None and reason in found, found
    if "engine holds" not in reason:
        assert reason in problem(altered(key, change))  # the values are checked without the engine's shapes too


def test_a_missing_tensor_or_one_the_engine_has_no_place_for_is_named():
    expected = specs_of(a_state())
    state = a_state()
    del state["exp_avg_sq/w"]
    assert problem(state, expected) == "no tensor exp_avg_sq/w"
    assert problem({**a_state(), "exp_avg_sq/v": torch.ones(1)}, expected) == \
        "a tensor exp_avg_sq/v the engine has no place for"
    assert problem({}, {**expected, "param/v": Spec((1,), torch.float32)}) == "no tensor exp_avg/w (nor 3 more)"


def test_a_predicted_negative_second_moment_is_clamped_to_zero_in_a_new_tensor():
    state = altered("exp_avg_sq/w", lambda t: t - 0.5)
    negative = int((state["exp_avg_sq/w"] < 0).sum())
    assert negative > 0
    kept = state["exp_avg_sq/w"].clone()
    clamped, count = clamp_second_moments(state)
    assert count == negative and problem(clamped) is None
    assert torch.equal(clamped["exp_avg_sq/w"], kept.clamp(min=0))
    assert torch.equal(state["exp_avg_sq/w"], kept)  # the prediction's own tensor (may be the history's) untouched
    assert clamped["param/w"] is state["param/w"] and clamped["exp_avg/w"] is state["exp_avg/w"]


# ---------------------------------------------------------------- restarts from planted states

F = 11  # the first run's last iteration


def config(run_dir, mode: str, **checkpoint) -> dict:
    cfg = tiny_config(run_dir, stages=1, predictor={"name": "linear", "history": 3}, recovery={"mode": mode})
    cfg["cpsr"]["checkpoint"].update({"interval": 2, "keep_last": 4, "survivor_dir": str(run_dir.parent / "survivors"),
                                      **checkpoint})
    return cfg


def first_run(cfg: dict, dump: bool = False) -> dict[int, float]:
    """Train F iterations (each host snapshot in place before the next), dump if ``dump``; the losses."""
    engine, *_ = build(cfg)
    batches = random_batches(engine)
    losses = {}
    for _ in range(F):
        loss = engine.train_batch(iter(batches)).item()
        losses[engine.global_steps] = loss
        if engine.cpsr.host_snapshots is not None:
            engine.cpsr.host_snapshots.wait(30)
    if dump:
        assert engine.cpsr.survivor.dump("test")
    assert engine.checkpoint_engine.flush(timeout_s=60)
    engine.destroy()
    return losses


def negate_second_moment(directory: str) -> str:
    """Negate one second moment of the dump (or host snapshot) in ``directory`` and write it again with its
    manifest, checksum and all: a dump whose only fault is its values. Returns the tensor's key."""
    manifest = records.read_manifests(directory)[0]
    contents = read_snapshot(os.path.join(directory, dumps.STATE_FILE))
    key = sorted(k for k in contents["state"] if k.startswith("exp_avg_sq/"))[-1]
    contents["state"][key] = contents["state"][key].neg()
    dumps.write_dump(directory, contents, manifest, manifest["checksum"])
    return key


def restarted(cfg: dict, iterations: int = 3) -> tuple:
    """The run of ``cfg`` started again and trained ``iterations`` more: (its recovery report, its losses by
    iteration, its second moments all non-negative)."""
    engine, *_ = build(cfg)
    report = engine.cpsr.recovery
    batches = random_batches(engine)
    losses = {}
    for _ in range(iterations):
        loss = engine.train_batch(iter(batches)).item()
        losses[engine.global_steps] = loss
    sound = all(bool((t >= 0).all()) for k, t in engine_state(engine).items() if k.startswith("exp_avg_sq/"))
    engine.destroy()
    return report, losses, sound


def warnings_of(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


@pytest.mark.parametrize("mode", ["predict", "auto"])
def test_a_survivor_dump_with_a_negative_second_moment_is_left_out(tmp_path, cpsr_logs, mode):
    run_dir = tmp_path / "run"
    first_run(config(run_dir, mode), dump=True)
    directory = dumps.dump_dir(str(tmp_path / "survivors"), run_id.run_identity(str(run_dir)), 0)
    key = negate_second_moment(directory)
    report, losses, sound = restarted(config(run_dir, mode))
    assert report.reached == F and not (report.sources or {}).get("0", "").startswith("survivor"), report
    assert all(math.isfinite(loss) for loss in losses.values()) and sound, losses
    assert f"rank 0's survivor dump of iteration {F} is left out, the next source serves: it holds a negative " \
           f"second moment" in warnings_of(cpsr_logs) and key in warnings_of(cpsr_logs)


@pytest.mark.parametrize("mode", ["recompute", "auto"])
def test_a_host_snapshot_with_a_negative_second_moment_is_left_for_the_one_before(tmp_path, cpsr_logs, mode):
    """Checkpoints every 6, host snapshots every 2: at F = 11 the snapshots of 10 and 8 are after checkpoint 6;
    the one of 10 planted, the restart recomputes from the one of 8, exactly as the first run computed."""
    run_dir = tmp_path / "run"
    cfg = config(run_dir, mode, interval=6, memory_interval=2)
    first = first_run(cfg)
    root, run = str(tmp_path / "survivors"), run_id.run_identity(str(run_dir))
    slot = 10 // 2 % host_snapshot.SLOTS
    key = negate_second_moment(host_snapshot.snapshot_dir(root, run, 0, slot))
    report, losses, sound = restarted(cfg)
    assert (report.method, report.reached, report.resume_iteration) == ("recompute", F, 8), report
    assert report.sources == {"0": "host snapshot"}, report
    assert losses == {i: first[i] for i in (9, 10, 11)} and sound
    assert "rank 0's host snapshot of iteration 10 is left out" in warnings_of(cpsr_logs)
    assert key in warnings_of(cpsr_logs)


def test_a_prediction_past_zero_of_a_second_moment_is_clamped_and_resumed(tmp_path, cpsr_logs, monkeypatch):
    """linear with predicted moments, its second moments taken past zero (as extrapolating one that shrinks
    does): the restart predicts, with those values at zero, and trains on with finite losses."""
    run_dir = tmp_path / "run"
    cfg = config(run_dir, "predict")
    cfg["cpsr"]["predictor"]["moments"] = "predict"
    first_run(cfg)
    predict = Predictor.predict

    def past_zero(self, target, **options):
        predicted = predict(self, target, **options)
        return {k: t - t.max() / 2 if k.startswith("exp_avg_sq/") else t for k, t in predicted.items()}

    monkeypatch.setattr(Predictor, "predict", past_zero)
    report, losses, sound = restarted(cfg)
    assert (report.method, report.predictor, report.resume_iteration) == ("predict", "linear", F), report
    assert all(math.isfinite(loss) for loss in losses.values()) and sound, losses
    assert "negative values of Adam's second moments (exp_avg_sq) at iteration 11: set to zero" in \
        warnings_of(cpsr_logs)


def summary_path(run_dir, iteration: int) -> str:
    (path,) = glob.glob(os.path.join(os.path.dirname(summaries.path(str(run_dir), 0, iteration, 0)),
                                     f"{iteration:09d}-*.pt"))
    return path


def held_out_with_an_extra_field(summary: dict):
    return {**summary, "held_out": {**summary["held_out"], "spread": 0.1}}


@pytest.mark.parametrize("damage, said", [(held_out_with_an_extra_field, "cannot take its summary"),
                                          (lambda summary: [summary], "holds a list, not a summary")])
def test_a_summary_of_another_shape_means_the_full_history(tmp_path, cpsr_logs, damage, said):
    """trend keeps its slope and held-out error beside each checkpoint; one the predictor cannot take (a field
    more in its held-out error, a list for a dict) is the history's to replace, as a damaged one is."""
    run_dir = tmp_path / "run"
    cfg = config(run_dir, "predict")
    cfg["cpsr"]["predictor"] = {"name": "trend", "history": 3}
    first_run(cfg)
    path = summary_path(run_dir, 10)
    iteration, attempt = (int(part) for part in os.path.basename(path).removesuffix(".pt").split("-"))
    summary, _ = summaries.read(str(run_dir), 0, iteration, attempt)
    assert summary["held_out"] is not None
    summaries.write(str(run_dir), 0, iteration, attempt, summaries.encode(damage(summary)), keep=4)
    report, losses, _ = restarted(cfg)
    assert (report.method, report.predictor, report.checkpoint, report.resume_iteration) == \
        ("predict", "trend", 10, F), report
    assert all(math.isfinite(loss) for loss in losses.values())
    assert said in warnings_of(cpsr_logs) and "reading the full history instead" in warnings_of(cpsr_logs)
