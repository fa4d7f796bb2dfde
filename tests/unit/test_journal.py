import errno
import logging
import os
import shutil

import pytest

from cpsr_ds.checkpoint.capture.journal import (
    MAX_RANK_SKEW,
    ProgressJournal,
    append_validation,
    journal_path,
    read_journal,
    read_progress,
    read_validation,
    reached_iteration,
)
from support.training import cpsr_logs, write_journal  # noqa: F401 (a fixture)


def test_append_and_read_back_exact_floats(tmp_path):
    journal = ProgressJournal(str(tmp_path), rank=3)
    losses = [2.0 / 3.0, 1e-30, 4.123456789012345]
    for i, loss in enumerate(losses, start=1):
        journal.append(i, loss)
    journal.close()
    entries = read_journal(journal_path(str(tmp_path), 3))
    assert [e.iteration for e in entries] == [1, 2, 3]
    assert [e.loss for e in entries] == losses
    assert entries[0].wall_time <= entries[1].wall_time <= entries[2].wall_time


def test_truncated_last_line_is_skipped(tmp_path):
    journal = ProgressJournal(str(tmp_path), rank=0)
    journal.append(1, 0.5)
    journal.append(2, 0.25)
    journal.close()
    path = journal_path(str(tmp_path), 0)
    with open(path, "ab") as f:
        f.write(b"3,0.12")  # a write cut short by a kill
    assert [e.iteration for e in read_journal(path)] == [1, 2]
    with open(path, "ab") as f:
        f.write(b"\n4,0.1,17.0\n")
    assert [e.iteration for e in read_journal(path)] == [1, 2, 4]


def test_a_line_cut_short_stays_apart_from_the_next_jobs_lines(tmp_path):
    path = write_journal(tmp_path, 0, [1, 2])
    with open(path, "ab") as f:
        f.write(b"3")  # a kill cut the write of "3,..." short
    write_journal(tmp_path, 0, [3, 4])  # the restarted job
    progress = read_progress(str(tmp_path))
    assert [e.iteration for e in progress.entries[0]] == [1, 2, 3, 4] and progress.problems == ()


def test_reached_iteration_is_the_slowest_rank(tmp_path):
    assert reached_iteration(str(tmp_path)) is None
    for rank, last in [(0, 12), (1, 11)]:
        journal = ProgressJournal(str(tmp_path), rank)
        for i in range(1, last + 1):
            journal.append(i, 1.0)
        journal.close()
    assert reached_iteration(str(tmp_path)) == 11


def test_reopened_journal_appends(tmp_path):
    for i in (1, 2):
        journal = ProgressJournal(str(tmp_path), rank=0)
        journal.append(i, float(i))
        journal.close()
    assert [e.iteration for e in read_journal(journal_path(str(tmp_path), 0))] == [1, 2]


def test_validation_log_last_entry_wins(tmp_path):
    append_validation(str(tmp_path), 10, 3.0)
    append_validation(str(tmp_path), 20, 2.5)
    append_validation(str(tmp_path), 20, 2.4)
    assert read_validation(str(tmp_path)) == {10: 3.0, 20: 2.4}
    assert os.path.isfile(tmp_path / "validation.csv")


@pytest.mark.parametrize("bogus", [1000000, 99999999999])
def test_an_entry_that_jumps_forward_cuts_the_journal_there(tmp_path, bogus):
    paths = [write_journal(tmp_path, rank, range(1, 46)) for rank in (0, 1)]
    for path in paths:
        with open(path, "a") as f:
            f.write(f"{bogus},2.9,1795340903.0\n46,2.8,1795340904.0\n")
    progress = read_progress(str(tmp_path))
    assert progress.reached == 45 == reached_iteration(str(tmp_path))
    assert [e.iteration for e in progress.entries[0]] == list(range(1, 46))
    assert progress.problems == tuple(f"journal {path} line 46 jumps from iteration 45 to {bogus}: "
                                      "ignoring this line and every line after it" for path in paths)


def test_a_restart_that_goes_back_is_plausible_and_covers_the_recomputed_iterations(tmp_path):
    write_journal(tmp_path, 0, [*range(1, 28), *range(21, 41)])
    write_journal(tmp_path, 1, [*range(1, 28), *range(21, 40)])
    progress = read_progress(str(tmp_path))
    assert progress.reached == 39 and progress.problems == ()
    # Iteration 39 was reached by the run that resumed at 21, on both ranks, after 1 to 27.
    assert progress.covered_from(39) == 1 and progress.covered_from(27) == 1


def test_a_restart_from_a_snapshot_within_the_recorded_iterations_keeps_them_covered(tmp_path):
    """A crash after 241 resumed from the snapshot of 240 and reached 242: every iteration from 233 is recorded,
    though the file's last consecutive run starts at 241."""
    write_journal(tmp_path, 0, [*range(220, 239), *range(233, 242), 241, 242])
    progress = read_progress(str(tmp_path))
    assert progress.reached == 242 and progress.covered_from(242) == 220
    other = tmp_path / "other"
    write_journal(other, 0, [*range(300, 320), *range(280, 290)])  # back before the journal's first record
    assert read_progress(str(other)).covered_from(289) == 280 and read_progress(str(other)).covered_from(319) == 300
    assert read_progress(str(other)).covered_from(321) is None


def test_journals_too_far_apart_use_the_slowest_rank_and_say_so(tmp_path):
    write_journal(tmp_path, 0, range(1, 46))
    write_journal(tmp_path, 1, range(1, 31))
    progress = read_progress(str(tmp_path))
    assert progress.reached == 30
    assert progress.problems == (f"the ranks' journals disagree: rank 0 reached iteration 45, rank 1 30 "
                                 f"(more than {MAX_RANK_SKEW} apart); using the slowest rank's, 30",)


def test_a_journal_that_only_starts_late_does_not_cover_what_came_before(tmp_path):
    write_journal(tmp_path, 0, [1000000])
    progress = read_progress(str(tmp_path))
    assert progress.reached == 1000000 and progress.covered_from(1000000) == 1000000


def test_a_deleted_run_directory_is_reported_once(tmp_path, cpsr_logs):
    run_dir = tmp_path / "run"
    journal = ProgressJournal(str(run_dir), rank=0)
    journal.append(1, 1.0)
    assert not cpsr_logs.records
    shutil.rmtree(run_dir)
    journal.append(2, 1.0)
    journal.append(3, 1.0)
    journal.close()
    warnings = [r.getMessage() for r in cpsr_logs.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"the run directory {run_dir} is gone" in warnings[0]


def test_a_failing_write_keeps_training_and_the_journal_contiguous(tmp_path, cpsr_logs, monkeypatch):
    journal = ProgressJournal(str(tmp_path), rank=0)
    journal.append(1, 1.0)
    real_write = os.write
    state = {"full": True, "short": True}

    def write(fd, data):
        if fd == journal._fd and state["full"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), journal.path)
        if fd == journal._fd and state["short"]:
            state["short"] = False
            return real_write(fd, data[:len(data) - 5])  # the disk fills mid-line
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    for i in range(2, 6):
        journal.append(i, 1.0)  # must not raise
    state["full"] = False
    journal.append(6, 1.0)
    journal.append(7, 1.0)
    journal.close()
    assert [e.iteration for e in read_journal(journal.path)] == list(range(1, 8))
    warnings = [r.getMessage() for r in cpsr_logs.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "ENOSPC" in warnings[0] and journal.path in warnings[0]
    assert "written again, nothing lost" in warnings[1]
