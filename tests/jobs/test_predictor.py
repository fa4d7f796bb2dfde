"""Predictor package on synthetic checkpoint trajectories: FDD, samples, the simple
extrapolators, VITP training and prediction, state dicts, memory."""

import copy
import io
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpsr_ds.predictor import NotReady, kind_of, make_predictor
from cpsr_ds.predictor import fdd, samples
from cpsr_ds.predictor import trainer as trainer_module
from cpsr_ds.predictor.simple import damping_gain, fit_damping, increment_gram, intervals
from cpsr_ds.predictor.state import PIECE, History
from cpsr_ds.predictor.trainer import FILL_CHECK_PIECE, HELD_OUT_PIECE, significantly_lower
from cpsr_ds.integration.deepspeed.shard import assemble, shapes_of, share

# Checkpoints at variable intervals (30..70 iterations), the failure between two.
ITERATIONS = [0, 40, 75, 140, 180, 230, 300, 335, 390, 450, 490, 540]
TARGET = 570


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # The 2-core CI machine runs other suites alongside; one thread keeps step times stable.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def decay(t, n=4096, k=0.004, noise=0.0, seed=0):
    """Parameters decaying exponentially toward a target (rate k per iteration), plus
    independent noise per checkpoint; Adam-like moments that follow the gradient."""
    gen = torch.Generator().manual_seed(seed)
    x0, target = torch.randn(n, generator=gen), 0.1 * torch.randn(n, generator=gen)
    factor = math.exp(-k * t)
    x = target + (x0 - target) * factor
    if noise:
        x = x + noise * torch.randn(n, generator=torch.Generator().manual_seed(seed + 1 + t))
    grad = k * (x0 - target) * factor
    return {"param/w": x.reshape(64, -1), "exp_avg/w": grad.reshape(64, -1), "exp_avg_sq/w": grad.square().reshape(64, -1)}


def fed(name, states=decay, iterations=ITERATIONS, **options):
    p = make_predictor(name, **options)
    for it in iterations:
        p.observe(it, states(it))
    return p


def rel_error(pred, truth, last, key="param/w"):
    return float((pred[key] - truth[key]).norm() / (last[key] - truth[key]).norm())


# --- state layout -------------------------------------------------------------

def test_kind_comes_from_the_key_prefix():
    assert kind_of("param/h.0.attn.weight") == "param"
    assert kind_of("exp_avg/h.0.attn.weight") == "exp_avg"
    assert kind_of("exp_avg_sq/x") == "exp_avg_sq"
    assert kind_of("step/x") == kind_of("param") == kind_of("weight") == "other"


# --- FDD ----------------------------------------------------------------------

def test_a_checkpoint_observed_a_piece_at_a_time_joins_the_history_whole_after_its_last_piece():
    state = {"param/w": torch.randn(2 * PIECE + 3), "param/b": torch.randn(4, 5),
             "exp_avg/w": torch.randn(2 * PIECE + 3), "exp_avg/b": torch.randn(4, 5), "step": torch.tensor(7)}
    whole, pieces = History(3, align=8), History(3, align=8)
    whole.append(40, state)
    copied = 0
    for _ in pieces.appending(40, state):
        copied += 1
        assert len(pieces) == 0 and not pieces.others
    assert copied == 2 * 3  # per kind b's 20 values and w's 2 PIECE + 3 in pieces of PIECE values
    assert list(pieces.iterations) == [40] and pieces.others.keys() == whole.others.keys() == {"step"}
    assert all(torch.equal(pieces.flats[0][k], whole.flats[0][k]) for k in ("param", "exp_avg"))
    assert pieces.flats[0]["param"].numel() % 8 == 0
    assert pieces.flats[0]["param"][2 * PIECE + 3 + 20:].eq(0).all()  # the alignment padding


