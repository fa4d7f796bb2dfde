"""benchmarks/control_evidence.py: each candidate's lag from a run's journal, and their scoring."""

import math

import pytest
import torch

from benchmarks import control_evidence as ce
from cpsr_ds.checkpoint.capture.journal import ProgressJournal


def curve(t: float) -> float:
    """A loss curve of the form fitter.fit_recent fits: a + b ln t."""
    return 4.0 - 0.3 * math.log(t)


def write_journal(run_dir, losses: dict[int, float]) -> None:
    journal = ProgressJournal(str(run_dir), rank=0)
    for i, loss in sorted(losses.items()):
        journal.append(i, loss)
    journal.close()


def test_a_run_lagging_by_k_iterations_is_measured_k_behind_by_the_realised_candidates(tmp_path):
    c, d, lag = 500, 25, 12.0
    f = c + d
    reference = {i: curve(i) for i in range(1, 2000)}
    recovered = {**{i: curve(i) for i in range(1, f + 1)}, **{i: curve(i - lag) for i in range(f + 1, f + 5 * d)}}
    write_journal(tmp_path / "run", recovered)
    case = {"c": c, "d": d, "gap_after_restore": curve(f - 2 * lag) - curve(f)}
    got = ce.candidates(case, str(tmp_path / "run"), reference, a=0.6)
    assert got["realised"] == pytest.approx(lag, rel=0.05)
    assert got["realised_paired"] == pytest.approx(lag, rel=0.05)
    assert got["loss_probe"] == pytest.approx(2 * lag, rel=0.05)
    assert got["along"] == pytest.approx(0.4 * d)
    assert ce.candidates(case, str(tmp_path / "run"), reference, a=None)["along"] is None  # vitp: no check
    assert ce.candidates(case, str(tmp_path / "absent"), reference, a=0.6) is None


def test_the_scores_rank_candidates_against_the_protocols_lag():
    rows = [{"seed": 1, "c": 500, "d": 10, "method": m, "lag": lag, "loss_probe": probe, "realised": lag + 1,
             "realised_paired": lag, "along": None if m == "linear" else lag}
            for m, lag, probe in (("trend", 2.0, 9.0), ("skip", 8.0, 1.0), ("linear", 5.0, 5.0))]
    summary = ce.evaluate(rows)
    assert summary["realised"]["spearman"] == pytest.approx(1.0)
    assert summary["loss_probe"]["spearman"] == pytest.approx(-1.0)
    assert summary["realised"]["picks_cheapest"] == 1.0 and summary["loss_probe"]["picks_cheapest"] == 0.0
    assert summary["realised"]["median_error_over_d"] == pytest.approx(0.1)
    assert summary["by_predictor"]["skip"] == {"lag": 0.8, "loss_probe": 0.1, "realised": 0.9, "realised_paired": 0.8,
                                               "along": 0.8}
    assert summary["along"]["picks_cheapest"] == 1.0 and summary["by_predictor"]["linear"]["along"] is None


def test_along_is_the_share_of_the_step_covered_along_it_whatever_lies_across():
    prev, truth = torch.zeros(3), torch.tensor([2.0, 0.0, 0.0])
    assert ce.along_step(torch.tensor([1.0, 5.0, -5.0]), truth, prev) == 0.5
    assert ce.along_step(torch.tensor([3.0, 0.0, 0.0]), truth, prev) == 1.5
    assert ce.along_step(prev, truth, prev) == 0.0
