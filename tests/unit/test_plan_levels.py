"""The failure classes, the two-level plan (levels.py) and the projection (``plan --simulate``), on hand-worked values."""

import io
import json
import math

import pytest

from cpsr_ds import cli
from cpsr_ds.config import ConfigError, CPSRConfig
from cpsr_ds.planning import failure_mix, levels, projection
from cpsr_ds.planning.failure_mix import NODE_LOST, PROCESS_CRASH

# Rates per iteration and costs in iterations where snapshots pay: k = sqrt(2 * 0.02 / 1e-4) = 20,
# n = sqrt(2 * 2 / (0.5 * 1e-4)) = 282.84; first order with 0.02 + 0.01414 < without sqrt(2 * 2 * 0.5 * 2e-4) = 0.02.
RATES = {PROCESS_CRASH: 1e-4, NODE_LOST: 1e-4}
COSTS = levels.LevelCosts(snapshot=0.02, checkpoint=2.0, rho=0.5, restart_crash=10.0, restart_node=100.0)


def test_llama3_shares_are_the_table_s_counts_by_class():
    # Software Bug 54, Dependency 2, NCCL Watchdog Timeouts 7, Network Switch/Cable 35 of 419.
    assert sum(failure_mix.LLAMA3_CAUSES.values()) == 419
    assert failure_mix.LLAMA3_SHARES[PROCESS_CRASH] == pytest.approx(98 / 419)
    assert failure_mix.LLAMA3_SHARES[NODE_LOST] == pytest.approx(321 / 419)
    assert failure_mix.LLAMA3_RATE_PER_HOUR == pytest.approx(419 / (54 * 24))


@pytest.mark.parametrize("shares, problem", [({PROCESS_CRASH: 0.5, NODE_LOST: 0.6}, "sum to 1"),
                                              ({PROCESS_CRASH: 1.5, NODE_LOST: -0.5}, "process_crash"),
                                              ({PROCESS_CRASH: 1.0}, "missing"),
                                              ({PROCESS_CRASH: 0.5, NODE_LOST: 0.5, "oom": 0.0}, "unknown")])
def test_bad_shares_are_named(shares, problem):
    with pytest.raises(ValueError, match=problem):
        failure_mix.class_rates(1.0, shares)


def test_class_rates_split_the_job_s_rate():
    assert failure_mix.class_rates(0.08, {PROCESS_CRASH: 0.25, NODE_LOST: 0.75}) == \
        {PROCESS_CRASH: pytest.approx(0.02), NODE_LOST: pytest.approx(0.06)}


def test_config_mix_defaults_to_llama3_and_refuses_a_bad_sum():
    assert CPSRConfig().planner.failure_mix.model_dump() == pytest.approx(failure_mix.LLAMA3_SHARES)
    with pytest.raises(ConfigError, match=r"cpsr\.planner\.failure_mix: .*sum to 1"):
        CPSRConfig.parse_block({"planner": {"failure_mix": {"process_crash": 0.5, "node_lost": 0.6}}})


def test_closed_form_is_each_level_s_young_interval():
    k, n = levels.closed_form(RATES, COSTS)
    assert k == pytest.approx(20.0)
    assert n == pytest.approx(math.sqrt(8e4))


def test_first_order_terms_per_failure_class():
    terms = levels.cost_rates(20.0, 200.0, RATES, COSTS, exact=False)
    assert terms["snapshots"] == pytest.approx(0.02 / 20)
    assert terms["checkpoints"] == pytest.approx(2.0 / 200)
    assert terms[PROCESS_CRASH] == pytest.approx(1e-4 * (20 / 2 + 10))  # k / 2 lost, and the restart
    assert terms[NODE_LOST] == pytest.approx(1e-4 * (0.5 * 200 / 2 + 100))  # (1 - rho) n / 2, and the restart
    # Without snapshots a crash resumes from storage as a lost node does, and restarts from storage.
    assert levels.cost_rates(None, 200.0, RATES, COSTS, exact=False)[PROCESS_CRASH] == pytest.approx(1e-4 * (50 + 10))
    from_storage = levels.LevelCosts(snapshot=0.02, checkpoint=2.0, rho=0.5, restart_crash=10.0, restart_storage=30.0)
    assert levels.cost_rates(None, 200.0, RATES, from_storage, exact=False)[PROCESS_CRASH] == \
        pytest.approx(1e-4 * (50 + 30))
    assert levels.cost_rates(20.0, 200.0, RATES, from_storage, exact=False)[PROCESS_CRASH] == \
        pytest.approx(1e-4 * (10 + 10))


