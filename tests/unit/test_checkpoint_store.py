"""On-disk checkpoint layout: file format, atomic writes, retries, verification, selection, inspect."""

import collections
import errno
import json
import logging
import os

import pytest
import torch

from cpsr_ds.cli import main
from cpsr_ds.checkpoint.storage import catalog, loading, ondisk, records, retention
from cpsr_ds.checkpoint.storage.filesystem import describe_error, fs
from cpsr_ds.integration.deepspeed import load_hooks
from cpsr_ds.checkpoint.engines.checkfreq import measured_interval, profiled_interval
from cpsr_ds.checkpoint.engines.async_engine import CheckpointStats
from cpsr_ds.checkpoint.storage.fileformat import ALIGN, CheckpointError, TensorRef, flatten, layout, read_snapshot, unflatten
from cpsr_ds.checkpoint.engines.persist import RetryPolicy, with_retries
from cpsr_ds.config import CheckpointConfig
from cpsr_ds.checkpoint.engines.snapshot import plan
from support.checkpoints import (assert_same, make_checkpoint, nested_state, two_checkpoints,  # noqa: F401 (a fixture)
                                 write_snapshot)


Pair = collections.namedtuple("Pair", "a b")


def test_flatten_unflatten_round_trip_keeps_types_and_python_objects():
    state = {**nested_state(), "named": Pair(torch.zeros(1), "y")}
    skeleton, tensors = flatten(state)
    assert len(tensors) == 7
    assert isinstance(skeleton["module"]["w"], TensorRef)
    assert skeleton["plain"] == ("text", 3, None)
    assert_same(unflatten(skeleton, list(tensors)), state)


def test_layout_aligns_every_tensor():
    specs, total = layout([torch.zeros(3, dtype=torch.uint8), torch.zeros(5), torch.zeros(())])
    assert [s.offset for s in specs] == [0, ALIGN, 2 * ALIGN]
    assert [s.nbytes for s in specs] == [3, 20, 4]
    assert total == 2 * ALIGN + 4


