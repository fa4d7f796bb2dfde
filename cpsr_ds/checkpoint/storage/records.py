"""The records of a checkpoint directory: their schemas, and reading them back without trusting them.

A rank's manifest lists its files (size, digest, non-finite tensors), the commit record
says rank 0 saw every rank's manifest, a progress line says one file landed, ``latest``
names a tag. Nothing read from storage is trusted: a damaged record raises
:class:`MetadataError` naming the file and what is wrong (strict schemas: a value of
the wrong type is damage, not something to coerce), and ``latest`` damaged reads as none.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Collection, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cpsr_ds.checkpoint.storage.filesystem import cause
from cpsr_ds.checkpoint.storage.fileformat import CheckpointError
from cpsr_ds.checkpoint.storage.ondisk import COMMIT, LATEST, MANIFEST_RE, manifest_name
from cpsr_ds.config import CheckpointConfig

log = logging.getLogger(__name__)

_MAX_TAG = 4096
Checksum = CheckpointConfig.model_fields["checksum"].annotation  # the algorithms the config allows


class MetadataError(CheckpointError, ValueError):
    """A damaged manifest or commit record; the message names the file and what is wrong."""


class _Record(BaseModel):
    # Strict: a value of the wrong type is damage, not something to coerce.
    model_config = ConfigDict(extra="allow", strict=True)

    tag: str
    world_size: int = Field(gt=0)
    iteration: Optional[int] = None
    attempt: int = Field(0, ge=0)


class CommitRecord(_Record):
    """``cpsr_commit.json``: rank 0 saw every rank's manifest. Other keys (``started_ns``) are information only.

    ``ranks`` and ``stages``: the ranks, and their pipeline stages, whose parts a checkpoint
    of some stages holds (``checkpoint.per_stage``); absent: every rank's (a full cut).
    """

    ranks: Optional[list[int]] = None
    stages: Optional[list[int]] = None

    @model_validator(mode="after")
    def _ranks_in_world(self) -> "CommitRecord":
        outside = [r for r in self.ranks or () if not 0 <= r < self.world_size]
        if outside:
            raise ValueError(f"ranks {outside} not in a world of {self.world_size}")
        return self


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    size: int = Field(ge=0)
    digest: str
    # Key paths of the floating tensors that held NaN or Inf when the file was written.
    nonfinite: list[str] = []


class Manifest(_Record):
    """``cpsr_manifest.rankNNNNN.json``: the files one rank wrote, all durable before it."""

    rank: int = Field(ge=0)
    checksum: Checksum
    files: dict[str, FileEntry]
    # Why the rank gave the checkpoint up; rank 0 then gives it up without waiting.
    failed: Optional[str] = None

    @field_validator("files")
    @classmethod
    def _inside_the_checkpoint(cls, files: dict) -> dict:
        for rel in files:
            _inside_the_checkpoint(rel)
        return files

    @model_validator(mode="after")
    def _rank_in_world(self) -> "Manifest":
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} not below world_size {self.world_size}")
        return self


class ProgressLine(FileEntry):
    """One line of ``cpsr_progress.rankNNNNN.jsonl``: a file that landed, with the entry its manifest will list."""

    attempt: int = Field(ge=0)
    checksum: Checksum
    file: str

    @field_validator("file")
    @classmethod
    def _inside_the_checkpoint(cls, rel: str) -> str:
        return _inside_the_checkpoint(rel)


def _inside_the_checkpoint(rel: str) -> str:
    if os.path.isabs(rel) or os.path.normpath(rel).split(os.sep)[0] in ("..", "."):
        raise ValueError(f"{rel!r} is not a path inside the checkpoint")
    return rel


def _read_record(path: str, schema: type[BaseModel]) -> dict:
    """The record in ``path``, checked against ``schema``; FileNotFoundError if absent, MetadataError if damaged."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise
    except OSError as err:
        raise MetadataError(f"{path}: unreadable: {cause(err)}") from None
    try:
        return schema.model_validate_json(raw).model_dump()
    except ValidationError as err:
        what = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" if e["loc"] else e["msg"]
                         for e in err.errors())
        raise MetadataError(f"{path}: damaged: {what}") from None


def _read_manifest(path: str, rank: int) -> dict:
    man = _read_record(path, Manifest)
    if man["rank"] != rank:
        raise MetadataError(f"{path}: damaged: says rank {man['rank']}")
    return man


