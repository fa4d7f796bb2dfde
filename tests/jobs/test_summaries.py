"""The predictor's summaries kept beside the checkpoints (cpsr_ds/recovery/sources/summaries.py): written
atomically, after the checkpoints in flight have persisted and before the process exits, read back only when whole
and of the same checkpoint, the newest few kept."""

import glob
import os
import threading
import time

import pytest
import torch

from benchmarks.common.processes import tiny_config
from conftest import run_job
from cpsr_ds.runtime.schedule import iterations_to_checkpoint
from cpsr_ds.checkpoint.storage import records
from cpsr_ds.checkpoint.engines.throttle import Throttle
from cpsr_ds.recovery.sources import summaries


def summary(value: float) -> dict:
    return {"name": "trend", "iteration": 7, "slope": {"param": torch.full((5,), value, dtype=torch.bfloat16)}}


def test_a_summary_reads_back_for_its_iteration_and_attempt_only(tmp_path):
    summaries.write(str(tmp_path), 3, 7, 2, summaries.encode(summary(0.5)), keep=4)
    got, size = summaries.read(str(tmp_path), 3, 7, 2)
    assert size == os.path.getsize(summaries.path(str(tmp_path), 3, 7, 2))
    torch.testing.assert_close(got["slope"]["param"], summary(0.5)["slope"]["param"], rtol=0, atol=0)
    assert summaries.read(str(tmp_path), 3, 7, 1) == (None, 0)  # another attempt's checkpoint 7
    assert summaries.read(str(tmp_path), 2, 7, 2) == (None, 0)  # another rank's


def test_a_damaged_summary_is_refused(tmp_path, caplog):
    summaries.write(str(tmp_path), 0, 7, 1, summaries.encode(summary(0.5)), keep=4)
    path = summaries.path(str(tmp_path), 0, 7, 1)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))
    got, size = summaries.read(str(tmp_path), 0, 7, 1)
    assert got is None and size == len(data) and "is damaged" in caplog.text
    open(path, "wb").write(bytes(data[:40]))  # truncated
    assert summaries.read(str(tmp_path), 0, 7, 1)[0] is None


def test_only_the_newest_summaries_are_kept(tmp_path):
    for iteration in (5, 10, 15, 20, 25):
        summaries.write(str(tmp_path), 0, iteration, 1, summaries.encode(summary(iteration)), keep=3)
    # A later attempt orders after.
    summaries.write(str(tmp_path), 0, 25, 2, summaries.encode(summary(25.0)), keep=3)
    kept = sorted(os.listdir(os.path.dirname(summaries.path(str(tmp_path), 0, 5, 1))))
    assert kept == ["000000020-1.pt", "000000025-1.pt", "000000025-2.pt"]


def test_a_failed_write_is_logged_not_raised(tmp_path, caplog):
    blocker = tmp_path / "predictor_summaries"
    blocker.write_text("a file where the directory should be")
    summaries.write(str(tmp_path), 0, 7, 1, summaries.encode(summary(0.5)), keep=4)
    assert "was not written" in caplog.text


BIG = {"name": "trend", "iteration": 7, "slope": {"param": torch.ones(100_000, dtype=torch.bfloat16)}}  # 200 kB


def test_the_writer_leaves_the_caller_at_once_and_writes_each_summary_at_the_write_limit(tmp_path):
    writer = summaries.Writer(Throttle(400_000))  # half a second a summary
    t0 = time.monotonic()
    for iteration in (5, 10):
        submitted = time.monotonic()
        writer.submit(str(tmp_path), 0, iteration, 1, BIG, keep=1)
        assert time.monotonic() - submitted < 0.1
        assert not writer.flush(timeout_s=0.05)
        assert writer.flush(timeout_s=30)
    assert time.monotonic() - t0 >= 0.8  # both through the limit
    kept = os.listdir(os.path.dirname(summaries.path(str(tmp_path), 0, 5, 1)))
    assert kept == ["000000010-1.pt"]  # keep=1: the newest only
    assert summaries.read(str(tmp_path), 0, 10, 1)[0]["iteration"] == 7
    assert writer.close(timeout_s=1)


def test_a_summary_that_would_not_be_written_before_the_next_checkpoint_begins_takes_nothing_of_the_limit(tmp_path):
    """The next checkpoint's persist starts with the write limit's burst: a summary that would not be written, the
    burst refilled, by then is dropped before its first piece; one with room is written."""
    throttle = Throttle(400_000)  # BIG: half a second, the burst 50 ms
    writer = summaries.Writer(throttle)
    writer.submit(str(tmp_path), 0, 5, 1, BIG, keep=4, deadline=time.monotonic() + 0.5)
    assert writer.flush(timeout_s=30)
    assert summaries.read(str(tmp_path), 0, 5, 1) == (None, 0)
    assert throttle.take(throttle.burst) == 0  # the burst is still there
    writer.submit(str(tmp_path), 0, 10, 1, BIG, keep=4, deadline=time.monotonic() + 5)
    assert writer.close(timeout_s=30)
    assert summaries.read(str(tmp_path), 0, 10, 1)[0]["iteration"] == 7


