"""bench_ftcost's pure parts: failure traces, T_l from a run's records, intervals over traces, the projection,
the storage limit."""

import importlib
import math

import numpy as np
import pytest
from scipy import stats

from cpsr_ds.planning import fault_tolerance_cost
from cpsr_ds.checkpoint.capture.journal import Entry
from cpsr_ds.recovery import RecoveryReport, append_report, read_reports
from cpsr_ds import runlog
from cpsr_ds.runlog import CostRow, StateRow, append, measurements_path


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("benchmarks.bench_ftcost")


# ---------------------------------------------------------------- traces

def test_a_trace_is_seeded_sorted_distinct_within_the_run_with_at_least_three_failures(bench):
    for seed in range(50):
        trace = bench.failure_trace(seed, 700, expected=4)
        assert trace == bench.failure_trace(seed, 700, expected=4)
        assert len(trace) >= 3
        assert trace == sorted(set(trace))
        assert 1 <= trace[0] and trace[-1] <= 700
    assert len({tuple(bench.failure_trace(seed, 700, expected=4)) for seed in range(50)}) == 50


def test_a_trace_keeps_three_failures_where_few_are_expected(bench):
    traces = [bench.failure_trace(seed, 100, expected=0.5) for seed in range(20)]
    assert all(len(t) >= 3 and t[-1] <= 100 for t in traces)


def test_the_trace_follows_the_rate(bench):
    counts = [len(bench.failure_trace(seed, 10_000, expected=8)) for seed in range(300)]
    assert 7.5 < np.mean(counts) < 8.8  # Poisson(8) given at least 3: mean 8.02


def test_a_trace_that_cannot_hold_three_failures_is_refused(bench):
    with pytest.raises(ValueError, match="cannot place 3 failures"):
        bench.failure_trace(0, 2, expected=4)


# ---------------------------------------------------------------- T_l from a run's records

def cost(rank, attempt, iteration, slowdown, stage=0, persist=0.4, stall=0.01):
    return CostRow(iteration=iteration, stage=stage, rank=rank, attempt=attempt, iteration_time_s=0.02,
                   stall_s=stall, slowdown_s=slowdown, persist_s=persist, nbytes=1000)


@pytest.fixture
def run_dir(tmp_path):
    """Two attempts; ranks 0 and 2 measure two stages; checkpoint 20 taken again after a restart."""
    d = str(tmp_path)
    for row in (cost(0, 1, 10, 0.10), cost(2, 1, 10, 0.30, stage=1), cost(0, 1, 20, 0.05), cost(2, 1, 20, 0.02, stage=1),
                cost(0, 2, 20, 0.07), cost(0, 2, 30, 0.01)):
        append(measurements_path(d, row.rank), row)
    append(measurements_path(d, 0), StateRow(iteration=10, stage=0, rank=0, attempt=1, predictor="trend", n_p=5))
    for report in (RecoveryReport("fresh", None, None, 0),
                   RecoveryReport("recompute", 27, 20, 20),
                   RecoveryReport("predict", 45, 30, 45, predictor="trend"),
                   RecoveryReport("restart", 4, None, 0)):
        append_report(d, report)
    return d


def test_checkpoint_cost_sums_each_checkpoints_slowest_rank_over_every_attempt(bench, run_dir):
    seconds, checkpoints, measured = bench.checkpoint_cost(bench.cost_rows(run_dir))
    assert checkpoints == measured == 4
    assert seconds == pytest.approx(0.30 + 0.05 + 0.07 + 0.01)


def test_a_commit_without_a_cost_row_counts_at_the_median_measured_cost(bench, run_dir):
    # Six commits logged, four measured (0.30, 0.05, 0.07, 0.01: median 0.06); fewer logged never lowers the count.
    assert bench.checkpoint_cost(bench.cost_rows(run_dir), committed=6) == (pytest.approx(0.43 + 2 * 0.06), 6, 4)
    assert bench.checkpoint_cost(bench.cost_rows(run_dir), committed=3) == (pytest.approx(0.43), 4, 4)