def test_fdd_round_trip_with_nothing_dropped_is_exact():
    y = torch.randn(3, 7, 50, dtype=torch.float64)
    bands = fdd.Bands(7, low=1, mid=2)
    low, mid, high = fdd.split(y, bands, dim=1)
    torch.testing.assert_close(fdd.assemble(low, mid, high, window=7, dim=1), y, rtol=0, atol=1e-12)


def test_mid_band_of_the_default_bands_is_forty_percent():
    assert fdd.Bands(5).mid_volume == pytest.approx(0.4)
    assert fdd.Bands(8, low=1, mid=2).mid_volume == pytest.approx(0.5)
    with pytest.raises(ValueError):
        fdd.Bands(4, low=2, mid=2)


def test_dropping_high_bins_removes_injected_high_frequency_noise():
    w = 8
    i = torch.arange(w, dtype=torch.float64)[:, None]
    phase = torch.rand(1, 100, dtype=torch.float64) * 6.28
    clean = 0.5 + 0.3 * torch.sin(2 * math.pi * i / w + phase) + 0.2 * torch.cos(4 * math.pi * i / w)
    noise = 0.2 * torch.cos(2 * math.pi * 3 * i / w + 2 * phase) + 0.1 * (-1.0) ** i
    denoised = fdd.denoise(clean + noise, fdd.Bands(w, low=1, mid=2), dim=0)
    torch.testing.assert_close(denoised, clean, rtol=0, atol=1e-12)


# --- samples ------------------------------------------------------------------

def test_windows_are_strided_with_a_target_within_one_stride():
    wins = samples.windows(8, 3, max_stride=2)
    assert {len(w.inputs) for w in wins} == {3}
    for w in wins:
        stride = w.inputs[1] - w.inputs[0]
        assert stride in (1, 2) and list(w.inputs) == list(range(w.inputs[0], w.inputs[-1] + 1, stride))
        assert w.inputs[-1] < w.target <= min(w.inputs[-1] + stride, 7)
    # stride 1: starts 0..4, one target each; stride 2: starts 0..2, two targets unless past the end
    assert len(wins) == 5 + (2 + 2 + 1)


def test_gathered_samples_have_the_right_shapes_and_time_stamps():
    token = 16
    series = [torch.arange(64, dtype=torch.float32) + 1000 * c for c in range(6)]
    window = samples.Window((1, 2, 4), 5)
    rows = torch.tensor([3, 0])
    batch = samples.gather(series, window.inputs, rows, token)
    assert batch.shape == (2, 3, token)
    torch.testing.assert_close(batch[0, 2], series[4][3 * token:4 * token])
    times, target = window.times(ITERATIONS)
    assert times.tolist() == [40.0, 75.0, 180.0] and target == 230
    feats = samples.time_features(times, target)
    mean = (180 - 40) / 2
    assert feats.shape == (4, 2)
    torch.testing.assert_close(feats[:, 0], torch.tensor([35, 35, 105, 50]) / mean)
    torch.testing.assert_close(feats[:, 1], torch.tensor([-140, -105, 0, 50]) / mean)


# --- simple extrapolators -----------------------------------------------------

def linear_states(t):
    a = torch.linspace(-1, 1, 300)
    return {
        "param/a": (a + 0.002 * t).reshape(20, 15),
        "param/h": (a[:10] - 0.001 * t).to(torch.float16),
        "exp_avg/a": (0.01 * a + 1e-5 * t).reshape(20, 15),
        "exp_avg_sq/a": (0.55 - 0.001 * t + 0 * a).reshape(20, 15),
        "step": torch.tensor(t),
    }


def test_linear_is_exact_on_a_linear_trajectory_and_keeps_keys_shapes_dtypes():
    p = fed("linear", linear_states)
    out = p.predict(TARGET)
    truth = linear_states(TARGET)
    assert {k: (v.shape, v.dtype) for k, v in out.items()} == {k: (v.shape, v.dtype) for k, v in truth.items()}
    torch.testing.assert_close(out["param/a"], truth["param/a"], rtol=0, atol=1e-5)
    torch.testing.assert_close(out["param/h"], truth["param/h"])
    last = linear_states(ITERATIONS[-1])
    for key in ("exp_avg/a", "exp_avg_sq/a", "step"):
        torch.testing.assert_close(out[key], last[key], rtol=0, atol=0)
    # float16 storage of param/h bounds the exactness of the held-out prediction
    assert p.validation_error().relative < 1e-2


