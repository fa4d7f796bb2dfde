"""Random-number state (cpsr_ds/checkpoint/capture/rng.py): what exact recomputation with dropout rests on (the fused
CPU Adam's bias correction, the other part, is tests/jobs/test_fused_adam.py)."""

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import cpsr_ds
from benchmarks.common.processes import TEST_MODEL, tiny_config
from cpsr_ds.checkpoint.capture import dumps, host_snapshot, rng, run_id
from cpsr_ds.config import CheckpointConfig
from examples.gpt.model import GPTConfig, gpt_pipeline
from cpsr_ds.recovery.sources.host_snapshot import resume_from
from cpsr_ds.recovery.sources.survivor import restore_dump
from support.training import process_group  # noqa: F401 (a fixture; process_group is autouse)


PLAIN = (torch.Tensor, int, float, str)


def draws() -> tuple:
    """A dropout mask and a draw of numpy's and Python's global generators."""
    mask = F.dropout(torch.ones(256), p=0.5, training=True)
    return mask, np.random.standard_normal(4), random.random(), random.gauss(0, 1)


def same(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2:] == b[2:]


def only_plain(value) -> bool:
    """Whether ``value`` holds tensors, ints, floats, str, lists, tuples and dicts only."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and only_plain(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(only_plain(v) for v in value)
    return isinstance(value, PLAIN)


def test_a_dropout_mask_drawn_after_restore_equals_the_one_drawn_after_capture():
    random.gauss(0, 1)  # Python's generator holds a cached Gaussian: it must come back too
    module = torch.nn.Module()
    module.micro_offset = 7
    state = rng.capture(module)
    first = draws()
    module.micro_offset = 9
    assert not same(draws(), first)
    rng.restore(state, module)
    assert same(draws(), first) and module.micro_offset == 7
    assert only_plain(state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_cuda_dropout_mask_drawn_after_restore_equals_the_one_drawn_after_capture():
    torch.cuda.init()
    state = rng.capture()
    first = F.dropout(torch.ones(256, device="cuda"), p=0.5, training=True)
    assert not torch.equal(F.dropout(torch.ones(256, device="cuda"), p=0.5, training=True), first)
    rng.restore(state)
    assert torch.equal(F.dropout(torch.ones(256, device="cuda"), p=0.5, training=True), first)


def test_the_state_comes_back_from_a_snapshot_file(tmp_path):
    state = rng.capture()
    first = draws()
    (tmp_path / "run").mkdir()
    cfg = CheckpointConfig(dir=str(tmp_path / "run"), survivor_dir=str(tmp_path / "survivors"))
    root, run = dumps.prepare(cfg)
    manifest = {"rank": 0, "world_size": 1, "attempt": 1, "run": run, "stage": 0, "iteration": 3, "reason": "test"}
    dumps.write_dump(dumps.dump_dir(root, run, 0), {"state": {}, "fragments": {}, "counters": {"rng": state}},
                        manifest, cfg.checksum)
    read = dumps.read_survivor(root, 0, run, 1)
    draws()
    rng.restore(read.counters["rng"])
    assert same(draws(), first)


def dropout_engine(tmp_path, **checkpoint):
    """A one-stage GPT with dropout whose survivor dumps (and host snapshots) go under tmp_path."""
    config = tiny_config(tmp_path / "run", stages=1)
    config["cpsr"]["checkpoint"].update(survivor_dir=str(tmp_path / "survivors"), **checkpoint)
    config["cpsr"]["recovery"] = {"mode": "recompute"}
    gpt = GPTConfig(**TEST_MODEL, hidden_dropout=0.3, attention_dropout=0.3)
    model = gpt_pipeline(gpt, num_stages=1, seed=1)
    engine, *_ = cpsr_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    gen = torch.Generator().manual_seed(0)
    shape = (engine.train_micro_batch_size_per_gpu(), gpt.seq_length)
    batches = [(torch.randint(0, gpt.vocab_size, shape, generator=gen),) * 2
               for _ in range(engine.gradient_accumulation_steps())]
    return engine, batches


def dumped(engine, tmp_path):
    assert engine.cpsr.survivor.dump("test")
    return dumps.read_survivor(str(tmp_path / "survivors"), 0, run_id.run_identity(str(tmp_path / "run")))


def snapshot(engine, tmp_path):
    engine.cpsr.host_snapshots.wait(30)
    (snap,) = [s for s in host_snapshot.read_snapshots(engine.cpsr.cfg.checkpoint, 0, attempt=1) if s.iteration == 2]
    return snap


@pytest.mark.parametrize("source", ["survivor", "host snapshot"])
def test_an_iteration_redone_from_a_dump_or_snapshot_draws_the_same_dropout(tmp_path, source):
    engine, batches = dropout_engine(tmp_path, memory_interval=2)
    for _ in range(2):
        engine.train_batch(iter(batches))
    state = dumped(engine, tmp_path) if source == "survivor" else snapshot(engine, tmp_path)
    assert state.counters["rng"]["iteration"] == 2
    engine.eval_batch(iter(batches))  # evaluation between iterations moves no stream
    loss = engine.train_batch(iter(batches))
    assert engine.train_batch(iter(batches)) != loss  # the state moved on
    if source == "survivor":
        restore_dump(engine, state)
    else:
        resume_from(engine, state, c=2)
    # The forward pass of the redone iteration: the dump's weights, the dump's dropout masks.
    assert engine.train_batch(iter(batches)) == loss


@pytest.mark.parametrize("strategy", ["torch", "cpsr", "pccheck"])
def test_an_iteration_recomputed_from_a_checkpoint_of_each_strategy_draws_the_same_dropout(tmp_path, strategy):
    engine, batches = dropout_engine(tmp_path, strategy=strategy, interval=2)
    losses = [engine.train_batch(iter(batches)) for _ in range(3)]
    engine.destroy()  # the journal is at 3, the newest checkpoint 2
    restarted, _ = dropout_engine(tmp_path, strategy=strategy, interval=2)
    assert (restarted.cpsr.recovery.method, restarted.global_steps) == ("recompute", 2)
    assert restarted.train_batch(iter(batches)) == losses[2]
    restarted.destroy()
