import dataclasses
import json
import math
import statistics
import sys

import numpy as np
import pytest

from cpsr_ds.planning import plan_report
from cpsr_ds import runlog
from cpsr_ds.cli import main
from cpsr_ds.checkpoint.capture.journal import ProgressJournal, append_validation
from cpsr_ds.runlog import CostRow, PlanRow, StateRow

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ALPHA1, ALPHA2 = 4e-3, 1.5
WHAT_IF = ["--lambda", "2e-5", "--ts", "0.5", "--alpha1", "1e-3", "--alpha2", "1.0", "--tau1", "0.3",
           "--tau2", "-12", "--xi", "1e-8", "--np", "3.5e8"]


def stage_plan(stage, T_c, method):
    return {"stage": stage, "T_c": T_c, "method": method, "T_c_theorem1": float(T_c), "T_c_numerical": float(T_c)}


def inputs(**fitted):
    return {"lambda_per_hour": 0.08, "lambda": 2e-5, "iteration_time_s": 0.25, "T_s": 0.8, "persist": 3.0,
            "in_flight": 1, **fitted}


MEMORY_PLAN = runlog.MemoryPlanRow(120, 0, 2.5, "snapshot", 6, 4e-4, 0.02, 100.0, 3.0)
PLANS = [
    PlanRow(0, 0, 1.0, "warm-up", 0, "empirical", "recompute", 50, inputs=inputs()),
    PlanRow(100, 0, 2.0, "first", 0, "empirical", "predict", 80,
            inputs=inputs(alpha1=ALPHA1, alpha2=ALPHA2, tau1=0.3, tau2=-12.0, xi=1e-6, N_p=1000, d_max=45),
            stages=[stage_plan(0, 80, "theorem1"), stage_plan(1, 95, "numerical")]),
    PlanRow(180, 0, 3.0, "phase", 1, "paper", "predict", 120,
            inputs=inputs(alpha1=2 * ALPHA1, alpha2=ALPHA2 + 0.3, tau1=0.4, tau2=-12.5, xi=2e-6, N_p=1000),
            stages=[stage_plan(0, 120, "theorem1"), stage_plan(1, 130, "theorem1")],
            fallback="tau1 from 3 checkpoints only"),
]
# (iteration, slowdown_s of stage 0, of stage 1): 50 and 100 under the warm-up plan, 180 under the first
# (phase 0), 300 under the phase plan (phase 1).
CHECKPOINTS = [(50, 0.1, 0.5), (100, 0.3, 0.7), (180, 0.2, 0.6), (300, 0.9, 1.1)]


def write_measurements(directory):
    for iteration, *slowdowns in CHECKPOINTS:
        for stage, slowdown in enumerate(slowdowns):
            path = runlog.measurements_path(directory, rank=stage)
            runlog.append(path, StateRow(iteration, stage, stage, 0, "trend", 1000, xi=1e-6 * (1 + iteration / 1000),
                                         held_out_error=1e-4 / iteration))
            runlog.append(path, CostRow(iteration, stage, stage, 0, 0.25, 0.01, slowdown, 2.0 + stage, 4096))


@pytest.fixture
def run_dir(tmp_path):
    """A run of 300 iterations: journal and validation losses on Eq. 11's curve, three plans, four checkpoints
    measured on two stages, and one damaged plans line."""
    directory = str(tmp_path / "run")
    journal = ProgressJournal(directory, rank=0)
    for i in range(1, 301):
        journal.append(i, math.exp(-ALPHA1 * i + ALPHA2) * (1 + 0.01 * math.sin(i)))
    journal.close()
    for i in range(0, 301, 50):
        append_validation(directory, i, math.exp(-ALPHA1 * i + ALPHA2))
    write_measurements(directory)
    for plan in PLANS:
        runlog.append(runlog.plans_path(directory), plan)
    runlog.append(runlog.plans_path(directory), MEMORY_PLAN)
    with open(runlog.plans_path(directory), "a") as f:
        f.write('{"kind": "plan", "iteration": 2')  # cut short by a crash
    return directory


