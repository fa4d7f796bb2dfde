"""The controlled choice between PB-R and RB-R (recovery.mode auto), from its inputs."""

import math
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from deepspeed.runtime.lr_schedules import WarmupCosineLR, WarmupLR

from cpsr_ds import runlog
from cpsr_ds.checkpoint.capture.journal import Entry, ProgressJournal, Progress, read_progress
from cpsr_ds.checkpoint.storage.agreement import combine_progress
from cpsr_ds.config import CPSRConfig, RecoveryConfig
from cpsr_ds.planning.calibration import END_OF_TRAINING_COS_MIN_RATIO, MEASURED_REDUCTION, PESSIMISM
from cpsr_ds.planning.cost_model import EmpiricalModel, Estimate, recovery_choice
from cpsr_ds.planning.fitter import MIN_POINTS, CurveFit, accuracy_fit, fit_recent, loss_excess, stage_xi
from cpsr_ds.recovery import (
    RecoveryReport,
    advance_counters,
    append_report,
    carried_lag,
    expected_loss_excess,
    fallback_reason,
    implausible_reach,
    journal_losses,
    progress_losses,
    recovery_model,
)
from cpsr_ds.recovery.decision import _decide


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


def choice(excess):
    """The empirical model's choice for a failure that lost 25 iterations, the guard's excess given."""
    return recovery_choice(Estimate("empirical", 7.75), 25, lambda lag: excess, RecoveryConfig().max_loss_excess,
                           PESSIMISM)


@pytest.mark.parametrize("r, excess, recomputes", [
    (None, 0.001, "no held-out checkpoint"),
    (1.6, 0.001, "diverging"),
    (0.9, 0.02, "max_loss_excess"),
    (0.9, 0.004, None),
    (0.9, None, None),
    (math.nan, 0.001, "diverging"),
    (0.9, math.nan, "non-finite losses"),
    (0.9, math.inf, "non-finite losses"),
])
def test_auto_recomputes_for_an_unchecked_or_diverging_predictor_or_too_much_loss(r, excess, recomputes):
    why = fallback_reason(RecoveryConfig(), r, choice(excess))
    assert why is None if recomputes is None else recomputes in why


def test_a_nan_loss_where_the_fit_looks_gives_no_finite_estimate_and_auto_recomputes(tmp_path):
    losses = {i: curve(i) for i in range(1, 401)}
    directory = journal(tmp_path, {**losses, 390: math.nan})
    excess = expected_loss_excess(directory, 400, 10)
    assert math.isnan(excess)
    assert "non-finite losses" in fallback_reason(RecoveryConfig(), 0.5, choice(excess))
    # Outside the span the fit reads (f/2..f) a diverged loss changes nothing.
    assert math.isfinite(expected_loss_excess(journal(tmp_path / "early", {**losses, 20: math.nan}), 400, 10))


def progress(*runs):
    """Rank 0's journal made of the given iteration ranges, one after another."""
    entries = [Entry(i, 1.0, 0.0) for run in runs for i in run]
    return Progress({0: entries}, max(e.iteration for e in entries))


def test_f_must_be_within_the_planned_length_and_recorded_from_the_checkpoint_on():
    assert implausible_reach(progress(range(1, 48)), c=40, planned=100) is None
    assert implausible_reach(progress(range(1, 48)), c=40, planned=None) is None
    assert "beyond the planned training length, 45 iterations" in implausible_reach(progress(range(1, 48)), 40, 45)
    # A journal that starts past c + 1 says nothing about iterations c + 1 onwards.
    assert implausible_reach(progress([1000000]), c=40, planned=None) == \
        "the journals do not record every iteration from 41 to 1000000"
    assert implausible_reach(progress(range(1, 30), range(45, 48)), c=40, planned=None) is not None
    assert implausible_reach(progress(range(1, 45), range(38, 48)), c=40, planned=None) is None


def fake_engine(scheduler_class, **params):
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([param], lr=0.001)
    scheduler = scheduler_class(optimizer, **params)
    optimizer.state[param]["step"] = torch.tensor(10.0)
    return SimpleNamespace(global_steps=10, global_samples=80, train_batch_size=lambda: 8, optimizer=optimizer,
                           lr_scheduler=scheduler)