def test_commits_are_counted_from_the_jobs_log_over_every_attempt(bench, tmp_path):
    log = tmp_path / "run.log"
    log.write_text("[cpsr_ds] checkpoint global_step5 committed, latest moved to it\n"
                   "[cpsr_ds] checkpoint global_step10 committed\n"
                   "[cpsr_ds] cpsr recovery: recomputing from global_step10\n"
                   "[cpsr_ds] checkpoint global_step10 committed, latest moved to it\n")
    assert bench.committed_checkpoints(str(log)) == 3


def test_a_checkpoint_measured_below_zero_counts_as_measured(bench, tmp_path):
    # One checkpoint's slowdown is a noisy estimate; flooring it at 0 would bias the run's sum upward.
    rows = [cost(0, 1, 10, 0.10), cost(0, 1, 20, -0.04), cost(0, 1, 30, -0.02), cost(2, 1, 30, -0.05, stage=1)]
    assert bench.checkpoint_cost(rows) == (pytest.approx(0.10 - 0.04 - 0.02), 3, 3)


def test_slowdowns_summing_to_at_least_the_stalls_are_a_checkpoint_cost(bench):
    # Two checkpoints below their stalls, one far above: the sum stands.
    rows = [cost(0, 1, 10, 0.001, stall=0.01), cost(0, 1, 20, -0.02, stall=0.01), cost(0, 1, 30, 0.05, stall=0.01)]
    assert bench.implausible_checkpoint_cost(rows) == ""


def test_slowdowns_summing_below_the_stalls_leave_the_checkpoint_cost_unmeasurable(bench):
    # The slowest rank's stall per checkpoint: 0.03 + 0.02 = 0.05 s blocked, the slowdowns sum to 0.04 s.
    rows = [cost(0, 1, 10, 0.03, stall=0.01), cost(2, 1, 10, 0.02, stage=1, stall=0.03),
            cost(0, 2, 10, 0.01, stall=0.02)]
    assert "sum to 0.04 s, below their stalls' 0.05 s" in bench.implausible_checkpoint_cost(rows)


def test_an_unmeasurable_checkpoint_cost_leaves_no_total(bench):
    got = bench.ft_cost(checkpoint_s=None, recomputed_iters=11, lag_iters=4.0, iteration_time_s=0.02,
                        failure_free_s=20.0)
    assert got["ft_cost_s"] is None and got["ft_cost_pct"] is None
    assert got["recovery_cost_s"] == pytest.approx(15 * 0.02)


def test_a_run_without_cost_rows_is_an_error_naming_the_file(bench, tmp_path):
    d = str(tmp_path)
    append(measurements_path(d, 0), StateRow(iteration=10, stage=0, rank=0, attempt=1, predictor="trend", n_p=5))
    with pytest.raises(bench.NoCostRows, match=r"measurements/rank00000\.jsonl"):
        bench.cost_rows(d)


def test_recoveries_count_recomputed_and_lost_iterations(bench, run_dir):
    got = bench.recoveries(read_reports(run_dir))
    # recompute: d = 7; restart without a checkpoint: recomputes 4 from 0; predict: d = 15, not recomputed.
    assert got == {"n_failures": 3, "recomputed_iters": 11, "lost_iters": 26, "predicted": 1, "in_flight": 0}


def test_a_recovery_from_the_parameters_in_flight_is_counted_as_not_exact(bench, tmp_path):
    d = str(tmp_path)
    for report in (RecoveryReport("fresh", None, None, 0),
                   RecoveryReport("recompute", 37, 32, 32, sources={"0": "in flight", "1": "in flight"}),
                   RecoveryReport("recompute", 57, 48, 48, sources={"0": "host snapshot", "1": "host snapshot"})):
        append_report(d, report)
    got = bench.recoveries(read_reports(d))
    assert got == {"n_failures": 2, "recomputed_iters": 14, "lost_iters": 14, "predicted": 0, "in_flight": 1}


