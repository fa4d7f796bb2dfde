"""Engines built and trained in the test's own process (one rank of world size 1 over gloo), and the journal and
logs they write: what the plugin, survivor, validation and recovery-input tests share."""

import logging
import os

import deepspeed
import pytest
import torch

import cpsr_ds
from benchmarks.common.processes import TEST_MODEL, free_port, tiny_config
from cpsr_ds.checkpoint.capture.journal import ProgressJournal, journal_path
from examples.gpt.model import GPTConfig, gpt_pipeline


@pytest.fixture(scope="module", autouse=True)
def process_group():
    """One process group of world size 1 for the whole module that imports it (autouse there)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")
    yield
    torch.distributed.destroy_process_group()


def build(config):
    model = gpt_pipeline(GPTConfig(**TEST_MODEL), num_stages=1, seed=1)
    return cpsr_ds.initialize(model=model, model_parameters=model.parameters(), config=config)


def random_batches(engine):
    gpt = GPTConfig(**TEST_MODEL)
    gen = torch.Generator().manual_seed(0)
    shape = (engine.train_micro_batch_size_per_gpu(), gpt.seq_length)
    return [(torch.randint(0, gpt.vocab_size, shape, generator=gen),) * 2
            for _ in range(engine.gradient_accumulation_steps())]


def trained(tmp_path, zero_stage=0, iterations=2, **checkpoint):
    """A one-stage engine after ``iterations`` iterations, its dumps under tmp_path/survivors."""
    config = tiny_config(tmp_path / "run", stages=1, zero_stage=zero_stage)
    config["cpsr"]["checkpoint"].update(survivor_dir=str(tmp_path / "survivors"), **checkpoint)
    model = gpt_pipeline(GPTConfig(**TEST_MODEL), num_stages=1, seed=1)
    engine, *_ = cpsr_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    gpt = GPTConfig(**TEST_MODEL)
    gen = torch.Generator().manual_seed(0)
    shape = (engine.train_micro_batch_size_per_gpu(), gpt.seq_length)
    batches = [(torch.randint(0, gpt.vocab_size, shape, generator=gen),) * 2
               for _ in range(engine.gradient_accumulation_steps())]
    snapshots = engine.cpsr.host_snapshots
    for _ in range(iterations):
        engine.train_batch(iter(batches))
        if snapshots is not None:
            # Each host snapshot in place before the next is due: on a loaded machine a durable write can take
            # longer than the iterations between them, and the next one would be skipped.
            snapshots.wait(30)
    return engine, batches


def write_journal(directory, rank, iterations, loss=1.0):
    journal = ProgressJournal(str(directory), rank)
    for i in iterations:
        journal.append(i, loss)
    journal.close()
    return journal_path(str(directory), rank)


@pytest.fixture
def cpsr_logs(caplog, monkeypatch):
    """Records of cpsr_ds's loggers, which the plugin keeps from propagating to the root."""
    monkeypatch.setattr(logging.getLogger("cpsr_ds"), "propagate", True)
    caplog.set_level(logging.INFO)
    return caplog
