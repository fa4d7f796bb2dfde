"""bench_overhead's pure parts: throughput from a journal, on/off ratios over pairs, per-stage bubble and predictor
time from coordinator record lines, the filled share, held-out errors paired, recovery memory by DP degree."""

import importlib
import math

import pytest

from cpsr_ds.checkpoint.capture.journal import Entry
from cpsr_ds.config import CoordinatorConfig
from cpsr_ds.coordinator import Coordinator, read_records
from cpsr_ds.runlog import CostRow, StateRow


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("benchmarks.bench_overhead")


def line(rank, stage, iteration, bubble_s, predictor_s, inline_s=0.0, iterations=1, slices=(), cpu_s=None):
    row = {"rank": rank, "stage": stage, "iteration": iteration, "iterations": iterations, "bubble_s": bubble_s,
           "predictor_s": predictor_s, "inline_s": inline_s, "slices": [list(s) for s in slices]}
    return row if cpu_s is None else {**row, "predictor_cpu_s": cpu_s}


# ---------------------------------------------------------------- throughput and ratios

def test_throughput_counts_only_the_iterations_after_the_warm_up(bench):
    # Slow warm-up iterations (3 s each), then 0.5 s per iteration with a 1 s checkpoint every 4th.
    walls, t = [], 0.0
    for i in range(1, 21):
        t += 3.0 if i <= 8 else 0.5 + (1.0 if i % 4 == 0 else 0.0)
        walls.append(Entry(i, 1.0, t))
    after = [e for e in walls if e.iteration >= 8]
    expected = 12 / (after[-1].wall_time - after[0].wall_time)
    assert bench.throughput(walls, 8) == pytest.approx(expected)
    assert expected == pytest.approx(12 / 9.0)  # 12 iterations of 0.5 s and 3 checkpoints
    with pytest.raises(ValueError, match="from 20 on"):
        bench.throughput(walls, 20)


def test_the_ratio_is_taken_per_pair_and_summarised(bench):
    on, off = [0.98, 1.02, 0.97, 1.10], [1.0, 1.0, 1.0, 1.0]
    result = bench.ratios(on, off)
    assert result["ratios"] == pytest.approx(on)
    assert result["median"] == pytest.approx(1.0)
    assert result["mean"] == pytest.approx(sum(on) / 4)
    lo, hi = result["ci95"]
    assert lo < result["mean"] < hi
    # A pair's ratio, not the ratio of the means: a slow pair (a busy machine) does not weigh more.
    paired = bench.ratios([2.0, 0.5], [2.0, 0.5])
    assert paired["ratios"] == [1.0, 1.0] and paired["median"] == 1.0
    one = bench.ratios([1.0], [2.0])
    assert one["median"] == 0.5 and one["ci95"] == [-math.inf, math.inf]
    with pytest.raises(ValueError, match="not pairs"):
        bench.ratios([1.0, 1.0], [1.0])


# ---------------------------------------------------------------- coordinator records

def test_per_stage_sums_the_stages_ranks_after_the_warm_up(bench):
    rows = [
        # A line that covers warm-up iterations is left out, even if it ends after the warm-up.
        line(0, 0, 10, 50.0, 50.0, iterations=10),
        line(0, 0, 12, 99.0, 99.0, iterations=3),
        # Stage 0 has two data-parallel ranks.
        line(0, 0, 11, 0.4, 0.2, inline_s=0.1, slices=[("RecvGrad@3", 0.25, 0.2)], cpu_s=0.15),
        line(0, 0, 12, 0.4, 0.3, slices=[("RecvGrad@3", 0.25, 0.3)], cpu_s=0.2),
        line(2, 0, 11, 0.6, 0.1, cpu_s=0.05),
        line(2, 0, 12, 0.6, 0.0, inline_s=0.3),  # written before predictor_cpu_s was recorded
        line(1, 1, 12, 0.2, 0.0, iterations=2),
    ]
    stages = bench.per_stage(rows, warm_up=10)
    assert sorted(stages) == [0, 1]
    s0 = stages[0]
    assert s0["iterations"] == 4
    assert s0["bubble_s_per_iter"] == pytest.approx(2.0 / 4)
    assert s0["predictor_s_per_iter"] == pytest.approx(0.6 / 4)
    assert s0["inline_s_per_iter"] == pytest.approx(0.4 / 4)
    assert s0["filled_fraction"] == pytest.approx(0.6 / 2.0)
    assert (s0["slices"], s0["overruns"]) == (2, 1)
    assert stages[1]["bubble_s_per_iter"] == pytest.approx(0.1)
    assert stages[1]["filled_fraction"] == 0.0
    # All stages: weighted by their bubble time, not a mean of the shares.
    assert bench.filled_fraction(stages) == pytest.approx(0.6 / 2.2)
    assert bench.filled(0.1, 0.0) is None
    assert bench.work_per_iter(stages) == pytest.approx({0: 0.25, 1: 0.0})
    assert bench.cpu_per_iter(stages) == pytest.approx({0: 0.4 / 4, 1: 0.0})
    assert bench.per_stage(rows, warm_up=12) == {}


