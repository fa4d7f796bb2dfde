"""The torch strategy: torch.save files with manifests and a commit record, through the engine API and DeepSpeed."""

import json
import logging
import os
import time

import pytest
import torch

from benchmarks.common.processes import TEST_MODEL, tiny_config
import cpsr_ds
from cpsr_ds.cli import main
from cpsr_ds.checkpoint.storage import catalog, records
from cpsr_ds.checkpoint.engines.factory import create_engine
from cpsr_ds.checkpoint.engines.torch_engine import TorchEngine
from examples.gpt.model import GPTConfig, gpt_pipeline
from support.checkpoints import (MODEL, assert_same, checkpoint, config, optim, process_group,  # noqa: F401 (a fixture)
                                 states)


@pytest.fixture
def engines():
    made = []

    def make(d, rank=0, world_size=1, **kw):
        eng = create_engine(config(d, strategy="torch", **kw), rank, world_size, attempt=3)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.cleanup()


def test_checkpoint_has_manifests_a_commit_record_and_verifies(tmp_path, engines, capsys):
    d = str(tmp_path)
    eng = engines(d)
    assert isinstance(eng, TorchEngine) and eng.is_decoupled()
    st = states(n=1000)
    tag = checkpoint(eng, d, 3, st)
    assert records.read_latest(d) == tag == catalog.select_checkpoint(d)
    manifest = records.read_manifests(os.path.join(d, tag))[0]
    assert sorted(manifest["files"]) == sorted([MODEL, optim(0)]) and manifest["attempt"] == 3
    assert records.read_commit(os.path.join(d, tag))["attempt"] == 3
    assert_same(eng.load(os.path.join(d, tag, MODEL)), st["model"])
    assert not [n for n in os.listdir(os.path.join(d, tag)) if n.startswith(".")]  # no temporary files left
    checkpoint(eng, d, 4, states(n=1000))
    assert records.read_latest(d) == "global_step4"
    os.truncate(os.path.join(d, "global_step4", optim(0)), 100)
    assert catalog.select_checkpoint(d) == tag
    assert main(["inspect", d, "--json"]) == 0
    rows = {r["tag"]: r for r in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert rows["global_step4"]["status"] == "invalid" and rows[tag]["status"] == "valid"


def test_a_rank_that_gives_up_ends_rank_0_s_wait_at_once(tmp_path, engines, caplog):
    d = str(tmp_path)
    rank0, rank1 = engines(d, 0, 2, commit_timeout_s=60.0), engines(d, 1, 2, commit_timeout_s=60.0)
    checkpoint(rank1, d, 1, states(n=100), rank=1)
    checkpoint(rank0, d, 1, states(n=100), rank=0)
    assert records.read_latest(d) == "global_step1"
    os.makedirs(os.path.join(d, "global_step2", optim(1), "blocked"))  # rank 1's rename fails
    checkpoint(rank1, d, 2, states(n=100), rank=1)
    start = time.monotonic()
    with caplog.at_level(logging.ERROR):
        checkpoint(rank0, d, 2, states(n=100), rank=0)
    assert time.monotonic() - start < 10
    assert "rank 1 gave up: writing " + optim(1) in caplog.text and os.path.join(d, "global_step2") in caplog.text
    assert records.read_latest(d) == "global_step1" == catalog.select_checkpoint(d)
    assert not os.path.exists(os.path.join(d, "global_step2"))  # the given-up checkpoint is removed


def test_a_non_finite_tensor_is_never_committed(tmp_path, engines, caplog):
    d = str(tmp_path)
    eng = engines(d)
    checkpoint(eng, d, 1, states(n=100))
    st = states(n=100)
    st["optim"]["fp32"][7] = float("nan")
    with caplog.at_level(logging.ERROR):
        checkpoint(eng, d, 2, st)
    assert f"{optim(0)}: non-finite values in fp32" in caplog.text
    assert records.read_latest(d) == "global_step1" and not os.path.exists(os.path.join(d, "global_step2"))


def test_deepspeed_commits_the_torch_engine_and_leaves_latest_to_it(tmp_path, process_group):
    run = str(tmp_path / "run")
    cfg = tiny_config(run, stages=1)
    cfg["cpsr"]["checkpoint"].update(strategy="torch", interval=2)
    model = gpt_pipeline(GPTConfig(**TEST_MODEL), num_stages=1, seed=1)
    engine, *_ = cpsr_ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    gpt = GPTConfig(**TEST_MODEL)
    batch = (torch.randint(0, gpt.vocab_size, (engine.train_micro_batch_size_per_gpu(), gpt.seq_length)),) * 2
    for _ in range(4):
        engine.train_batch(iter([batch] * engine.gradient_accumulation_steps()))
    # global_step2 was committed at step 3's optimizer step; global_step4 is open until cleanup.
    assert records.read_latest(run) == "global_step2" and engine.checkpoint_engine.get_commit_info().tag == "global_step4"
    engine.checkpoint_engine.cleanup()
    assert records.read_latest(run) == "global_step4" == catalog.select_checkpoint(run)
    layer = os.path.join(run, "global_step4", "layer_01-model_states.pt")
    assert layer.removeprefix(os.path.join(run, "global_step4") + os.sep) in records.read_manifests(
        os.path.dirname(layer))[0]["files"]
    engine.load_checkpoint(run, tag="global_step2")
    assert engine.global_steps == 2
    os.truncate(layer, os.path.getsize(layer) // 2)
    assert catalog.select_checkpoint(run) == "global_step2"