def test_moments_predicted_on_request_and_exp_avg_sq_never_negative():
    for name in ("linear", "damped", "ridge"):
        out = fed(name, linear_states, moments="predict").predict(TARGET)
        truth = linear_states(TARGET)
        torch.testing.assert_close(out["exp_avg/a"], truth["exp_avg/a"], rtol=0, atol=1e-5)
        # the linear trend of exp_avg_sq crosses zero before the target
        assert float(truth["exp_avg_sq/a"].min()) < 0 and float(out["exp_avg_sq/a"].min()) == 0.0
    kept = fed("linear", linear_states, params="keep").predict(TARGET)
    torch.testing.assert_close(kept["param/a"], linear_states(ITERATIONS[-1])["param/a"], rtol=0, atol=0)


def test_a_prediction_read_in_place_shares_the_kept_moments_with_the_history_and_is_otherwise_alike():
    p = fed("trend")
    newest = p.history.flats[-1]
    copied, in_place = p.predict(TARGET), p.predict(TARGET, kept_views=True)
    assert all(torch.equal(copied[k], in_place[k]) for k in copied)
    for key in ("exp_avg/w", "exp_avg_sq/w"):
        ours = newest[key.partition("/")[0]]
        assert in_place[key].data_ptr() == ours.data_ptr()
        assert copied[key].data_ptr() != ours.data_ptr()
    assert in_place["param/w"].data_ptr() != newest["param"].data_ptr()
    assert torch.equal(p.predict(TARGET)["param/w"], copied["param/w"])  # predicting changed no history


def test_trend_is_exact_on_a_linear_trajectory_and_averages_out_checkpoint_noise():
    out = fed("trend", linear_states).predict(TARGET)
    torch.testing.assert_close(out["param/a"], linear_states(TARGET)["param/a"], rtol=0, atol=1e-5)

    def drifting(t, gen=torch.Generator()):
        gen.manual_seed(t)
        return {"param/w": 0.001 * t + 0.02 * torch.randn(4096, generator=gen)}

    truth, last = {"param/w": torch.full((4096,), 0.001 * TARGET)}, drifting(ITERATIONS[-1])
    err_trend = rel_error(fed("trend", drifting, span=4).predict(TARGET), truth, last)
    err_linear = rel_error(fed("linear", drifting).predict(TARGET), truth, last)
    assert err_trend < 0.8 * err_linear


def test_trend_predicts_from_the_newest_checkpoint_and_its_summary_as_from_the_history():
    states = lambda t: decay(t, noise=1e-3)
    full = fed("trend", states)
    summary = full.summary(full.validation_error())
    assert summary["slope"]["param"].dtype == torch.bfloat16
    short = make_predictor("trend")
    short.observe(ITERATIONS[-1], states(ITERATIONS[-1]))
    assert not short.ready()
    assert short.load_summary(summary) and short.ready()
    assert short.validation_error() == full.validation_error()
    expected, got, last = full.predict(TARGET), short.predict(TARGET), states(ITERATIONS[-1])
    step = expected["param/w"] - last["param/w"]
    assert step.abs().max() > 0
    # The slope is kept in bf16: the step is rounded to 8 bits.
    assert torch.all((got["param/w"] - expected["param/w"]).abs() <= step.abs() * 2**-8 + 1e-7)
    torch.testing.assert_close(got["exp_avg/w"], last["exp_avg/w"], rtol=0, atol=0)
    # The next checkpoint (a restarted job's first) is held out against the kept slope, as the full history's
    # newest would be against its own: a failure before the second one may still predict.
    short.observe(TARGET, states(TARGET))
    full.observe(TARGET, states(TARGET))
    held_out, reference = short.validation_error(), full.validation_error()
    assert held_out is not None and held_out.iteration == TARGET
    assert held_out.relative == pytest.approx(reference.relative, rel=0.02)
    assert short.summary(held_out)["held_out"]["relative"] == held_out.relative


