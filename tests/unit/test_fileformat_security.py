"""Planted checkpoint files: nothing unpickled before its checksum matched, and then no global outside the
allowlist, in our format and in DeepSpeed's (torch.save); real checkpoints of the tiny GPT still save and load."""

import json
import logging
import os
import pickle
import struct

import pytest
import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

import cpsr_ds
from benchmarks.common.processes import TEST_MODEL, tiny_config
from conftest import train_on_random_tokens
from cpsr_ds.checkpoint.storage import catalog, loading, ondisk
from cpsr_ds.checkpoint.storage.filesystem import fs
from cpsr_ds.checkpoint.capture import dumps
from cpsr_ds.checkpoint.engines.factory import create_engine
from cpsr_ds.checkpoint.storage.fileformat import (MAGIC, PAGE, CheckpointError, align, flatten, layout, read_skeleton,
                                           read_snapshot, scan_file)
from cpsr_ds.checkpoint.engines.snapshot import HostBuffers, snapshot_file
from examples.gpt.model import GPTConfig, gpt_pipeline
from support.checkpoints import (MODEL, NEW, RANK1, assert_same, checkpoint, config,  # noqa: F401 (fixtures)
                                 deepspeed_checkpoint, edit_json, process_group, run_inspect,
                                 two_checkpoints, write_snapshot)


class Command:
    """Unpickled, runs ``touch MARKER``: what a planted file would do with the reader's rights."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def planted_bytes(state) -> bytes:
    """A file in our format holding ``state``, its header pickled by plain pickle (whatever it names)."""
    skeleton, tensors = flatten(state)
    specs, total = layout(tensors)
    header = pickle.dumps((skeleton, specs), protocol=pickle.HIGHEST_PROTOCOL)
    head = MAGIC + struct.pack("<Q", len(header)) + header
    data = bytearray(total)
    for t, s in zip(tensors, specs):
        data[s.offset:s.offset + s.nbytes] = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return head + bytes(align(len(head), PAGE) - len(head)) + bytes(data)


def plant(ckpt_dir, rel, raw: bytes, rank: int, digest: bool = True) -> str:
    """Replace file ``rel`` of a checkpoint by ``raw``; with ``digest`` its manifest entry made to match it."""
    path = os.path.join(ckpt_dir, rel)
    size, checksum = fs.write_atomic(path, [raw], "xxh3_64")
    if digest:
        name = os.path.basename(rel)
        edit_json(os.path.join(os.path.dirname(path), ondisk.manifest_name(rank)),
                  lambda m: m["files"][name].update(size=size, digest=checksum))
    return path


def entry(ckpt_dir, rel, rank):
    with open(os.path.join(ckpt_dir, os.path.dirname(rel), ondisk.manifest_name(rank))) as f:
        return json.load(f)["files"][os.path.basename(rel)]


def test_a_planted_snapshot_naming_a_command_is_refused_though_checksum_and_manifest_match(
        two_checkpoints, tmp_path, caplog, capsys):
    marker = tmp_path / "ran"
    rel = os.path.join(NEW, RANK1)
    path = plant(two_checkpoints, rel, planted_bytes({"w": torch.ones(3), "x": Command(marker)}), rank=1)
    refused = f"{path}: refused: it names posix.system"
    for read in (lambda: read_snapshot(path, entry(two_checkpoints, rel, 1)), lambda: read_snapshot(path),
                 lambda: scan_file(path, entry(two_checkpoints, rel, 1)), lambda: read_skeleton(path),
                 lambda: loading.load_file(path)):
        with pytest.raises(CheckpointError, match=refused):
            read()
    with caplog.at_level(logging.ERROR):
        assert catalog.select_checkpoint(two_checkpoints) == "global_step10"
    assert refused in caplog.text
    row = run_inspect(two_checkpoints, capsys)["rows"][NEW]
    assert row["status"] == "invalid" and any(p.startswith(refused) for p in row["problems"])
    assert not marker.exists()


def test_a_planted_snapshot_with_a_wrong_checksum_is_refused_before_its_header_is_unpickled(two_checkpoints,
                                                                                            tmp_path):
    marker = tmp_path / "ran"
    rel = os.path.join(NEW, RANK1)
    expect = entry(two_checkpoints, rel, 1)
    raw = planted_bytes({"w": torch.ones(3), "x": Command(marker)})
    path = plant(two_checkpoints, rel, raw + bytes(expect["size"] - len(raw)), rank=1, digest=False)
    # The header names a refused global: only a header left unparsed ends in the checksum's error.
    for read in (read_snapshot, scan_file):
        with pytest.raises(CheckpointError, match=f"{path}: checksum mismatch"):
            read(path, expect)
    assert not marker.exists()


def test_a_planted_deepspeed_checkpoint_naming_a_command_is_refused_by_inspect_and_selection(tmp_path, capsys,
                                                                                            caplog):
    d = str(tmp_path / "run")
    marker = tmp_path / "ran"
    deepspeed_checkpoint(d, "global_step1", {"module": {"3.weight": torch.ones(3)}})
    deepspeed_checkpoint(d, "global_step2", {"module": {"3.weight": torch.ones(3)}, "x": Command(marker)})
    path = os.path.join(d, "global_step2", "mp_rank_00_model_states.pt")
    refused = f"{path}: refused: it names posix.system"
    row = run_inspect(d, capsys)["rows"]["global_step2"]
    assert row["status"] == "invalid" and any(p.startswith(refused) for p in row["problems"])
    with caplog.at_level(logging.ERROR):
        assert catalog.select_checkpoint(d) == "global_step1"
    assert refused in caplog.text
    with pytest.raises(CheckpointError, match=refused):
        loading.load_file(path)
    assert not marker.exists()


def zero_optimizer_state() -> dict:
    """What DeepSpeed's ZeRO optimizer's state_dict holds besides tensors, with fp16's dynamic loss scaler."""
    return {"loss_scaler": DynamicLossScaler(2.0**16, 1000, 1.0, 2, False, dtype=torch.float16),
            "zero_stage": ZeroStageEnum.optimizer_states, "partition_count": [2],
            "param_slice_mappings": [{"w": fragment_address(numel=3, start=0)}], "ids": {1, 2}, "cut": slice(1, 3),
            "single_partition_of_fp32_groups": [torch.randn(3)]}