def test_per_stage_reads_the_coordinators_own_lines(bench, tmp_path):
    for rank, stage in ((0, 0), (1, 1)):
        coordinator = Coordinator(CoordinatorConfig(log_every=2), str(tmp_path), rank, stage)
        for iteration in range(1, 5):
            coordinator.slot("RecvGrad@3")
            coordinator.waited()
            coordinator.end_iteration(iteration)
    rows = read_records(str(tmp_path))
    assert len(rows) == 4
    stages = bench.per_stage(rows, warm_up=2)
    for stage in (0, 1):
        mine = [r for r in rows if r["stage"] == stage and r["iteration"] == 4]
        assert stages[stage]["iterations"] == 2
        assert stages[stage]["bubble_s_per_iter"] == pytest.approx(mine[0]["bubble_s"] / 2)
        assert stages[stage]["predictor_s_per_iter"] == 0.0


def test_fig10_series_are_per_iteration_means_over_a_stages_ranks(bench):
    rows = [line(0, 0, 1, 0.4, 0.2), line(2, 0, 1, 0.6, 0.0), line(0, 0, 3, 0.8, 0.4, iterations=2),
            line(1, 1, 1, 9.0, 9.0)]
    its, bubble, placed = bench.per_iteration(rows, 0)
    assert its == [1, 3]
    assert bubble == pytest.approx([0.5, 0.4])
    assert placed == pytest.approx([0.1, 0.2])


# ---------------------------------------------------------------- accuracy and memory

def state(iteration, stage, error, predictor="vitp"):
    return StateRow(iteration, stage, stage, 0, predictor, 100, held_out_error=error)


def test_accuracy_pairs_the_newest_checkpoint_both_runs_measured(bench):
    cost = CostRow(12, 0, 0, 0, 0.1, 0.0, 0.0, 0.1, 10)
    on = [state(10, 0, 3.0), state(12, 0, 2.0), state(14, 0, None), state(10, 1, 5.0), cost,
          state(16, 0, 0.1, predictor="trend")]
    off = [state(10, 0, 4.0), state(12, 0, 2.5), state(14, 0, 1.5), state(12, 1, 6.0)]
    assert bench.accuracy(on, off, "vitp", warm_up=8) == {0: {
        "iteration": 12, "on": 2.0, "off": 2.5, "checkpoints_after_warm_up": 2,
        "ratio_after_warm_up": pytest.approx(math.sqrt(3.0 / 4.0 * 2.0 / 2.5))}}
    assert bench.accuracy(on, off, "vitp", warm_up=10)[0]["ratio_after_warm_up"] == pytest.approx(0.8)
    assert bench.accuracy(on, off, "vitp", warm_up=12)[0]["ratio_after_warm_up"] is None


def test_accuracy_over_pairs_summarizes_each_stages_ratios(bench):
    pairs = [{0: {"ratio_after_warm_up": r}, 1: {"ratio_after_warm_up": 1.0}} for r in (0.9, 1.1, 1.0)]
    pairs.append({0: {"ratio_after_warm_up": None}})
    summary = bench.accuracy_over_pairs(pairs)
    assert summary[0]["median"] == pytest.approx(1.0) and summary[0]["measured"] == 3
    assert summary[0]["ci95"][0] < 1.0 < summary[0]["ci95"][1]
    assert summary[0]["unmeasurable"]["count"] == 1 and summary[0]["ratios"] == [0.9, 1.1, 1.0, None]
    assert summary[1]["measured"] == 3 and summary[1]["mean"] == pytest.approx(1.0)


