"""benchmarks/gpu: run.sh's dry run (every GPU measurement's code path on the CPU, at toy sizes; part quick first),
its resumption and failure report, and the versions wheels.sh fetches."""

import json
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import version

import pytest

from benchmarks.common.processes import finish, start
from conftest import ROOT

RUN = os.path.join(ROOT, "benchmarks", "gpu", "run.sh")
WHEELS = os.path.join(ROOT, "benchmarks", "gpu", "wheels.sh")
# The dry run's strategies: one of each code path of bench_checkpoint's protocol.
STRATEGIES = {"torch", "cpsr", "ds_decoupled"}
CHECKPOINT_FIELDS = {"stall_s", "slowdown_s", "raw_copy_s", "persist_gbps", "disk_gbps", "repeats", "device", "states",
                     "sizes"}
# Every measurement's JSON and the fields its summary and the README's table read.
EXPECTED = {
    "device": {"name", "cuda_available", "torch", "cuda", "deepspeed", "cpus", "memory_gib", "disk_free_gib"},
    "checkpoint_gpt2_0.35b": CHECKPOINT_FIELDS,
    "recovery_test": {"passed", "collected_only", "seconds", "summary"},
    "coordinator_test": {"passed", "collected_only", "seconds", "summary"},
    "checkpoint_gpt3_3.35b": CHECKPOINT_FIELDS,
    "restart_gpt2_0.35b": {"device", "model", "predictor", "predictor_gpu_peak_mib", "predictor_work", "restart",
                           "report", "downtime_s"},
    "recovery_bench": {"median_reduction", "worst_final_loss_excess", "median_window_end_excess", "cases", "settings"},
    "recovery_gpt2_0.35b": {"median_reduction", "ci95_reduction", "worst_final_loss_excess", "median_window_end_excess",
                            "cases", "settings"},
    "predictor_footprint": {"train_peak_mib", "predict_working_peak_mib", "train_step_s", "predict_s"},
}


def run_sh(tmp_path, *args, env=None, timeout_s=600):
    """run.sh with this interpreter, in a process group of its own; (exit status, its output)."""
    log = tmp_path / f"run-{len(list(tmp_path.glob('run-*.log')))}.log"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", **(env or {}))
    [code] = finish([start([RUN, *map(str, args)], log, env)], timeout_s)
    return code, log.read_text()


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """(tmp, OUT_DIR, the output of every part, that of part quick): part quick first, then every part into the same
    OUT_DIR, which keeps quick's measurements and runs the others."""
    tmp = tmp_path_factory.mktemp("gpu_dry")
    out = tmp / "out"
    code, quick = run_sh(tmp, out, "--dry-run", "--part", "quick")
    assert code == 0, quick[-6000:]
    code, output = run_sh(tmp, out, "--dry-run")
    assert code == 0, output[-6000:]
    return tmp, out, output, quick


def load(out, name):
    with open(out / f"{name}.json") as f:
        return json.load(f)


def test_dry_run_writes_every_measurement_with_its_fields(dry_run):
    _, out, output, _ = dry_run
    for name, fields in EXPECTED.items():
        assert (out / f"{name}.txt").exists(), name
        assert fields <= load(out, name).keys(), (name, fields - load(out, name).keys())
        assert f"  {name}" in output.split("GPU measurements in")[-1], name
    assert load(out, "device")["name"] and load(out, "device")["cuda_available"] is False


def test_dry_run_measures_the_model_states_at_toy_size(dry_run):
    _, out, _, _ = dry_run
    gpt2, gpt3 = load(out, "checkpoint_gpt2_0.35b"), load(out, "checkpoint_gpt3_3.35b")
    assert gpt2["states"] == ["gpt2_0.35b"] and set(gpt2["stall_s"]) == STRATEGIES
    assert gpt3["states"] == ["gpt3_3.35b"] and set(gpt3["stall_s"]) == {"torch", "cpsr"}
    for result, layers in ((gpt2, 2), (gpt3, 2)):
        state = next(iter(result["sizes"].values()))
        assert state["model"]["layers"] == layers and state["model"]["bf16"] and state["model"]["zero_stage"] == 1
        # The state as checkpointed: bf16 weights, fp32 masters and Adam's two moments, 14 bytes a parameter.
        assert state["bytes"] >= 14 * state["model"]["params"], (state["bytes"], state["model"]["params"])
        assert result["raw_copy_s"] > 0 and result["disk_gbps"] > 0
        for strategy in ("torch", "cpsr"):
            assert result["stall_s"][strategy] > 0 and result["persist_gbps"][strategy] > 0