@pytest.mark.parametrize("change", ["iteration", "span", "size", "name"])
def test_a_summary_that_does_not_fit_is_refused(change):
    states = lambda t: decay(t)
    summary = fed("trend", states).summary(None)
    summary = {**summary, "slope": dict(summary["slope"])}
    short = make_predictor("trend", span=3 if change == "span" else 4)
    newest = ITERATIONS[-2] if change == "iteration" else ITERATIONS[-1]
    short.observe(newest, states(newest))
    if change == "size":
        summary["slope"]["param"] = summary["slope"]["param"][:-1]
    if change == "name":
        summary["name"] = "linear"
    assert not short.load_summary(summary) and not short.ready()


def test_only_trend_summarizes_and_needs_two_checkpoints_for_it():
    assert make_predictor("trend").summary(None) is None
    for name in ("skip", "linear", "damped"):
        assert not make_predictor(name).summarizes and fed(name, lambda t: decay(t)).summary(None) is None


def test_damping_gain_spans_linear_to_skip():
    assert damping_gain(0.0, 50, 20) == pytest.approx(20 / 50)
    assert damping_gain(0.01, 50, 50) == pytest.approx(math.exp(-0.5))
    assert damping_gain(100.0, 50, 20) == pytest.approx(0.0, abs=1e-12)


def test_damped_fits_the_decay_rate_and_beats_linear():
    k = 0.004
    states = lambda t: decay(t, k=k, noise=1e-4)
    damped = fed("damped", states)
    assert damped.fitted_damping()["param/w"] == pytest.approx(k, rel=0.05)
    truth, last = states(TARGET), states(ITERATIONS[-1])
    err_damped = rel_error(damped.predict(TARGET), truth, last)
    err_linear = rel_error(fed("linear", states).predict(TARGET), truth, last)
    assert err_damped < 0.5 * err_linear < 0.5
    assert damped.validation_error().relative < fed("linear", states).validation_error().relative


def test_fit_damping_recovers_zero_and_heavy_damping():
    its = ITERATIONS[:8]
    steps = intervals(its)
    straight = [torch.full((10,), 0.01 * t) for t in its]
    assert fit_damping(increment_gram(straight), steps) == pytest.approx(0.0, abs=1e-6)
    noise = [torch.randn(1000, generator=torch.Generator().manual_seed(t)) for t in its]
    assert damping_gain(fit_damping(increment_gram(noise), steps), 50, 25) < 0.2


def test_ridge_beats_skip_on_a_smooth_trajectory():
    states = lambda t: decay(t, noise=1e-3)
    ridge = fed("ridge", states)
    truth, last = states(TARGET), states(ITERATIONS[-1])
    assert rel_error(ridge.predict(TARGET), truth, last) < 0.3
    assert ridge.validation_error().relative < 0.3
    assert fed("skip", states).validation_error().relative == 1.0


def test_misuse_is_refused():
    p = make_predictor("damped")
    with pytest.raises(NotReady):
        p.predict(10)
    p.observe(0, decay(0))
    p.observe(10, decay(10))
    assert not p.ready() and p.validation_error() is None
    with pytest.raises(ValueError, match="not after"):
        p.observe(10, decay(10))
    with pytest.raises(ValueError, match="layout"):
        p.observe(20, {"param/w": torch.zeros(3)})
    p.observe(20, decay(20))
    with pytest.raises(ValueError, match="before the last"):
        p.predict(15)
    with pytest.raises(ValueError, match="unknown predictor"):
        make_predictor("oracle")
    with pytest.raises(ValueError):
        make_predictor("linear", moments="extrapolate")