def test_plan_cuts_pieces_at_chunk_boundaries_and_covers_every_byte():
    specs, total = layout([torch.zeros(100, dtype=torch.uint8), torch.zeros(300, dtype=torch.uint8)])
    pieces = plan(specs, total, chunk_bytes=128)
    assert all(p.dst // 128 == (p.dst + p.src_end - p.src_start - 1) // 128 for p in pieces)
    covered = sorted((p.dst, p.dst + p.src_end - p.src_start) for p in pieces)
    assert covered == [(0, 100), (128, 256), (256, 384), (384, 428)]
    assert pieces[-1].ready == total and pieces[0].ready == 128


@pytest.mark.parametrize("mapped", [False, True])
def test_snapshot_file_round_trip_with_checksum(tmp_path, mapped):
    state = nested_state()
    path = str(tmp_path / "f.pt")
    size, digest = write_snapshot(path, state, chunk_bytes=64)
    assert size == os.path.getsize(path)
    assert_same(read_snapshot(path, {"size": size, "digest": digest}, mapped=mapped), state)


def test_a_mapped_snapshot_outlives_its_file_s_replacement_and_never_writes_the_file(tmp_path):
    path = str(tmp_path / "f.pt")
    size, digest = write_snapshot(path, {"w": torch.arange(4096.0)})
    loaded = read_snapshot(path, {"size": size, "digest": digest}, mapped=True)
    os.rename(path, str(tmp_path / "old.pt"))  # replaced by renaming, as dumps are
    write_snapshot(path, {"w": torch.zeros(4096)})
    assert torch.equal(loaded["w"], torch.arange(4096.0))
    loaded["w"].add_(1.0)  # copy-on-write: the file keeps its bytes
    assert_same(read_snapshot(str(tmp_path / "old.pt"), {"size": size, "digest": digest}), {"w": torch.arange(4096.0)})


@pytest.mark.parametrize("mapped", [False, True])
def test_read_snapshot_names_corrupt_and_truncated_files(tmp_path, mapped):
    path = str(tmp_path / "f.pt")
    size, digest = write_snapshot(path, nested_state())
    with open(path, "r+b") as f:
        f.seek(size - 3)
        f.write(b"\xff\xfe\xfd")
    with pytest.raises(CheckpointError, match=r"f\.pt: checksum mismatch"):
        read_snapshot(path, {"size": size, "digest": digest}, mapped=mapped)
    os.truncate(path, size - 10)
    with pytest.raises(CheckpointError, match=r"f\.pt: truncated"):
        read_snapshot(path, {"size": size, "digest": digest}, mapped=mapped)


def test_read_snapshot_loads_torch_save_files(tmp_path):
    path = str(tmp_path / "ds.pt")
    state = nested_state()
    torch.save(state, path)
    assert_same(read_snapshot(path), state)


def test_deepspeed_s_file_count_check_reads_only_the_header_of_a_file_in_our_format(tmp_path):
    """SDLoader's check wants one integer of the first file; without ZeRO that file holds stage 0's optimizer
    state, which a later stage's rank would otherwise read whole."""
    from deepspeed.runtime.state_dict_factory import SDLoaderFactory

    state = {"module": {"w": torch.randn(256, 256)}, "mp_world_size": 2}
    paths = [str(tmp_path / f"mp_rank_0{i}_model_states.pt") for i in (0, 1)]
    for path in paths:
        write_snapshot(path, state)
    loads = []

    class Loads:
        def load(self, path, map_location=None):
            loads.append(path)
            return loading.load_file(path, map_location)

    before = loading.bytes_loaded()
    with load_hooks.reading_each_file_once():
        SDLoaderFactory.get_sd_loader(paths, checkpoint_engine=Loads())
        with pytest.raises(CheckpointError, match="checkpoint count 1 is different from saved mp_world_size 2"):
            SDLoaderFactory.get_sd_loader(paths[1:], checkpoint_engine=Loads())
    assert loads == [] and 0 < loading.bytes_loaded() - before < 2 * 4096 * 2
    # Outside the block DeepSpeed's own check runs, loading the file whole.
    SDLoaderFactory.get_sd_loader(paths, checkpoint_engine=Loads())
    assert loads == paths[:1]


def test_write_atomic_leaves_target_untouched_on_error(tmp_path):
    path = str(tmp_path / "x")
    fs.write_atomic(path, [b"old"])

    def chunks():
        yield b"new"
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        fs.write_atomic(path, chunks())
    assert open(path, "rb").read() == b"old"
    assert os.listdir(tmp_path) == ["x"]


def test_with_retries_logs_cause_and_backs_off(caplog):
    calls, sleeps = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OSError(errno.EACCES, "Permission denied", "/ckpt/f")
        return "done"

    with caplog.at_level(logging.WARNING):
        assert with_retries(flaky, RetryPolicy(3, 0.5), "writing f", sleep=sleeps.append) == "done"
    assert sleeps == [0.5, 1.0]
    assert "EACCES Permission denied: /ckpt/f" in caplog.text


def test_with_retries_gives_up_with_the_last_error():
    attempts = []

    def full():
        attempts.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        with_retries(full, RetryPolicy(2, 0.0), "writing f", sleep=lambda s: None)
    assert len(attempts) == 3
    assert describe_error(OSError(errno.ENOSPC, "No space left on device")) == "ENOSPC No space left on device"


def test_profiled_interval_respects_budget_and_persist_rate():
    assert profiled_interval(1.0, stall_s=0.1, persist_s=2.0, budget=0.02, in_flight=1) == 5
    assert profiled_interval(0.1, stall_s=0.001, persist_s=5.0, budget=0.02, in_flight=1) == 50
    assert profiled_interval(0.1, stall_s=0.001, persist_s=5.0, budget=0.02, in_flight=2) == 25
    assert profiled_interval(10.0, stall_s=0.0, persist_s=0.0, budget=0.02, in_flight=1) == 1
    # Storage writes one checkpoint in 5 s however many persist at once.
    assert profiled_interval(0.1, stall_s=0.001, persist_s=5.0, budget=0.02, in_flight=2, storage_s=5.0) == 50


def test_the_budget_rule_follows_the_median_of_the_last_checkpoints_not_one_stall_a_busy_host_stretched():
    cfg = CheckpointConfig(strategy="checkfreq", overhead_budget=0.02)
    stats = CheckpointStats()
    assert measured_interval(cfg, stats, 0.025, 1) is None  # nothing measured: "auto" has no interval yet
    for i, (stall_s, persist_s) in enumerate([(0.5, 9.0), (0.002, 0.4), (0.002, 0.4), (0.002, 0.4), (0.002, 0.4),
                                              (0.15, 0.4)]):
        stats.stalled(stall_s)
        stats.recent.append((f"global_step{i}", 1000, persist_s))
    # The first checkpoint is out of the window; of the last five, the spike is one: 0.002 / (0.02 * 0.025) = 4, and
    # persisting (0.4 s) takes 16 iterations. The last stall alone would give 300.
    assert measured_interval(cfg, stats, 0.025, 1) == 16
    for _ in range(3):
        stats.stalled(0.15)
    assert measured_interval(cfg, stats, 0.025, 1) == 300  # most of the last five stalled that long: it is the cost


# ---------------------------------------------------------------- directories of checkpoints


def test_corrupt_file_is_named_and_previous_checkpoint_selected(two_checkpoints, caplog):
    bad = os.path.join(two_checkpoints, "global_step20", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with open(bad, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"oops")
    with caplog.at_level(logging.ERROR):
        assert catalog.select_checkpoint(two_checkpoints) == "global_step10"
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt: checksum mismatch" in caplog.text


def test_truncated_file_is_named_and_previous_checkpoint_selected(two_checkpoints, caplog):
    bad = os.path.join(two_checkpoints, "global_step20", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    os.truncate(bad, 100)
    with caplog.at_level(logging.ERROR):
        assert catalog.select_checkpoint(two_checkpoints, read_data=False) == "global_step10"
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt: truncated or overwritten: 100 bytes" in caplog.text


def test_missing_rank_manifest_is_named_and_previous_checkpoint_selected(two_checkpoints, caplog):
    os.unlink(os.path.join(two_checkpoints, "global_step20", ondisk.manifest_name(1)))
    with caplog.at_level(logging.ERROR):
        assert catalog.select_checkpoint(two_checkpoints) == "global_step10"
    assert "global_step20: rank 1 manifest cpsr_manifest.rank00001.json missing" in caplog.text


def test_latest_never_moves_back_to_an_older_checkpoint(two_checkpoints):
    make_checkpoint(two_checkpoints, "global_step15")
    assert records.read_latest(two_checkpoints) == "global_step20"
    assert records.read_commit(os.path.join(two_checkpoints, "global_step15")) is not None


def test_order_follows_iteration_and_attempt_not_the_clock(tmp_path):
    d = str(tmp_path)
    hour = 3600 * 10**9
    make_checkpoint(d, "global_step30", started_ns=10 * hour)
    # A later attempt on a host whose clock is an hour behind, and going backwards.
    for i, step in enumerate((40, 50, 60)):
        make_checkpoint(d, f"global_step{step}", attempt=1, started_ns=9 * hour - i)
        assert records.read_latest(d) == f"global_step{step}"
    assert sorted(retention.apply_retention(d, keep_last=2, protected=lambda tag: False)) == ["global_step30",
                                                                                          "global_step40"]
    assert [(c.tag, c.attempt) for c in catalog.scan(d)] == [("global_step50", 1), ("global_step60", 1)]
    assert catalog.select_checkpoint(d) == "global_step60"
    make_checkpoint(d, "global_step60", attempt=2, started_ns=0)
    assert records.read_latest(d) == "global_step60" and catalog.scan(d)[-1].attempt == 2
    assert ondisk.order_key(None, 5) < ondisk.order_key(0, 0) < ondisk.order_key(0, 1) < ondisk.order_key(1, 0)


def test_retention_keeps_last_k_committed_and_spares_in_flight(tmp_path):
    d = str(tmp_path)
    for i in range(1, 5):
        make_checkpoint(d, f"global_step{i * 10}")
    make_checkpoint(d, "global_step5", commit=False)
    make_checkpoint(d, "global_step45", commit=False)
    deleted = retention.apply_retention(d, keep_last=2, protected=lambda tag: tag == "global_step10")
    assert sorted(deleted) == ["global_step20", "global_step5"]
    assert sorted(os.listdir(d)) == ["global_step10", "global_step30", "global_step40", "global_step45", "latest"]


def test_retention_never_touches_the_run_directory_s_other_folders(tmp_path):
    d = str(tmp_path)
    os.makedirs(os.path.join(d, "faults"))  # empty until a fault fires
    os.makedirs(os.path.join(d, "journal"))
    with open(os.path.join(d, "journal", "rank00000.csv"), "w") as f:
        f.write("1,2.0,3.0\n")
    for i in range(1, 4):
        make_checkpoint(d, f"global_step{i * 10}")
    retention.apply_retention(d, keep_last=1, protected=lambda tag: False)
    assert sorted(os.listdir(d)) == ["faults", "global_step30", "journal", "latest"]
    assert [c.tag for c in catalog.scan(d)] == ["global_step30"]


def test_deepspeed_checkpoint_without_manifest_counts_when_latest_names_it(tmp_path):
    d = str(tmp_path)
    for tag in ("global_step1", "global_step2"):
        os.makedirs(os.path.join(d, tag))
        torch.save({"w": torch.ones(2)}, os.path.join(d, tag, "mp_rank_00_model_states.pt"))
    with open(os.path.join(d, "latest"), "w") as f:
        f.write("global_step1")
    assert catalog.select_checkpoint(d) == "global_step1"


def test_inspect_lists_checkpoints_latest_and_journal(two_checkpoints, capsys):
    os.unlink(os.path.join(two_checkpoints, "global_step20", ondisk.manifest_name(0)))
    journal = os.path.join(two_checkpoints, "journal")
    os.makedirs(journal)
    with open(os.path.join(journal, "rank00000.csv"), "w") as f:
        f.write("1,2.5,100.0\n2,2.4,101.0\n3,2.3,102.0\n")
    with open(os.path.join(journal, "rank00001.csv"), "w") as f:
        f.write("1,2.5,100.0\n2,2.4,101.0\n3,2.3")
    assert main(["inspect", two_checkpoints, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {c["tag"]: c for c in report["checkpoints"]}
    assert rows["global_step10"]["valid"] and not rows["global_step20"]["valid"]
    assert rows["global_step20"]["latest"] and rows["global_step10"]["iteration"] == 10
    assert "rank 0 manifest" in rows["global_step20"]["problems"][0]
    assert report["usable"] == "global_step10"
    assert report["journal_iteration"] == 2