def test_per_class_splits_the_end_lag_over_the_recoveries_that_left_one_by_their_d(bench, tmp_path):
    d = str(tmp_path)
    for report in (RecoveryReport("fresh", None, None, 0),
                   RecoveryReport("recompute", 57, 56, 56, sources={"0": "host snapshot"}),  # crash: 1 recomputed
                   RecoveryReport("predict", 80, 70, 81),  # lost node: d 10, predicted
                   RecoveryReport("recompute", 130, 100, 100, sources={"0": "in flight"}),  # lost node: d 30
                   RecoveryReport("recompute", 150, 140, 140)):  # crash without a snapshot: 10 recomputed
        append_report(d, report)
    classes = ["process_crash", "node_lost", "node_lost", "process_crash"]
    got = bench.per_class(read_reports(d), classes, [1.0, 2.0, 3.0, 4.0], lag_iters=8.0, expected=[1, 2, 3, 4])
    crash, node = got["process_crash"], got["node_lost"]
    assert (crash["failures"], crash["host_snapshot"], crash["inexact"], crash["recomputed_iters"]) == (2, 1, 0, 11)
    assert crash["recovery_iters"] == 11 and crash["downtime_s"] == 5.0 and crash["expected_iters"] == 5
    # The lag, 8 iterations, over the predicted (d 10) and the in-flight (d 30) recoveries: 2 + 6.
    assert (node["failures"], node["inexact"], node["recomputed_iters"], node["lost_iters"]) == (2, 2, 30, 40)
    assert node["lag_iters"] == pytest.approx(8.0) and node["recovery_iters"] == pytest.approx(38.0)
    unmeasured = bench.per_class(read_reports(d), classes, [1.0, 2.0, 3.0, 4.0], lag_iters=None,
                                 expected=[1, None, 3, 4])
    assert unmeasured["node_lost"]["recovery_iters"] is None and unmeasured["process_crash"]["recovery_iters"] == 11
    assert unmeasured["node_lost"]["expected_iters"] is None and unmeasured["process_crash"]["expected_iters"] == 5
    with pytest.raises(ValueError):  # a failure without its class
        bench.per_class(read_reports(d), classes[:3], [1.0, 2.0, 3.0], lag_iters=8.0, expected=[1, 2, 3])


def test_the_model_expects_half_an_interval_and_the_persist_per_failure_less_what_prediction_saves(bench):
    assert bench.expected_per_failure(4, 30, 5, 0.5) == {"process_crash": 2.0, "node_lost": 10.0}
    assert bench.expected_per_failure(None, 30, 5, 0.0) == {"process_crash": 20.0, "node_lost": 20.0}


def test_class_summary_weighs_each_runs_expectation_by_its_failures(bench):
    def run(crashes, nodes, crash_iters, node_iters, expected):
        rows = {"process_crash": {"failures": crashes, "recovery_iters": crash_iters, "host_snapshot": crashes,
                                  "inexact": 0, "downtime_s": 2.0 * crashes,
                                  "expected_iters": expected["process_crash"] * crashes},
                "node_lost": {"failures": nodes, "recovery_iters": node_iters, "host_snapshot": 0, "inexact": nodes,
                              "downtime_s": 4.0 * nodes, "expected_iters": expected["node_lost"] * nodes}}
        return {"per_class": rows}

    runs = [run(1, 3, 2.0, 30.0, {"process_crash": 1.0, "node_lost": 10.0}),
            run(0, 2, 0.0, None, {"process_crash": 1.0, "node_lost": 20.0}),  # its lag unmeasurable
            run(2, 1, 6.0, 10.0, {"process_crash": 4.0, "node_lost": 5.0})]
    got = bench.class_summary(runs)
    crash, node = got["process_crash"], got["node_lost"]
    assert (crash["failures"], crash["compared_failures"]) == (3, 3)
    assert crash["recovery_iters_per_failure"] == pytest.approx(8 / 3)
    assert crash["expected_iters_per_failure"] == pytest.approx((1 + 2 * 4) / 3)
    assert crash["measured_over_expected"] == pytest.approx(8 / 9)
    assert (node["failures"], node["compared_failures"], node["inexact"]) == (6, 4, 6)
    assert node["recovery_iters_per_failure"] == pytest.approx(10.0)
    assert node["expected_iters_per_failure"] == pytest.approx((3 * 10 + 5) / 4)
    assert node["downtime_s_per_failure"] == pytest.approx(4.0)


def test_failure_classes_follow_the_share_seeded_apart_from_the_failure_times(bench):
    classes = bench.failure_classes(3, 2000, 0.25)
    assert classes == bench.failure_classes(3, 2000, 0.25) and set(classes) == {"process_crash", "node_lost"}
    assert classes.count("process_crash") / 2000 == pytest.approx(0.25, abs=0.04)
    assert bench.failure_classes(3, 5, 0.0) == ["node_lost"] * 5 and bench.failure_classes(3, 5, 1.0) == ["process_crash"] * 5
    with pytest.raises(ValueError, match="share"):
        bench.failure_classes(3, 5, 1.5)