# --- VITP ---------------------------------------------------------------------

VITP_SMALL = dict(token_size=256, batch_chunks=16, min_train_steps=20, d_model=32)


def test_vitp_training_loss_decreases_and_its_prediction_beats_skip():
    states = lambda t: decay(t, noise=1e-3)
    p = fed("vitp", states, **VITP_SMALL)
    assert not p.ready()
    untrained_val_loss, untrained_relative, _ = p.trainer.validate()
    assert untrained_relative == pytest.approx(1.0)  # a zero head starts as skip
    for _ in range(4):
        p.step(n_steps=40)
    assert p.ready() and p.trainer.steps == 160
    curve = p.trainer.curve
    assert curve[-1].train_loss < 0.5 * curve[0].train_loss
    assert max(c.val_loss for c in curve) < 0.1 * untrained_val_loss
    assert [c.steps for c in curve] == [40, 80, 120, 160] and curve[-1].seconds > curve[0].seconds > 0
    truth, last = states(TARGET), states(ITERATIONS[-1])
    assert rel_error(p.predict(TARGET), truth, last) < 0.5
    assert p.validation_error().relative < 0.5


def test_vitp_split_across_two_replicas_samples_half_the_chunks_each_and_still_beats_skip(monkeypatch):
    """Each data-parallel replica trains on its own share of the stage's state (shard.share) with half the
    stage's chunks per step: together they sample what one predictor of the whole stage does."""
    states = lambda t: decay(t, noise=1e-3)  # noqa: E731
    stage = fed("vitp", states, **VITP_SMALL)
    replicas = [fed("vitp", lambda t, r=r: share(states(t), r, 2), shards=2, **VITP_SMALL) for r in range(2)]
    sampled = []
    real = trainer_module.descending
    monkeypatch.setattr(trainer_module, "descending",
                        lambda model, opt, kind, batches, values: sampled.append(values) or real(model, opt, kind,
                                                                                                 batches, values))
    stage.step(n_steps=1)
    for p in replicas:
        p.step(n_steps=1)
    token = VITP_SMALL["token_size"]
    assert sampled == [16 * token, 8 * token, 8 * token]
    assert (replicas[0].trainer.val_chunks, stage.trainer.val_chunks) == (128, 256)
    assert replicas[0].options["shards"] == 2 and stage.options["shards"] == 1
    for p in replicas:
        p.step(n_steps=159)
        assert p.ready()
    truth, last = states(TARGET), states(ITERATIONS[-1])
    predicted = assemble([p.predict(TARGET) for p in replicas], shapes_of(truth))
    assert rel_error(predicted, truth, last) < 0.5


@pytest.mark.parametrize("shards", [0, -1, 1.5])
def test_vitp_refuses_a_split_into_no_whole_number_of_replicas(shards):
    with pytest.raises(ValueError, match="whole number of replicas"):
        make_predictor("vitp", **VITP_SMALL).split_work(shards)


def test_vitp_step_respects_a_time_budget():
    p = fed("vitp", decay, **VITP_SMALL)
    report = p.step(budget_s=0.3)
    assert report.steps >= 1 and report.seconds < 0.3 + 0.5
    assert fed("vitp", decay, iterations=ITERATIONS[:4], **VITP_SMALL).step(n_steps=5).steps == 0


