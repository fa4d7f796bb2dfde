"""checkpoint.memory_interval auto: the host-snapshot interval planned (levels.memory_interval) and taken by a run."""

import pytest

from benchmarks.common.processes import tiny_config
from cpsr_ds.checkpoint.capture import host_snapshot
from cpsr_ds.config import ConfigError, CPSRConfig
from cpsr_ds import runlog
from cpsr_ds.planning import failure_mix, levels
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
    assert planned["interval"] == levels.memory_interval(planned["stall_s"], planned["iteration_s"], crashes, 50)
    assert snapshots.interval == planned["interval"]
    k = planned["interval"]
    while engine.global_steps < 2 + 2 * k:
        engine.train_batch(iter(batches))
        snapshots.wait(30)
    found = host_snapshot.read_snapshots(engine.cpsr.cfg.checkpoint, 0, attempt=1)
    newest = engine.global_steps - engine.global_steps % k
    assert sorted(s.iteration for s in found) == ([2, newest] if newest - k <= 2 else [newest - k, newest])


def test_a_restart_begins_at_the_interval_its_previous_attempt_planned(tmp_path):
    """Not at first_interval again: a crash soon after the restart would find no snapshot."""
    config = tiny_config(tmp_path / "run", stages=1)
    config["cpsr"]["checkpoint"].update(survivor_dir=str(tmp_path / "survivors"), memory_interval="auto")
    # Crashes so rare that the plan is the longest interval, whatever this machine measures.
    config["cpsr"]["planner"] = {"first_interval": 2, "failure_rate_per_hour": 1e-9, "max_interval": 5}
    engine, *_ = build(config)
    batches = random_batches(engine)
    for _ in range(2):
        engine.train_batch(iter(batches))
    engine.cpsr.host_snapshots.wait(30)
    assert engine.cpsr.host_snapshots.interval == 5
    restarted = host_snapshot.install(engine, engine.cpsr.cfg.checkpoint, 2, engine.cpsr.cfg.planner)
    assert (restarted.interval, restarted.planned) == (5, None)  # planned again from its own first snapshot
    assert host_snapshot.install(engine, engine.cpsr.cfg.checkpoint, 3, engine.cpsr.cfg.planner).interval == 2


def test_the_storage_level_plans_against_the_lost_nodes_alone():
    assert failure_mix.storage_rate(0.5, {"process_crash": 0.2, "node_lost": 0.8}, snapshots=False) == 0.5
    assert failure_mix.storage_rate(0.5, {"process_crash": 0.2, "node_lost": 0.8}, snapshots=True) == 0.4
    with pytest.raises(ValueError, match="sum to 1"):
        failure_mix.storage_rate(0.5, {"process_crash": 0.5, "node_lost": 0.8}, snapshots=True)


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
