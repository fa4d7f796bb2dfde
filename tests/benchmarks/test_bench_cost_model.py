"""bench_recovery's check of the recovery cost models against measured lags, on synthetic cases."""

import importlib
import json
import math
from dataclasses import asdict, replace

import pytest
import torch

from cpsr_ds.planning.fitter import stage_xi
from cpsr_ds.predictor import make_predictor


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("benchmarks.bench_recovery")


def drifting_state(t: int) -> dict:
    """A stage whose parameters move by 0.01 per iteration; the moments are constant."""
    w = torch.linspace(-1, 1, 12) + 0.01 * t
    return {"param/w": w, "exp_avg/w": torch.full((12,), 0.1), "exp_avg_sq/w": torch.full((12,), 1e-4)}


CHECKPOINTS = list(range(10, 210, 10))


def test_held_out_points_are_the_last_checkpoints_each_predicted_from_the_ones_before(bench):
    loaded = []

    def state_at(k):
        loaded.append(k)
        return drifting_state(k)

    skip = bench.held_out_points(lambda: make_predictor("skip", history=4), CHECKPOINTS, state_at, c=150, last=8)
    assert [k for k, _ in skip] == list(range(80, 160, 10))
    # skip copies the checkpoint 10 iterations before: off by 0.1 per parameter, Eq. 9 = 0.01
    assert [e for _, e in skip] == pytest.approx([0.01] * 8, rel=1e-5)
    assert max(loaded) == 150 and min(loaded) == 40  # k's history of 4 checkpoints, nothing after c
    trend = bench.held_out_points(lambda: make_predictor("trend", history=4), CHECKPOINTS, drifting_state, c=150)
    assert len(trend) == 8 and all(e < 1e-8 for _, e in trend)  # a linear drift is extrapolated exactly


def test_held_out_points_leave_out_checkpoints_without_enough_history(bench):
    points = bench.held_out_points(lambda: make_predictor("linear", history=4), CHECKPOINTS, drifting_state, c=40)
    assert [k for k, _ in points] == [30, 40]  # linear needs 2 checkpoints before k


def falling_losses(f: int) -> dict:
    return {t: 3.0 * math.exp(-0.002 * t) for t in range(1, f + 1)}


def test_cost_model_record_has_every_models_estimate_and_the_paper_models_inputs(bench):
    points = [(k, 0.01 * math.exp(-0.1 * k / 10)) for k in range(80, 160, 10)]
    record = bench.cost_model_record("trend", 155, 150, 10, falling_losses(155), points, stage_xi(drifting_state(150)))
    json.dumps(record)  # stored in the results as it is
    assert set(record["estimates"]) == {"empirical", "paper", "paper-eq14"}
    assert record["estimates"]["empirical"] == pytest.approx((1 - 0.690) * 5)
    assert all(lag is not None and lag > 0 for lag in record["estimates"].values()), record["reasons"]
    assert record["inputs"]["loss_o"]["alpha1"] == pytest.approx(0.002, rel=1e-3)
    assert record["inputs"]["loss_p"]["tau1"] == pytest.approx(0.1, rel=1e-3)
    assert record["inputs"]["xi"] == {"fitted": True, "xi": pytest.approx(1e-4), "n_p": 12}
    assert record["inputs"]["held_out"] == [list(p) for p in points]


def test_cost_model_record_says_why_a_model_has_no_estimate(bench):
    vitp = bench.cost_model_record("vitp", 155, 150, 10, falling_losses(155), None, stage_xi(drifting_state(150)))
    assert set(vitp["estimates"]) == {"empirical"} and "trained network" in vitp["inputs"]["skipped"]
    short = bench.cost_model_record("trend", 155, 150, 10, falling_losses(155), [(150, 0.01)],
                                    stage_xi(drifting_state(150)))
    assert short["estimates"]["paper"] is None and "accuracy curve" in short["reasons"]["paper"]


def case(bench, method, measured, estimates, decision=None):
    return bench.Case(1, method, 50, 500, 25, measured, None, measured, None, 0.0, None, 0.0,
                      decision or f"predict (PB-R) with {method}: resuming", cost_model={"estimates": estimates}
                      if estimates else {})


def test_cost_model_check_per_model_and_predictor_survives_the_json_round_trip(bench):
    lags = [5.0, 9.0, 14.0, 20.0]
    cases = [case(bench, "trend", lag, {"empirical": 7.75, "paper": 2 * lag}) for lag in lags]
    cases += [case(bench, "linear", lag, {"empirical": 12.9, "paper": 30.0 - lag}) for lag in lags]
    cases += [case(bench, "linear", None, {"empirical": 12.9, "paper": 1.0})]  # unmeasurable
    cases += [case(bench, "recompute", 25.0, {}, "RB-R")]
    stored = [bench.Case(**json.loads(json.dumps(asdict(c)))) for c in cases]
    check = bench.cost_model_check(stored)
    assert check == bench.cost_model_check(cases)
    assert set(check["by_predictor"]) == {"trend", "linear"}
    trend, linear = check["by_predictor"]["trend"], check["by_predictor"]["linear"]
    assert trend["paper"]["spearman"] == pytest.approx(1.0) and trend["paper"]["median_ratio"] == pytest.approx(2.0)
    assert linear["paper"]["spearman"] == pytest.approx(-1.0) and linear["paper"]["unmeasurable"] == 1
    assert trend["empirical"]["spearman"] is None  # a constant estimate ranks nothing
    assert check["all"]["paper"]["n"] == 8 and check["in_sample"] == []


