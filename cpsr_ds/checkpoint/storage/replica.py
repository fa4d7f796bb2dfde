"""Replicas: with node-local storage each rank's part of a checkpoint also lives on the next node.

Once rank 0 has decided to commit a checkpoint, each rank's :class:`Replicator` sends
its part (manifest, the files it lists, rank 0's commit record) to its peer on the next
node, ``(node + 1) % nodes``, and the checkpoint commits once every rank's has arrived
(layout.py). The peer keeps it under ``CKPT_DIR/replicas/TAG``: a checkpoint directory
of its own, never taken for the node's own checkpoints (catalog.scan skips it), verified
with the same manifests and checksums, and retained alike. At recovery, before DeepSpeed loads, each
node gets the parts it lacks (its ranks' own; on a job of another world size, every
rank's) from its replicas or from the node holding them (:func:`restore`); a checkpoint
whose parts could not all be written there (a full disk) is left out on every rank.

The transfer uses a gloo process group made at start for this alone
(:func:`open_channel`) and used only by the replicating thread, and at recovery, before
any replication, by the main thread: collectives of training on the default group
would interleave with a background thread's messages there, and a checkpoint's
files, gigabytes on a real model, are too big for the key-value store. Every rank
replicates the same commits in the same order, so sends and receives pair up.
"""

from __future__ import annotations

import datetime
import logging
import os
import queue
import re
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from cpsr_ds.checkpoint.storage import catalog, filesystem, ondisk, records, retention
from cpsr_ds.checkpoint.storage.filesystem import fs
from cpsr_ds.checkpoint.capture.exiting import RestartCannotHelp

log = logging.getLogger(__name__)

CHUNK = 64 << 20
# DeepSpeed's loader counts every model-parallel rank's file of these and reads the first, whichever rank loads.
SHARED_FILE_RE = re.compile(r"^mp_rank_\d+_model_states\.pt$")
# A manifest key: the manifest lists its rank's SHARED_FILE_RE files alone, not its whole part.
PARTIAL = "partial"
# A peer busy writing a previous checkpoint's files may take this long to take the next.
TIMEOUT = datetime.timedelta(minutes=30)


_channel = None


def open_channel():
    """Collective, at start: the process group replication and restoring use."""
    global _channel
    _channel = dist.new_group(backend="gloo", timeout=TIMEOUT)
    return _channel


def channel():
    """The group :func:`open_channel` made; None before."""
    return _channel


def peers(nodes, rank: int) -> tuple[int, list[int]]:
    """(the rank on the next node that keeps ``rank``'s replicas, the ranks of the node before whose ``rank`` keeps)."""

    def target(r: int) -> int:
        node = nodes.node_of(r)
        nxt = nodes.ranks(node + 1)
        return nxt[nodes.ranks(node).index(r) % len(nxt)]

    before = nodes.ranks(nodes.node_of(rank) - 1)
    return target(rank), [r for r in before if target(r) == rank]


def replica_dir(ckpt_dir: str) -> str:
    return os.path.join(ckpt_dir, ondisk.REPLICAS)


def _part(ckpt_dir: str, tag: str, owner: int, record: Optional[dict], only: Optional[re.Pattern]) -> dict:
    """What goes of ``owner``'s part of ``tag`` in ``ckpt_dir``: the manifest (``only``: listing the files whose
    names match alone, marked PARTIAL), the commit record, the files; a part that is gone goes as an empty one."""
    tag_dir = os.path.join(ckpt_dir, tag)
    try:
        manifest = records.read_manifests(tag_dir).get(owner)
        record = record or records.read_commit(tag_dir)
    except (OSError, ValueError) as err:
        log.error("checkpoint %s: rank %d's part in %s unreadable: %s", tag, owner, ckpt_dir, err)
        manifest = None
    files = [rel for rel in sorted(manifest["files"]) if only is None or only.match(os.path.basename(rel))] \
        if manifest else []
    if manifest is not None:
        manifest = {**manifest, "files": {rel: manifest["files"][rel] for rel in files}}
        if only is not None:
            manifest[PARTIAL] = True
    return {"tag": tag, "rank": owner, "manifest": manifest, "record": record, "files": files}


def _send_part(group, ckpt_dir: str, tag: str, owner: int, dst: int, record: Optional[dict],
               only: Optional[re.Pattern] = None) -> None:
    """``owner``'s part of ``tag`` in ``ckpt_dir`` to ``dst`` (:func:`_part`)."""
    header = _part(ckpt_dir, tag, owner, record, only)
    dist.send_object_list([header], dst=dst, group=group)
    for rel in header["files"]:
        _send_file(group, os.path.join(ckpt_dir, tag, rel), header["manifest"]["files"][rel]["size"], dst)


