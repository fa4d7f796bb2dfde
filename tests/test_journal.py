import os

from cpsr_ds.checkpoint.journal import (
    ProgressJournal,
    append_validation,
    journal_path,
    read_journal,
    read_validation,
    reached_iteration,
)


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