def test_dry_run_restart_and_recovery(dry_run):
    _, out, _, _ = dry_run
    restart = load(out, "restart_gpt2_0.35b")
    assert restart["report"]["method"] == "predict" and restart["report"]["reached"] == 23
    assert set(restart["restart"]) == {"process_start_s", "model_build_s", "deepspeed_init_s", "reading_s",
                                       "prediction_s", "writing_s", "plugin_setup_s", "corpus_s", "other_setup_s",
                                       "first_step_s", "total_s"}
    assert all(v >= 0 for v in restart["restart"].values()) and restart["restart"]["reading_s"] > 0
    assert restart["predictor_work"] and restart["predictor_gpu_peak_mib"] is None  # no CUDA here
    bench = load(out, "recovery_bench")
    assert set(bench["median_reduction"]) == {"recompute", "trend", "default"}
    assert len({(c["c"], c["d"]) for c in bench["cases"]}) >= 3
    # pytest selects the two single-process tests: "2/N tests collected (N - 2 deselected)".
    test = load(out, "recovery_test")
    assert test["passed"] and re.match(r"2(/\d+)? tests collected", test["summary"])
    # Every test of the CUDA path is selected (skipped when run here, as make test does).
    test = load(out, "coordinator_test")
    assert test["passed"] and test["collected_only"] and re.match(r"5 tests collected", test["summary"])


def test_quick_part_runs_the_coordinator_tests_and_recovery_at_gpt2_shape(dry_run):
    _, out, _, quick = dry_run
    summary = quick.split("GPU measurements in")[-1]
    assert re.findall(r"^  (\S+)", summary, re.M) == ["device", "coordinator_test", "recovery_gpt2_0.35b"]
    bench = load(out, "recovery_gpt2_0.35b")
    assert set(bench["median_reduction"]) == {"recompute", "trend", "default"}
    settings = bench["settings"]
    assert settings["config"] == "benchmarks/gpu/gpt2_recovery.json" and not settings["cost_model"]
    with open(os.path.join(ROOT, settings["config"])) as f:
        config = json.load(f)
    assert config["bf16"]["enabled"] and config["zero_optimization"]["stage"] == 1
    # 3 failures x 2 values of d, each with every method, and the default's loss excess at f + 4d.
    Tc = settings["intervals"][0]
    failures = {(c["c"], c["d"]) for c in bench["cases"]}
    assert len(failures) == 6 and {d for _, d in failures} == {Tc // 2, Tc - 1}
    assert sorted((c["method"], c["c"], c["d"]) for c in bench["cases"]) == sorted(
        (m, c, d) for m in ("recompute", "trend", "default") for c, d in failures)
    assert all(c["window_end_excess"] is not None for c in bench["cases"])
    # Each failure's cases were written as measured, the same as the summary's.
    with open(out / "recovery_gpt2_0.35b.cases.jsonl") as f:
        written = [json.loads(line) for line in f]
    assert [{k: v for k, v in c.items() if k != "curve"} for c in written] == bench["cases"]
    # The reference kept the checkpoints the recoveries read (each c and the 3 before it) and deleted the others.
    kept = {c - j * Tc for c, _ in failures for j in range(4)}
    log = (out / "recovery_gpt2_0.35b.txt").read_text()
    assert f"the reference kept the checkpoints at {sorted(kept)}" in log


def test_rerun_keeps_what_exists_and_a_failure_fails_the_run(dry_run):
    tmp, out, _, _ = dry_run
    again = tmp / "again"
    shutil.copytree(out, again)
    (again / "recovery_bench.json").unlink()
    # An impossible knob makes the reduced bench_recovery fail at once; the part's other measurement is kept.
    code, output = run_sh(tmp, again, "--dry-run", "--part", "3", env={"RECOVERY_TC": "ten"})
    assert code == 1, output[-4000:]
    summary = output.split("GPU measurements in")[-1]
    assert "recovery_bench" in summary and "FAILED" in summary and "predictor_footprint" in summary
    assert "kept" in summary and "checkpoint_gpt2" not in summary
    assert not (again / "recovery_bench.json").exists() and "--intervals" in (again / "recovery_bench.txt").read_text()


def test_part_quick_runs_nothing_once_its_time_is_spent(tmp_path):
    code, output = run_sh(tmp_path, tmp_path / "out", "--dry-run", "--part", "quick", env={"QUICK_LIMIT_S": "0"})
    assert code == 1, output[-4000:]
    summary = output.split("GPU measurements in")[-1]
    for name in ("device", "coordinator_test", "recovery_gpt2_0.35b"):
        assert re.search(rf"^  {re.escape(name)} +FAILED  not run: the part's time is spent$", summary, re.M), summary
    assert not (tmp_path / "out" / "recovery_gpt2_0.35b.txt").exists()


def test_wheels_pins_the_versions_installed_here():
    pins = subprocess.run([WHEELS, "--pins"], env=dict(os.environ, PYTHON=sys.executable), capture_output=True,
                          text=True, timeout=60, check=True).stdout.split()
    found = dict(pin.split("==") for pin in pins)
    for name in ("deepspeed", "megatron-core", "pydantic", "pydantic-core", "hjson", "annotated-types",
                 "typing-inspection", "typing-extensions", "pytest"):
        assert found.get(name) == version(name), name
