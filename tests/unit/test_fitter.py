"""The fitter's curves (Eq. 8, 11), the held-out error (Eq. 9), xi (Eq. 7) and the training phases."""

import math

import numpy as np
import pytest
import torch

from cpsr_ds.planning import fitter
from cpsr_ds.planning.fitter import (
    FLAT,
    NOT_POSITIVE,
    RISING,
    TOO_FEW,
    AccuracyFit,
    LossFit,
    NoFit,
    Phase,
    accuracy_fit,
    fit_loss_o,
    fit_loss_p,
    held_out_error,
    next_phase,
    XiSums,
    curvature_of,
    phases,
    stage_xi,
    xi_sums,
)
from cpsr_ds.integration.deepspeed.shard import share


def exponential(rate, intercept, ts, noise, seed=0):
    """exp(-rate t + intercept) times lognormal noise of relative size ``noise``."""
    rng = np.random.default_rng(seed)
    return {int(t): float(math.exp(-rate * t + intercept + rng.normal(0, noise))) for t in ts}


def test_loss_o_fit_recovers_alpha1_alpha2_from_noisy_losses_over_the_recent_window():
    losses = exponential(1e-3, 1.5, range(1, 2001), noise=0.02)
    fit = fit_loss_o(losses, 2000)
    assert isinstance(fit, LossFit)
    assert fit.alpha1 == pytest.approx(1e-3, rel=0.05) and fit.alpha2 == pytest.approx(1.5, abs=0.02)
    assert fit.rmse_log == pytest.approx(0.02, rel=0.1)
    assert (fit.lo, fit.hi, fit.n) == (1000, 2000, 1001)
    assert fit(1500) == pytest.approx(math.exp(-1.5 + 1.5), rel=0.01)
    # An earlier start widens the window; the losses past f are not read.
    wide = fit_loss_o({**losses, 2500: 1e-9}, 2000, start=200)
    assert (wide.lo, wide.n) == (200, 1801) and wide.alpha1 == pytest.approx(1e-3, rel=0.05)


def test_loss_p_fit_recovers_tau1_tau2_from_noisy_held_out_errors():
    T_c = 50
    errors = exponential(0.3 / T_c, -9.0, range(T_c, 13 * T_c, T_c), noise=0.1, seed=1)
    fit = fit_loss_p(list(errors.items()), T_c)
    assert isinstance(fit, AccuracyFit)
    assert fit.tau1 == pytest.approx(0.3, rel=0.1) and fit.tau2 == pytest.approx(-9.0, abs=0.15)
    assert (fit.T_c, fit.n) == (50, 12) and 0.05 < fit.rmse_log < 0.15
    assert fit(4 * T_c) == pytest.approx(math.exp(-1.2 - 9.0), rel=0.15)


FALLING = {t: math.exp(-0.01 * t) for t in range(1, 41)}


@pytest.mark.parametrize("losses, cause", [
    ({t: FALLING[t] for t in range(1, 15)}, TOO_FEW),
    ({}, TOO_FEW),
    ({**FALLING, 30: math.nan}, NOT_POSITIVE),
    ({**FALLING, 31: math.inf}, NOT_POSITIVE),
    ({**FALLING, 32: 0.0}, NOT_POSITIVE),
    ({**FALLING, 33: -1.0}, NOT_POSITIVE),
    ({t: 2.5 for t in range(1, 41)}, FLAT),
    (exponential(0.0, 1.0, range(1, 41), noise=0.05, seed=3), FLAT),  # noise without a trend
    (exponential(0.002, 1.0, range(1, 41), noise=0.2, seed=4), FLAT),  # a trend the noise hides
    ({t: math.exp(0.01 * t) for t in range(1, 41)}, RISING),
])
def test_loss_o_fallbacks(losses, cause):
    fit = fit_loss_o(losses, 40, start=1)
    assert isinstance(fit, NoFit) and not fit
    assert fit.cause == cause and fit.reason


@pytest.mark.parametrize("points, T_c, cause", [
    ([(50, 1e-4), (100, 5e-5)], 50, TOO_FEW),
    ([(50, 1e-4), (50, 5e-5), (50, 4e-5)], 50, TOO_FEW),  # one t: no slope
    ([(50, 1e-4), (100, 5e-5), (150, math.nan)], 50, NOT_POSITIVE),
    ([(50, 1e-4), (100, 5e-5), (150, math.inf)], 50, NOT_POSITIVE),
    ([(50, 1e-4), (100, 5e-5), (150, 0.0)], 50, NOT_POSITIVE),
    ([(50, 1e-4), (100, 5e-5), (150, 2.5e-5)], 0, NOT_POSITIVE),
    ([(50, 1e-4), (100, 5e-5), (150, 2.5e-5)], math.nan, NOT_POSITIVE),
    ([(50, 1e-4), (100, 1e-4), (150, 1e-4), (200, 1e-4)], 50, FLAT),
    ([(50, 1e-4), (100, 2e-4), (150, 4e-4), (200, 8e-4)], 50, RISING),
])
def test_loss_p_fallbacks(points, T_c, cause):
    fit = fit_loss_p(points, T_c)
    assert isinstance(fit, NoFit) and fit.cause == cause and fit.reason