def predicted(bench, seed, method, lag, d=25):
    measured = None if lag is None else 1 - lag / d
    return bench.Case(seed, method, 50, 500, d, lag, measured, lag, measured, 0.0, None, 0.0,
                      f"predict (PB-R) with {method}: resuming", cost_model={"estimates": {"empirical": 1.0}})


def test_the_empirical_model_is_checked_with_rho_from_the_other_seeds(bench):
    # trend saves 90 % of d on seed 1, 50 % on seed 2, 10 % on seed 3: one rho from all seeds would estimate
    # every case alike, the rho of the other seeds ranks them backwards.
    lags = {1: (2.5, 3.0), 2: (12.5, 13.0), 3: (22.5, 23.0)}
    cases = [predicted(bench, seed, "trend", lag) for seed, pair in lags.items() for lag in pair]
    cases += [predicted(bench, 1, "trend", None), predicted(bench, 2, "skip", 20.0)]  # unmeasurable; one seed only
    cases += [case(bench, "recompute", 25.0, {}, "RB-R")]
    rho = bench.out_of_seed_reductions(cases)
    assert rho[1]["trend"] == pytest.approx(sum(1 - lag / 25 for s in (2, 3) for lag in lags[s]) / 4)
    assert rho[3]["trend"] == pytest.approx(sum(1 - lag / 25 for s in (1, 2) for lag in lags[s]) / 4)
    assert "skip" not in rho[2] and rho[1]["skip"] == pytest.approx(0.2)
    checked = bench.with_out_of_seed_empirical(cases, rho)
    estimates = [c.cost_model["estimates"]["empirical"] for c in checked[:6]]
    assert estimates == pytest.approx([(1 - rho[seed]["trend"]) * 25 for seed in (1, 1, 2, 2, 3, 3)])
    skip = checked[7].cost_model
    assert skip["estimates"]["empirical"] is None and "no measured reduction for predictor 'skip'" in \
        skip["reasons"]["empirical"]
    trend = bench.cost_model_check(checked)["by_predictor"]["trend"]["empirical"]
    assert trend["n"] == 6 and trend["unmeasurable"] == 1 and trend["spearman"] < -0.9
    # In sample, one rho per predictor: a constant estimate, which ranks nothing.
    assert bench.cost_model_check(cases)["by_predictor"]["trend"]["empirical"]["spearman"] is None


# ---------------------------------------------------------------- the charge at the end of training


def curve(t: float) -> float:
    """A validation loss that falls fast early and flattens: quadratic in log(t), the reference fit's family."""
    return 4.0 - 0.45 * math.log(t) + 0.02 * math.log(t) ** 2


def flattening_reference(end=2000, every=20) -> dict:
    """The reference's validation curve, evaluated every 20 iterations."""
    return {t: curve(t) for t in range(every, end + 1, every)}


def test_end_lag_is_the_lag_a_final_excess_amounts_to_on_the_flat_end_of_the_curve(bench):
    reference = flattening_reference()
    loss = reference[2000]
    for lag in (5.0, 40.0, 150.0):
        assert bench.end_lag(reference, (curve(2000 - lag) - loss) / loss) == pytest.approx(lag, rel=1e-3)
    assert bench.end_lag(reference, -0.5) is None  # far below anything the reference reaches: unmeasurable


def test_end_of_training_charges_the_defaults_predictions_by_their_place_in_training(bench):
    """The same final excess costs more iterations at the end than the same excess costs where the curve is
    steep: the table separates the recoveries by where they came, and leaves out what did not predict."""
    reference = flattening_reference()
    loss, d = reference[2000], 25

    def default(c, window_lag, end_lag):
        excess = (curve(2000 - end_lag) - loss) / loss
        return bench.Case(1, "default", 50, c, d, window_lag, 1 - window_lag / d, window_lag, 1 - window_lag / d,
                          0.0, None, 0.0, "predict (PB-R) with trend: resuming", final_loss_excess=excess)

    cases = [default(500, 2.5, 50.0), default(500, 5.0, 40.0), default(1000, 10.0, 10.0), default(1500, 5.0, 5.0),
             bench.Case(1, "default", 50, 1500, d, 25.0, 0.0, 25.0, 0.0, 0.0, 0, 0.0, "recompute (RB-R)",
                        final_loss_excess=0.0),
             replace(default(1500, 5.0, 5.0), method="trend", final_loss_excess=None)]
    table = bench.end_of_training(cases, {"1-Tc50": reference})
    assert list(table) == ["25 %", "50 %", "75 %", "all"]
    assert table["all"]["cases"] == 4 and table["25 %"]["cases"] == 2
    early = table["25 %"]
    assert early["window"]["mean"] == pytest.approx(1 - 3.75 / d)
    assert early["end"]["mean"] == pytest.approx(1 - 45.0 / d, abs=0.05) and early["end"]["mean"] < 0
    assert table["75 %"]["end"]["median"] == pytest.approx(0.8, abs=0.02)
    json.dumps(table)
