"""Scan, verify, select: which checkpoints a directory holds, what is wrong with each, which to load.

A directory holding any of our snapshot files is ours (``cpsr``) and loadable only with
every manifest and the commit record; one of ``torch.save`` files without manifests
(DeepSpeed's own engine) is at best ``unverified``, and is opened and checked before it
is chosen. A damaged manifest, commit record or ``latest`` is reported by name and the
checkpoint it belongs to is skipped, never a crash.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Collection, Iterable, Optional

from cpsr_ds.checkpoint.storage.filesystem import cause
from cpsr_ds.checkpoint.storage.fileformat import MAGIC, CheckpointError, check_size, scan_file
from cpsr_ds.checkpoint.storage.ondisk import (COMMIT, DEEPSPEED_FILE_RE, MANIFEST_RE, PROGRESS_RE, REPLICAS, TEMP_RE,
                                               iteration_attempt, manifest_name, order_key, tag_iteration)
from cpsr_ds.checkpoint.storage.records import Metadata, read_latest, read_metadata

log = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    """One tag directory as found on storage."""

    tag: str
    kind: str                 # "cpsr" (our metadata or snapshot files) or "deepspeed" (torch.save files only)
    iteration: Optional[int]
    attempt: int              # the job attempt that wrote it; with ``iteration`` the order of checkpoints
    size: int
    committed: bool           # DeepSpeed's format: ``latest`` names it or a newer one
    problems: list[str] = field(default_factory=list)
    ranks: Optional[tuple[int, ...]] = None  # the ranks whose parts it holds (checkpoint.per_stage); None: all
    world_size: int = 0       # of the job that wrote it; 0: unknown (DeepSpeed's format)

    @property
    def key(self) -> tuple[int, int]:
        return order_key(self.iteration, self.attempt)

    @property
    def full(self) -> bool:
        """Every rank's part: a consistent cut of the whole job."""
        return self.ranks is None

    def holds(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    @property
    def valid(self) -> bool:
        """Loadable: committed, nothing found wrong."""
        return self.committed and not self.problems

    @property
    def status(self) -> str:
        """valid, unverified (DeepSpeed's format: no manifest vouches for it), invalid or not committed."""
        if not self.committed:
            return "not committed"
        if self.problems:
            return "invalid"
        return "valid" if self.kind == "cpsr" else "unverified"


def scan(ckpt_dir: str) -> list[Checkpoint]:
    """Tag directories of ``ckpt_dir`` from metadata only (no data read), oldest first by ``order_key``."""
    found = []
    try:
        names = sorted(os.listdir(ckpt_dir))
    except FileNotFoundError:
        return found
    for name in names:
        tag_dir = os.path.join(ckpt_dir, name)
        if name.startswith(".") or name == REPLICAS or not os.path.isdir(tag_dir):
            continue
        try:
            ckpt = describe(tag_dir, name)
        except FileNotFoundError:  # deleted while we looked
            continue
        except OSError as err:
            log.warning("%s: unreadable, skipped: %s", tag_dir, cause(err))
            continue
        if ckpt is not None:
            found.append(ckpt)
    return sorted(found, key=lambda c: (c.key, c.tag))


def describe(tag_dir: str, tag: str) -> Optional[Checkpoint]:
    """The checkpoint in ``tag_dir``, or None for a directory that holds none (the journal, say)."""
    meta = read_metadata(tag_dir)
    files = _files(tag_dir)
    size = sum(files.values())
    if not meta.found:
        kind = _kind_without_metadata(tag_dir, files)
        if kind is None:
            return None
        return Checkpoint(tag, kind, tag_iteration(tag), 0, size, committed=False)
    record = meta.commit or next((meta.manifests[r] for r in sorted(meta.manifests)), {})
    ranks = record.get("ranks") if meta.commit else None
    return Checkpoint(tag, "cpsr", *iteration_attempt(tag, record), size, committed=meta.committed,
                      ranks=None if ranks is None else tuple(ranks), world_size=record.get("world_size", 0))


def _files(tag_dir: str) -> dict[str, int]:
    """The size of every file under ``tag_dir``, by path relative to it."""
    return {os.path.relpath(os.path.join(root, name), tag_dir): _size(os.path.join(root, name))
            for root, _, names in os.walk(tag_dir) for name in names}


def _data_files(files: Iterable[str]) -> list[str]:
    """The files a checkpoint's manifests must list: all but our metadata and hidden (temporary) files."""
    return sorted(rel for rel in files
                  if not any(part.startswith(".") for part in rel.split(os.sep))
                  and rel != COMMIT and not MANIFEST_RE.match(rel) and not PROGRESS_RE.match(rel))


def _size(path: str) -> int:
    # Writers rename and retention deletes while we look: a vanished file counts as empty.
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def _kind_without_metadata(tag_dir: str, files: Iterable[str]) -> Optional[str]:
    """"cpsr" if any file is a snapshot or temporary file of ours (a persist cut short), "deepspeed" for
    DeepSpeed's files alone, None for other directories (the journal, fault markers: retention must not touch them).
    """
    names = [os.path.basename(rel) for rel in files]
    if any(TEMP_RE.match(n) for n in names) or any(_has_magic(os.path.join(tag_dir, rel)) for rel in files):
        return "cpsr"
    if any(DEEPSPEED_FILE_RE.match(n) for n in names):
        return "deepspeed"
    return None


def _has_magic(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def verify(ckpt_dir: str, ckpt: Checkpoint, read_data: bool = True,
           ranks: Optional[Collection[int]] = None, need_commit: bool = True,
           share: Optional[tuple[int, int]] = None) -> list[str]:
    """Problems of a checkpoint, each naming the file, rank or tensor; empty means loadable.

    Ours: every rank's manifest and the commit record are there and sound, the manifests
    list every file there is and no non-finite tensor, every file has its size and, with
    ``read_data``, its checksum and finite floating tensors (one read). DeepSpeed's
    format, only with ``read_data``: every file loads and its floating tensors are finite.
    ``ranks``: check only these ranks' parts (a node's own directory holds no others');
    files no manifest lists then go unnoticed. ``need_commit``: a missing commit record is a problem.
    ``share`` (i, n): read the data of every n-th listed file from the i-th only (in name order), the others'
    sizes checked, so that n processes together read each file once.
    """
    tag_dir = os.path.join(ckpt_dir, ckpt.tag)
    try:
        meta = read_metadata(tag_dir, ranks)
        files = _files(tag_dir)
    except OSError as err:
        return [f"{tag_dir}: unreadable: {cause(err)}"]
    if ckpt.kind == "deepspeed":
        if not read_data:
            return []
        return [p for rel in _data_files(files) for p in _check_file(os.path.join(tag_dir, rel), None, read_data)]
    if not meta.found:
        return [f"{ckpt.tag}: no manifest, snapshot files only (partial checkpoint)"]
    part = meta.commit.get("ranks") if meta.commit else None
    if part is not None:
        # A checkpoint of some stages: the other ranks wrote nothing into it, what they left is not its.
        ranks = sorted(set(part) if ranks is None else set(part) & set(ranks))
        meta.manifests = {r: m for r, m in meta.manifests.items() if r in ranks}
        meta.present &= set(ranks)
    problems = meta.problems + _incomplete(ckpt.tag, meta, ranks, need_commit)
    listed = {rel: (entry, man["checksum"]) for man in meta.manifests.values() for rel, entry in man["files"].items()}
    left = {rel for man in meta.stale.values() for rel in man["files"]}
    if not problems and ranks is None:
        # Every manifest is there and sound, so together they list every file of the checkpoint.
        problems += [f"{os.path.join(tag_dir, rel)}: listed in no rank manifest"
                     for rel in _data_files(files) if rel not in listed and rel not in left]
        if not listed:
            problems.append(f"{ckpt.tag}: the manifests list no files")
    for i, (rel, (entry, algorithm)) in enumerate(sorted(listed.items())):
        mine = share is None or i % share[1] == share[0]
        problems += _check_file(os.path.join(tag_dir, rel), entry, read_data and mine, algorithm)
    return problems


def verify_data(ckpt_dir: str, tag: str, share: Optional[tuple[int, int]] = None) -> list[str]:
    """:func:`verify` of checkpoint ``tag`` reading its data (``share``: that part of its files); [] for one in
    DeepSpeed's format, whose files :func:`loadable_checkpoints` opened already."""
    try:
        ckpt = describe(os.path.join(ckpt_dir, tag), tag)
    except OSError as err:
        return [f"{os.path.join(ckpt_dir, tag)}: unreadable: {cause(err)}"]
    if ckpt is None:
        return [f"{os.path.join(ckpt_dir, tag)}: no checkpoint there"]
    return [] if ckpt.kind == "deepspeed" else verify(ckpt_dir, ckpt, read_data=True, share=share)


def _incomplete(tag: str, meta: Metadata, ranks: Optional[Collection[int]] = None,
                need_commit: bool = True) -> list[str]:
    """Ranks (of ``ranks``, None: of the world) missing, disagreeing or giving up, and a missing commit record."""
    world = meta.commit["world_size"] if meta.commit else max(
        (m["world_size"] for m in meta.manifests.values()), default=0)
    expected = range(world) if ranks is None else sorted(ranks)
    problems = [f"{tag}: rank {r} manifest {manifest_name(r)} missing (partial checkpoint)"
                for r in expected if r not in meta.present]
    for r, man in sorted(meta.manifests.items()):
        if man["world_size"] != world:
            problems.append(f"{tag}: rank {r} manifest says world size {man['world_size']}, not {world}")
        if man["failed"]:
            problems.append(f"{tag}: rank {r} gave the checkpoint up: {man['failed']}")
    if need_commit and not meta.committed:
        problems.append(f"{tag}: not committed ({COMMIT} missing)")
    return problems


def _check_file(path: str, entry: Optional[dict], read_data: bool, algorithm: str = "xxh3_64") -> list[str]:
    """Problems of one file: its size against ``entry`` and the non-finite tensors it lists; with
    ``read_data`` also its checksum and every floating tensor (``entry`` None: DeepSpeed's format).
    """
    nonfinite = set(entry["nonfinite"]) if entry else set()
    try:
        if read_data:
            nonfinite.update(scan_file(path, entry, algorithm))
        elif entry is not None:
            check_size(path, os.path.getsize(path), entry)
    except FileNotFoundError:
        return [f"{path}: missing"]
    except CheckpointError as err:
        return [str(err)]
    except OSError as err:
        return [f"{path}: unreadable: {cause(err)}"]
    return [f"{path}: non-finite values in {name}" for name in sorted(nonfinite)]


def list_checkpoints(ckpt_dir: str, read_data: bool = True, ranks: Optional[Collection[int]] = None) -> list[Checkpoint]:
    """All checkpoints, oldest first, each verified (the parts of ``ranks``, None: every rank's); those in
    DeepSpeed's format count as committed when ``latest`` names them or a newer checkpoint (DeepSpeed moves it
    only after a complete save)."""
    found = scan(ckpt_dir)
    latest = read_latest(ckpt_dir)
    named = next((c for c in found if c.tag == latest), None)
    for c in found:
        if c.kind == "deepspeed":
            c.committed = named is not None and c.key <= named.key
        if c.kind == "cpsr" or c.committed:
            c.problems = verify(ckpt_dir, c, read_data, ranks)
    return found


def loadable_checkpoints(ckpt_dir: str, read_data: bool = True) -> list[Checkpoint]:
    """The valid checkpoints, oldest first; each rejected one newer than the newest valid is logged.

    Checkpoints in DeepSpeed's format are opened and checked even without ``read_data``:
    nothing else vouches for them. Every rank reaches the same answer from the same
    shared directory, so no collective is needed.
    """
    found = list_checkpoints(ckpt_dir, read_data)
    if not read_data:
        for c in found:
            if c.kind == "deepspeed" and c.committed:
                c.problems = verify(ckpt_dir, c, read_data=True)
    for c in reversed(found):
        if c.valid:
            break
        if c.problems:
            log.error("checkpoint %s is not loadable, falling back to an older one: %s", c.tag, "; ".join(c.problems))
    return [c for c in found if c.valid]


def select_checkpoint(ckpt_dir: str, read_data: bool = True) -> Optional[str]:
    """The tag to load: the newest valid full cut (every rank's part), or None when there is none."""
    valid = [c for c in loadable_checkpoints(ckpt_dir, read_data) if c.full]
    return valid[-1].tag if valid else None
