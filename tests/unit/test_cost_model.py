"""The recovery cost model (Eq. 13-14, the empirical model), its loss-excess guard and its check against measured lags."""

import math

import numpy as np
import pytest

from cpsr_ds.planning.cost_model import (
    PREDICT,
    RECOMPUTE,
    Case,
    EmpiricalModel,
    Estimate,
    PaperModel,
    evaluate,
    paper_model,
    recovery_choice,
)
from cpsr_ds.planning.fitter import FLAT, AccuracyFit, LossFit, NoFit, StageCurvature, fit_recent, loss_excess
from cpsr_ds.planning.fault_tolerance_cost import PbrParams, prediction_deviation
from cpsr_ds.planning.calibration import END_OF_TRAINING_COS_MIN_RATIO
from cpsr_ds.planning.lr_schedule import shape, warmup_cosine

P = PbrParams(alpha1=1e-3, alpha2=1.0, tau1=0.5, tau2=-20.0, xi=1e-6, N_p=1e6)


def eq13_by_hand(f, c, T_c, p, exact=True):
    """Eq. 13 from Eq. 10 at c scaled by (d / T_c)^2, against the loss of Eq. 11 at f."""
    delta_F = prediction_deviation(c, T_c, p) * ((f - c) / T_c) ** 2
    x = delta_F / math.exp(-p.alpha1 * f + p.alpha2)
    return (math.log1p(x) if exact else x) / p.alpha1


@pytest.mark.parametrize("f, c, T_c", [(1050, 1000, 100), (1099, 1000, 100), (3020, 3000, 50), (560, 500, 50)])
def test_paper_model_is_eq13_with_the_predictor_at_c_predicting_d_ahead(f, c, T_c):
    for exact in (True, False):
        est = PaperModel(P, T_c, exact).estimate(f, c, "trend")
        assert est and est.model == ("paper" if exact else "paper-eq14")
        assert est.lag == pytest.approx(eq13_by_hand(f, c, T_c, P, exact), rel=1e-9)
        assert est.inputs["d"] == f - c and est.inputs["T_c"] == T_c and est.inputs["tau1"] == P.tau1


def test_eq14_approximates_eq13_where_the_excess_is_small_and_overestimates_where_not():
    small, large = PaperModel(P, 100), PaperModel(PbrParams(1e-3, 1.0, 0.5, 10.0, 1e-6, 1e6), 100)
    assert small.estimate(1100, 1000, "x").inputs["relative_excess"] < 1e-3
    assert PaperModel(P, 100, exact=False).estimate(1100, 1000, "x").lag == pytest.approx(
        small.estimate(1100, 1000, "x").lag, rel=1e-3)
    assert large.estimate(1100, 1000, "x").inputs["relative_excess"] > 1
    assert PaperModel(large.params, 100, exact=False).estimate(1100, 1000, "x").lag > 1.5 * large.estimate(1100, 1000, "x").lag


def test_paper_lag_grows_with_the_distance_predicted_and_falls_as_the_predictor_learns():
    model = PaperModel(P, 100, exact=False)
    assert model.estimate(1100, 1000, "x").lag / model.estimate(1050, 1000, "x").lag == pytest.approx(
        4 * math.exp(P.alpha1 * 50), rel=1e-9)
    # tau1 / T_c > alpha1: one more checkpoint learnt lowers the error faster than the loss falls
    assert model.estimate(2050, 2000, "x").lag < model.estimate(1050, 1000, "x").lag
    assert model.estimate(1000, 1000, "x").lag == 0.0


def test_paper_lag_stays_finite_where_the_excess_is_beyond_float_range():
    huge = PbrParams(1e-3, 1.0, 1e-6, 800.0, 1.0, 1e9)
    est = PaperModel(huge, 100).estimate(1100, 1000, "x")
    assert math.isfinite(est.lag) and est.lag > 800 / huge.alpha1


def test_paper_model_from_the_fitter_results_takes_t_c_from_the_accuracy_fit():
    model = paper_model(LossFit(1e-3, 1.0, 0.01, 500, 1000, 501), AccuracyFit(0.5, -20.0, 50.0, 0.1, 8),
                        StageCurvature(1e-6, 1_000_000))
    assert model.params == P and model.T_c == 50.0
    assert model.estimate(1050, 1000, "trend").lag == pytest.approx(eq13_by_hand(1050, 1000, 50, P))