def test_snapshots_cost_their_runs_excess_iteration_time_and_sparse_ones_their_stall(bench):
    assert bench.snapshot_cost(0.026, 0.025, 1000, 1, 0.004) == pytest.approx(1.0)
    assert bench.snapshot_cost(0.025, 0.025, 1000, 20, 0.004) == pytest.approx(0.2)
    assert bench.snapshot_cost(0.024, 0.025, 1000, 1, 0.0) == pytest.approx(-1.0)  # noise, kept as measured


def test_a_runs_baseline_is_the_runs_without_snapshots_just_before_and_after_it(bench):
    assert bench.STRATEGIES == ("torch", "checkfreq", "in_memory", "pccheck", "cpsr", "cpsr_fix")
    clean = {"torch": 1.0, "checkfreq": 2.0, "in_memory": 9.0, "pccheck": 4.0, "cpsr": 9.0, "cpsr_fix": 8.0}
    assert bench.neighbour_base_s("in_memory", clean) == 3.0
    assert bench.neighbour_base_s("cpsr", clean) == 6.0
    assert bench.neighbour_base_s("pccheck", clean) == 5.0  # itself left out: checkfreq and cpsr_fix
    assert bench.neighbour_base_s("torch", clean) == 2.0 and bench.neighbour_base_s("cpsr_fix", clean) == 4.0


def memory_plan(iteration, attempt, interval, stall_s=1e-4):
    return runlog.MemoryPlanRow(iteration, attempt, 0.0, "snapshot", interval, stall_s, 0.02, 100.0, interval / 2)


def storage_plan(iteration, attempt, reason, T_c, per_failure=None):
    stages = [] if per_failure is None else [{"stage": 0, "per_failure": per_failure}]
    return runlog.PlanRow(iteration, attempt, 0.0, reason, 0, "empirical", "predict", T_c, stages=stages)


def test_the_snapshot_plan_is_read_from_the_runs_plans(bench, tmp_path):
    assert bench.snapshot_plan(str(tmp_path)) is None
    for row in (memory_plan(5, 1, 12, 4.1e-4), storage_plan(6, 1, "first", 30), memory_plan(3, 2, 9, 3.5e-5)):
        runlog.append(runlog.plans_path(str(tmp_path)), row)
    assert bench.snapshot_plan(str(tmp_path)) == (9, 3.5e-05)


def test_each_failure_is_expected_to_cost_what_the_plans_in_force_then_expected(bench, tmp_path):
    d = str(tmp_path)
    for row in (storage_plan(0, 1, "warm-up", 50), memory_plan(50, 1, 8), storage_plan(50, 1, "first", 20, 12.5),
                storage_plan(90, 2, "restart", 22, 14.0), memory_plan(90, 2, 6)):
        runlog.append(runlog.plans_path(d), row)
    for report in (RecoveryReport("fresh", None, None, 0), RecoveryReport("recompute", 40, 0, 0),
                   RecoveryReport("recompute", 70, 50, 50), RecoveryReport("recompute", 95, 90, 90),
                   RecoveryReport("recompute", 120, 110, 110), RecoveryReport("recompute", 130, 120, 120)):
        append_report(d, report)
    classes = ["node_lost", "process_crash", "node_lost", "process_crash", "node_lost"]
    got = bench.planned_per_failure(d, read_reports(d), classes, first_interval=50, snapshots=True)
    # Attempt 1 failed at 40 under the warm-up plan, 2 at 70 before its own plans (none in force: a crash at
    # first_interval / 2), 3 at 95, 4 at 120 and 5 at 130 with no plan of theirs.
    assert got == [25.0, 25.0, None, 25.0, None]
    again = bench.planned_per_failure(d, read_reports(d)[:3], ["node_lost", "node_lost"], 50, snapshots=True)
    assert again == [25.0, None]
    runlog.append(runlog.plans_path(d), storage_plan(60, 2, "first", 30, 9.0))
    runlog.append(runlog.plans_path(d), memory_plan(60, 2, 4))
    assert bench.planned_per_failure(d, read_reports(d)[:3], ["node_lost", "process_crash"], 50, True) == [25.0, 2.0]
    assert bench.planned_per_failure(d, read_reports(d)[:3], ["node_lost", "process_crash"], 50, False) == [25.0, 9.0]


