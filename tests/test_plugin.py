"""cpsr_ds.initialize in one process (world size 1, gloo): pass-through and installation."""

import json
import os

import deepspeed
import pytest
import torch
from deepspeed.runtime.pipe.engine import PipelineEngine

from conftest import TEST_MODEL, free_port, tiny_config
import cpsr_ds
from cpsr_ds.models.gpt import GPTConfig, gpt_pipeline
from cpsr_ds.plugin import CPSRPipelineEngine


@pytest.fixture(scope="module", autouse=True)
def process_group():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")
    yield
    torch.distributed.destroy_process_group()


def build(config):
    model = gpt_pipeline(GPTConfig(**TEST_MODEL), num_stages=1, seed=1)
    return cpsr_ds.initialize(model=model, model_parameters=model.parameters(), config=config)


def test_without_a_block_it_is_deepspeed_initialize(tmp_path):
    config = tiny_config(tmp_path, stages=1)
    del config["cpsr"], config["gpt"]
    engine, optimizer, loader, scheduler = build(config)
    assert type(engine) is PipelineEngine
    assert not hasattr(engine, "cpsr")
    assert optimizer is engine.optimizer and scheduler is engine.lr_scheduler and loader is None
    assert deepspeed.PipelineEngine is PipelineEngine


def test_disabled_block_is_deepspeed_initialize(tmp_path):
    config = tiny_config(tmp_path / "run", stages=1)
    config["cpsr"]["enabled"] = False
    engine, *_ = build(config)
    assert type(engine) is PipelineEngine
    assert not (tmp_path / "run").exists()


def test_enabled_block_installs_the_engine_and_reports_a_fresh_start(tmp_path):
    engine, *_ = build(tiny_config(tmp_path / "run", stages=1))
    assert type(engine) is CPSRPipelineEngine
    assert engine.cpsr.recovery.method == "fresh" and engine.global_steps == 0
    assert deepspeed.PipelineEngine is PipelineEngine  # restored after initialize


def test_config_path_and_bad_block(tmp_path):
    config = tiny_config(tmp_path / "run", stages=1)
    config["cpsr"]["checkpoint"]["interval"] = "often"
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="cpsr.checkpoint.interval"):
        build(str(path))


def test_a_plain_module_is_refused_with_a_clear_error(tmp_path):
    with pytest.raises(TypeError, match="must be a deepspeed.pipe.PipelineModule"):
        cpsr_ds.initialize(model=torch.nn.Linear(2, 2), config=tiny_config(tmp_path, stages=1))
