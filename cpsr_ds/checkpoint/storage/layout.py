"""The per-node layout: where each rank's part of a checkpoint goes, and how rank 0's word on it reaches every rank.

``checkpoint.storage`` ``shared``: one directory every rank writes into; rank 0 reads the
manifests there and alone commits (committing.py) and applies retention. ``node_local``:
one directory per node (topology.py); the manifests' summaries and rank 0's
:class:`CommitVerdict` go through torch.distributed's key-value store (thread-safe, so the
committers' threads use it beside training's collectives), each rank's part is copied to
the next node (replica.py), and each node's lowest rank writes its node's commit record and
``latest`` once every part is there. So a committed checkpoint is on two nodes; one whose
replication fails or is not confirmed within ``commit_timeout_s`` is not committed.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from cpsr_ds.checkpoint.storage import records, replica
from cpsr_ds.checkpoint.storage.filesystem import POLL_S
from cpsr_ds.checkpoint.storage.topology import Nodes, found_nodes, verify_storage
from cpsr_ds.config import CheckpointConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommitVerdict:
    """Rank 0's word on a checkpoint: its commit ``record``, or None and why it was given up."""

    record: Optional[dict] = None
    reason: str = ""

class SharedLayout:
    """One directory every rank sees: the manifests are there, rank 0 commits alone."""

    storage = "shared"

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.nodes = Nodes.single(world_size)
        self.retention_ranks = None

    @property
    def commits(self) -> bool:
        """Whether this rank runs a committer."""
        return self.rank == 0

    @property
    def decides(self) -> bool:
        return self.rank == 0

    @property
    def writes_commit(self) -> bool:
        return self.rank == 0

    @property
    def record_commits(self) -> bool:
        """Whether writing the commit record is the commit (else rank 0's decision is)."""
        return True

    def publish(self, job_key: str, manifest: dict) -> None:
        """The manifest on the shared directory is all rank 0 needs."""

    def parts(self, job_key: str, tag_dir: str) -> dict[int, dict]:
        """Every rank's manifest (or summary) of a checkpoint that is there so far, by rank."""
        return records.read_manifests(tag_dir)

    def announce(self, job_key: str, decision: CommitVerdict) -> None:
        """Only rank 0 acts on its decisions here."""

    def decision(self, job_key: str) -> Optional[CommitVerdict]:
        raise AssertionError("with shared storage only rank 0 commits")

    def replicate(self, job_key: str, tag: str, ckpt_dir: str, record: dict) -> None:
        """Rank 0 decided to commit ``tag``: nothing to copy with one shared copy."""

    def replicated(self, job_key: str) -> bool:
        """Whether every rank's part is on the next node too, as the commit needs."""
        return True

    def replication_failed(self, job_key: str) -> Optional[str]:
        """Why a part of the checkpoint could not be replicated; None while none failed."""
        return None

    def close(self, timeout_s: float) -> bool:
        """Finish the work left after the commits, for at most ``timeout_s``; whether it finished."""
        return True

    def release(self, timeout_s: float) -> None:
        """This rank's checkpoints need the job no more (at exit, whether they finished or not)."""