def test_closed_form_and_numerical_plans_agree():
    plan = levels.plan_levels(RATES, COSTS)
    assert plan.method == "closed form" and not plan.violations
    k, n = plan.numerical
    assert k == pytest.approx(20.0, rel=0.05) and n == pytest.approx(math.sqrt(8e4), rel=0.05)
    assert plan.cost_rate_closed == pytest.approx(plan.cost_rate_numerical, rel=0.01)
    assert (plan.memory_interval, plan.storage_interval) == (20, 283)
    assert plan.per_failure[PROCESS_CRASH] == pytest.approx(20 / 2 + 10, rel=0.02)


def test_snapshots_are_off_where_they_cost_more_than_the_crashes_they_save():
    # sqrt(2 * 0.5 * 1e-4) + sqrt(2 * 2 * 0.5 * 1e-4) = 0.0241 > sqrt(2 * 2 * 0.5 * 2e-4) = 0.02.
    costly = levels.LevelCosts(snapshot=0.5, checkpoint=2.0, rho=0.5)
    plan = levels.plan_levels(RATES, costly)
    assert plan.memory_interval is None and plan.closed[0] is None and plan.numerical[0] is None
    assert plan.storage_interval == 200  # sqrt(2 * 2 / (0.5 * 2e-4))


def test_a_long_interval_past_the_approximations_is_planned_numerically():
    frequent = {PROCESS_CRASH: 0.01, NODE_LOST: 0.01}
    plan = levels.plan_levels(frequent, levels.LevelCosts(snapshot=0.02, checkpoint=20.0))
    assert plan.method == "numerical" and plan.violations
    assert plan.cost_rate_numerical <= plan.cost_rate_closed


def _simulate(*flags):
    out = io.StringIO()
    assert cli.main(["plan", "--simulate", "--json", *flags], out=out) == 0
    return json.loads(out.getvalue())


def test_simulate_projects_every_strategy_on_the_same_model():
    report = _simulate("--gpus", "8", "--state-gb", "53.6", "--storage-gbps", "1", "--host-copy-gbps", "12",
                       "--iteration-s", "1.8", "--failures-per-hour", "0.08", "--run-hours", "10.9")
    rows = {r["strategy"]: r for r in report["strategies"]}
    assert set(rows) == {"checkfreq", "pccheck", "in-memory", "cpsr"}
    for row in rows.values():
        assert row["T_l_hours"] == pytest.approx(sum(row["hours"].values()))
    plan = report["cpsr_plan"]
    assert (rows["cpsr"]["memory_interval"], rows["cpsr"]["storage_interval"]) == \
        (plan["memory_interval"], plan["storage_interval"])
    # The stall: 53.6 GB over 8 GPUs at 12 GB/s; the persist: 53.6 GB at 1 GB/s.
    assert report["seconds"]["stall"] == pytest.approx(53.6 / 8 / 12)
    assert report["seconds"]["persist"] == pytest.approx(53.6)


def test_simulate_names_a_bad_input(capsys):
    with pytest.raises(SystemExit):
        cli.main(["plan", "--simulate", "--crash-share", "1.5"], out=io.StringIO())
    assert "share of process_crash must be in [0, 1]" in capsys.readouterr().err


def test_projection_refuses_a_cluster_without_gpus():
    with pytest.raises(ValueError, match="gpus"):
        projection.Cluster(gpus=0, state_gb=1, storage_gbps=1, host_copy_gbps=1, iteration_s=1,
                           failures_per_hour=1, shares=failure_mix.LLAMA3_SHARES, run_hours=1)