def test_deepspeed_s_optimizer_state_round_trips_in_both_formats(tmp_path):
    state = zero_optimizer_state()
    write_snapshot(str(tmp_path / "ours.pt"), state)
    torch.save(state, tmp_path / "theirs.pt")
    for name in ("ours.pt", "theirs.pt"):
        got = read_snapshot(str(tmp_path / name))
        assert got["loss_scaler"].__dict__ == state["loss_scaler"].__dict__
        assert_same({k: v for k, v in got.items() if k != "loss_scaler"},
                    {k: v for k, v in state.items() if k != "loss_scaler"})


def test_a_state_a_restart_would_refuse_is_not_written(tmp_path):
    state = {"w": torch.ones(3), "x": Command(tmp_path / "ran")}
    with pytest.raises(CheckpointError, match="f.pt: not written: it names posix.system"):
        snapshot_file("f.pt", state, HostBuffers(pin=False), None)
    dump = str(tmp_path / "dump")
    with pytest.raises(CheckpointError, match=f"{dump}/{dumps.STATE_FILE}: not written: it names posix.system"):
        dumps.write_dump(dump, state, {"rank": 0}, "xxh3_64")
    d = str(tmp_path / "run")
    engine = create_engine(config(d, strategy="torch"), 0, 1)
    with pytest.raises(CheckpointError, match=f"{MODEL}: not written: it names posix.system"):
        checkpoint(engine, d, 1, {"model": state, "optim": {}})
    assert not (tmp_path / "ran").exists() and not os.path.exists(os.path.join(d, "global_step1", MODEL))


@pytest.mark.parametrize("strategy", ["cpsr", "torch"])
def test_real_checkpoints_of_the_pipeline_with_zero1_and_bf16_save_and_load(tmp_path, process_group, strategy):
    """Every global in the files of a real checkpoint is allowed: the engine loads it back; a planted file in its
    place (re-checksummed) makes DeepSpeed's load_checkpoint fail, naming it, and the command never runs."""
    run = str(tmp_path / "run")
    cfg = tiny_config(run, stages=1, zero_stage=1)
    cfg["bf16"] = {"enabled": True}
    cfg["cpsr"]["checkpoint"].update(strategy=strategy, interval=2, survivor=False)
    model = gpt_pipeline(GPTConfig(**TEST_MODEL), num_stages=1, seed=1)
    engine, *_ = cpsr_ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    train_on_random_tokens(engine, 2)
    engine.checkpoint_engine.cleanup()
    if strategy == "cpsr":
        assert engine.checkpoint_engine.flush(60)
    assert catalog.select_checkpoint(run) == "global_step2"
    tag_dir = os.path.join(run, "global_step2")
    optim = next(n for n in os.listdir(tag_dir) if n.endswith("optim_states.pt"))
    expected = engine.optimizer.state_dict()
    got = loading.load_file(os.path.join(tag_dir, optim))["optimizer_state_dict"]
    assert type(got["loss_scaler"]) is type(expected["loss_scaler"])
    assert_same({k: v for k, v in got.items() if k != "loss_scaler"},
                {k: v for k, v in expected.items() if k != "loss_scaler"})
    engine.load_checkpoint(run, tag="global_step2")
    assert engine.global_steps == 2

    marker = tmp_path / "ran"
    planted = {**loading.load_file(os.path.join(tag_dir, optim)), "x": Command(marker)}
    if strategy == "cpsr":
        raw = planted_bytes(planted)
    else:
        torch.save(planted, tmp_path / "planted.pt")
        raw = (tmp_path / "planted.pt").read_bytes()
    plant(run, os.path.join("global_step2", optim), raw, rank=0)
    with pytest.raises(CheckpointError, match=f"{optim}: refused: it names posix.system"):
        engine.load_checkpoint(run, tag="global_step2")
    assert not marker.exists()