def test_vitp_training_in_pieces_pauses_after_each_micro_batch_and_trains_as_in_one_go():
    """The coordinator runs vitp's training a piece at a time, a bubble's worth each, other work in the pauses: a
    piece is a micro-batch of ``micro_chunks`` chunks (a step's last with its optimizer step), the held-out check
    the last one. Run so, with held-out checks between the pieces, it trains as in one go."""
    whole, pieced = (fed("vitp", decay, micro_chunks=4, **VITP_SMALL) for _ in range(2))
    whole.step(n_steps=3)
    pieces = pieced.training(n_steps=3)
    pauses = 0
    for _ in pieces:
        pauses += 1
        pieced.trainer.validate()  # another job's work in the pause: the network in eval mode, no gradients
    assert pauses == 3 * (VITP_SMALL["batch_chunks"] // 4) + 1
    assert pieced.trainer.steps == whole.trainer.steps == 3 and len(pieced.trainer.curve) == 1
    assert pieced.trainer.curve[0].val_loss == whole.trainer.curve[0].val_loss
    for name, weight in whole.trainer.model.state_dict().items():
        assert torch.equal(weight, pieced.trainer.model.state_dict()[name]), name


@pytest.mark.parametrize("fill_check", [False, True])
def test_vitp_never_trains_on_a_held_out_chunk(fill_check):
    """16 chunks: the last, 15, is held out for the fill check, and its neighbour after it would be chunk 0."""
    p = fed("vitp", decay, **VITP_SMALL)
    if fill_check:
        p.reserve_fill_check()
    held = {0, 10} | ({5, 15} if fill_check else set())
    rows = torch.cat([p.trainer._train_rows("param") for _ in range(50)])
    assert not held & set(rows.tolist())
    assert set(rows.tolist()) == set(range(16)) - held


def test_vitp_training_names_the_piece_after_its_last_step_at_the_pause_before_it():
    # The coordinator keeps the held-out check's cost apart from the micro-batches' (coordinator.PieceCost.named).
    p = fed("vitp", decay, **VITP_SMALL)
    names = list(p.training(n_steps=2))
    assert names[-2:] == [HELD_OUT_PIECE, None] and set(names[:-2]) == {None}, names  # the steps' pieces first
    names = list(p.trainer.training(n_steps=2, validate=False, then=FILL_CHECK_PIECE))
    assert names[-1] == FILL_CHECK_PIECE and set(names[:-1]) == {None}, names


def test_vitp_filling_keeps_the_weights_that_do_best_on_its_check_and_keeps_them_when_stopped():
    states = lambda t: decay(t, noise=1e-3)  # noqa: E731
    filled, stopped = (fed("vitp", states, fill_every=2, **VITP_SMALL) for _ in range(2))
    for p in (filled, stopped):
        p.reserve_fill_check()
        p.step(n_steps=5)
    start = filled.trainer.validate(check=True)[1]
    pieces = sum(1 for _ in itertools.islice(filled.filling(), 5000))
    assert pieces < 5000  # it ended: a block of two steps stopped lowering the check's error
    assert filled.trainer.validate(check=True)[1] <= start
    assert (filled.trainer.steps - 5) % 2 == 0  # the undone block's steps are not counted
    before = copy.deepcopy(stopped.trainer.model.state_dict())
    filling = stopped.filling()
    assert next(filling) == FILL_CHECK_PIECE  # names the check before the first block, which runs next
    next(filling)  # the check
    next(filling)  # the block's first step (one micro-batch): the weights move
    assert any(not torch.equal(w, before[k]) for k, w in stopped.trainer.model.state_dict().items())
    filling.close()  # the next checkpoint drops the job: back to the best, the weights it began with
    assert stopped.trainer.steps == 5
    for name, weight in stopped.trainer.model.state_dict().items():
        assert torch.equal(weight, before[name]), name
    assert list(fed("vitp", states, **VITP_SMALL).filling()) == []  # no check reserved: no filling


def test_vitp_filling_waits_fill_patience_checks_for_a_new_best_and_ends_on_the_best():
    p = fed("vitp", decay, fill_every=1, fill_patience=2, **VITP_SMALL)
    p.reserve_fill_check()
    p.step(n_steps=3)
    # The check's errors at the start, then after each fill step (every chunk alike, so no noise): the best after
    # the third step, then two misses.
    errors = iter([1.0, 0.9, 0.95, 0.8, 0.85, 0.82, 0.5])
    p.trainer.check_errors = lambda: torch.full((8,), next(errors), dtype=torch.float64)
    seen = {}
    for _ in p.filling():
        seen.setdefault(p.trainer.steps, copy.deepcopy(p.trainer.model.state_dict()))
    assert list(errors) == [0.5]  # it ended after the second miss in a row
    assert sorted(seen) == [3, 4, 5, 6, 7, 8] and p.trainer.steps == 6
    for name, weight in p.trainer.model.state_dict().items():
        assert torch.equal(weight, seen[6][name]), name


def test_a_lower_check_error_counts_only_beyond_the_chunks_spread():
    before = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], dtype=torch.float64)
    assert significantly_lower(before - 0.5, before)  # every chunk lower alike
    assert not significantly_lower(before, before) and not significantly_lower(before + 0.5, before)
    # The same total improvement, from one chunk among chunks that move both ways: noise.
    mixed = before + torch.tensor([-4.0, 0.5, -0.5, 0.5, -0.5, 0.5, -0.5, 0.0], dtype=torch.float64)
    assert mixed.sum() == (before - 0.5).sum() and not significantly_lower(mixed, before)
    assert significantly_lower(torch.tensor([0.5]), torch.tensor([1.0]))  # one chunk: its sign