@pytest.mark.parametrize("scheduler_class, params", [
    (WarmupLR, {"warmup_max_lr": 0.01, "warmup_num_steps": 20}),
    (WarmupCosineLR, {"total_num_steps": 100, "warmup_num_steps": 20}),
])
def test_counters_advance_in_one_step_of_a_deepspeed_schedule(scheduler_class, params):
    stepped, jumped = fake_engine(scheduler_class, **params), fake_engine(scheduler_class, **params)
    for _ in range(37):
        stepped.lr_scheduler.step()
    advance_counters(jumped, 37)
    assert jumped.lr_scheduler.last_batch_iteration == stepped.lr_scheduler.last_batch_iteration
    assert jumped.lr_scheduler.get_last_lr() == stepped.lr_scheduler.get_last_lr()
    assert (jumped.global_steps, jumped.global_samples) == (47, 80 + 37 * 8)
    start = time.perf_counter()
    advance_counters(jumped, 99999999999)
    assert time.perf_counter() - start < 1.0
    assert jumped.lr_scheduler.last_batch_iteration == stepped.lr_scheduler.last_batch_iteration + 99999999999


# ---------------------------------------------------------------- the model planner.cost_model names

ALPHA1, ALPHA2, TAU1, TAU2 = 2e-4, 1.0, 0.1, 0.5
C, F = 400, 420
# Checkpoints the held-out errors were measured at, unevenly spaced as under interval auto: the newest spacing 50.
MEASURED_AT = (100, 150, 200, 300, 350, 400)


def stage_state(second_moment=0.01):
    """A stage of 4 parameters; exp_avg_sq None: an optimizer without a second moment."""
    state = {"param/weight": torch.ones(2, 2), "exp_avg/weight": torch.zeros(2, 2)}
    if second_moment is not None:
        state["exp_avg_sq/weight"] = torch.full((2, 2), second_moment)
    return state


def held_out(t, T_c=50.0):
    return math.exp(-TAU1 * t / T_c + TAU2)


def measured_errors():
    """Eq. 8 at MEASURED_AT, each predicted from the checkpoint before it: (h / 50)^2 times held_out for a spacing h,
    the error growing with the distance predicted (fitter.DISTANCE_EXPONENT)."""
    spacings = [50] + [b - a for a, b in zip(MEASURED_AT, MEASURED_AT[1:])]
    return [(t, held_out(t) * (h / 50) ** 2) for t, h in zip(MEASURED_AT, spacings)]


def record(directory, errors, stage=0, predictor="trend"):
    for t, error in errors:
        runlog.append(runlog.measurements_path(str(directory), stage), runlog.StateRow(
            t, stage, stage, 0, predictor, n_p=4, xi=0.01, held_out_error=error, relative_error=0.5))


def run_dir(tmp_path, errors=None):
    """A run that failed after F: rank 0's journal on Eq. 11, and (``errors``, default Eq. 8's) stage 0's measurements."""
    directory = journal(tmp_path, {i: math.exp(-ALPHA1 * i + ALPHA2) for i in range(1, F + 1)})
    record(directory, measured_errors() if errors is None else errors)
    return directory


def eq13(exact=True):
    """The lag Eq. 13 (Eq. 14) gives at F from C with xi 0.01 over 4 parameters and T_c 50, by hand."""
    x = math.exp(ALPHA1 * F - ALPHA2) * 0.01 * 4 * held_out(C) * ((F - C) / 50) ** 2 / 2
    return (math.log1p(x) if exact else x) / ALPHA1


def test_paper_model_is_built_from_the_runs_journal_measurements_and_state(tmp_path):
    directory = run_dir(tmp_path)
    record(directory, [(450, 1e3)])  # after c: not seen at c
    record(directory, [(t, 1e3 * held_out(t)) for t in MEASURED_AT], predictor="linear")
    record(directory, [(t, 1e3 * held_out(t)) for t in MEASURED_AT], stage=1)
    losses = journal_losses(directory)
    model = recovery_model("paper", directory, losses, 0, "trend", F, C, stage_xi(stage_state()))
    assert model.T_c == 50.0 and model.exact
    p = model.params
    assert (p.alpha1, p.alpha2, p.tau1, p.tau2) == pytest.approx((ALPHA1, ALPHA2, TAU1, TAU2), rel=1e-6)
    assert (p.xi, p.N_p) == (pytest.approx(0.01), 4)
    assert not recovery_model("paper-eq14", directory, losses, 0, "trend", F, C, stage_xi(stage_state())).exact
    assert recovery_model("empirical", directory, losses, 0, "trend", F, C, stage_xi(stage_state())) == EmpiricalModel()
    with pytest.raises(ValueError, match="'eq13'"):
        recovery_model("eq13", directory, losses, 0, "trend", F, C, stage_xi(stage_state()))


