"""cpsr_ds.initialize on a run directory an earlier start of another layout left (one process, gloo)."""

import logging

import pytest

from benchmarks.common.processes import tiny_config
from cpsr_ds.recovery import read_reports
from cpsr_ds.world import Layout, WorldChangeError, read_layout, write_layout
from support.training import build, process_group  # noqa: F401 (a fixture; process_group is autouse)


def test_another_pipeline_degree_is_refused_before_training_and_reported(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("cpsr_ds"), "propagate", True)  # the plugin's logger writes to stdout
    run = tmp_path / "run"
    write_layout(str(run), Layout(world_size=2, pipeline=2, tensor=1, micro_batch=4, grad_accum=2))
    with pytest.raises(WorldChangeError, match=r"pipeline stages 2 -> 1 \(world size 2 -> 1\)"):
        build(tiny_config(run, stages=1))
    assert "restart with 2 pipeline stages" in caplog.text
    (refused,) = read_reports(str(run))
    assert refused.method == "refused" and "pipeline stages 2 -> 1" in refused.reason
    assert read_layout(str(run)).attempt == 0  # the refused start recorded no layout
    assert not (run / "journal").exists()  # and trained nothing


def test_a_smaller_world_raises_the_accumulation_deepspeed_is_given(tmp_path):
    run = tmp_path / "run"
    write_layout(str(run), Layout(world_size=2, pipeline=1, tensor=1, micro_batch=4, grad_accum=2))
    engine, *_ = build(tiny_config(run, stages=1))
    assert (engine.gradient_accumulation_steps(), engine.train_batch_size()) == (4, 16)
    assert "gradient accumulation 2 -> 4" in engine.cpsr.recovery.world_change
    assert read_layout(str(run)) == Layout(1, 1, 1, 4, 4, attempt=1)
    engine.destroy()