def test_accuracy_fit_scales_errors_to_the_newest_spacing():
    # The error falls by e each checkpoint; the interval doubled after iteration 40, and errors grow as (h / T_c)^2.
    its = [10, 20, 30, 40, 60, 80, 100]
    errors = [(t, math.exp(-k) * ((t - its[k - 1]) / 20) ** 2 if k else 1.0) for k, t in enumerate(its)]
    fit = accuracy_fit(errors)
    assert isinstance(fit, AccuracyFit) and fit.T_c == 20
    # tau1 per checkpoint of 20 iterations: e falls once per 10 iterations before, per 20 after.
    assert 1.0 < fit.tau1 < 2.0
    assert not accuracy_fit(errors[:2]) and not accuracy_fit([])


def test_a_fit_is_either_no_fit_or_has_a_finite_positive_rate():
    rng = np.random.default_rng(5)
    fitted = 0
    for case in range(300):
        n = int(rng.integers(3, 40))
        ts = np.sort(rng.choice(np.arange(1, 200), size=n, replace=False))
        ys = np.exp(rng.normal(0, 0.01) * ts + rng.normal(0, rng.choice([0.0, 0.01, 0.5]), size=n))
        for fit in (fit_loss_o(dict(zip(ts.tolist(), ys.tolist())), 200, start=1),
                    fit_loss_p(list(zip(ts.tolist(), ys.tolist())), 7)):
            if isinstance(fit, NoFit):
                continue
            fitted += 1
            rate, intercept = (fit.alpha1, fit.alpha2) if isinstance(fit, LossFit) else (fit.tau1, fit.tau2)
            assert rate > 0 and math.isfinite(rate) and math.isfinite(intercept) and math.isfinite(fit.rmse_log)
    assert 50 < fitted < 550  # both outcomes occur


def state(params, **moments):
    out = {f"param/{name}": p for name, p in params.items()}
    for kind, values in moments.items():
        out.update({f"{kind}/{name}": v for name, v in values.items()})
    return out


def test_held_out_error_is_the_mean_squared_difference_per_parameter_over_parameters_only():
    truth = state({"w": torch.zeros(2, 3), "b": torch.zeros(2)}, exp_avg={"w": torch.zeros(2, 3), "b": torch.zeros(2)})
    predicted = state({"w": torch.full((2, 3), 0.5), "b": torch.tensor([1.0, -1.0])},
                      exp_avg={"w": torch.full((2, 3), 100.0), "b": torch.zeros(2)})
    # Per parameter (element), not per tensor: (6 * 0.25 + 2 * 1) / 8.
    assert held_out_error(predicted, truth) == pytest.approx(3.5 / 8)
    assert held_out_error(truth, truth) == 0.0


def test_held_out_error_of_a_diverged_prediction_is_inf_and_a_missing_parameter_is_named():
    truth = state({"w": torch.zeros(3)})
    assert held_out_error(state({"w": torch.tensor([0.0, math.nan, 1.0])}), truth) == math.inf
    assert held_out_error(state({"w": torch.tensor([0.0, math.inf, 1.0])}), truth) == math.inf
    with pytest.raises(ValueError, match="param/w is missing"):
        held_out_error({}, truth)
    with pytest.raises(ValueError, match=r"param/w is \(2,\)"):
        held_out_error(state({"w": torch.zeros(2)}), truth)


def test_xi_is_the_mean_second_moment_over_the_stages_parameters_after_an_adam_step():
    torch.manual_seed(0)
    w, b, frozen = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(4)), torch.zeros(5)
    beta2 = 0.95
    optimizer = torch.optim.AdamW([w, b], lr=1e-3, betas=(0.9, beta2))
    steps = []
    for _ in range(3):
        optimizer.zero_grad()
        ((w.sum(0) * b) ** 2).sum().backward()
        steps.append((w.grad.clone(), b.grad.clone()))
        optimizer.step()
    moments = {"w": optimizer.state[w]["exp_avg_sq"], "b": optimizer.state[b]["exp_avg_sq"]}
    curvature = stage_xi(state({"w": w.detach(), "b": b.detach(), "frozen": frozen}, exp_avg_sq=moments))
    # Eq. 7 unrolled from v_0 = 0: v_t = beta2 v_{t-1} + (1 - beta2) g_t^2, averaged over the 16 optimised values.
    v = [torch.zeros(3, 4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)]
    for grads in steps:
        v = [beta2 * vi + (1 - beta2) * g.double() ** 2 for vi, g in zip(v, grads)]
    assert curvature.xi == pytest.approx(float(sum(vi.sum() for vi in v)) / 16, rel=1e-5)
    assert curvature.n_p == 12 + 4 + 5