def test_paper_model_without_a_fit_gives_no_estimate_and_says_which_fit_is_missing():
    model = paper_model(NoFit(FLAT, "losses do not fall measurably"), AccuracyFit(0.5, -20.0, 50.0, 0.1, 8),
                        NoFit("too few", "no exp_avg_sq in the state"))
    est = model.estimate(1050, 1000, "trend")
    assert not est and est.lag is None
    assert "loss curve (Eq. 11): losses do not fall measurably" in est.reason and "xi (Eq. 7)" in est.reason
    choice = recovery_choice(est, 50, lambda lag: 0.0, 0.005, 1.5)
    assert choice.method == RECOMPUTE and "losses do not fall measurably" in choice.reason


def test_empirical_model_is_one_minus_rho_times_d_per_predictor():
    model = EmpiricalModel()
    assert model.estimate(1100, 1000, "trend").lag == pytest.approx(31.0)
    assert model.estimate(1100, 1000, "skip").lag == pytest.approx(80.9)
    assert model.estimate(1100, 1000, "skip").inputs == {"d": 100, "rho": 0.191}
    unknown = model.estimate(1100, 1000, "oracle")
    assert not unknown and "'oracle'" in unknown.reason and "trend" in unknown.reason


def decaying(rates, place):
    """The shape of the schedule ``rates`` at ``place`` of the run."""
    f = int(place * len(rates))
    return shape(rates[:f], rates[f:])


COSINE = warmup_cosine(2000, END_OF_TRAINING_COS_MIN_RATIO)  # the schedule the profile was measured under


def test_empirical_model_takes_rho_by_the_share_of_a_decaying_schedule_still_ahead():
    early, middle, late = (EmpiricalModel(schedule=decaying(COSINE, place)).estimate(1000, 900, "trend")
                           for place in (0.25, 0.5, 0.75))
    assert early.lag == pytest.approx(134.3, rel=1e-3) and early.inputs["rho"] == pytest.approx(-0.343, abs=1e-3)
    assert early.inputs["place"] == 0.25 and early.inputs["remaining"] == pytest.approx(0.566, abs=1e-3)
    assert middle.lag == pytest.approx(38.5, rel=1e-3) and late.lag == pytest.approx(9.4)
    # Linear between the measured points, constant beyond them.
    assert EmpiricalModel(schedule=decaying(COSINE, 0.05)).estimate(1000, 900, "trend").inputs["rho"] == -0.343
    assert EmpiricalModel(schedule=decaying(COSINE, 0.99)).estimate(1000, 900, "trend").inputs["rho"] == 0.906
    between = EmpiricalModel(schedule=decaying(COSINE, 0.4)).estimate(1000, 900, "trend").inputs["rho"]
    assert -0.343 < between < 0.615
    # A linear decay has nearly the same share ahead at the same places; a warmup-stable-decay more of it.
    linear = [1 - t / 2000 for t in range(2000)]
    wsd = [1.0 if t < 1600 else 1 - (t - 1600) / 400 for t in range(2000)]
    for place, rho in ((0.25, -0.343), (0.5, 0.615), (0.75, 0.906)):
        assert EmpiricalModel(schedule=decaying(linear, place)).rho("trend")[0] == pytest.approx(rho, abs=0.06)
    assert [EmpiricalModel(schedule=decaying(wsd, place)).rho("trend")[0] < rho
            for place, rho in ((0.5, 0.615), (0.75, 0.906))] == [True, True]
    # A predictor with no profile, a constant schedule, or one the caller does not know keeps the rho over [2d, 4d].
    assert EmpiricalModel(schedule=decaying(COSINE, 0.25)).estimate(500, 400, "linear").inputs == {"d": 100, "rho": 0.484}
    for schedule in (shape([1.0] * 10, [1.0] * 10), None):
        assert EmpiricalModel(schedule=schedule).estimate(500, 400, "trend").inputs == {"d": 100, "rho": 0.69}


def test_a_schedule_of_unknown_shape_gives_no_estimate_and_says_why():
    rising = EmpiricalModel(schedule=shape([1.0] * 5, [1.0, 2.0, 1.0])).estimate(500, 400, "trend")
    assert not rising and rising.reason.startswith("no end-of-training estimate: the rate rises ahead")
    choice = recovery_choice(rising, 100, lambda lag: 0.0, 0.005, 1.6)
    assert choice.method == RECOMPUTE and "the rate rises ahead" in choice.reason