def test_recovery_fits_eq8_as_the_planner_does_however_the_checkpoints_were_spaced(tmp_path):
    """One Eq. 8 fit (fitter.accuracy_fit): recovery's paper model takes the fit the online planner makes from the
    same held-out errors; with errors growing with the distance predicted, its estimate is the one at a fixed
    spacing of 50, though the checkpoints came every 20, then every 10 iterations (29 errors: more than one window)."""
    its = list(range(20, 201, 20)) + list(range(210, C + 1, 10))
    spacings = [20] + [b - a for a, b in zip(its, its[1:])]
    errors = [(t, held_out(t) * (h / 50) ** 2) for t, h in zip(its, spacings)]
    directory = run_dir(tmp_path, errors)
    model = recovery_model("paper", directory, journal_losses(directory), 0, "trend", F, C, stage_xi(stage_state()))
    planned = accuracy_fit(errors)
    assert model.T_c == planned.T_c == 10
    assert (model.params.tau1, model.params.tau2) == (planned.tau1, planned.tau2)
    assert model.estimate(F, C, "trend").lag == pytest.approx(eq13(), rel=1e-6)


def test_every_node_takes_rank_0s_losses_from_the_agreed_progress(tmp_path):
    """node_local: rank 0's journal is on node 0 only; node 1 gets its losses from the progress all agreed on."""
    node0 = run_dir(tmp_path / "node0")
    node1 = tmp_path / "node1"
    other = ProgressJournal(str(node1), rank=1)
    for i in range(1, F + 1):
        other.append(i, 9.0)
    other.close()
    with pytest.raises(FileNotFoundError):
        journal_losses(str(node1))
    agreed = combine_progress([read_progress(node0), read_progress(str(node1))])
    assert progress_losses(agreed) == journal_losses(node0)
    assert len(progress_losses(agreed)) == F


class FixedPredictor:
    """A ready predictor whose prediction is ``state``; held-out error r = 0.5, checked ``horizon`` iterations
    ahead."""

    name = "trend"

    def __init__(self, state, horizon=50):
        self.state, self.horizon = state, horizon

    def ready(self):
        return True

    def validation_error(self):
        return SimpleNamespace(relative=0.5, horizon=self.horizon)

    def predict(self, f, kept_views=False):
        return {key: value.clone() for key, value in self.state.items()}


