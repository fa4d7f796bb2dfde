import math

import numpy as np
import pytest

from cpsr_ds.lag import fit_curve, lag_at, late_lag, mean_ci95, transient


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
        assert fit.iteration_at(float(reference_curve(i)), margin=100) == pytest.approx(i, abs=2)


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


def test_loss_beyond_the_span_is_clipped_not_extrapolated_without_end(fit):
    assert lag_at(fit, 500, 0.0, margin=50) == pytest.approx(500 - 850)
    assert lag_at(fit, 500, 99.0, margin=50) == pytest.approx(500 - 150)


def test_fit_needs_enough_points():
    with pytest.raises(ValueError, match="need more than 3 reference points"):
        fit_curve([100, 200, 300], [3.0, 2.5, 2.2], lo=100, hi=300)


def test_mean_ci95_matches_student_t():
    mean, lo, hi = mean_ci95([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5
    assert hi - mean == pytest.approx(3.182446 * np.std([1, 2, 3, 4], ddof=1) / 2, rel=1e-5)
    assert mean - lo == pytest.approx(hi - mean)
    assert mean_ci95([3.0])[1:] == (-math.inf, math.inf)