def test_vitp_check_errors_are_the_fill_checks_squared_errors_per_chunk():
    p = fed("vitp", lambda t: decay(t, noise=1e-3), **VITP_SMALL)
    p.reserve_fill_check()
    p.step(n_steps=3)
    errors = p.trainer.check_errors()
    _, relative, per_kind = p.trainer.validate(check=True)
    assert errors.numel() == 2 * len(p.trainer._kinds())  # chunks 5 and 15 of 16, each kind
    assert float(errors.sum()) == pytest.approx(sum(e for e, _, _ in per_kind.values()), rel=1e-9)
    assert relative == pytest.approx(math.sqrt(float(errors.sum()) / sum(b for _, b, _ in per_kind.values())))


def test_vitp_steps_without_their_held_out_check_train_alike_and_add_no_curve_point():
    checked, unchecked = (fed("vitp", decay, **VITP_SMALL) for _ in range(2))
    checked.step(n_steps=3)
    report = unchecked.step(n_steps=3, validate=False)
    assert report.steps == 3 and math.isnan(report.val_loss) and not unchecked.trainer.curve
    assert len(checked.trainer.curve) == 1
    for name, weight in checked.trainer.model.state_dict().items():
        assert torch.equal(weight, unchecked.trainer.model.state_dict()[name]), name


@pytest.mark.parametrize("name", ["skip", "linear", "trend", "damped", "ridge", "vitp"])
def test_state_dict_round_trip_gives_identical_predictions(name):
    options = VITP_SMALL if name == "vitp" else {}
    p = fed(name, lambda t: decay(t, noise=1e-3), moments="predict", **options)
    if name == "vitp":
        p.step(n_steps=25)
    buf = io.BytesIO()
    torch.save(p.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=False)
    q = make_predictor(name, **sd["options"])
    q.load_state_dict(sd)
    for key, value in p.predict(TARGET).items():
        assert torch.equal(value, q.predict(TARGET)[key]), key
        if key.startswith("exp_avg_sq/"):
            assert float(value.min()) >= 0
    if name == "vitp":
        light = make_predictor(name, **sd["options"])
        light.load_state_dict(p.state_dict(include_history=False))
        for it in ITERATIONS[-light.history.capacity:]:
            light.observe(it, decay(it, noise=1e-3))
        assert torch.equal(light.predict(TARGET)["param/w"], p.predict(TARGET)["param/w"])
        assert light.trainer.curve == p.trainer.curve


def test_vitp_peak_memory_is_under_200_mb():
    out = subprocess.run(
        [sys.executable, "-m", "cpsr_ds.predictor.footprint", "--chunks", "4096", "--steps", "5", "--threads", "1"],
        capture_output=True, text=True, check=True, timeout=120, cwd=Path(__file__).resolve().parents[2],
    )
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert 0 < figures["train_peak_mib"] <= 200
    assert figures["predict_working_peak_mib"] <= 200