def test_each_strategy_gets_its_levels_and_the_traces_mix(bench):
    memory = bench.strategy_block("in_memory", "auto", 2.0, [5], 1.0, 0.25, "/r/in_memory")
    assert memory["checkpoint"] == {"strategy": "checkfreq", "interval": "auto", "write_mbps": 2.0,
                                    "memory_interval": 1, "survivor_dir": "/r/in_memory.node"}
    assert memory["recovery"] == {"mode": "recompute"}
    cpsr = bench.strategy_block("cpsr", "auto", 2.0, [5], 1.0, 0.25, "/r/cpsr")
    assert cpsr["checkpoint"]["memory_interval"] == "auto" and cpsr["recovery"] == {"mode": "auto"}
    assert cpsr["planner"] == {"failure_rate_per_hour": 1.0, "failure_mix": {"process_crash": 0.25, "node_lost": 0.75}}
    for strategy in ("torch", "checkfreq", "pccheck", "cpsr_fix"):
        assert "memory_interval" not in bench.strategy_block(strategy, 20, 2.0, [5], 1.0, 0.25, "/r/x")["checkpoint"]


def test_ft_cost_adds_checkpoint_cost_recomputation_and_lag_at_the_iteration_time(bench):
    got = bench.ft_cost(checkpoint_s=1.5, recomputed_iters=11, lag_iters=4.0, iteration_time_s=0.02,
                        failure_free_s=20.0)
    assert got["recovery_cost_s"] == pytest.approx(15 * 0.02)
    assert got["ft_cost_s"] == pytest.approx(1.8)
    assert got["ft_cost_pct"] == pytest.approx(9.0)
    with_snapshots = bench.ft_cost(checkpoint_s=1.5, recomputed_iters=11, lag_iters=4.0, iteration_time_s=0.02,
                                   failure_free_s=20.0, snapshot_s=0.2)
    assert with_snapshots["ft_cost_s"] == pytest.approx(2.0) and with_snapshots["snapshot_cost_s"] == 0.2


def test_an_unmeasurable_lag_leaves_no_number(bench):
    got = bench.ft_cost(checkpoint_s=1.5, recomputed_iters=11, lag_iters=None, iteration_time_s=0.02,
                        failure_free_s=20.0)
    assert got["ft_cost_s"] is None and got["ft_cost_pct"] is None and got["recovery_cost_s"] is None
    assert got["checkpoint_cost_s"] == 1.5


def test_the_interval_used_is_the_median_gap_within_attempts(bench):
    rows = [cost(0, 1, i, 0.0) for i in (50, 69, 88, 107)] + [cost(0, 2, i, 0.0) for i in (95, 114, 133)]
    assert bench.used_interval(rows) == 19


def test_downtime_runs_from_the_killed_jobs_last_iteration_to_the_restarts_first(bench):
    # Killed after 5 (the restart recomputes 5 from checkpoint 4) and after 8 (the restart predicts, resumes at 9).
    entries = [Entry(i, 1.0, t) for i, t in [(1, 0.0), (2, 1.0), (3, 2.0), (4, 3.0), (5, 4.0), (5, 10.0), (6, 11.0),
                                             (7, 12.0), (8, 13.0), (9, 20.5), (10, 21.5)]]
    assert bench.downtimes(entries, [5, 8]) == [6.0, 7.5]


def test_iteration_times_leave_out_each_restart_even_one_that_resumes_at_the_next_iteration(bench):
    # As above: after 5 the restart recomputes 5; after 8 it predicts and its first line is 9, 7.5 s later.
    entries = [Entry(i, 1.0, t) for i, t in [(1, 0.0), (2, 1.0), (3, 2.0), (4, 3.0), (5, 4.0), (5, 10.0), (6, 11.0),
                                             (7, 12.0), (8, 13.0), (9, 20.5), (10, 21.5)]]
    assert bench.iteration_seconds(entries, [5, 8]) == [1.0] * 8
    assert 7.5 in bench.iteration_seconds(entries, [5])  # a gap across a restart it is not told of stays in