def test_a_summary_whose_room_a_slow_persist_took_is_dropped(tmp_path):
    """The room is reckoned after the checkpoints in flight persisted, not when the summary was submitted."""
    persisted = threading.Event()
    writer = summaries.Writer(Throttle(400_000), after=persisted.wait)
    writer.submit(str(tmp_path), 0, 5, 1, BIG, keep=4, deadline=time.monotonic() + 1.0)
    time.sleep(0.6)  # 0.4 s left: not enough for 0.5 s of writing
    persisted.set()
    assert writer.close(timeout_s=30)
    assert summaries.read(str(tmp_path), 0, 5, 1) == (None, 0)


def test_the_next_checkpoint_is_reckoned_from_the_fixed_interval_or_the_schedule():
    assert [iterations_to_checkpoint(i, 18, 0) for i in (18, 19, 35, 36)] == [18, 17, 1, 18]
    assert iterations_to_checkpoint(19, "auto", 54) == 35
    assert iterations_to_checkpoint(60, "auto", 54) == 0  # overdue: due now


def test_a_summary_the_writer_cannot_serialise_is_logged_and_the_next_one_written(tmp_path, caplog):
    writer = summaries.Writer()
    writer.submit(str(tmp_path), 0, 5, 1, {"name": "trend", "slope": lambda: None}, keep=4)
    assert writer.flush(timeout_s=30)  # before the next: it would supersede this one
    writer.submit(str(tmp_path), 0, 10, 1, summary(0.5), keep=4)
    assert writer.close(timeout_s=30)
    assert "summary of iteration 5 was not written" in caplog.text
    assert summaries.read(str(tmp_path), 0, 5, 1) == (None, 0)
    assert summaries.read(str(tmp_path), 0, 10, 1)[0] is not None


def test_the_writer_waits_for_the_checkpoints_in_flight_before_each_summary(tmp_path):
    persisted = threading.Event()
    writer = summaries.Writer(after=persisted.wait)
    writer.submit(str(tmp_path), 0, 5, 1, summary(0.5), keep=4)
    assert not writer.flush(timeout_s=0.2)
    assert summaries.read(str(tmp_path), 0, 5, 1) == (None, 0)
    persisted.set()
    assert writer.close(timeout_s=30)
    assert summaries.read(str(tmp_path), 0, 5, 1)[0]["iteration"] == 7


def test_a_script_that_exits_without_destroying_its_engine_still_writes_the_last_summary(tmp_path):
    """train_gpt.py leaves its engine to the interpreter's exit, and the last checkpoint (the write limit makes its
    persist outlast the script) is still persisting then: its summary is written before the interpreter tears down."""
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, stages=1)
    config["cpsr"]["checkpoint"].update(interval=5, write_mbps=1.0)
    run_job(tmp_path, config, "--train-iters", 20, "--eval-interval", 20, nprocs=1)
    assert records.read_latest(str(run_dir)) == "global_step20"
    written = os.listdir(os.path.dirname(summaries.path(str(run_dir), 0, 20, 0)))
    assert any(name.startswith("000000020-") for name in written), written
    # The last checkpoint was still open at exit (no optimizer step sealed it): persisted before its summary.
    assert after_their_checkpoints(run_dir) >= {20}


def after_their_checkpoints(run_dir) -> set[int]:
    """The iterations of the summaries in ``run_dir`` whose checkpoint is there; each written after that
    checkpoint's files, not beside them (asserted)."""
    directory = os.path.dirname(summaries.path(str(run_dir), 0, 0, 0))
    checked = set()
    for name in os.listdir(directory):
        iteration = int(name.partition("-")[0])
        files = glob.glob(str(run_dir / f"global_step{iteration}" / "*.pt"))
        if files:
            assert os.path.getmtime(os.path.join(directory, name)) >= max(map(os.path.getmtime, files)), name
            checked.add(iteration)
    return checked


@pytest.mark.serial  # a loaded machine stretches a persist past the next checkpoint, whose start drops the summary
def test_each_summary_is_written_after_its_checkpoint_persisted_not_beside_it(tmp_path):
    """The predictor summarises a checkpoint while DeepSpeed's save has it open: the summary waits until the next
    optimizer step sealed it and the writer saw it persisted, so the two never share the write limit."""
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, stages=1)
    # A checkpoint (1.7 MB) persists in about 7 of the 20 iterations between checkpoints, its summary in 1.
    config["cpsr"]["checkpoint"].update(interval=20, write_mbps=10.0, keep_last=4)
    run_job(tmp_path, config, "--train-iters", 60, "--eval-interval", 60, nprocs=1)
    assert after_their_checkpoints(run_dir) == {40, 60}  # trend has no slope to keep at its first checkpoint