def test_early_in_a_decaying_run_the_empirical_model_recomputes_and_says_where():
    early = recovery_choice(EmpiricalModel(schedule=decaying(COSINE, 0.25)).estimate(500, 450, "trend"), 50,
                            lambda lag: 0.0, 0.005, 1.6)
    assert early.method == RECOMPUTE
    assert early.reason == ("empirical estimates a lag of 67.1 iterations (rho -0.34 at 25% of the planned run, 57% of "
                            "its learning-rate area ahead), not below the 50 recomputing costs")
    late = recovery_choice(EmpiricalModel(schedule=decaying(COSINE, 0.75)).estimate(1500, 1450, "trend"), 50,
                           lambda lag: 0.0, 0.005, 1.6)
    assert late.method == PREDICT and "(rho 0.91 at 75% of the planned run, 7% of" in late.reason


def test_beyond_the_horizon_the_predictor_was_checked_at_the_empirical_lag_grows_as_the_paper_models():
    model = EmpiricalModel(horizon=50)
    assert model.estimate(1050, 1000, "trend").lag == pytest.approx(15.5)  # d = horizon: (1 - rho) d
    far = model.estimate(1100, 1000, "trend")
    # (d / T_c)^DISTANCE_EXPONENT in the paper's model: twice the distance, four times the lag at d = horizon.
    assert far.lag == pytest.approx(4 * 15.5) and far.inputs == {"d": 100, "rho": 0.69, "horizon": 50}
    choice = recovery_choice(far, 100, lambda lag: 0.0, 0.005, 1.6)
    assert "(100 iterations ahead, beyond the 50 its held-out check predicted)" in choice.reason
    assert EmpiricalModel(horizon=None).estimate(1100, 1000, "trend").lag == pytest.approx(31.0)


def test_empirical_model_scales_with_the_share_of_the_parameters_predicted():
    whole, half = EmpiricalModel().estimate(1100, 1000, "trend"), EmpiricalModel(share=0.5).estimate(1100, 1000, "trend")
    assert half.lag == pytest.approx(whole.lag / 2) and half.inputs["share"] == 0.5
    assert EmpiricalModel(share=0.0).estimate(1100, 1000, "trend").lag == 0.0
    for share in (1.5, -0.1, math.nan):
        est = EmpiricalModel(share=share).estimate(1100, 1000, "trend")
        assert not est and "share predicted" in est.reason


@pytest.mark.parametrize("model", [EmpiricalModel(), PaperModel(P, 100)])
@pytest.mark.parametrize("f, c", [(900, 1000), (math.nan, 1000), (1100, None)])
def test_no_estimate_without_a_failure_after_the_checkpoint(model, f, c):
    est = model.estimate(f, c, "trend")
    assert not est and "no failure to estimate" in est.reason


# ---------------------------------------------------------------- the guard and the choice


def sqrt_curve_losses(n=2000):
    """A fast-falling loss 2 + 30 / sqrt(t): steep early, flat late."""
    return {t: 2.0 + 30.0 / math.sqrt(t) for t in range(1, n + 1)}


def test_choice_predicts_late_and_recomputes_early_by_the_jobs_own_loss_curve():
    losses = sqrt_curve_losses()
    est = EmpiricalModel().estimate(2000, 1900, "trend")  # lag 31 of 100
    late = recovery_choice(est, 100, lambda lag: loss_excess(fit_recent(losses, 2000), 2000, lag), 0.005, 1.6)
    assert late.method == PREDICT and late.guard_lag == pytest.approx(1.6 * 31.0)
    assert 0 < late.loss_excess <= 0.005
    est = EmpiricalModel().estimate(200, 100, "trend")
    early = recovery_choice(est, 100, lambda lag: loss_excess(fit_recent(losses, 200), 200, lag), 0.005, 1.6)
    assert early.method == RECOMPUTE and early.loss_excess > 0.005 and "above max_loss_excess" in early.reason


def test_choice_asks_the_curve_about_the_pessimistic_lag():
    asked = []
    choice = recovery_choice(Estimate("m", 20.0), 100, lambda lag: asked.append(lag) or 0.001, 0.005, 2.5)
    assert asked == [50.0] and choice.method == PREDICT and choice.loss_excess == 0.001


