"""Progress records: the files of a checkpoint in flight that have landed, rank by rank.

Until its manifest is written, a rank records each file as it lands (size, digest and
attempt, one line each) in ``cpsr_progress.rankNNNNN.jsonl``, which the manifest then
replaces: the landed files of a checkpoint a failure cut short can still be checked
(recovery's ``in_flight`` source reads the parameters there).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import NamedTuple

from pydantic import ValidationError

from cpsr_ds.checkpoint.storage.filesystem import cause, fs
from cpsr_ds.checkpoint.storage.ondisk import PROGRESS_RE, progress_name
from cpsr_ds.checkpoint.storage.records import FileEntry, ProgressLine, read_manifest_files

log = logging.getLogger(__name__)


def record_progress(tag_dir: str, rank: int, rel: str, entry: dict, attempt: int, algorithm: str,
                    first: bool) -> None:
    """Add file ``rel``, durable on storage with its manifest ``entry``, to ``rank``'s progress record in
    ``tag_dir`` (``first``: the first file of this attempt's part, which starts the record anew)."""
    line = json.dumps({"attempt": attempt, "checksum": algorithm, "file": rel, **entry}) + "\n"
    fs.append_durable(os.path.join(tag_dir, progress_name(rank)), line, first)


def forget_progress(tag_dir: str, rank: int) -> None:
    """Remove ``rank``'s progress record, which its manifest has replaced."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(tag_dir, progress_name(rank)))


class Landed(NamedTuple):
    """One file a rank's progress record says landed: its manifest entry and the algorithm of its digest."""

    entry: dict
    algorithm: str
    attempt: int


def read_progress(tag_dir: str) -> dict[str, Landed]:
    """The files every rank's progress record in ``tag_dir`` lists, by path relative to it. Only the lines of a
    record's newest attempt count (an older attempt's file may have been written again since); a line that is
    not one (a write cut short) ends its record there."""
    landed: dict[str, Landed] = {}
    try:
        names = sorted(n for n in os.listdir(tag_dir) if PROGRESS_RE.match(n))
    except FileNotFoundError:
        return landed
    for name in names:
        path = os.path.join(tag_dir, name)
        try:
            with open(path, errors="replace") as f:
                lines = _progress_lines(f)
        except OSError as err:
            log.warning("%s: unreadable, skipped: %s", path, cause(err))
            continue
        newest = max((file.attempt for _, file in lines), default=None)
        landed.update((rel, file) for rel, file in lines if file.attempt == newest)
    return landed


def landed_files(tag_dir: str) -> dict[str, Landed]:
    """The files of a checkpoint that did not commit known to have landed whole: those its ranks' progress
    records list (:func:`read_progress`) and those of the sound manifests of the ranks that finished their part
    (a manifest replaces its rank's record)."""
    landed = read_progress(tag_dir)
    try:
        manifests = read_manifest_files(tag_dir).manifests
    except FileNotFoundError:
        return landed
    for man in manifests.values():
        landed.update((rel, Landed(entry, man["checksum"], man.get("attempt", 0))) for rel, entry in man["files"].items())
    return landed


def _progress_lines(f) -> list[tuple[str, Landed]]:
    lines = []
    for text in f:
        try:
            line = ProgressLine.model_validate_json(text)
        except ValidationError:
            break
        entry = line.model_dump(include=set(FileEntry.model_fields), exclude_defaults=True)
        lines.append((line.file, Landed(entry, line.checksum, line.attempt)))
    return lines
