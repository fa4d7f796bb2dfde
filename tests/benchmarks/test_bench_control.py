"""benchmarks/bench_control.py: the oracle, the regret, the guard and the acceptance checks, from cases."""

import json
import os

import pytest

from benchmarks import bench_control as bc
from benchmarks.common.recovery_cases import SCHEDULES
from conftest import ROOT


def case(method, lag, c=500, d=20, seed=1, decision="", final=None):
    return {"seed": seed, "method": method, "c": c, "d": d, "lag_iters": lag, "decision": decision,
            "final_loss_excess": final}


PREDICTED = ("cpsr recovery: job reached iteration 520, last checkpoint 500; predict (PB-R) with trend: resuming at "
             "iteration 520 (held-out error r = 0.9, empirical estimates a lag of 6.2 of 20 iterations)")
RECOMPUTED = "cpsr recovery: job reached iteration 520, last checkpoint 500; recompute (RB-R): 20 iterations to redo"


def test_the_oracle_is_the_cheapest_method_in_hindsight_and_regret_the_defaults_excess_over_it():
    cases = [case("recompute", 20.0), case("trend", 8.0), case("skip", 15.0), case("linear", None),
             case("default", 8.0, decision=PREDICTED, final=0.007),
             case("recompute", 20.0, c=1000), case("trend", 25.0, c=1000),
             case("default", 20.0, c=1000, decision=RECOMPUTED, final=0.0)]
    first, second = bc.failure_rows(cases, max_loss_excess=0.005)
    assert (first["oracle_method"], first["oracle_lag"], first["regret"]) == ("trend", 8.0, 0.0)
    assert first["default_method"] == "trend" and first["violation"]
    assert (first["estimated_lag"], first["measured_lag_of_estimate"]) == (6.2, 8.0)
    assert (second["oracle_method"], second["regret"], second["default_method"]) == ("recompute", 0.0, "recompute")
    assert not second["violation"] and second["estimated_lag"] is None
    summary = bc.summarize([first, second])
    assert summary["guard_violations"] == 1 and summary["mean_regret_over_d"]["mean"] == 0.0
    assert summary["oracle_reduction"]["mean"] == pytest.approx((0.6 + 0.0) / 2)
    # Skip measured 15 of 20 in the first failure: 25 % that a hindsight choice between equal lags "saves".
    assert first["skip_lag"] == 15.0 and second["skip_lag"] is None
    assert summary["skip_lag_over_d"]["mean"] == 0.75 and summary["noise_oracle_reduction"]["mean"] == 0.25


def test_acceptance_names_the_workloads_where_the_default_saves_less_than_half_the_oracle():
    def s(default, oracle, regret=0.0, violations=0):
        return {"default_reduction": {"mean": default}, "oracle_reduction": {"mean": oracle},
                "mean_regret_over_d": {"mean": regret}, "guard_violations": violations, "failures": 6}

    per = {"a": s(0.5, 0.6), "b": s(0.05, 0.5), "c": s(0.0, 0.1)}
    checks = bc.acceptance(per, s(0.2, 0.4, regret=0.16, violations=1))
    assert checks == {"no_guard_violations": False, "mean_regret_at_most": False,
                      "default_saves_half_of_oracle": False, "workloads_short_of_half": ["b"]}


@pytest.mark.parametrize("name", ["control.json", "control_quick.json"])
def test_the_matrix_spans_the_sizes_corpora_schedules_and_rates_the_issue_names(name):
    with open(os.path.join(ROOT, "benchmarks", "workloads", name)) as f:
        workloads = json.load(f)
    assert len(workloads) >= 8 and len({w["name"] for w in workloads}) == len(workloads)
    assert {w["schedule"] for w in workloads} == set(SCHEDULES)
    assert len({w["data"] for w in workloads}) >= 2 and len({w["lr"] for w in workloads}) >= 2
    # Parameters of the blocks: 12 h^2 per layer; the embeddings add little at these sizes.
    sizes = {w["num_layers"] * 12 * w["hidden_size"] ** 2 for w in workloads}
    assert len(sizes) >= 3 and max(sizes) / min(sizes) >= 30
    for w in workloads:
        assert bc.workload_argv(w, "/tmp/x")[:2] == ["--intervals", str(w["Tc"])]
