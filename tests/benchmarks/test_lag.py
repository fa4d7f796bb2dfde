import math

import numpy as np
import pytest

from benchmarks.common.lag import Unmeasurable, iteration_at, lag_at, late_lag, mean_ci95, summarize, transient
from cpsr_ds.planning.fitter import fit_curve


def reference_curve(iterations):
    """A smooth descending loss curve, like a language model's."""
    return 2.0 + 3.0 / np.sqrt(np.asarray(iterations, dtype=float))


@pytest.fixture
def fit():
    its = np.arange(10, 1001, 10)
    return fit_curve(its, reference_curve(its), lo=200, hi=800)


def test_fit_reproduces_a_smooth_curve_and_inverts_it(fit):
    for i in (250, 400, 700):
        assert fit(i) == pytest.approx(reference_curve(i), rel=2e-4)
        assert iteration_at(fit, float(reference_curve(i)), margin=100) == pytest.approx(i, abs=2)


def test_a_run_shifted_by_l_iterations_has_lag_l(fit):
    f, d, shift = 400, 40, 17
    points = {k: float(reference_curve(f + k - shift)) for k in range(0, 4 * d + 1, 8)}
    assert late_lag(fit, f, d, points, margin=100) == pytest.approx(shift, abs=1.5)
    ahead = {k: float(reference_curve(f + k + 10)) for k in points}
    assert late_lag(fit, f, d, ahead, margin=100) == pytest.approx(-10, abs=1.5)


def test_late_window_ignores_the_transient(fit):
    f, d = 400, 40
    points = {k: float(reference_curve(f + k - 5)) + (0.5 if k < 2 * d else 0.0) for k in range(0, 4 * d + 1, 8)}
    assert late_lag(fit, f, d, points, margin=100) == pytest.approx(5, abs=1.5)
    assert transient(fit, f, d, points, late=5, margin=100) == 80  # the first k of the settled stretch


def test_paired_estimate_removes_noise_shared_with_the_reference(fit):
    f, d, shift = 400, 40, 12
    rng = np.random.default_rng(0)
    bumps = {i: float(rng.normal(0, 0.01)) for i in range(300, 700)}  # batch effects at iteration i
    reference = {i: float(reference_curve(i)) + bumps[i] for i in bumps}
    points = {k: float(reference_curve(f + k - shift)) + bumps[f + k] for k in range(2 * d, 4 * d + 1, 8)}
    plain = late_lag(fit, f, d, points, margin=100)
    paired = late_lag(fit, f, d, points, margin=100, reference=reference)
    assert abs(paired - shift) < 1.0 < abs(plain - shift)


def test_loss_beyond_the_span_is_unmeasurable_not_clipped(fit):
    for loss in (0.0, 99.0):
        with pytest.raises(Unmeasurable, match=f"the loss {loss:.4f} lies outside .* iterations 150-850") as why:
            lag_at(fit, 500, loss, margin=50)
        assert why.value.kind == "out of range"


def shifted(curve, f, d, shift, step=8):
    """A recovered run's validation losses, ``shift`` iterations behind ``curve``, at k = 0..4d."""
    return {k: float(curve(f + k - shift)) for k in range(0, 4 * d + 1, step)}


def noisy_fit(curve, scatter, seed=0):
    its = np.arange(20, 1001, 20)
    losses = curve(its) + np.random.default_rng(seed).normal(0, scatter, len(its))
    return fit_curve(its, losses, lo=200, hi=800)


def unmeasurable(fit, points, f=400, d=40, margin=100) -> Unmeasurable:
    with pytest.raises(Unmeasurable) as why:
        late_lag(fit, f, d, points, margin=margin)
    return why.value


def test_a_flat_reference_gives_no_lag():
    flat = lambda i: np.full(np.shape(i), 2.0)  # noqa: E731
    its = np.arange(10, 1001, 10)
    why = unmeasurable(fit_curve(its, flat(its), lo=200, hi=800), shifted(flat, 400, 40, 17))
    assert why.kind == "flat" and "flat over iterations 480-560" in str(why)