@dataclass
class Metadata:
    """A tag directory's manifests and commit record; damaged ones are problems."""

    manifests: dict[int, dict] = field(default_factory=dict)  # the sound ones, by rank
    present: set[int] = field(default_factory=set)            # ranks with a manifest file, sound or not
    commit: Optional[dict] = None
    committed: bool = False                                   # a commit record is there, sound or not
    problems: list[str] = field(default_factory=list)
    # Manifests an earlier attempt's larger world left under a tag the committed attempt wrote again: not its.
    stale: dict[int, dict] = field(default_factory=dict)

    @property
    def found(self) -> bool:
        return bool(self.present) or self.committed


def read_manifest_files(tag_dir: str, ranks: Optional[Collection[int]] = None) -> Metadata:
    """The manifests of ``ranks`` (None: of every rank) in ``tag_dir``."""
    meta = Metadata()
    for name in os.listdir(tag_dir):
        m = MANIFEST_RE.match(name)
        if not m or (ranks is not None and int(m.group(1)) not in ranks):
            continue
        rank = int(m.group(1))
        try:
            meta.manifests[rank] = _read_manifest(os.path.join(tag_dir, name), rank)
        except FileNotFoundError:  # deleted while we looked
            continue
        except MetadataError as err:
            meta.problems.append(str(err))
        meta.present.add(rank)
    return meta


def read_metadata(tag_dir: str, ranks: Optional[Collection[int]] = None) -> Metadata:
    """The manifests of ``ranks`` (None: of every rank) and the commit record in ``tag_dir``, less the manifests
    an earlier attempt's larger world left there."""
    meta = read_manifest_files(tag_dir, ranks)
    try:
        meta.commit = read_commit(tag_dir)
        meta.committed = meta.commit is not None
    except MetadataError as err:
        meta.problems.append(str(err))
        meta.committed = True
    if meta.commit is not None:
        # A restart on fewer ranks writes a tag again; each rank forgets only its own earlier manifest.
        world, attempt = meta.commit["world_size"], meta.commit.get("attempt", 0)
        meta.stale = {r: m for r, m in meta.manifests.items() if r >= world and m.get("attempt", 0) != attempt}
        meta.manifests = {r: m for r, m in meta.manifests.items() if r not in meta.stale}
        meta.present -= set(meta.stale)
    return meta


def read_manifests(tag_dir: str) -> dict[int, dict]:
    """Every rank manifest in ``tag_dir``, by rank; a damaged one raises :class:`MetadataError` naming it."""
    try:
        meta = read_manifest_files(tag_dir)
    except FileNotFoundError:
        return {}
    if meta.problems:
        raise MetadataError(meta.problems[0])
    return meta.manifests


def manifest_entry(manifests: dict[int, dict], tag_dir: str, path: str) -> Optional[tuple[dict, str]]:
    """The manifest entry of ``path`` and the checksum algorithm that made it, if any rank lists it."""
    rel = os.path.relpath(path, tag_dir)
    for man in manifests.values():
        if rel in man["files"]:
            return man["files"][rel], man["checksum"]
    return None


def forget_metadata(tag_dir: str, rank: int) -> None:
    """Remove what an earlier run left under a tag for ``rank`` (its manifest; on rank 0 the commit record),
    so that it cannot be mistaken for this run's."""
    for name in [manifest_name(rank)] + ([COMMIT] if rank == 0 else []):
        try:
            os.unlink(os.path.join(tag_dir, name))
        except FileNotFoundError:
            pass
        except OSError as err:
            log.warning("%s: could not remove the stale %s: %s", tag_dir, name, cause(err))


def read_latest(ckpt_dir: str) -> Optional[str]:
    """The tag ``latest`` names; None when it is missing, or damaged (logged with its path and what is wrong)."""
    path = os.path.join(ckpt_dir, LATEST)
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_TAG + 1)
    except FileNotFoundError:
        return None
    except OSError as err:
        problem = f"unreadable: {cause(err)}"
    else:
        problem = _tag_problem(raw)
    if problem:
        log.warning("%s: damaged, ignored: %s", path, problem)
        return None
    return raw.decode().strip()


def _tag_problem(raw: bytes) -> Optional[str]:
    """What makes the content of ``latest`` no tag, if anything."""
    try:
        tag = raw.decode().strip()
    except UnicodeDecodeError:
        return f"not text: {raw[:40]!r}"
    if len(raw) > _MAX_TAG:
        return f"longer than {_MAX_TAG} bytes"
    if not tag:
        return "empty"
    if tag in (".", "..") or tag.startswith(".") or "/" in tag or "\0" in tag:
        return f"{tag!r} is not a checkpoint tag"
    return None


def read_commit(tag_dir: str) -> Optional[dict]:
    """The commit record of ``tag_dir``; None if there is none, :class:`MetadataError` if it is damaged."""
    try:
        return _read_record(os.path.join(tag_dir, COMMIT), CommitRecord)
    except FileNotFoundError:
        return None