def small_engine(stage=0):
    """The engine surface recovery writes a prediction into: one 2 x 2 weight under AdamW, one step taken."""
    module = torch.nn.Linear(2, 2, bias=False)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.001)
    module(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    return SimpleNamespace(module=module, optimizer=optimizer, lr_scheduler=None, stage_id=stage, global_steps=C,
                           global_samples=C * 8, train_batch_size=lambda: 8)


def decide(directory, name, engine=None, state=None, horizon=50):
    cfg = CPSRConfig.parse_block({"checkpoint": {"dir": directory}, "planner": {"cost_model": name}})
    state = stage_state() if state is None else state
    progress = read_progress(directory)  # rank 0's journal, up to F
    assert progress.reached == F
    return _decide(engine or small_engine(), cfg, FixedPredictor(state, horizon), progress, C, stage_xi(state))


@pytest.mark.parametrize("name, lag", [
    ("empirical", (1 - MEASURED_REDUCTION["trend"]) * (F - C)),
    ("paper", eq13()),
    ("paper-eq14", eq13(exact=False)),
])
def test_the_decision_uses_the_model_planner_cost_model_names(tmp_path, name, lag):
    report = decide(run_dir(tmp_path), name)
    assert report.method == "predict" and report.resume_iteration == F
    assert report.cost_model == name and report.predicted_share == 1.0  # one process: everything predicted
    assert report.estimated_cost == pytest.approx(lag, rel=1e-6)
    assert f"{name} estimates a lag of {lag:.1f}" in report.reason


@pytest.mark.parametrize("planned, method, rho", [(4 * F, "recompute", -0.343), (4 * F // 3, "predict", 0.906)])
def test_under_a_schedule_with_a_planned_end_the_decision_takes_rho_at_the_failures_place(tmp_path, planned,
                                                                                           method, rho):
    engine = small_engine()
    # The schedule the profile was measured under, up to its 2 warm-up iterations.
    engine.lr_scheduler = WarmupCosineLR(engine.optimizer, total_num_steps=planned, warmup_num_steps=2,
                                         cos_min_ratio=END_OF_TRAINING_COS_MIN_RATIO)
    report = decide(run_dir(tmp_path), "empirical", engine)
    assert report.method == method and report.estimated_cost == pytest.approx((1 - rho) * (F - C), abs=0.01 * (F - C))
    assert f"(rho {rho:.2f} at {F / planned:.0%} of the planned run, " in report.reason


def test_a_failure_beyond_the_horizon_the_predictor_was_checked_at_is_estimated_a_longer_lag(tmp_path):
    report = decide(run_dir(tmp_path), "empirical", horizon=(F - C) // 2)
    assert report.method == "predict"
    assert report.estimated_cost == pytest.approx((1 - MEASURED_REDUCTION["trend"]) * (F - C) * 2)
    assert "(20 iterations ahead, beyond the 10 its held-out check predicted)" in report.reason


@pytest.mark.parametrize("errors, stage, second_moment, why", [
    ([], 0, 0.01, "0 held-out errors of trend for stage 0 up to iteration 400"),  # no measurements file
    (None, 1, 0.01, "0 held-out errors of trend for stage 1"),  # another stage's only
    ([(t, 1e-4) for t in MEASURED_AT], 0, 0.01, "held-out errors do not fall measurably"),
    (None, 0, None, "xi (Eq. 7): no exp_avg_sq"),
])
def test_without_the_paper_models_inputs_the_decision_recomputes_saying_why(tmp_path, errors, stage, second_moment,
                                                                            why):
    report = decide(run_dir(tmp_path, errors), "paper", small_engine(stage), stage_state(second_moment))
    assert report.method == "recompute" and report.resume_iteration == C
    assert report.cost_model == "paper" and report.estimated_cost is None
    assert report.reason.startswith("no paper estimate: ") and why in report.reason


def predicted(f, lag, c):
    return RecoveryReport("predict", f, c, f, estimated_cost=lag)


def test_the_lag_a_run_carries_is_its_predictions_since_the_checkpoint_it_resumed_from():
    first, second = predicted(120, 10.0, 100), predicted(260, 4.0, 250)
    assert carried_lag([], 300) == 0
    assert carried_lag([first, second], 300) == 14.0
    # Resumed from a checkpoint between the two: only the first prediction is behind it.
    assert carried_lag([first, second], 200) == 10.0
    # A later start that recomputed from before the first prediction undid both.
    undone = RecoveryReport("recompute", 280, 110, 110)
    assert carried_lag([first, second, undone], 300) == 0
    assert carried_lag([first, second, undone, predicted(330, 2.5, 300)], 400) == 2.5
    # A restart from scratch carries nothing; a recompute from after a prediction keeps it.
    assert carried_lag([first, RecoveryReport("restart", 150, None, 0)], 300) == 0
    assert carried_lag([first, RecoveryReport("recompute", 200, 150, 150)], 300) == 10.0


def test_earlier_predictions_lags_count_against_the_loss_excess_a_new_one_may_leave(tmp_path):
    directory = run_dir(tmp_path)
    alone = decide(directory, "empirical")
    assert alone.method == "predict"
    # Lags add up: what earlier predictions left behind, the next one's lag comes on top of.
    carried = 4 * alone.guard_lag
    assert expected_loss_excess(directory, F, PESSIMISM * carried + alone.guard_lag) > RecoveryConfig().max_loss_excess
    append_report(directory, predicted(C - 50, carried, C - 100))
    report = decide(directory, "empirical")
    assert report.method == "recompute" and "carried from earlier predictions" in report.reason
    assert report.guard_lag == pytest.approx(PESSIMISM * carried + alone.guard_lag)
