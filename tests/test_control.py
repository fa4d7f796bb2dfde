"""The controlled choice between PB-R and RB-R (recovery.mode auto), from its inputs."""

import math

import numpy as np
import pytest

from cpsr_ds.checkpoint.journal import ProgressJournal
from cpsr_ds.config import RecoveryConfig
from cpsr_ds.fitter import MIN_POINTS, fit_recent, loss_excess
from cpsr_ds.lag import CurveFit
from cpsr_ds.recovery import expected_loss_excess, fallback_reason


def journal(tmp_path, losses):
    j = ProgressJournal(str(tmp_path), rank=0)
    for iteration, loss in losses.items():
        j.append(iteration, loss)
    j.close()
    return str(tmp_path)


def curve(i):
    return 4.0 - 0.5 * math.log(i)  # falls fast early, slowly late


def test_fit_recovers_a_log_linear_curve_from_noisy_losses():
    rng = np.random.default_rng(0)
    losses = {i: curve(i) + rng.normal(0, 0.02) for i in range(1, 2001)}
    fitted = fit_recent(losses, 2000)
    b, a = fitted.coefficients
    assert b == pytest.approx(-0.5, rel=0.05) and a == pytest.approx(4.0, rel=0.02)
    exact = CurveFit(np.array([-0.5, 4.0]), 1, 2000)
    assert loss_excess(exact, 1000, 0) == 0.0
    assert loss_excess(exact, 1000, 10**6) == pytest.approx((4.0 - curve(1000)) / curve(1000))


def test_expected_loss_excess_reads_the_jobs_loss_curve(tmp_path):
    directory = journal(tmp_path, {i: curve(i) for i in range(1, 801)})
    for f, lag in ((200, 20), (800, 20), (800, 5)):
        assert expected_loss_excess(directory, f, lag) == pytest.approx((curve(f - lag) - curve(f)) / curve(f), rel=1e-3)
    assert expected_loss_excess(directory, 200, 20) > expected_loss_excess(directory, 800, 20)


def test_a_rerun_iteration_counts_once_and_a_short_journal_gives_no_estimate(tmp_path):
    losses = {i: curve(i) for i in range(1, 401)}
    directory = journal(tmp_path, {**losses, **{i: 99.0 for i in range(300, 350)}})
    journal(tmp_path, {i: losses[i] for i in range(300, 401)})  # the recomputed iterations, appended later
    assert expected_loss_excess(directory, 400, 10) == pytest.approx((curve(390) - curve(400)) / curve(400), rel=1e-3)
    assert expected_loss_excess(journal(tmp_path / "short", {i: 3.0 for i in range(1, MIN_POINTS)}), 20, 5) is None


@pytest.mark.parametrize("r, excess, recomputes", [
    (None, 0.001, "no held-out checkpoint"),
    (1.6, 0.001, "diverging"),
    (0.9, 0.02, "max_loss_excess"),
    (0.9, 0.004, None),
    (0.9, None, None),
])
def test_auto_recomputes_for_an_unchecked_or_diverging_predictor_or_too_much_loss(r, excess, recomputes):
    why = fallback_reason(RecoveryConfig(), r, lag=12.5, excess=excess)
    assert why is None if recomputes is None else recomputes in why