def test_recovery_peaks_are_stage_zeros_largest_by_dp_degree(bench):
    def mem(rank, stage, dp, baseline_mib, peak_mib):
        return {"rank": rank, "stage": stage, "dp_rank": 0, "dp": dp, "method": "predict",
                "baseline_kib": baseline_mib * 1024, "peak_kib": peak_mib * 1024}

    rows = [mem(0, 0, 1, 300, 340), mem(1, 1, 1, 300, 900),
            mem(0, 0, 2, 300, 330), mem(2, 0, 2, 310, 345), mem(1, 1, 2, 300, 800)]
    peaks = bench.recovery_peaks(rows)
    assert peaks == {1: 40.0, 2: 35.0}
    assert list(peaks) == [1, 2]
    assert bench.dp_ratio(peaks, peaks) == {1: 1.0, 2: 1.0}
    assert bench.dp_ratio({0: 2.0, 1: 0.0, 2: 1.0}, {0: 1.0, 1: 1.0}) == {0: 0.5, 1: None, 2: None}


def test_recovery_over_share_is_each_dp_degrees_largest_peak_over_the_ranks_own_share(bench):
    rows = [{"dp": 1, "baseline_kib": 100, "peak_kib": 400, "share_kib": 100},
            {"dp": 2, "baseline_kib": 100, "peak_kib": 250, "share_kib": 50},
            {"dp": 2, "baseline_kib": 100, "peak_kib": 300, "share_kib": 100}]
    assert bench.recovery_over_share(rows) == {1: 3.0, 2: 3.0}


# ---------------------------------------------------------------- no pipeline: the background thread

def test_pp1_figures_are_by_dp_degree_with_the_background_time_per_iteration(bench):
    rows = [dict(line(0, 0, 11, 0.0, 0.0, inline_s=0.1), background_s=0.3),
            dict(line(1, 0, 11, 0.0, 0.0), background_s=0.5),
            line(0, 0, 12, 0.0, 0.0, inline_s=0.2)]  # a line from before background_s
    stage = bench.per_stage(rows, warm_up=10)[0]
    assert stage["background_s_per_iter"] == pytest.approx(0.8 / 3)
    assert stage["inline_s_per_iter"] == pytest.approx(0.3 / 3)
    assert stage["filled_fraction"] is None  # no bubbles
    result = lambda median: {"throughput_ratio": {"median": median}}  # noqa: E731
    layouts = {(2, 1): result(1.0), (1, 2): result(0.97), (4, 1): result(0.9), (1, 1): result(0.99)}
    by_dp = bench.at_pp(layouts, 1)
    assert list(by_dp) == [1, 2]
    assert bench.median_ratios(by_dp) == {1: 0.99, 2: 0.97}
    assert bench.median_ratios(bench.at_pp(layouts, 4)) == {1: 0.9}
    assert bench.at_pp(layouts, 8) == {}


def test_plain_runs_summarise_only_their_pp1_layouts(bench):
    """--plain runs only the PP = 1 layouts on the plain engine: the headline layout's figures are None, the layouts
    are named after the engine."""
    stage = {"background_s_per_iter": 0.25, "inline_s_per_iter": 0.01, "predictor_s_per_iter": 0.0,
             "bubble_s_per_iter": 0.0}
    layouts = {(1, dp): {"throughput_ratio": {"median": ratio}, "stages": {0: stage}, "bubble_filled_fraction": None}
               for dp, ratio in ((1, 1.08), (2, 0.9))}
    args = bench.parse_args(["--plain", "--quick"])
    result = bench.summarize_all(args, layouts, {}, [])
    assert result["throughput_ratio"] is None and result["predictor_s_per_iter"] is None
    assert result["throughput_ratio_pp1"] == {1: 1.08, 2: 0.9}
    assert result["background_s_per_iter_pp1"] == {1: 0.25, 2: 0.25}
    assert list(result["layouts"]) == ["plain_dp1", "plain_dp2"]
    assert result["recovery_peak_host_mb"] == {}
