"""runtime/restart_time.py: a start's seconds by part."""

import time

from cpsr_ds.runtime import restart_time


def test_a_start_counts_each_part_from_the_end_of_the_last_and_marks_outside_one_do_nothing():
    restart_time.mark("reading")  # no start in progress: nothing to mark, nothing raised
    with restart_time.clock() as clock:
        before = time.perf_counter()
        restart_time.mark("reading")
        first = clock.seconds["reading"]
        restart_time.mark("prediction")
        restart_time.mark("reading")  # a part met again adds up
        after = time.perf_counter()
    assert list(clock.seconds) == ["process_start", "imports", "reading", "prediction"]
    assert clock.seconds["reading"] > first > 0
    assert clock.seconds["reading"] + clock.seconds["prediction"] <= after - before + first
    restart_time.mark("rest")
    assert "rest" not in clock.seconds


def test_the_process_age_is_the_time_since_this_process_was_created():
    age = restart_time.process_age_s()
    assert age is not None and 0 < age < time.time()
    assert restart_time.RestartClock().seconds["process_start"] <= age


def test_the_scripts_own_marks_split_its_start_before_initialize(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(restart_time.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(restart_time, "_IMPORTED", (90.0, 1.5))
    monkeypatch.setattr(restart_time, "_script_parts", [])
    restart_time.mark_start("imports")  # 10 s after import cpsr_ds
    now[0] = 101.0
    restart_time.mark_start("distributed_init")
    now[0] = 104.0
    restart_time.mark_start("model")
    now[0] = 104.5
    with restart_time.clock() as clock:
        restart_time.mark("distributed_init")  # initialize's own, where the script initialised it already
    assert list(clock.seconds) == ["process_start", "imports", "distributed_init", "model", "script"]
    assert clock.seconds == {"process_start": 1.5, "imports": 10.0, "distributed_init": 1.0, "model": 3.0,
                             "script": 0.5}
    with restart_time.clock() as again:  # a second start in the process: the script's marks were used once
        pass
    assert list(again.seconds) == ["process_start", "imports"]
