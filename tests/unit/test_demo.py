"""The demo's summary (``make demo``'s last words), on run directories written by the product's own writers."""

import importlib.util
import math
import os

from conftest import ROOT
from cpsr_ds.checkpoint.capture.journal import ProgressJournal, append_validation
from cpsr_ds.recovery import RecoveryReport, append_report


def load_demo():
    spec = importlib.util.spec_from_file_location("demo", os.path.join(ROOT, "launch", "demo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def curve(i):
    return 2.0 + 3.0 * math.exp(-i / 40)


def test_the_summary_reports_a_predicting_recovery_its_lag_and_what_auto_would_have_done(tmp_path):
    demo = load_demo()
    reference, run = tmp_path / "reference", tmp_path / "run"
    for directory in (reference, run):
        directory.mkdir()
    journal = ProgressJournal(str(run), 0)
    for i in list(range(1, 79)) + list(range(79, 151)):  # failed after 78, resumed there by prediction
        journal.append(i, curve(i))
    journal.close()
    lag = 3
    for i in range(0, 151, demo.EVAL_INTERVAL):
        append_validation(str(reference), i, curve(i))
        append_validation(str(run), i, curve(i) if i <= 78 else curve(i - lag))
    append_report(str(run), RecoveryReport("fresh", None, None, 0))
    append_report(str(run), RecoveryReport("predict", 78, 70, 78, reason="recovery.mode is predict",
                                           predictor="trend", relative_error=0.6, estimated_cost=2.5,
                                           cost_model="empirical", guard_lag=4.0, loss_excess=0.0073))
    summary = demo.summarize(str(run), str(reference))
    assert "attempts: 2" in summary
    assert "recovery.mode auto would have recomputed: a lag of 4.0 iterations would leave the loss 0.73% higher" in summary
    assert "against 8 to recompute" in summary
