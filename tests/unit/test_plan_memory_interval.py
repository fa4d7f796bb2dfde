"""checkpoint.memory_interval auto: the host-snapshot interval planned (levels.memory_interval) and taken by a run."""

import shutil

import pytest

from benchmarks.common.processes import tiny_config
from cpsr_ds.checkpoint.capture import host_snapshot
from cpsr_ds.config import ConfigError, CPSRConfig
from cpsr_ds import runlog
from cpsr_ds.planning import levels
from support.training import build, process_group, random_batches  # noqa: F401 (process_group is autouse)


def test_memory_interval_is_young_s_on_the_crash_rate():
    # stall 0.01 s of a 0.1 s iteration: 0.1 iterations; 36 crashes / h: 0.001 per iteration; sqrt(0.2 / 0.001).
    assert levels.memory_interval(0.01, 0.1, 36.0) == round(200 ** 0.5)
    assert levels.memory_interval(0.01, 0.1, 0.0, max_interval=500) == 500  # no crashes: the longest
    with pytest.raises(ValueError, match="iteration_s"):
        levels.memory_interval(0.01, 0.0, 36.0)


def test_memory_interval_takes_auto_and_names_a_bad_value():
    assert CPSRConfig.parse_block({"checkpoint": {"memory_interval": "auto"}}).checkpoint.memory_interval == "auto"
    with pytest.raises(ConfigError, match=r'checkpoint\.memory_interval: .*"auto" or null'):
        CPSRConfig.parse_block({"checkpoint": {"memory_interval": "every"}})


def test_a_run_with_auto_snapshots_at_the_planned_interval(tmp_path):
    """first_interval until the first snapshot, then the plan from its measured stall and iteration time."""
    config = tiny_config(tmp_path / "run", stages=1)
    config["cpsr"]["checkpoint"].update(survivor_dir=str(tmp_path / "survivors"), memory_interval="auto")
    # Frequent crashes, so that the plan lies within a few iterations whatever this machine measures.
    config["cpsr"]["planner"] = {"first_interval": 2, "failure_rate_per_hour": 3.6e6, "max_interval": 50}
    engine, *_ = build(config)
    batches = random_batches(engine)
    snapshots = engine.cpsr.host_snapshots
    assert snapshots.interval == 2 and snapshots.planned is None
    for _ in range(2):
        engine.train_batch(iter(batches))
    snapshots.wait(30)
    planned = snapshots.planned
    crashes = 3.6e6 * engine.cpsr.cfg.planner.failure_mix.process_crash
    # The posterior after a run without failures: below the configured rate (its prior is worth a millisecond here).
    assert 0 < planned.crashes_per_hour < crashes
    assert planned.interval == levels.memory_interval(planned.stall_s, planned.iteration_s, planned.crashes_per_hour, 50)
    assert snapshots.interval == planned.interval and planned.per_crash == planned.interval / 2
    assert runlog.read_memory_plans(str(tmp_path / "run")) == ([planned], [])
    k = planned.interval
    while engine.global_steps < 2 + 2 * k:
        engine.train_batch(iter(batches))
        snapshots.wait(30)
    found = host_snapshot.read_snapshots(engine.cpsr.cfg.checkpoint, 0, attempt=1)
    newest = engine.global_steps - engine.global_steps % k
    assert sorted(s.iteration for s in found) == ([2, newest] if newest - k <= 2 else [newest - k, newest])


def test_a_restart_begins_at_the_interval_planned_from_the_last_plan_also_after_a_lost_node(tmp_path):
    """Not at first_interval again: a crash soon after the restart would find no snapshot. The plan is on storage,
    so a restart on a new node (its memory gone) finds it too."""
    config = tiny_config(tmp_path / "run", stages=1)
    config["cpsr"]["checkpoint"].update(survivor_dir=str(tmp_path / "survivors"), memory_interval="auto")
    # Crashes so rare that the plan is the longest interval, whatever this machine measures.
    config["cpsr"]["planner"] = {"first_interval": 2, "failure_rate_per_hour": 1e-9, "max_interval": 5}
    engine, *_ = build(config)
    batches = random_batches(engine)
    for _ in range(2):
        engine.train_batch(iter(batches))
    engine.cpsr.host_snapshots.wait(30)
    first = engine.cpsr.host_snapshots.planned
    assert engine.cpsr.host_snapshots.interval == first.interval == 5
    cfg = engine.cpsr.cfg
    shutil.rmtree(tmp_path / "survivors")  # the node is lost with its memory
    restarted = host_snapshot.install(engine, cfg.checkpoint, 2, cfg.planner, crashes_per_hour=3.6e6)
    # Planned again at the restart, from the last plan's stall and iteration time at the new rate, and recorded.
    again = runlog.read_memory_plans(str(tmp_path / "run"))[0][-1]
    assert (again.reason, again.attempt, again.stall_s, again.iteration_s) == ("restart", 2, first.stall_s,
                                                                               first.iteration_s)
    assert again.interval == levels.memory_interval(first.stall_s, first.iteration_s, 3.6e6, 5)
    assert (restarted.interval, restarted.planned, restarted.auto) == (again.interval, None, True)
    (tmp_path / "other").mkdir()
    elsewhere = cfg.checkpoint.model_copy(update={"dir": str(tmp_path / "other")})
    assert host_snapshot.install(engine, elsewhere, 2, cfg.planner).interval == 2  # no plan yet: first_interval


@pytest.mark.parametrize("memory_interval", [None, 3])
def test_a_runs_storage_plan_takes_the_crashes_out_where_snapshots_serve_them(tmp_path, memory_interval):
    """The planner's lambda is the configured rate (its posterior after seconds of running, within 1e-4) times
    the lost nodes' share with host snapshots, the whole rate without them."""
    config = tiny_config(tmp_path / "run", stages=1)
    config["cpsr"]["checkpoint"].update(interval="auto", survivor_dir=str(tmp_path / "survivors"),
                                        memory_interval=memory_interval)
    config["cpsr"]["planner"] = {"first_interval": 2, "failure_rate_per_hour": 0.08}
    engine, *_ = build(config)
    batches = random_batches(engine)
    planned = []
    while not planned and engine.global_steps < 40:
        engine.train_batch(iter(batches))
        planned = [p for p in runlog.read_plans(str(tmp_path / "run"))[0] if p.reason != "warm-up"]
    assert planned, "no plan from measured costs in 40 iterations"
    share = engine.cpsr.cfg.planner.failure_mix.node_lost if memory_interval else 1.0
    assert planned[0].inputs["lambda_per_hour"] == pytest.approx(0.08 * share, rel=1e-4)
