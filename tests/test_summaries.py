"""The predictor's summaries kept beside the checkpoints (cpsr_ds/recovery/sources/summaries.py): written
atomically, read back only when whole and of the same checkpoint, the newest few kept."""

import os

import torch

from cpsr_ds.recovery.sources import summaries


def summary(value: float) -> dict:
    return {"name": "trend", "iteration": 7, "slope": {"param": torch.full((5,), value, dtype=torch.bfloat16)}}


def test_a_summary_reads_back_for_its_iteration_and_attempt_only(tmp_path):
    summaries.write(str(tmp_path), 3, 7, 2, summary(0.5), keep=4)
    got, size = summaries.read(str(tmp_path), 3, 7, 2)
    assert size == os.path.getsize(summaries.path(str(tmp_path), 3, 7, 2))
    torch.testing.assert_close(got["slope"]["param"], summary(0.5)["slope"]["param"], rtol=0, atol=0)
    assert summaries.read(str(tmp_path), 3, 7, 1) == (None, 0)  # another attempt's checkpoint 7
    assert summaries.read(str(tmp_path), 2, 7, 2) == (None, 0)  # another rank's


def test_a_damaged_summary_is_refused(tmp_path, caplog):
    summaries.write(str(tmp_path), 0, 7, 1, summary(0.5), keep=4)
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
        summaries.write(str(tmp_path), 0, iteration, 1, summary(iteration), keep=3)
    summaries.write(str(tmp_path), 0, 25, 2, summary(25.0), keep=3)  # a later attempt orders after
    kept = sorted(os.listdir(os.path.dirname(summaries.path(str(tmp_path), 0, 5, 1))))
    assert kept == ["000000020-1.pt", "000000025-1.pt", "000000025-2.pt"]


def test_a_failed_write_is_logged_not_raised(tmp_path, caplog):
    blocker = tmp_path / "predictor_summaries"
    blocker.write_text("a file where the directory should be")
    summaries.write(str(tmp_path), 0, 7, 1, summary(0.5), keep=4)
    assert "was not written" in caplog.text
