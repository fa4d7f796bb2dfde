"""The run's own evidence of rho: the held-out check's ``along`` and the estimate the empirical model takes."""

import math

import pytest
import torch

from cpsr_ds.planning.cost_model import EmpiricalModel
from cpsr_ds.planning.evidence import CHECKS, Evidence, evidence, worst
from cpsr_ds.predictor.base import along_step, holdout_error


def test_along_is_the_share_of_the_step_covered_along_it_whatever_lies_across():
    prev, truth = torch.zeros(3), torch.tensor([2.0, 0.0, 0.0])
    assert along_step(torch.tensor([1.0, 5.0, -5.0]), truth, prev) == 0.5  # across the step: not counted
    assert along_step(torch.tensor([3.0, 0.0, 0.0]), truth, prev) == 1.5  # overshoot
    assert along_step(prev, truth, prev) == 0.0  # the previous checkpoint itself: skip
    assert along_step(truth, prev, prev) is None  # no step


def test_the_held_out_check_reports_along_where_the_parameters_are_predicted():
    prev, truth = {"param": torch.zeros(2), "exp_avg": torch.zeros(2)}, {"param": torch.ones(2), "exp_avg": torch.ones(2)}
    pred = {"param": torch.full((2,), 0.25), "exp_avg": torch.ones(2)}
    assert holdout_error(10, 5, pred, truth, prev, ("param", "exp_avg")).along == 0.25
    assert holdout_error(10, 5, pred, truth, prev, ("exp_avg",)).along is None


def test_rho_is_the_mean_of_the_newest_checks_less_its_standard_error():
    found = evidence("trend", [(100, 0.0), (200, 0.6), (300, 0.8), (400, 0.6), (500, 0.8), (600, 1.0)], upto=500)
    assert found.alongs == (0.6, 0.8, 0.6, 0.8) and len(found.alongs) == CHECKS  # 600 is after c, 100 too old
    assert found.mean == pytest.approx(0.7)
    assert found.stderr == pytest.approx(math.sqrt(4 * 0.01 / 3 / 4))
    assert found.rho == pytest.approx(0.7 - math.sqrt(0.01 / 3))
    assert Evidence("trend", (1.4, 1.6)).rho == 1.0  # never more than the lost iterations
    assert evidence("trend", [(100, 0.9)]).thin and evidence("trend", [(100, 0.9)]).rho is None


def test_the_least_evidence_of_several_stages_speaks_for_the_job():
    strong, weak, thin = Evidence("trend", (0.9, 0.9)), Evidence("trend", (0.2, 0.4)), Evidence("trend", (0.9,))
    assert worst([strong, None, weak]) is weak
    assert worst([strong, thin, weak]) is thin
    assert worst([None, None]) is None


def test_the_empirical_model_takes_the_runs_rho_over_its_constants_and_recomputes_on_thin_evidence():
    run = Evidence("trend", (0.2, 0.4))
    estimate = EmpiricalModel(evidence=run).estimate(120, 100, "trend")
    assert estimate.lag == pytest.approx((1 - run.rho) * 20)
    assert estimate.inputs["along"] == pytest.approx(0.3) and estimate.inputs["checks"] == 2
    thin = EmpiricalModel(evidence=Evidence("trend", (0.9,))).estimate(120, 100, "trend")
    assert thin.lag is None and "thin evidence: 1 held-out check(s) of trend" in thin.reason
    other = EmpiricalModel(evidence=run).estimate(120, 100, "linear")
    assert other.lag is None and "no held-out checks of linear" in other.reason
    assert EmpiricalModel(evidence=run).estimate(120, 100, "skip").lag == 20  # c's state covers none of the step