class NodeLocalLayout(SharedLayout):
    """One directory per node; manifests' summaries and decisions go through ``kv`` (a torch.distributed Store)."""

    storage = "node_local"

    def __init__(self, rank: int, nodes: Nodes, kv, replicator=None):
        self.rank = rank
        self.nodes = nodes
        self.retention_ranks = nodes.ranks(nodes.node_of(rank))
        self._kv = kv
        self._replicator = replicator

    @property
    def commits(self) -> bool:
        # Every rank follows rank 0's decisions: its node's records and its replica depend on them.
        return True

    @property
    def writes_commit(self) -> bool:
        return self.nodes.leads(self.rank)

    @property
    def record_commits(self) -> bool:
        return False

    def _key(self, job_key: str, what: str) -> str:
        return f"cpsr/{self.nodes.run}/{job_key}/{what}"

    def publish(self, job_key: str, manifest: dict) -> None:
        # What the committer decides by, not the file list: the store holds it in memory.
        summary = {"failed": manifest.get("failed"),
                   "files": {rel: {"nonfinite": e["nonfinite"]} for rel, e in manifest["files"].items()
                             if e.get("nonfinite")}}
        self._kv.set(self._key(job_key, f"rank{self.rank}"), json.dumps(summary))

    def parts(self, job_key: str, tag_dir: str) -> dict[int, dict]:
        keys = {r: self._key(job_key, f"rank{r}") for r in range(self.nodes.world_size)}
        return {r: json.loads(self._kv.get(key)) for r, key in keys.items() if self._kv.check([key])}

    def announce(self, job_key: str, decision: CommitVerdict) -> None:
        self._kv.set(self._key(job_key, "decision"), json.dumps({"record": decision.record, "reason": decision.reason}))
        for r in range(self.nodes.world_size):
            self._kv.delete_key(self._key(job_key, f"rank{r}"))

    def decision(self, job_key: str) -> Optional[CommitVerdict]:
        key = self._key(job_key, "decision")
        if not self._kv.check([key]):
            return None
        return CommitVerdict(**json.loads(self._kv.get(key)))

    def replicate(self, job_key: str, tag: str, ckpt_dir: str, record: dict) -> None:
        if self._replicator is not None:
            self._replicator.submit(tag, ckpt_dir, record, lambda error: self._confirm(job_key, error))

    def _confirm(self, job_key: str, error: Optional[str]) -> None:
        """This rank's replication of the checkpoint done (``error`` None) or failed, for every node's lead to see."""
        if error is None:
            self._kv.add(self._key(job_key, "replicated"), 1)
        else:
            self._kv.set(self._key(job_key, "replication_failed"), f"rank {self.rank}: {error}")

    def replicated(self, job_key: str) -> bool:
        # Every rank sends its part and receives the node before's, so all ranks' word covers every part.
        return self._replicator is None or self._kv.add(self._key(job_key, "replicated"), 0) == self.nodes.world_size

    def replication_failed(self, job_key: str) -> Optional[str]:
        key = self._key(job_key, "replication_failed")
        if self._replicator is None or not self._kv.check([key]):
            return None
        return self._kv.get(key).decode()

    def close(self, timeout_s: float) -> bool:
        return self._replicator is None or self._replicator.stop(timeout_s)

    def release(self, timeout_s: float) -> None:
        """Say so in the store; rank 0 then waits, for at most ``timeout_s``, until every rank has.

        DeepSpeed's launch starts the store in rank 0's process: had rank 0 ended right after its
        last commit, a rank still polling for that decision or its replicas' confirmation would
        lose the store and leave its node without the record and ``latest`` of a committed checkpoint.
        Once replication broke (a node lost) nothing commits any more, and a rank that lost the store
        keeps its part all the same: rank 0 waits for nobody then.
        """
        key = f"cpsr/{self.nodes.run}/released"
        broken = self._replicator is not None and self._replicator.broken
        try:
            released = self._kv.add(key, 1)
            deadline = time.monotonic() + timeout_s
            while self.decides and not broken and released < self.nodes.world_size:
                if time.monotonic() >= deadline:
                    log.warning("%d of %d ranks' checkpoints still needed the job after %.1f s; this process "
                                "ends without them", self.nodes.world_size - released, self.nodes.world_size,
                                timeout_s)
                    return
                time.sleep(POLL_S)
                released = self._kv.add(key, 0)
        except RuntimeError as err:  # torch's DistError: the store's process ended, nobody to wait for
            log.info("the job's store is gone (%s); nothing to release", err)


def make_layout(cfg: CheckpointConfig, rank: int, world_size: int, *, kv=None, nodes: Optional[Nodes] = None):
    """The layout ``cfg.storage`` names; node_local learns the nodes from :func:`verify_storage` by default."""
    if cfg.storage == "shared":
        return SharedLayout(rank, world_size)
    nodes = nodes or found_nodes(cfg.dir) or verify_storage(cfg)
    if kv is None:
        kv = dist.distributed_c10d._get_default_store()
    channel = replica.channel()
    replicator = (replica.Replicator(channel, nodes, rank, cfg.keep_last)
                  if channel is not None and len(nodes.groups) > 1 else None)
    return NodeLocalLayout(rank, nodes, kv, replicator)

