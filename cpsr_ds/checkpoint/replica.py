"""Replicas: with node-local storage each rank's committed part also lives on the next node.

Once rank 0 has decided to commit a checkpoint, each rank's :class:`Replicator` sends
its part (manifest, the files it lists, the commit record) to its peer on the next node, ``(node + 1) % nodes``, which
keeps it under ``CKPT_DIR/replicas/TAG``: a checkpoint directory of its own, never
taken for the node's own checkpoints (store.scan skips it), verified with the same
manifests and checksums, and retained alike. At recovery a rank whose own part is gone
gets it back from there (:func:`restore`) before DeepSpeed loads it.

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
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from cpsr_ds.checkpoint import store

log = logging.getLogger(__name__)

CHUNK = 64 << 20
# DeepSpeed's loader counts every model-parallel rank's file of these and reads the first, whichever rank loads.
SHARED_FILE_RE = re.compile(r"^mp_rank_\d+_model_states\.pt$")
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
    return os.path.join(ckpt_dir, store.REPLICAS)


def _send_part(group, ckpt_dir: str, tag: str, owner: int, dst: int, record: Optional[dict],
               only: Optional[re.Pattern] = None) -> None:
    """``owner``'s part of ``tag`` in ``ckpt_dir`` to ``dst`` (``only``: the files whose names match, listed
    alone in the manifest sent); a part that is gone goes as an empty one."""
    tag_dir = os.path.join(ckpt_dir, tag)
    try:
        manifest = store.read_manifests(tag_dir).get(owner)
        record = record or store.read_commit(tag_dir)
    except (OSError, ValueError) as err:
        log.error("checkpoint %s: rank %d's part not replicated: %s", tag, owner, err)
        manifest = None
    files = [rel for rel in sorted(manifest["files"]) if only is None or only.match(os.path.basename(rel))] \
        if manifest else []
    if manifest is not None:
        manifest = {**manifest, "files": {rel: manifest["files"][rel] for rel in files}}
    header = {"tag": tag, "rank": owner, "manifest": manifest, "record": record, "files": files}
    dist.send_object_list([header], dst=dst, group=group)
    for rel in files:
        _send_file(group, os.path.join(tag_dir, rel), manifest["files"][rel]["size"], dst)


def _send_file(group, path: str, size: int, dst: int) -> None:
    """``size`` bytes of ``path`` in chunks; zeros where it is shorter (the receiver's checksum then tells)."""
    with open(path, "rb") if os.path.exists(path) else open(os.devnull, "rb") as f:
        for start in range(0, size, CHUNK):
            n = min(CHUNK, size - start)
            data = bytearray(n)
            f.readinto(data)
            dist.send(torch.frombuffer(data, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8),
                      dst=dst, group=group)


def _chunks(group, size: int, src: int) -> Iterator[torch.Tensor]:
    for start in range(0, size, CHUNK):
        buf = torch.empty(min(CHUNK, size - start), dtype=torch.uint8)
        dist.recv(buf, src=src, group=group)
        yield buf.numpy()


def _receive_part(group, src: int, into: str) -> Optional[str]:
    """Write the part ``src`` sends into ``into``/TAG; returns the tag, None for an empty part."""
    box = [None]
    dist.recv_object_list(box, src=src, group=group)
    header = box[0]
    if header["manifest"] is None:
        return None
    tag_dir = os.path.join(into, header["tag"])
    os.makedirs(tag_dir, exist_ok=True)
    for rel in header["files"]:
        path = os.path.join(tag_dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        store.write_atomic(path, _chunks(group, header["manifest"]["files"][rel]["size"], src))
    store.write_json_atomic(os.path.join(tag_dir, store.manifest_name(header["rank"])), header["manifest"])
    if header["record"] is not None:
        store.write_json_atomic(os.path.join(tag_dir, store.COMMIT), header["record"])
    return header["tag"]


class Replicator:
    """This rank's replicating thread: its committed parts to the next node, the node before's parts into its own."""

    def __init__(self, group, nodes, rank: int, keep_last: int):
        self._group = group
        self.rank = rank
        self.keep_last = keep_last
        self._dst, self._srcs = peers(nodes, rank)
        self._keeps = nodes.ranks(nodes.node_of(rank) - 1)
        self._queue: queue.Queue = queue.Queue()
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
        broken = None
        for tag, ckpt_dir, record, done in iter(self._queue.get, None):
            if broken is None:
                try:
                    self._replicate(tag, ckpt_dir, record)
                except Exception as err:
                    # The peer died or its storage failed. Sends and receives pair up only while every
                    # rank replicates the same checkpoints, so no later one is tried either.
                    broken = f"replication to rank {self._dst} stopped at checkpoint {tag}: {err}"
                    log.error("%s; no checkpoint commits from now on", broken)
            done(broken)

    def _replicate(self, tag: str, ckpt_dir: str, record: dict) -> None:
        # Sends first: gloo buffers them, so a ring of ranks all sending then receiving does not deadlock.
        sending = threading.Thread(target=_send_part,
                                   args=(self._group, ckpt_dir, tag, self.rank, self._dst, record), daemon=True)
        sending.start()
        kept = replica_dir(ckpt_dir)
        for src in self._srcs:
            _receive_part(self._group, src, kept)
        sending.join()
        store.apply_retention(kept, self.keep_last, lambda t: False, ranks=self._keeps)
        log.info("checkpoint %s: rank %d's part replicated to rank %d", tag, self.rank, self._dst)


def restore(ckpt_dir: str, rank: int, agreed: list) -> None:
    """Collective at recovery: each part an owner lacks comes back from the rank keeping its replica."""
    moves = sorted((a.tag, owner, holder) for a in agreed for owner, holder in a.sources.items())
    if not moves:
        return
    group = channel()
    for tag, owner, holder in moves:
        if rank == holder:
            _send_part(group, replica_dir(ckpt_dir), tag, owner, owner, None)
        elif rank == owner:
            _receive_part(group, holder, ckpt_dir)
            log.warning("checkpoint %s: rank %d's own part was gone or damaged, restored from the replica on rank %d",
                        tag, rank, holder)



def share_model_states(ckpt_dir: str, rank: int, nodes, tags: list[str]) -> None:
    """Collective at recovery: each node's lowest rank gets the other nodes' ranks' model-states files of ``tags``
    (SHARED_FILE_RE), with manifests listing them alone, so that DeepSpeed loads from any node's directory."""
    for tag in tags:
        for owner in range(sum(map(len, nodes.groups))):
            for node in range(len(nodes.groups)):
                dst = nodes.ranks(node)[0]
                if node == nodes.node_of(owner):
                    continue
                if rank == owner:
                    _send_part(channel(), ckpt_dir, tag, owner, dst, None, only=SHARED_FILE_RE)
                elif rank == dst:
                    _receive_part(channel(), owner, ckpt_dir)