def test_a_failure_without_a_restart_in_the_journal_is_an_error(bench):
    entries = [Entry(i, 1.0, float(i)) for i in range(1, 6)]
    with pytest.raises(ValueError, match="no restart after the failure at iteration 5"):
        bench.downtimes(entries, [5])


# ---------------------------------------------------------------- the lag at the end

def curve(iterations, shift=0.0):
    return {i: 4.0 - 0.5 * math.log(i - shift) for i in iterations}


def test_the_end_lag_finds_a_run_that_runs_behind(bench):
    iters = 1000
    start, every = bench.window(iters)
    reference = curve(range(iters - bench.FIT_SPAN * (iters - start), iters + 1, every))
    run = curve(range(start, iters + 1, every), shift=12.0)
    got = bench.end_lag(reference, run, iters)
    assert got["unmeasurable"] == ""
    assert got["lag_iters"] == pytest.approx(12.0, abs=0.5)


def test_the_end_lag_over_a_flat_reference_is_unmeasurable_with_the_reason(bench):
    iters = 1000
    start, every = bench.window(iters)
    reference = {i: 2.0 for i in range(iters - bench.FIT_SPAN * (iters - start), iters + 1, every)}
    got = bench.end_lag(reference, {i: 2.0 for i in range(start, iters + 1, every)}, iters)
    assert got["lag_iters"] is None and got["unmeasurable"] == "flat" and "flat" in got["unmeasurable_reason"]


# ---------------------------------------------------------------- over the traces

def test_the_interval_over_traces_is_students_and_leaves_unmeasurable_traces_out(bench):
    values = [10.0, 12.0, 17.0, None]
    got = bench.over_traces(values)
    x = np.array([10.0, 12.0, 17.0])
    half = stats.t.ppf(0.975, 2) * x.std(ddof=1) / math.sqrt(3)
    assert got["mean"] == pytest.approx(13.0) and got["median"] == 12.0
    assert got["ci95"] == pytest.approx([13.0 - half, 13.0 + half])
    assert got["measured"] == 3 and got["unmeasurable"]["count"] == 1


def test_reductions_are_paired_per_trace(bench):
    got = bench.reductions([6.0, 5.0, None, 4.0], [10.0, 10.0, 10.0, None])
    assert got["measured"] == 2 and got["mean"] == pytest.approx(0.45)


# ---------------------------------------------------------------- projection

LAM, T_S, PERSIST = 2e-5, 0.5, 19.0


def test_the_empirical_cost_rate_spans_recomputing_and_free_recovery():
    T_c = np.array([5.0, 19.0, 60.0, 400.0])
    recompute = fault_tolerance_cost.recompute_cost_rate(T_c, LAM, T_S, PERSIST)
    assert fault_tolerance_cost.empirical_cost_rate(T_c, LAM, T_S, 0.0, PERSIST) == pytest.approx(recompute)
    period = T_c + T_S + np.maximum(0.0, PERSIST - T_c)
    checkpoints_only = LAM * (T_S + np.maximum(0.0, PERSIST - T_c)) / np.expm1(LAM * period)
    half = fault_tolerance_cost.empirical_cost_rate(T_c, LAM, T_S, 0.5, PERSIST)
    assert half == pytest.approx((recompute + checkpoints_only) / 2)


def measured_components():
    async_ = {"T_s": 0.5, "stall": 0.1, "persist": 19.0, "in_flight": 1}
    return {"torch": {"strategy": "torch", "T_s": 19.0, "stall": 19.0, "persist": 19.0, "in_flight": 1},
            "checkfreq": {"strategy": "checkfreq", **async_},
            "pccheck": {"strategy": "pccheck", **async_, "in_flight": 2},
            "cpsr": {"strategy": "cpsr", **async_}, "cpsr_fix": {"strategy": "cpsr_fix", **async_}}


