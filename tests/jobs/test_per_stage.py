"""checkpoint.per_stage: the interval arithmetic, checkpoints of some stages, retention and the layer split."""

import os
import sys
import threading

import pytest
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

from conftest import ROOT
from cpsr_ds.checkpoint.storage import catalog, ondisk, records
from cpsr_ds.checkpoint.storage.catalog import Checkpoint
from cpsr_ds.checkpoint.storage.retention import retained
from cpsr_ds.config import ConfigError, CPSRConfig
from examples.gpt.model import GPTConfig, stage_bounds
from cpsr_ds.runtime.schedule import StageSchedule, multiples
from support.checkpoints import checkpoint, engines, optim, states  # noqa: F401 (a fixture)


# ---------------------------------------------------------------- the interval arithmetic


@pytest.mark.parametrize("intervals, expected", [
    ([10, 30], (1, 3)),
    ([30, 10], (3, 1)),
    ([10, 20, 40], (1, 2, 4)),
    ([0.2, 0.5, 0.62], (1, 3, 3)),   # 2.5 and 3.1: the divisors of 3 nearest to them
    ([7, 9], (1, 1)),
    ([5], (1,)),
])
def test_each_stage_s_interval_is_a_multiple_of_the_shortest_dividing_the_longest(intervals, expected):
    found = multiples(intervals)
    assert found == expected
    assert all(max(found) % m == 0 for m in found)


@pytest.mark.parametrize("intervals", [[10, float("nan")], [0.0, 0.3], [-1, 4], [10, float("inf")]])
def test_intervals_that_are_no_measurement_keep_every_stage_together(intervals):
    assert multiples(intervals) == (1, 1)


def test_a_full_cut_recurs_every_longest_interval_and_each_stage_is_due_at_its_own():
    schedule = StageSchedule(origin=10, base=4, multiples=(1, 3))
    assert schedule.intervals() == [4, 12] and schedule.cycle == 12
    assert [i for i in range(0, 40) if schedule.due(i)] == [14, 18, 22, 26, 30, 34, 38]
    assert [i for i in range(0, 40) if schedule.full_cut(i)] == [22, 34]
    assert schedule.due(26) == (0,) and schedule.due(22) == (0, 1) and schedule.due(10) == ()
    together = StageSchedule.together(0, 5, 2)
    assert [i for i in range(1, 21) if together.full_cut(i)] == [i for i in range(1, 21) if together.due(i)] == [5, 10, 15, 20]


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("checkpoint, key", [
    ({"per_stage": True, "strategy": "torch"}, "per_stage needs strategy cpsr"),
    ({"per_stage": True, "strategy": "pccheck"}, "per_stage needs strategy cpsr"),
    ({"per_stage": True, "storage": "node_local"}, "per_stage needs storage shared"),
    ({"per_stage": "yes"}, "cpsr.checkpoint.per_stage"),
])
def test_per_stage_with_another_strategy_or_layout_is_refused_by_name(checkpoint, key):
    with pytest.raises(ConfigError, match=key):
        CPSRConfig.parse_block({"checkpoint": checkpoint})


def test_per_stage_is_off_by_default():
    assert CPSRConfig.parse_block({}).checkpoint.per_stage is False
    assert CPSRConfig.parse_block({"checkpoint": {"per_stage": True}}).checkpoint.per_stage is True


# ---------------------------------------------------------------- retention


def ckpt(iteration, ranks=None, world=2):
    return Checkpoint(f"global_step{iteration}", "cpsr", iteration, 1, 0, True,
                      ranks=None if ranks is None else tuple(ranks), world_size=world)


def test_retention_keeps_each_stage_s_newest_and_the_newest_full_cut():
    # Stage 0 (rank 0) every 4 iterations, stage 1 (rank 1) every 12: full cuts at 12 and 24.
    found = [ckpt(4), ckpt(8), ckpt(12), ckpt(16, [0]), ckpt(20, [0]), ckpt(24), ckpt(28, [0]), ckpt(32, [0])]
    assert retained(found, 2) == {"global_step28", "global_step32", "global_step12", "global_step24"}
    assert retained(found, 1) == {"global_step32", "global_step24"}
    # The newest full cut stays, however many checkpoints of one stage come after it.
    assert "global_step24" in retained(found + [ckpt(36, [0]), ckpt(40, [0])], 2)


