"""bench_restart's own parts: the GPT sized to a state, the floor's read and the ratio, and resuming from the runs
a killed benchmark left in runs.jsonl."""

import json
import time

import pytest

from benchmarks import bench_restart


@pytest.mark.parametrize("gib", [0.25, 1, 4])
def test_the_gpt_of_a_size_holds_about_that_much_state(gib):
    model = bench_restart.model_for(str(gib))
    assert model["hidden_size"] % 64 == 0 and model["hidden_size"] % model["num_attention_heads"] == 0
    assert abs(bench_restart.state_gib(model) - gib) / gib < 0.1


def test_the_floor_s_read_reads_every_byte_of_the_files_once(tmp_path):
    sizes = [0, 1, bench_restart.BLOCK + 3]
    files = []
    for k, n in enumerate(sizes):
        files.append(tmp_path / f"f{k}")
        files[-1].write_bytes(b"x" * n)
    seconds, nbytes = bench_restart.timed_read([str(f) for f in files])
    assert nbytes == sum(sizes) and seconds >= 0


def test_the_ratio_is_the_restart_over_the_floor_of_the_same_run():
    floor = bench_restart.floor_s(2.0, 0.5)
    assert floor == 2.5
    assert bench_restart.ratio(5.0, floor) == 2.0
    assert bench_restart.ratio(None, floor) is None


def test_a_read_with_no_files_to_read_leaves_the_floor_unmeasured():
    seconds, nbytes = bench_restart.timed_read([])
    assert (seconds, nbytes) == (None, 0)
    assert bench_restart.floor_s(2.0, seconds) is None
    assert bench_restart.ratio(5.0, bench_restart.floor_s(2.0, seconds)) is None


def finished(case: str, repeat: int, restart_s: float) -> dict:
    size, source, launcher = case.split("-")
    return {"case": case, "size": size, "source": source, "launcher": launcher, "repeat": repeat, "state_gib": 0.0,
            "exit": 0,
            "method": "recompute", "sources": {"0": "host snapshot"}, "restart_s": restart_s, "imports_s": 2.0,
            "read_s": 0.5, "floor_s": 2.5, "bytes_read": 10, "ratio": restart_s / 2.5,
            "seconds": {"process_start": 1.0, "reading": 0.1}}


def test_resume_skips_the_runs_already_done_and_summarises_them(tmp_path, monkeypatch, capsys):
    runs = [finished("tiny-host_snapshot-torchrun", k, 5.0 + k) for k in range(2)]
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    monkeypatch.setattr(bench_restart, "run_case", lambda *a: pytest.fail(f"ran {a} although it was done"))
    out = tmp_path / "out.json"
    bench_restart.main(["--sizes", "tiny", "--sources", "host_snapshot", "--launchers", "torchrun", "--repeats", "2",
                        "--resume", "--out-dir", str(tmp_path), "--json", str(out)])
    (case,) = json.loads(out.read_text())["cases"]
    assert (case["repeats"], case["restart_s"]["median"], case["ratio"]["median"]) == (2, 5.5, 2.2)
    assert case["seconds"]["process_start"]["median"] == 1.0
    assert "tiny  " in capsys.readouterr().out


def test_without_resume_earlier_runs_are_dropped_and_a_bad_size_is_refused(tmp_path, monkeypatch):
    (tmp_path / "runs.jsonl").write_text(json.dumps(finished("tiny-storage-deepspeed", 0, 4.0)) + "\n")
    ran = []
    monkeypatch.setattr(bench_restart, "run_case",
                        lambda *a: ran.append(a) or finished("tiny-storage-deepspeed", 0, 3.0))
    bench_restart.main(["--sizes", "tiny", "--sources", "storage", "--launchers", "deepspeed", "--repeats", "1",
                        "--out-dir", str(tmp_path), "--json", str(tmp_path / "out.json")])
    assert ran == [("tiny", "storage", "deepspeed", 0, str(tmp_path))]
    runs = bench_restart.done_runs(str(tmp_path / "runs.jsonl"))["tiny-storage-deepspeed"]
    assert [r["restart_s"] for r in runs] == [3.0]
    with pytest.raises(SystemExit):
        bench_restart.parse_args(["--sizes", "big"])


def test_under_torchrun_the_restart_begins_after_the_killed_ranks_first_line_of_its_iteration():
    from cpsr_ds.checkpoint.capture.journal import Entry

    # Killed after 5; the restart resumes from the snapshot of 4 and journals 5 again.
    entries = [Entry(i, 1.0, float(t)) for t, i in enumerate([1, 2, 3, 4, 5, 5, 6, 7])]
    assert bench_restart.first_after_kill(entries, 5) == 5
    with pytest.raises(ValueError, match="no restart"):
        bench_restart.first_after_kill(entries[:5], 5)


def test_the_floors_imports_run_from_the_interpreters_start_to_its_imports_done_not_its_exit(monkeypatch):
    # A bare interpreter that sleeps at exit: the floor does not wait for it.
    monkeypatch.setattr(bench_restart, "IMPORTS", "import atexit, time; atexit.register(time.sleep, 2)")
    started = time.perf_counter()
    seconds = bench_restart.timed_imports()
    assert time.perf_counter() - started >= 2 and 0 < seconds < 1.5