def test_a_fall_within_the_references_scatter_is_flat_a_steeper_one_is_measured():
    """The same scatter (0.25 % of the loss): a fall 10x smaller over d is noise, the language-model curve's is not."""
    shallow = lambda i: 2.0 + 0.3 / np.sqrt(np.asarray(i, dtype=float))  # noqa: E731
    for seed in range(10):
        why = unmeasurable(noisy_fit(shallow, 0.005, seed), shifted(shallow, 400, 40, 17))
        assert why.kind == "flat" and "within its scatter" in str(why)
        lag = late_lag(noisy_fit(reference_curve, 0.005, seed), 400, 40, shifted(reference_curve, 400, 40, 17),
                       margin=100)
        assert math.isfinite(lag)


def test_a_rising_reference_gives_no_lag():
    rising = lambda i: 2.0 + np.asarray(i, dtype=float) / 1000  # noqa: E731
    its = np.arange(10, 1001, 10)
    why = unmeasurable(fit_curve(its, rising(its), lo=200, hi=800), shifted(rising, 400, 40, 17))
    assert why.kind == "not decreasing" and "does not decrease over iterations 440-560" in str(why)


def test_a_loss_the_fit_never_reaches_gives_no_lag(fit):
    """A run so far ahead that its loss lies below anything the fit reaches within the search."""
    why = unmeasurable(fit, {k: 1.0 for k in range(0, 161, 8)})
    assert why.kind == "out of range" and "the loss 1.0000 lies outside" in str(why)


def test_a_fit_that_rises_between_the_window_and_the_matched_iteration_gives_no_lag():
    """Loss bumps up around iterations 180-340 (a cubic in log-iterations): a loss the window shares with the
    curve before the bump maps to three iterations, and the first is no lag."""
    bump = lambda i: 2.0 - (np.log(np.asarray(i, dtype=float)) - 5.5) ** 3 + 0.3 * (np.log(i) - 5.5)  # noqa: E731
    its = np.arange(10, 1001, 10)
    fit = fit_curve(its, bump(its), lo=100, hi=800, degree=3)
    assert late_lag(fit, 400, 40, shifted(bump, 400, 40, 17), margin=50) == pytest.approx(17, abs=1.5)
    why = unmeasurable(fit, {k: 1.96 for k in range(80, 161, 8)}, margin=50)
    assert why.kind == "not decreasing" and "rises from iteration 1" in str(why)


def test_summary_keeps_unmeasurable_cases_out_of_the_numbers():
    out = summarize([0.7, 0.6, 0.8, -2.0], ["flat", "out of range", "flat"])
    assert out["median"] == pytest.approx(0.65)
    assert out["mean"] == pytest.approx(0.025)
    assert out["ci95"] == pytest.approx(list(mean_ci95([0.7, 0.6, 0.8, -2.0])[1:]))
    assert out["measured"] == 4
    assert out["unmeasurable"] == {"count": 3, "by_reason": {"flat": 2, "out of range": 1}}
    nothing = summarize([], ["not decreasing"])
    assert (nothing["median"], nothing["mean"], nothing["ci95"]) == (None, None, None)
    assert nothing["unmeasurable"]["count"] == 1


def test_fit_needs_enough_points():
    with pytest.raises(ValueError, match="need more than 3 reference points"):
        fit_curve([100, 200, 300], [3.0, 2.5, 2.2], lo=100, hi=300)


def test_mean_ci95_matches_student_t():
    mean, lo, hi = mean_ci95([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5
    assert hi - mean == pytest.approx(3.182446 * np.std([1, 2, 3, 4], ddof=1) / 2, rel=1e-5)
    assert mean - lo == pytest.approx(hi - mean)
    assert mean_ci95([3.0])[1:] == (-math.inf, math.inf)
