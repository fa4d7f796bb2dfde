import json

from cpsr_ds import runlog
from cpsr_ds.runlog import CostRow, PlanRow, StateRow


def test_rows_round_trip_and_a_damaged_line_is_skipped_and_named(tmp_path):
    directory = str(tmp_path)
    state = StateRow(50, 0, 0, 0, "trend", 1000, xi=1e-5, held_out_error=2e-4, relative_error=0.4)
    cost = CostRow(50, 0, 0, 0, 0.03, 0.002, 0.05, 0.4, 4096)
    path = runlog.measurements_path(directory, 0)
    assert runlog.append(path, state) and runlog.append(path, cost)
    with open(path, "a") as f:
        f.write('{"kind": "state", "iteration": 10\n')  # cut short by a crash
        f.write(json.dumps({"kind": "cost", "iteration": 60}) + "\n")  # fields missing
    plan = PlanRow(50, 0, 1.0, "first", 0, "empirical", "predict", 120, inputs={"lambda": 1e-4})
    assert runlog.append(runlog.plans_path(directory), plan)
    rows, problems = runlog.read_measurements(directory)
    assert rows == [state, cost]
    assert len(problems) == 2 and all("rank00000.jsonl:" in p for p in problems)
    assert runlog.read_plans(directory) == ([plan], [])


def test_held_out_errors_take_the_newest_measurement_of_each_checkpoint(tmp_path):
    rows = [StateRow(50, 0, 0, 0, "trend", 10, held_out_error=3.0), StateRow(100, 0, 0, 0, "trend", 10, held_out_error=2.0),
            StateRow(100, 0, 0, 1, "trend", 10, held_out_error=1.5), StateRow(100, 1, 1, 1, "trend", 10, held_out_error=9.0),
            StateRow(150, 0, 0, 1, "skip", 10, held_out_error=5.0), StateRow(200, 0, 0, 1, "trend", 10)]
    assert runlog.held_out_errors(rows, stage=0, predictor="trend") == [(50, 3.0), (100, 1.5)]
    assert runlog.held_out_errors(rows, stage=0, predictor="trend", upto=60) == [(50, 3.0)]


def test_a_write_that_fails_returns_false_and_does_not_raise(tmp_path):
    blocker = tmp_path / "measurements"
    blocker.write_text("a file where the directory should be")
    assert not runlog.append(runlog.measurements_path(str(tmp_path), 0), CostRow(1, 0, 0, 0, 1.0, 0.0, 0.0, 0.0, 1))