# --- the memory cap (predictor.memory_mb) --------------------------------------

def test_vitp_accounts_its_weights_optimizer_samples_and_batch_from_the_tensors():
    p = fed("vitp", decay, **VITP_SMALL)
    trainer, token, window = p.trainer, VITP_SMALL["token_size"], p.bands.window
    weights = sum(w.numel() * 4 for w in trainer.model.parameters())
    p.step(n_steps=1)
    adam = sum(t.numel() * t.element_size() for s in trainer.optimizer.state.values() for t in s.values())
    f = trainer.footprint
    assert (f.weights, f.optimizer) == (weights, adam)
    assert adam == 2 * weights + 4 * len(list(trainer.model.parameters()))  # both moments and a step count each
    # Everything fits under 200 MiB: the history of the predicted kind (parameters) lives on the device.
    assert not f.streamed and f.batch == VITP_SMALL["batch_chunks"]
    assert f.samples == p.history.capacity * 4096 * 4
    # A step's activations grow by the same bytes with every chunk of the batch.
    per_chunk = trainer.costs.step_per_chunk
    assert per_chunk > (window + 1) * token * 4
    assert f.activations == trainer.costs.step_fixed + f.batch * per_chunk
    assert f.total == f.weights + f.optimizer + f.samples + f.activations


def test_under_a_small_cap_vitp_streams_smaller_batches_and_predicts_the_same():
    free = fed("vitp", decay, **VITP_SMALL)
    need = free.trainer.footprint
    capped = fed("vitp", decay, memory_mb=0.5 * need.total / 2**20, **VITP_SMALL)
    f = capped.trainer.footprint
    assert f.streamed and 1 <= f.batch < VITP_SMALL["batch_chunks"] and f.total <= 0.5 * need.total
    assert f.samples == f.batch * (capped.bands.window + 1) * VITP_SMALL["token_size"] * 4
    for p in (free, capped):
        p.step(n_steps=30)
    # The same samples in micro-batches: the gradients differ only by float rounding.
    assert capped.trainer.curve[-1].train_loss == pytest.approx(free.trainer.curve[-1].train_loss, rel=1e-3)
    torch.testing.assert_close(capped.predict(TARGET), free.predict(TARGET), rtol=1e-4, atol=1e-5)
    assert capped.options["memory_mb"] == pytest.approx(0.5 * need.total / 2**20)


def test_a_cap_below_one_chunk_names_the_key_and_the_sizes():
    with pytest.raises(ValueError, match=r"predictor\.memory_mb \(0\.5 MiB\).*weights .* MiB \+ optimizer state .* MiB "
                                         r"\+ samples .* MiB \+ activations .* MiB = .* MiB"):
        make_predictor("vitp", memory_mb=0.5)


def test_vitp_peak_memory_stays_under_a_small_cap():
    out = subprocess.run(
        [sys.executable, "-m", "cpsr_ds.predictor.footprint", "--chunks", "1024", "--steps", "3", "--threads", "1",
         "--memory-mb", "40"],
        capture_output=True, text=True, check=True, timeout=120, cwd=Path(__file__).resolve().parents[2],
    )
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["streamed"] and figures["batch"] < 256 and figures["accounted_mib"] <= 40
    assert 0 < figures["train_peak_mib"] <= 40
    assert figures["predict_working_peak_mib"] <= 40



def test_vitp_on_cuda_without_a_gpu_stops_the_start_naming_the_setting(monkeypatch):
    from cpsr_ds.config import CPSRConfig
    from cpsr_ds.recovery import new_predictor

    def block(device):
        return CPSRConfig.parse_block({"predictor": {"name": "vitp", "history": 6, "device": device},
                                       "checkpoint": {"keep_last": 6}})

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="predictor.device is cuda, but this process sees no CUDA device"):
        new_predictor(block("cuda"))
    assert next(new_predictor(block("cpu")).trainer.model.parameters()).device.type == "cpu"