def test_plan_run_dir_json_has_the_plans_their_stages_and_the_checkpoints_per_phase(run_dir, capsys):
    assert main(["plan", run_dir, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(p["iteration"], p["reason"], p["phase"], p["recovery"], p["T_c"]) for p in report["plans"]] == \
        [(p.iteration, p.reason, p.phase, p.recovery, p.T_c) for p in PLANS]
    assert report["plans"][1]["inputs"]["alpha1"] == ALPHA1 and report["plans"][2]["model"] == "paper"
    assert [(s["iteration"], s["stage"], s["T_c"], s["method"]) for s in report["stages"]] == \
        [(100, 0, 80, "theorem1"), (100, 1, 95, "numerical"), (180, 0, 120, "theorem1"), (180, 1, 130, "theorem1")]
    assert len(report["checkpoints"]) == 2 * len(CHECKPOINTS)
    phase_of = {c["iteration"]: c["phase"] for c in report["checkpoints"]}
    assert phase_of == {50: 0, 100: 0, 180: 0, 300: 1}
    first = report["checkpoints"][0]
    assert (first["slowdown_s"], first["xi"], first["held_out_error"]) == (0.1, 1e-6 * 1.05, 1e-4 / 50)
    phases = {p["phase"]: p for p in report["phases"]}
    assert set(phases) == {0, 1}
    assert phases[0]["T_c"] == [50, 80] and phases[0]["iterations"] == [50, 100, 180]
    assert phases[0]["median_interval"] == 65
    assert phases[0]["median_slowdown_s"] == pytest.approx(statistics.median([s for _, *ss in CHECKPOINTS[:3]
                                                                              for s in ss]))
    assert phases[0]["median_persist_s"] == pytest.approx(2.5)
    assert phases[1]["checkpoints"] == 1 and phases[1]["median_slowdown_s"] == pytest.approx(1.0)
    assert len(report["problems"]) == 1 and "plans.jsonl:5" in report["problems"][0]


def test_plan_run_dir_table_shows_each_plan_its_stages_and_the_measured_costs(run_dir, capsys):
    assert main(["plan", run_dir]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    first = next(line for line in lines if " first " in line)
    assert first.split()[:7] == ["100", "0", "first", "0", "empirical", "predict", "80"]
    assert first.split()[7:] == ["0.08", "0.8", "3", "0.004", "0.3", "1e-06", "1000", "45"]
    warm_up = next(line for line in lines if " warm-up " in line)
    assert warm_up.split()[-4:] == ["-"] * 4  # nothing fitted yet
    assert "stage 1: T_c 95 (numerical)" in out and "stage 1: T_c 130 (theorem1)" in out
    assert "fallback: tau1 from 3 checkpoints only" in out
    phase1 = next(line for line in lines if line.split()[:3] == ["1", "120", "1"])
    assert phase1.split()[3:] == ["300..300", "-", "1", "0.01", "2.5"]
    assert "problem: " in out and "plans.jsonl:5" in out
    memory = next(line for line in lines if " snapshot " in line)
    assert memory.split() == ["120", "0", "snapshot", "6", "0.0004", "0.02", "100", "3"]


def test_plan_run_dir_json_has_the_host_snapshot_plans(run_dir, capsys):
    assert main(["plan", run_dir, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["memory_plans"] == [{k: v for k, v in dataclasses.asdict(MEMORY_PLAN).items() if k != "kind"}]


def test_a_run_without_plans_says_so_and_still_lists_its_checkpoints(tmp_path, capsys):
    directory = str(tmp_path)
    write_measurements(directory)
    assert main(["plan", directory]) == 0
    out = capsys.readouterr().out
    assert f"{directory}: no plans.jsonl" in out
    row = next(line for line in out.splitlines() if line.startswith("    -"))
    assert row.split()[:4] == ["-", "-", str(len(CHECKPOINTS)), "50..300"]
    assert main(["plan", directory, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["has_plans"] is False and report["plans"] == [] and report["stages"] == []
    assert len(report["checkpoints"]) == 2 * len(CHECKPOINTS) and {c["phase"] for c in report["checkpoints"]} == {None}
    assert [p["phase"] for p in report["phases"]] == [None]


def test_an_empty_run_dir_says_nothing_was_planned_or_measured(tmp_path, capsys):
    assert main(["plan", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no plans.jsonl" in out and "no checkpoint measured" in out


@pytest.mark.parametrize("argv, message", [
    (["plan"], "missing --lambda, --ts"),
    (WHAT_IF[:4], "missing --alpha1"),
    (["RUN"] + WHAT_IF[:2], "not both"),
    (["RUN", "--persist", "3"], "--persist"),
    (WHAT_IF + ["--plot", "x.png"], "--plot needs RUN_DIR"),
    (["NOT_A_DIR"], "NOT_A_DIR: not a directory"),
])
def test_plan_takes_either_a_run_dir_or_the_what_if_inputs(tmp_path, capsys, argv, message):
    (tmp_path / "file").write_text("")
    substitute = {"RUN": str(tmp_path), "NOT_A_DIR": str(tmp_path / "file")}
    argv = [substitute.get(a, a) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        main(["plan"] + [a for a in argv if a != "plan"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message.replace("NOT_A_DIR", str(tmp_path / "file")) in err


def test_the_what_if_plan_still_prints_as_text(capsys):
    assert main(["plan"] + WHAT_IF + ["--persist", "2"]) == 0
    assert capsys.readouterr().out.startswith("T_c = ")


def test_plot_draws_the_losses_one_line_per_fit_the_checkpoints_and_the_interval(run_dir, tmp_path, capsys):
    path = tmp_path / "plan.png"
    assert main(["plan", run_dir, "--plot", str(path)]) == 0
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 20_000

    report = plan_report.run_report(run_dir)
    plot = plan_report.plot_run(run_dir, report, str(tmp_path / "again.png"))
    assert len(plot.losses) == 2  # the journal's and validation.csv's
    fitted = [p for p in PLANS if "alpha1" in p.inputs]
    assert len(plot.fits) == len(fitted)
    for line, plan, end in zip(plot.fits, fitted, [PLANS[2].iteration, 300]):
        x, y = line.get_xdata(), line.get_ydata()
        assert (x[0], x[-1]) == (plan.iteration // 2, end)  # fitted window start to the plan's replacement
        np.testing.assert_allclose(y, np.exp(-plan.inputs["alpha1"] * x + plan.inputs["alpha2"]))
    assert sorted(plot.checkpoints.get_xdata()) == [i for i, *_ in CHECKPOINTS]
    assert list(plot.interval.get_ydata()) == [p.T_c for p in PLANS] + [PLANS[-1].T_c]


def test_plot_without_matplotlib_names_the_missing_package(run_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["plan", run_dir, "--plot", str(tmp_path / "plan.png")]) == 1
    assert "needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "plan.png").exists()


def test_a_checkpoint_after_a_restart_belongs_to_the_plan_of_its_attempt():
    warm_up, first = PLANS[:2]
    restart = PlanRow(150, 1, 4.0, "restart", 2, "empirical", "predict", 60)
    plans = [warm_up, first, restart]
    assert plan_report.governing(plans, attempt=0, iteration=100) is warm_up  # made after that checkpoint
    assert plan_report.governing(plans, attempt=0, iteration=200) is first
    assert plan_report.governing(plans, attempt=1, iteration=200) is restart
    assert plan_report.governing(plans[1:], attempt=0, iteration=50) is None