def test_retention_without_checkpoints_of_some_stages_keeps_the_keep_last_newest():
    found = [ckpt(i) for i in range(1, 7)]
    assert retained(found, 3) == {"global_step4", "global_step5", "global_step6"}


# ---------------------------------------------------------------- checkpoints of some stages


def test_a_checkpoint_of_one_stage_commits_its_ranks_alone_and_leaves_latest_on_the_full_cut(tmp_path, engines):
    d = str(tmp_path)
    rank0, rank1 = (engines(d, r, 2, per_stage=True, keep_last=2) for r in (0, 1))
    for r, eng in enumerate((rank0, rank1)):
        checkpoint(eng, d, 4, states(n=100), rank=r)
    assert rank1.flush(30) and rank0.flush(30)
    for step in (8, 12, 16):  # stage 1 (rank 1) alone: rank 0, not due, commits without a part of its own
        for r, eng in enumerate((rank0, rank1)):
            eng.select([1], [1])
            eng.create(CheckpointCommitInfo(tag=f"global_step{step}", save_dir=d, save_latest=True))
            eng.makedirs(os.path.join(d, f"global_step{step}"), exist_ok=True)
            eng.save(states(n=100)["optim"], os.path.join(d, f"global_step{step}", optim(r)))
            eng.commit(eng.get_commit_info())
        assert rank1.flush(30) and rank0.flush(30)
    record = records.read_commit(os.path.join(d, "global_step16"))
    assert record["ranks"] == [1] and record["stages"] == [1]
    assert sorted(os.listdir(os.path.join(d, "global_step16"))) == sorted(
        [optim(1), ondisk.manifest_name(1), ondisk.COMMIT])
    found = {c.tag: c for c in catalog.list_checkpoints(d)}
    assert found["global_step16"].valid and found["global_step16"].ranks == (1,)
    # latest names what every rank can load; retention keeps rank 1's two newest and rank 0's (the full cut).
    assert records.read_latest(d) == catalog.select_checkpoint(d) == "global_step4"
    assert sorted(found) == ["global_step12", "global_step16", "global_step4"]
    assert rank0.stats.persisted == 1 and rank1.stats.persisted == 4


def test_a_rank_without_a_part_waits_for_no_host_buffers(tmp_path, engines):
    d = str(tmp_path)
    eng = engines(d, 0, 2, per_stage=True, commit_timeout_s=0.5)
    held, _ = eng._pool.take()  # as while this rank's last part persists
    eng.select([1], [1])
    creating = threading.Thread(target=eng.create, daemon=True,
                                args=(CheckpointCommitInfo(tag="global_step3", save_dir=d, save_latest=True),))
    creating.start()
    creating.join(10)
    assert not creating.is_alive(), "create() of a checkpoint without this rank's part waits for host buffers"
    eng._pool.give(held)


# ---------------------------------------------------------------- the layer split


def test_blocks_per_stage_place_the_embedding_first_and_the_head_last():
    assert stage_bounds([1, 3]) == [0, 2, 6]  # stage 0: embedding, block 1; stage 1: blocks 2-4, head
    assert stage_bounds([1, 2, 1]) == [0, 2, 4, 6]
    assert stage_bounds([2]) == [0, 4]
    assert GPTConfig(num_layers=4, partition_method="blocks:1,3").partition_method == "blocks:1,3"


@pytest.mark.parametrize("method, match", [
    ("blocks:1,2", "places 3 blocks, the model has num_layers 4"),
    ("blocks:0,4", "whole number >= 1 of blocks per stage"),
    ("blocks:a", "whole number >= 1"),
    ("balanced", "expected uniform, parameters, type:REGEX or blocks:"),
])
def test_a_layer_split_that_does_not_fit_the_model_is_refused(method, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(num_layers=4, partition_method=method)


def test_train_gpt_takes_the_blocks_of_each_stage():
    sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))
    import train_gpt

    config_path = os.path.join(ROOT, "configs", "gpt_tiny_cpu.json")
    for args, method in ((["--layers-per-stage", "1", "3"], "blocks:1,3"), (["--partition-method", "uniform"], "uniform")):
        config = train_gpt.build_config(train_gpt.parse_args(["--deepspeed_config", config_path, *args]))
        assert config["gpt"]["partition_method"] == method
