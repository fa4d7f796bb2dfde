"""Where a benchmark writes when its command names no output: the current result of its protocol in
benchmarks/results/<benchmark>/, under the name the committed result has."""

import importlib
import os

import pytest

from benchmarks.common.paths import RESULTS, result_path, with_default_outputs


def test_the_name_holds_the_benchmark_its_variant_and_quick():
    assert result_path("bench_recovery", "json", quick=True, variant="pp2") == \
        os.path.join(RESULTS, "bench_recovery", "bench_recovery_pp2_quick.json")
    assert result_path("chaos", "txt") == os.path.join(RESULTS, "chaos", "chaos.txt")


@pytest.mark.parametrize("benchmark, argv, variant", [
    ("bench_ftcost", [], ""), ("bench_ftcost", ["--quick"], ""), ("bench_recovery", ["--quick"], ""),
    ("bench_recovery", ["--layouts", "pp2", "--quick"], "pp2"), ("bench_overhead", ["--quick"], ""),
    ("bench_multinode", [], ""), ("checkpoint_slowdown", [], ""), ("early_prediction", [], ""),
])
def test_a_run_that_names_no_output_writes_over_the_committed_result(benchmark, argv, variant):
    args = with_default_outputs(importlib.import_module(f"benchmarks.{benchmark}").parse_args(argv), benchmark,
                                variant)
    assert os.path.exists(args.json), args.json
    assert os.path.dirname(args.json) == os.path.join(RESULTS, benchmark)


def test_the_plot_goes_beside_the_json():
    args = with_default_outputs(importlib.import_module("benchmarks.bench_ftcost").parse_args([]), "bench_ftcost",
                                plot=True)
    assert args.plot == args.json[:-len("json")] + "png" and os.path.exists(args.plot)


def test_a_command_that_names_one_output_writes_only_that(tmp_path):
    bench = importlib.import_module("benchmarks.bench_ftcost")
    args = with_default_outputs(bench.parse_args(["--json", str(tmp_path / "r.json")]), "bench_ftcost", plot=True)
    assert (args.json, args.plot) == (str(tmp_path / "r.json"), None)
    args = with_default_outputs(bench.parse_args(["--plot", str(tmp_path / "r.png")]), "bench_ftcost", plot=True)
    assert (args.json, args.plot) == (None, str(tmp_path / "r.png"))