@pytest.mark.parametrize("size", [2, 3])
def test_the_shares_sums_give_the_whole_stages_xi(size):
    """Data-parallel ranks each sum their share (shard.share: a 1-element bias leaves some shares without it);
    the stage's xi and N_p come from the sums added up, as the ranks' all-reduce adds them."""
    g = torch.Generator().manual_seed(0)
    whole = state({"w": torch.randn(5, 7, generator=g), "b": torch.randn(1, generator=g)},
                  exp_avg_sq={"w": torch.rand(5, 7, generator=g), "b": torch.rand(1, generator=g)})
    parts = [xi_sums(share(whole, r, size)) for r in range(size)]
    added = XiSums(*(sum(column) for column in zip(*parts)))
    assert added.count == 36 and added.n_p == 36
    assert curvature_of(added).xi == pytest.approx(stage_xi(whole).xi, rel=1e-12)
    assert curvature_of(parts[0]).xi != pytest.approx(stage_xi(whole).xi, rel=1e-3)


@pytest.mark.parametrize("moments, cause", [
    ({}, TOO_FEW),
    ({"w": torch.zeros(3)}, NOT_POSITIVE),
    ({"w": torch.tensor([1.0, math.nan, 1.0])}, NOT_POSITIVE),
    ({"w": torch.tensor([1.0, math.inf, 1.0])}, NOT_POSITIVE),
])
def test_xi_fallbacks(moments, cause):
    curvature = stage_xi(state({"w": torch.zeros(3)}, exp_avg_sq=moments))
    assert isinstance(curvature, NoFit) and curvature.cause == cause


def test_a_phase_ends_when_the_accumulated_relative_change_of_xi_exceeds_the_threshold():
    xis = [(0, 1.0), (10, 1.02), (20, 1.04), (30, 1.06),  # 0.06 accumulated at 30: a new phase
           (40, 1.08), (50, 1.06), (60, 1.08),  # net 0.02, accumulated 0.06 / 1.06: another
           (70, 1.08), (80, 1.10)]
    got = phases(xis)
    assert [p.index for p in got] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [p.start for p in got] == [0, 0, 0, 30, 30, 30, 60, 60, 60]
    assert got[5] == Phase(1, 30, 1.06, 1.06, pytest.approx(0.04 / 1.06))
    assert got[-1].change == pytest.approx(0.02 / 1.08)
    # A coarser threshold keeps it one phase until the change passes it.
    assert [p.index for p in phases(xis, threshold=0.11)] == [0] * 6 + [1] * 3


def test_a_xi_that_is_not_finite_and_positive_leaves_the_phase_as_it_was():
    phase = next_phase(None, 0, 1.0)
    for bad in (math.nan, math.inf, 0.0, -1.0):
        assert next_phase(phase, 10, bad) is phase
        assert next_phase(None, 10, bad) is None
    assert [p and p.index for p in phases([(0, math.nan), (10, 2.0), (20, math.nan), (30, 2.2)])] == [None, 0, 0, 1]


@pytest.mark.parametrize("chunk", [7, 1 << 20])
def test_squared_distance_in_chunks_sums_the_squared_float32_differences_in_float64(monkeypatch, chunk):
    monkeypatch.setattr(fitter, "CHUNK", chunk)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(100, generator=g), torch.randn(100, generator=g) * 1e-4
    assert fitter.squared_distance(a, b) == pytest.approx(float((a - b).square().double().sum()), rel=1e-12)
    assert fitter.squared_distance(a, b) == pytest.approx(float((a.double() - b.double()).square().sum()), rel=1e-6)
    assert fitter.squared_distance(a, a) == 0.0


def test_squared_distance_sums_a_chunk_in_float64(monkeypatch):
    # 2^24 + 1 is not a float32: a chunk of 2^24 + 1 unit squares summed in float32 would lose the last one.
    monkeypatch.setattr(fitter, "CHUNK", 1 << 25)
    ones = torch.ones((1 << 24) + 1)
    assert fitter.squared_distance(ones, torch.zeros_like(ones)) == float((1 << 24) + 1)


def test_squared_distance_of_half_precision_tensors_is_taken_in_float32():
    a = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    b = torch.tensor([1.0 + 2 ** -7, 2.0], dtype=torch.bfloat16)
    assert fitter.squared_distance(a, b) == 2.0 ** -14