def test_the_lag_a_run_carries_adds_to_the_guards():
    asked = []
    choice = recovery_choice(Estimate("m", 20.0), 100, lambda lag: asked.append(lag) or 0.001, 0.005, 2.5, 30.0)
    # The carried estimates are taken as pessimistically as the new one: 2.5 * (30 + 20).
    assert asked == [125.0] and choice.method == PREDICT and choice.guard_lag == 125.0
    choice = recovery_choice(Estimate("m", 20.0), 100, lambda lag: lag / 20_000, 0.005, 2.5, 30.0)
    assert choice.method == RECOMPUTE and "75.0 of them carried" in choice.reason
    assert recovery_choice(Estimate("m", 20.0), 100, lambda lag: lag / 20_000, 0.005, 2.5).method == PREDICT


def test_choice_predicts_where_the_journal_is_too_short_to_fit():
    choice = recovery_choice(Estimate("m", 20.0), 100, lambda lag: None, 0.005, 1.5)
    assert choice.method == PREDICT and choice.loss_excess is None


def test_choice_recomputes_where_the_estimate_is_not_below_d():
    choice = recovery_choice(Estimate("paper", 120.0), 100, lambda lag: 0.0, 0.005, 1.5)
    assert choice.method == RECOMPUTE and "120.0" in choice.reason and "100" in choice.reason


@pytest.mark.parametrize("lag, limit, pessimism, excess, carried", [
    (math.nan, 0.005, 1.5, 0.0, 0.0), (20.0, math.nan, 1.5, 0.0, 0.0), (20.0, None, 1.5, 0.0, 0.0),
    (20.0, 0.005, None, 0.0, 0.0), (20.0, 0.005, math.nan, 0.0, 0.0), (20.0, 0.005, 1.5, math.nan, 0.0),
    (20.0, 0.005, 1.5, math.inf, 0.0), (20.0, 0.005, 1.5, 0.0, math.nan), (20.0, 0.005, 1.5, 0.0, None),
])
def test_choice_recomputes_on_nan_or_missing_inputs(lag, limit, pessimism, excess, carried):
    choice = recovery_choice(Estimate("m", lag), 100, lambda _: excess, limit, pessimism, carried)
    assert choice.method == RECOMPUTE and choice.reason


# ---------------------------------------------------------------- checked against measured lags


def test_evaluate_rank_correlation_on_cases_with_known_correlation():
    measured = [10.0, 20.0, 30.0, 40.0, 50.0]
    # estimate ranks 2 1 3 5 4: sum of squared rank differences 4, rho = 1 - 6 * 4 / (5 * 24) = 0.8
    shuffled = [15.0, 12.0, 33.0, 90.0, 60.0]
    cases = [Case("trend", m, {"good": 0.5 * m, "reversed": 100 - m, "shuffled": s})
             for m, s in zip(measured, shuffled)]
    report = evaluate(cases)
    assert report["good"]["spearman"] == pytest.approx(1.0)
    assert report["reversed"]["spearman"] == pytest.approx(-1.0)
    assert report["shuffled"]["spearman"] == pytest.approx(0.8)
    assert report["good"]["median_ratio"] == pytest.approx(0.5)


def test_evaluate_medians_per_predictor_skipping_unmeasurable_cases_and_missing_estimates():
    rng = np.random.default_rng(0)
    cases = [Case("trend", float(m), {"a": 0.3 * m, "b": None if i % 4 == 0 else 2.0 * m})
             for i, m in enumerate(rng.uniform(5, 100, 12))]
    cases += [Case("skip", float(m), {"a": 0.9 * m, "b": 1.0 * m}) for m in rng.uniform(5, 100, 7)]
    cases += [Case("skip", None, {"a": 1e6, "b": 1e6}), Case("trend", -3.0, {"a": 5.0, "b": 5.0})]
    report = evaluate(cases)
    assert report["a"]["n"] == 20 and report["a"]["unmeasurable"] == 1 and report["a"]["no_estimate"] == 0
    assert report["b"]["n"] == 17 and report["b"]["no_estimate"] == 3
    assert report["a"]["no_ratio"] == 1
    assert report["a"]["median_ratio_by_predictor"] == pytest.approx({"skip": 0.9, "trend": 0.3})
    assert report["b"]["median_ratio_by_predictor"] == pytest.approx({"skip": 1.0, "trend": 2.0})


def test_evaluate_has_no_correlation_where_it_is_undefined():
    report = evaluate([Case("trend", 10.0, {"a": 1.0}), Case("trend", 20.0, {"a": 1.0}),
                       Case("trend", 30.0, {"a": 1.0}), Case("trend", None, {"a": 2.0})])
    assert report["a"]["spearman"] is None and report["a"]["median_ratio"] == pytest.approx(0.05)
