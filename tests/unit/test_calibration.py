"""The measured constants (cpsr_ds/planning/calibration.py) agree with the result files they name, and live there alone."""

import glob
import json
import os
import re

import numpy as np
import pytest

from cpsr_ds.planning import calibration
from cpsr_ds.planning.calibration import END_OF_TRAINING_REDUCTION, MEASURED_REDUCTION, PESSIMISM

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_end_of_training_reductions_are_those_of_the_recovery_benchmark():
    with open(os.path.join(ROOT, "benchmarks", "results", "bench_recovery", "bench_recovery.json")) as fh:
        table = json.load(fh)["end_of_training"]
    measured = tuple((int(share.split()[0]) / 100, round(row["end"]["mean"], 3))
                     for share, row in table.items() if share != "all")
    assert END_OF_TRAINING_REDUCTION == {"trend": measured}


def test_measured_reductions_are_those_of_the_recovery_benchmark():
    with open(os.path.join(ROOT, "benchmarks", "results", "bench_recovery", "bench_recovery.txt")) as fh:
        table = dict(re.findall(r"^(\w+)\s+\|\s+(-?[\d.]+)% \[", fh.read(), re.M))
    assert {name: float(table[name]) / 100 for name in MEASURED_REDUCTION} == pytest.approx(MEASURED_REDUCTION)


def test_pessimism_covers_nine_in_ten_measured_lags_of_the_recovery_benchmark():
    with open(os.path.join(ROOT, calibration.BENCH_RECOVERY_RESULT)) as fh:
        result = json.load(fh)
    rho = result["mean_reduction"]
    ratios = [case["lag_iters"] / ((1 - rho[case["method"]]) * case["d"]) for case in result["cases"]
              if case["method"] in MEASURED_REDUCTION and case["lag_iters"] is not None]
    assert len(ratios) == 216
    assert round(float(np.percentile(ratios, 90)), 2) == 1.63 and round(float(np.percentile(ratios, 90)), 1) == PESSIMISM


def test_result_files_and_commit_history_are_cited_by_calibration_alone():
    """A measured number elsewhere in cpsr_ds would drift from its result file unseen; history belongs to git."""
    citing, hashes = [], []
    for path in glob.glob(os.path.join(ROOT, "cpsr_ds", "**", "*.py"), recursive=True):
        with open(path) as fh:
            text = fh.read()
        name = os.path.relpath(path, ROOT)
        if "benchmarks/results/" in text and name != os.path.join("cpsr_ds", "planning", "calibration.py"):
            citing.append(name)
        hashes += [f"{name}: {h}" for h in re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", text)]
    assert citing == [] and hashes == []