def _file_chunks(path: str, size: int) -> Iterator[bytearray]:
    """``size`` bytes of ``path`` in chunks; zeros where it is shorter (the receiver's checksum then tells)."""
    with open(path, "rb") if os.path.exists(path) else open(os.devnull, "rb") as f:
        for start in range(0, size, CHUNK):
            data = bytearray(min(CHUNK, size - start))
            f.readinto(data)
            yield data


def _send_file(group, path: str, size: int, dst: int) -> None:
    for data in _file_chunks(path, size):
        dist.send(torch.frombuffer(data, dtype=torch.uint8), dst=dst, group=group)


def _chunks(group, size: int, src: int) -> Iterator[torch.Tensor]:
    for start in range(0, size, CHUNK):
        buf = torch.empty(min(CHUNK, size - start), dtype=torch.uint8)
        dist.recv(buf, src=src, group=group)
        yield buf.numpy()


def _write_part(into: str, header: dict, contents: Callable[[str, int], Iterator]) -> Optional[str]:
    """Write the part ``header`` describes into ``into``/TAG, each file's ``contents(rel, size)`` first, then the
    manifest and the commit record; returns the tag, None for an empty part."""
    if header["manifest"] is None:
        return None
    tag_dir = os.path.join(into, header["tag"])
    os.makedirs(tag_dir, exist_ok=True)
    for rel in header["files"]:
        path = os.path.join(tag_dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fs.write_atomic(path, contents(rel, header["manifest"]["files"][rel]["size"]))
    fs.write_json_atomic(os.path.join(tag_dir, ondisk.manifest_name(header["rank"])), header["manifest"])
    if header["record"] is not None:
        fs.write_json_atomic(os.path.join(tag_dir, ondisk.COMMIT), header["record"])
    return header["tag"]


def _receive_part(group, src: int, into: str) -> Optional[str]:
    """Write the part ``src`` sends into ``into``/TAG; returns the tag, None for an empty part. Where writing
    fails, the rest of what ``src`` sends is received all the same (the sends and receives stay paired)."""
    box = [None]
    dist.recv_object_list(box, src=src, group=group)
    header = box[0]
    files = header["manifest"]["files"] if header["manifest"] is not None else {}
    incoming = {rel: _chunks(group, files[rel]["size"], src) for rel in header["files"]}
    try:
        return _write_part(into, header, lambda rel, size: incoming[rel])
    except OSError:
        for chunks in incoming.values():  # each generator goes on where writing stopped
            for _ in chunks:
                pass
        raise


def _copy_part(ckpt_dir: str, tag: str, owner: int, into: str, only: Optional[re.Pattern]) -> Optional[str]:
    """``owner``'s part of ``tag`` in ``ckpt_dir`` (:func:`_part`) into ``into``/TAG on the same node."""
    header = _part(ckpt_dir, tag, owner, None, only)
    return _write_part(into, header, lambda rel, size: _file_chunks(os.path.join(ckpt_dir, tag, rel), size))


class Replicator:
    """This rank's replicating thread: its committed parts to the next node, the node before's parts into its own."""

    def __init__(self, group, nodes, rank: int, keep_last: int):
        self._group = group
        self.rank = rank
        self.keep_last = keep_last
        self._dst, self._srcs = peers(nodes, rank)
        self._keeps = nodes.ranks(nodes.node_of(rank) - 1)
        self._queue: queue.Queue = queue.Queue()
        # Why replication stopped (a peer died or its storage failed); None while it works.
        self.broken: Optional[str] = None
        self._thread = threading.Thread(target=self._run, name="cpsr-replicator", daemon=True)
        self._thread.start()

    def submit(self, tag: str, ckpt_dir: str, record: dict, done: Callable[[Optional[str]], None]) -> None:
        """Replicate ``tag``, then ``done(None)``, or ``done(why)`` where it failed."""
        self._queue.put((tag, ckpt_dir, record, done))

    def stop(self, timeout_s: float) -> bool:
        """Finish the replications submitted, for at most ``timeout_s``; whether they finished.

        A process must not end inside a transfer: tearing down gloo under it aborts the process.
        """
        self._queue.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        for tag, ckpt_dir, record, done in iter(self._queue.get, None):
            if self.broken is None:
                try:
                    self._replicate(tag, ckpt_dir, record)
                except Exception as err:
                    # The peer died or its storage failed. Sends and receives pair up only while every
                    # rank replicates the same checkpoints, so no later one is tried either.
                    self.broken = f"replication to rank {self._dst} stopped at checkpoint {tag}: {err}"
                    log.error("%s; no checkpoint commits from now on", self.broken)
            done(self.broken)

    def _replicate(self, tag: str, ckpt_dir: str, record: dict) -> None:
        # Sends first: gloo buffers them, so a ring of ranks all sending then receiving does not deadlock.
        sending = threading.Thread(target=_send_part,
                                   args=(self._group, ckpt_dir, tag, self.rank, self._dst, record), daemon=True)
        sending.start()
        kept = replica_dir(ckpt_dir)
        for src in self._srcs:
            _receive_part(self._group, src, kept)
        sending.join()
        retention.apply_retention(kept, self.keep_last, lambda t: False, ranks=self._keeps)
        log.info("checkpoint %s: rank %d's part replicated to rank %d", tag, self.rank, self._dst)


@dataclass(frozen=True)
class Move:
    """At recovery: ``owner``'s part of ``tag`` from rank ``src``'s checkpoint directory (``replica``: its replicas)
    into rank ``dst``'s node's; ``only``: its model-states files alone (SHARED_FILE_RE)."""

    tag: str
    owner: int
    src: int
    replica: bool
    dst: int
    only: bool = False


def restore(ckpt_dir: str, rank: int, nodes, moves: list[Move]) -> dict[str, str]:
    """Collective at recovery: every rank takes its side of ``moves``, in order (agreement.placement); a part on
    the same node is copied there, one on another node comes over the channel. Returns the checkpoints that
    are not whole where they are needed, each with why (a part not written: a full disk), on every rank."""
    failed = {}
    for m in moves:
        from_dir = replica_dir(ckpt_dir) if m.replica else ckpt_dir
        only = SHARED_FILE_RE if m.only else None
        local = nodes.node_of(m.src) == nodes.node_of(m.dst)
        if rank == m.src and not local:
            _send_part(_restoring(m), from_dir, m.tag, m.owner, m.dst, None, only)
        elif rank == m.dst:
            try:
                tag = _copy_part(from_dir, m.tag, m.owner, ckpt_dir, only) if local else \
                    _receive_part(_restoring(m), m.src, ckpt_dir)
            except OSError as err:
                failed.setdefault(m.tag, f"rank {m.owner}'s part not written into {ckpt_dir} on rank {rank}'s node: "
                                          f"{filesystem.describe_error(err)}")
                log.error("checkpoint %s: %s; the checkpoint is left out", m.tag, failed[m.tag])
                continue
            if tag is not None and not m.only:
                source = ("this node's replicas" if local else f"the replica on rank {m.src}") if m.replica else \
                    f"rank {m.src}'s directory"
                log.log(logging.WARNING if m.replica else logging.INFO,
                        "checkpoint %s: the part of rank %d (of the job that wrote it) restored from %s into %s",
                        tag, m.owner, source, ckpt_dir)
    return _everyones(failed)


def whole(ckpt_dir: str, checkpoints: list[catalog.Checkpoint], lost: dict[str, str]) -> list[catalog.Checkpoint]:
    """``checkpoints`` but those :func:`restore` could not make whole (``lost``: why, by tag);
    :class:`RestartCannotHelp` where that leaves none: starting afresh would give the committed ones up."""
    kept = [c for c in checkpoints if c.tag not in lost]
    if checkpoints and not kept:
        raise RestartCannotHelp(f"cpsr recovery: no checkpoint can be restored into {ckpt_dir}: "
                                f"{'; '.join(f'{tag}: {why}' for tag, why in lost.items())}. Restarting cannot help "
                                "until that is mended (a full disk: free space there)")
    return kept


def _everyones(failed: dict[str, str]) -> dict[str, str]:
    """Every rank's ``failed``, merged (a collective on the default group, where there are several ranks)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return failed
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, failed)
    return {tag: why for ranks in reversed(found) for tag, why in ranks.items()}


def _restoring(move: Move):
    if _channel is None:
        raise RuntimeError(f"checkpoint {move.tag}: rank {move.owner}'s part is on rank {move.src}'s node, not rank "
                           f"{move.dst}'s, and no channel connects the nodes (one node found at start)")
    return _channel
