"""A changed world size on restart, piece by piece: batch arithmetic, batches, progress, reports, ZeRO partitions."""

import json
import os

import numpy as np
import pytest
import torch

from cpsr_ds.checkpoint.storage import catalog, ondisk
from cpsr_ds.checkpoint.engines.factory import create_engine
from cpsr_ds.checkpoint.capture.journal import ProgressJournal, read_progress, retire_journals
from examples.gpt.corpus import Batches
from cpsr_ds.recovery import REPORTS, RecoveryReport, append_report, full_zero_state, read_reports
from cpsr_ds.world import Layout, WorldChangeError, adapt, batch_of, layout_of, newest, read_layout, write_layout
from support.checkpoints import checkpoint, config, states


CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}


def test_a_smaller_data_parallel_degree_keeps_the_global_batch_by_raising_accumulation():
    old = layout_of(CONFIG, world_size=2, pipeline=1, tensor=1, attempt=1)
    assert (old.data_parallel, old.global_batch) == (2, 16)
    config, now, change = adapt(CONFIG, old, layout_of(CONFIG, 1, 1, 1, attempt=2))
    assert (now.grad_accum, now.micro_batch, now.global_batch) == (4, 4, 16)
    assert batch_of(config, now.data_parallel) == (4, 4) and config["train_batch_size"] == 16
    assert "gradient accumulation 2 -> 4" in change
    # And back: the record of the smaller world gives the bigger one the same batch again.
    config, now, _ = adapt(config, now, layout_of(config, 2, 1, 1, attempt=3))
    assert (now.data_parallel, now.grad_accum, now.global_batch) == (2, 2, 16)


def test_an_unchanged_data_parallel_degree_leaves_the_config_alone():
    config = {**CONFIG, "gradient_accumulation_steps": 8}
    old = layout_of(CONFIG, 2, 1, 1, attempt=1)
    assert adapt(config, old, layout_of(config, 2, 1, 1, attempt=2))[0] is config
    assert adapt(config, None, layout_of(config, 2, 1, 1, attempt=1))[0] is config


def test_a_batch_that_cannot_be_kept_or_another_pipeline_degree_is_refused_by_name():
    old = layout_of(CONFIG, 2, 1, 1, attempt=1)
    with pytest.raises(WorldChangeError, match=r"data-parallel degree 2 -> 3 .*global batch of 16.*world size of 1, 2, 4"):
        adapt(CONFIG, old, layout_of(CONFIG, 3, 1, 1, attempt=2))
    piped = layout_of(CONFIG, 2, 2, 1, attempt=1)
    with pytest.raises(WorldChangeError, match=r"pipeline stages 2 -> 1 \(world size 2 -> 2\).*restart with 2 pipeline"):
        adapt(CONFIG, piped, layout_of(CONFIG, 2, 1, 1, attempt=2))


def test_batch_of_resolves_the_missing_value_as_deepspeed_does():
    assert batch_of({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2) == (4, 4)
    assert batch_of({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 2) == (8, 2)
    assert batch_of({"train_micro_batch_size_per_gpu": 4}, 2) == (4, 1)


def test_the_newest_layout_any_rank_sees_wins(tmp_path):
    write_layout(str(tmp_path), Layout(2, 1, 1, 4, 2, attempt=3))
    assert read_layout(str(tmp_path)) == Layout(2, 1, 1, 4, 2, attempt=3)
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "cpsr_world.json").write_text('{"world_size": 2,')
    assert read_layout(str(tmp_path / "cut")) is None
    assert newest([None, Layout(1, 1, 1, 4, 4, attempt=4), Layout(2, 1, 1, 4, 2, attempt=3)]).attempt == 4


def sequences(batches: Batches, iteration: int) -> list[bytes]:
    return sorted(t.numpy().tobytes() for tokens, _ in batches.micro_batches(iteration) for t in tokens)


def test_iteration_i_trains_on_the_same_sequences_at_any_data_parallel_degree():
    data = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint8)
    old = layout_of(CONFIG, 2, 1, 1, attempt=1)
    now = adapt(CONFIG, old, layout_of(CONFIG, 1, 1, 1, attempt=2))[1]

    def ranks(layout):
        return [Batches(data, data, seq_length=16, micro_batch=layout.micro_batch, grad_accum=layout.grad_accum,
                        dp_rank=r, dp_size=layout.data_parallel) for r in range(layout.data_parallel)]

    for iteration in (0, 7):
        before = sorted(s for b in ranks(old) for s in sequences(b, iteration))
        after = sorted(s for b in ranks(now) for s in sequences(b, iteration))
        assert len(before) == 16 and before == after
    assert sequences(ranks(now)[0], 0) != sequences(ranks(now)[0], 1)


def journal(directory, rank, iterations):
    j = ProgressJournal(str(directory), rank)
    for i in iterations:
        j.append(i, 1.0)
    j.close()