def test_projection_applies_each_strategys_rule_and_cost_rate_at_the_papers_scale(bench):
    rows = bench.projection(measured_components(), rho=0.6, budget=0.02)
    iteration_s = 16.8 / 19
    lam = 0.08 * iteration_s / 3600
    at = {(r["job"], r["storage_mbps"], r["strategy"]): r for r in rows}
    assert len(rows) == 3 * 2 * 5
    slow = at[("GPT2-0.35B", 250.0, "checkfreq")]
    assert slow["T_c"] == 19  # the persist time: the budget alone would allow 5
    rate = fault_tolerance_cost.recompute_cost_rate(19.0, lam, 0.5, 19.0)
    assert slow["cost_pct"] == pytest.approx(100 * rate)
    job_s = 7 * 3600 + 41 * 60
    assert slow["ft_cost_h"] == pytest.approx(rate * job_s / 3600)
    assert slow["checkpoints"] == pytest.approx(job_s / iteration_s / 19)
    assert slow["expected_failures"] == pytest.approx(0.08 * job_s / 3600)
    # Two persisting at once share the storage's bandwidth: one checkpoint per persist time, as CheckFreq's.
    assert at[("GPT2-0.35B", 250.0, "pccheck")]["T_c"] == 19
    assert at[("GPT2-0.35B", 2000.0, "checkfreq")]["T_c"] == 5  # persist 19 / 8 iterations: the budget rules
    assert at[("GPT2-0.35B", 2000.0, "torch")]["T_c"] == math.ceil(19 / 8 / 0.02)  # its stall is the write
    fix, best = at[("GPT2-0.35B", 250.0, "cpsr_fix")], at[("GPT2-0.35B", 250.0, "cpsr")]
    assert fix["T_c"] == 19
    assert fix["cost_pct"] == pytest.approx(
        100 * float(fault_tolerance_cost.empirical_cost_rate(19.0, lam, 0.5, 0.6, 19.0)))
    assert best["T_c"] > 19 and best["cost_pct"] < fix["cost_pct"] < slow["cost_pct"]
    # The cost rate does not depend on the job's length; T_l does.
    vgg = at[("VGG16", 250.0, "checkfreq")]
    assert vgg["cost_pct"] == slow["cost_pct"] and vgg["ft_cost_h"] > slow["ft_cost_h"]


# ---------------------------------------------------------------- storage

def test_the_papers_numbers_give_its_storage_bandwidth(bench):
    assert bench.paper_persist_s() == pytest.approx(16.8)
    # GPT2-0.35B's 4.2 GB persisting in 19 iterations of 16.8 s / 19 is the A30 server's 250 MB/s.
    assert bench.write_limit(4.2e9, 16.8 / 19) == pytest.approx(250.0)


def test_the_write_limit_persists_one_checkpoint_in_19_iterations(bench):
    mbps = bench.write_limit(1_674_824, 0.025)
    assert mbps == pytest.approx(1_674_824 / (19 * 0.025) / 1e6)
    assert 1_674_824 / (mbps * 1e6) / 0.025 == pytest.approx(19)
    with pytest.raises(ValueError):
        bench.write_limit(0, 0.025)
    assert "write_mbps 3.526" in bench.write_limit_text(1_674_824, 0.025)


def test_predictions_that_cost_more_than_recomputing_project_as_recomputing(bench):
    rho, source = bench.measured_rho([{"rho": -0.4}, {"rho": -0.2}, {"rho": 0.1}])
    assert rho == 0.0 and "below 0" in source
    assert bench.measured_rho([{"rho": 0.3}, {"rho": None}, {"rho": 0.5}])[0] == pytest.approx(0.4)


def test_a_lost_node_takes_the_killed_ranks_dump_and_snapshots_and_nothing_else(bench, tmp_path):
    run_dir = str(tmp_path / "cpsr")
    memory = tmp_path / "cpsr.node" / "run-id"
    kept = [memory / "rank00000", memory / "rank00000.memory0", memory / "owner.json", memory / "rank00000.mark"]
    lost = [memory / "rank00001", memory / "rank00001.memory0", memory / "rank00001.memory1", memory / "rank00001.mark"]
    for path in kept[:2] + lost[:3]:
        path.mkdir(parents=True)
    for path in (kept[2], kept[3], lost[3]):
        path.write_text("{}")
    bench.lose_node(run_dir, 1)
    assert all(p.exists() for p in kept) and not any(p.exists() for p in lost)


def test_the_layouts_kill_rank_is_in_every_runs_faults(bench):
    assert bench.strategy_block("checkfreq", "auto", 2.0, [5, 9], kill_rank=1)["faults"] == {
        "kill_at_iteration": [5, 9], "kill_rank": 1}
    assert bench.ds_config(100, "/r", {}, stages=2)["pipeline"] == {"stages": 2}