@pytest.mark.parametrize("node_local", [False, True])
def test_after_a_shrink_f_comes_from_the_ranks_still_in_the_job(tmp_path, node_local):
    """World 2 fails at 12 (checkpoint 10); world 1 redoes 11.. and fails at 16 (checkpoint 15)."""
    nodes = [tmp_path / "node0", tmp_path / "node1"] if node_local else [tmp_path, tmp_path]
    journal(nodes[0], 0, range(1, 13))
    journal(nodes[1], 1, range(1, 13))
    assert min(read_progress(str(n)).reached for n in nodes) == 12  # the first restart: the failed job's two ranks
    for node in nodes[:1]:  # node1 is gone; the restarted job retires what it sees
        retire_journals(str(node), world_size=1, attempt=2)
    journal(nodes[0], 0, range(11, 17))
    progress = read_progress(str(nodes[0]))
    assert progress.reached == 16 and list(progress.entries) == [0] and not progress.problems
    retired = nodes[0] / "journal" / "retired" / "attempt2" / "rank00001.csv"
    assert retired.exists() != node_local
    assert retire_journals(str(nodes[0]), world_size=1, attempt=3) == []


def test_recovery_reports_of_before_the_world_change_field_still_read(tmp_path):
    old_row = {"method": "recompute", "reached": 12, "checkpoint": 10, "resume_iteration": 10, "reason": "",
               "predictor": None, "relative_error": None, "estimated_cost": None, "cost_model": None,
               "guard_lag": None, "loss_excess": None, "description": "..."}
    (tmp_path / REPORTS).write_text(json.dumps(old_row) + "\n")
    append_report(str(tmp_path), RecoveryReport("refused", None, None, 0, reason="pipeline stages 2 -> 1",
                                                world_change="pipeline stages 2 -> 1"))
    old, refused = read_reports(str(tmp_path))
    assert old.lost_iterations == 2 and old.world_change is None
    assert refused.describe() == "cpsr recovery: cannot resume: pipeline stages 2 -> 1"


def test_zero_partitions_of_every_rank_reassemble_each_parameter():
    shapes = [{"a": torch.Size([3, 2]), "b": torch.Size([5])}, {"c": torch.Size([4])}]
    full = {kind: [torch.randn(11), torch.randn(4)] for kind in ("param", "exp_avg", "exp_avg_sq")}

    def part(rank):  # group 0: 11 values in partitions of 6, the last padded by 1; group 1: 2 + 2
        def cut(t, size):
            return t[rank * size:(rank + 1) * size]

        def padded(t, size):
            return torch.cat([t, torch.zeros(size - len(t))])

        moments = {g: {k: padded(cut(full[k][g], size), size) for k in ("exp_avg", "exp_avg_sq")}
                   for g, size in ((0, 6), (1, 2))}
        return {"single_partition_of_fp32_groups": [cut(full["param"][0], 6), cut(full["param"][1], 2)],
                "param_alignment_paddings": [[0, 0], [0]],
                "base_optimizer_state": {"state": {g: {"step": torch.tensor(7.0), **m} for g, m in moments.items()}}}

    state = full_zero_state([part(0), part(1)], shapes)
    for kind, (g0, g1) in full.items():
        assert torch.equal(state[f"{kind}/a"], g0[:6].view(3, 2))
        assert torch.equal(state[f"{kind}/b"], g0[6:])
        assert torch.equal(state[f"{kind}/c"], g1)


@pytest.mark.parametrize("strategy", ["torch", "cpsr"])
def test_a_tag_written_again_by_a_smaller_world_is_valid_beside_the_larger_world_s_leftovers(tmp_path, strategy):
    """Killed mid-checkpoint, a two-rank job left global_step12 uncommitted; the one-rank restart writes it again
    and commits it. Rank 1's earlier manifest and files stay there, and must not spoil the new checkpoint."""
    d = str(tmp_path)
    old = [create_engine(config(d, strategy="cpsr"), rank, 2, attempt=1) for rank in (0, 1)]
    for rank, eng in enumerate(old):
        checkpoint(eng, d, 12, states(n=100), rank=rank)
    assert all(eng.flush(30) for eng in old)
    for eng in old:
        eng.cleanup()
    os.unlink(os.path.join(d, "global_step12", ondisk.COMMIT))  # the commit the kill prevented
    os.unlink(os.path.join(d, ondisk.LATEST))

    new = create_engine(config(d, strategy=strategy), 0, 1, attempt=2)
    checkpoint(new, d, 12, states(n=100), rank=0)
    new.cleanup()  # persists and commits what is in flight
    (ckpt,) = catalog.list_checkpoints(d)
    assert (ckpt.world_size, ckpt.attempt, ckpt.problems) == (1, 2, [])
    assert catalog.select_checkpoint(d) == "global_step12"
