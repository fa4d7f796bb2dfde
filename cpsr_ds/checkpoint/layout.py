"""Where checkpoints live: one directory every rank shares, or one per node (``checkpoint.storage``).

``shared``: every rank writes its part and manifest into the one directory; rank 0's
committer reads the manifests there and alone writes the commit record, ``latest`` and
retention (store.py).

``node_local``: each node's ranks write into their node's own directory, and nothing
but the job connects the nodes. A rank publishes a summary of its durable manifest
(whether it gave up, its non-finite tensors) in torch.distributed's key-value store;
rank 0's committer decides from the summaries and publishes the decision; every rank
then hands its part to replication (replica.py), which copies it to the next node and
says so in the store; once every rank has, each node's lowest rank writes the commit
record into its node's directory, moves that node's ``latest`` and applies retention
there. So a committed checkpoint is on two nodes, and losing one loses none; a
checkpoint whose replication fails or is not confirmed within ``commit_timeout_s`` is
not committed (its parts stay, recovery may still use it where every part is sound).
The key-value store, not a collective: the committers run on threads of their own,
beside training's collectives, and the store is thread-safe.

A node is the set of ranks that see each other's files: :func:`verify_storage` finds
them at start, where collectives are safe, and refuses a ``shared`` directory that
is not shared.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import uuid
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from cpsr_ds.checkpoint import replica, store
from cpsr_ds.checkpoint.journal import Progress, agreed_reach, read_progress
from cpsr_ds.config import CheckpointConfig, ConfigError

log = logging.getLogger(__name__)

TOKENS = ".cpsr_ranks"  # hidden: no scan or retention looks at it


@dataclass(frozen=True)
class Nodes:
    """The ranks sharing each checkpoint directory, nodes ordered by their lowest rank; ``run``: this start's id."""

    groups: tuple[tuple[int, ...], ...]
    run: str = ""

    @staticmethod
    def single(world_size: int) -> "Nodes":
        return Nodes((tuple(range(world_size)),))

    def node_of(self, rank: int) -> int:
        return next(n for n, group in enumerate(self.groups) if rank in group)

    def ranks(self, node: int) -> tuple[int, ...]:
        return self.groups[node % len(self.groups)]

    def leads(self, rank: int) -> bool:
        """Whether ``rank`` is its node's lowest, the one that writes the node's commit records and ``latest``."""
        return rank == self.ranks(self.node_of(rank))[0]


@dataclass(frozen=True)
class Decision:
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
        return store.read_manifests(tag_dir)

    def announce(self, job_key: str, decision: Decision) -> None:
        """Only rank 0 acts on its decisions here."""

    def decision(self, job_key: str) -> Optional[Decision]:
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

    @property
    def _world_size(self) -> int:
        return sum(map(len, self.nodes.groups))

    def parts(self, job_key: str, tag_dir: str) -> dict[int, dict]:
        keys = {r: self._key(job_key, f"rank{r}") for r in range(self._world_size)}
        return {r: json.loads(self._kv.get(key)) for r, key in keys.items() if self._kv.check([key])}

    def announce(self, job_key: str, decision: Decision) -> None:
        self._kv.set(self._key(job_key, "decision"), json.dumps({"record": decision.record, "reason": decision.reason}))
        for r in range(self._world_size):
            self._kv.delete_key(self._key(job_key, f"rank{r}"))

    def decision(self, job_key: str) -> Optional[Decision]:
        key = self._key(job_key, "decision")
        if not self._kv.check([key]):
            return None
        return Decision(**json.loads(self._kv.get(key)))

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
        return self._replicator is None or self._kv.add(self._key(job_key, "replicated"), 0) == self._world_size

    def replication_failed(self, job_key: str) -> Optional[str]:
        key = self._key(job_key, "replication_failed")
        if self._replicator is None or not self._kv.check([key]):
            return None
        return self._kv.get(key).decode()

    def close(self, timeout_s: float) -> bool:
        return self._replicator is None or self._replicator.stop(timeout_s)


# ---------------------------------------------------------------- at start

_nodes: dict[str, Nodes] = {}


def _token_path(ckpt_dir: str, rank: int) -> str:
    return os.path.join(ckpt_dir, TOKENS, f"rank{rank:05d}")


def _seen(ckpt_dir: str, run: str, world_size: int) -> list[int]:
    """The ranks whose token of this start ``ckpt_dir`` holds."""
    found = []
    for r in range(world_size):
        try:
            with open(_token_path(ckpt_dir, r)) as f:
                if f.read() == run:
                    found.append(r)
        except OSError:
            continue
    return found


def group_nodes(seen: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    """The nodes from which ranks each rank sees; raises ValueError where sharing is not mutual."""
    groups = sorted({tuple(s) for s in seen})
    for rank, s in enumerate(seen):
        if rank not in s or any(seen[other] != s for other in s):
            raise ValueError(f"rank {rank} sees the files of ranks {s}, which do not all see the same")
    return tuple(groups)


def check_nodes(storage: str, ckpt_dir: str, seen: list[list[int]], run: str) -> Nodes:
    """The nodes the ranks' views of ``ckpt_dir`` make, or a ConfigError naming ``checkpoint.storage``."""
    world = len(seen)
    try:
        nodes = Nodes(group_nodes(seen), run)
    except ValueError as err:
        raise ConfigError(f"cpsr.checkpoint.storage: the checkpoint directories {ckpt_dir} are neither shared "
                          f"nor one per node: {err}") from None
    if storage == "shared" and len(nodes.groups) > 1:
        blind = next(r for r, s in enumerate(seen) if len(s) < world)
        raise ConfigError(f"cpsr.checkpoint.storage is shared, but the checkpoint directory {ckpt_dir} is not "
                          f"shared by every rank: rank {blind} sees the files of ranks {seen[blind]} only, of "
                          f"{world}; set checkpoint.storage to node_local for a directory on each node's own disk")
    return nodes


def verify_storage(cfg: CheckpointConfig) -> Nodes:
    """Collective: every rank leaves a token in its checkpoint directory and reports whose it sees."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        nodes = Nodes.single(1)
    else:
        rank, world = dist.get_rank(), dist.get_world_size()
        box = [uuid.uuid4().hex if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        run = box[0]
        path = _token_path(cfg.dir, rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        store.write_atomic(path, [run.encode()])
        dist.barrier()
        seen: list = [None] * world
        dist.all_gather_object(seen, _seen(cfg.dir, run, world))
        nodes = check_nodes(cfg.storage, cfg.dir, seen, run)
        if cfg.storage == "node_local" and len(nodes.groups) > 1:
            replica.open_channel()
    _nodes[cfg.dir] = nodes
    log.info("cpsr: checkpoint storage %s, %d node(s): %s", cfg.storage, len(nodes.groups),
             "; ".join(f"ranks {list(g)}" for g in nodes.groups))
    return nodes


def make_layout(cfg: CheckpointConfig, rank: int, world_size: int, *, kv=None, nodes: Optional[Nodes] = None):
    """The layout ``cfg.storage`` names; node_local learns the nodes from :func:`verify_storage` by default."""
    if cfg.storage == "shared":
        return SharedLayout(rank, world_size)
    nodes = nodes or _nodes.get(cfg.dir) or verify_storage(cfg)
    if kv is None:
        kv = dist.distributed_c10d._get_default_store()
    channel = replica.channel()
    replicator = (replica.Replicator(channel, nodes, rank, cfg.keep_last)
                  if channel is not None and len(nodes.groups) > 1 else None)
    return NodeLocalLayout(rank, nodes, kv, replicator)


# ---------------------------------------------------------------- at recovery


def _nodes_of(cfg: CheckpointConfig, world_size: int) -> Nodes:
    return _nodes.get(cfg.dir) or Nodes.single(world_size)


def _several() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _gathered(local) -> list:
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, local)
    return found


def combine_progress(progresses: list[Progress]) -> Progress:
    """One Progress from each node's: every rank's journal (the longest, where two nodes hold one), f the slowest's."""
    entries: dict[int, list] = {}
    for progress in progresses:
        for rank, found in progress.entries.items():
            if len(found) >= len(entries.get(rank, ())):
                entries[rank] = found
    problems = [p for progress in progresses for p in progress.problems]
    f, disagreement = agreed_reach({r: max(e.iteration for e in es) for r, es in entries.items() if es})
    return Progress(entries, f, tuple(dict.fromkeys(problems + ([disagreement] if disagreement else []))))


def agreed_progress(cfg: CheckpointConfig) -> Progress:
    """The journals' progress, f agreed by every rank (collective where the job has several ranks)."""
    progress = read_progress(cfg.dir)
    return combine_progress(_gathered(progress)) if _several() else progress


def _parts(ckpt_dir: str, rank: int, read_data: bool) -> dict[str, dict]:
    """``rank``'s part of each of our checkpoints in ``ckpt_dir``: order key, committed there, its problems."""
    return {c.tag: {"key": c.key, "committed": c.committed,
                    "problems": store.verify(ckpt_dir, c, read_data, ranks={rank}, need_commit=False)}
            for c in store.scan(ckpt_dir) if c.kind == "cpsr"}


def holdings(ckpt_dir: str, rank: int, nodes: Nodes, read_data: bool = True) -> dict:
    """What this rank can vouch for: its own parts and, on its node's lowest rank, the replicas the node keeps."""
    replicas = {}
    if nodes.leads(rank) and len(nodes.groups) > 1:
        kept = os.path.join(ckpt_dir, store.REPLICAS)
        replicas = {r: _parts(kept, r, read_data) for r in nodes.ranks(nodes.node_of(rank) - 1)}
    return {"own": _parts(ckpt_dir, rank, read_data), "replicas": replicas}


@dataclass(frozen=True)
class Agreed:
    """A checkpoint every rank can load; ``sources``: rank -> the rank keeping its replica, where its own is unusable."""

    tag: str
    key: tuple
    sources: dict


def _replica_holder(reports: list[dict], rank: int, tag: str) -> Optional[int]:
    return next((holder for holder, report in enumerate(reports)
                 if (part := report["replicas"].get(rank, {}).get(tag)) is not None and not part["problems"]), None)


def agree(reports: list[dict]) -> list[Agreed]:
    """The checkpoints committed on some node whose every rank's part is sound there or in a replica, oldest first.

    A commit record anywhere says rank 0 decided to commit, which it did once every
    rank's manifest was durable: a node that did not write its record in time still
    holds a committed part.
    """
    keys = {tag: part["key"] for report in reports for parts in [report["own"], *report["replicas"].values()]
            for tag, part in parts.items()}
    agreed = []
    for tag, key in sorted(keys.items(), key=lambda item: (item[1], item[0])):
        committed = any(parts.get(tag, {}).get("committed") for report in reports
                        for parts in [report["own"], *report["replicas"].values()])
        unusable = [r for r, report in enumerate(reports)
                    if tag not in report["own"] or report["own"][tag]["problems"]]
        sources = {r: _replica_holder(reports, r, tag) for r in unusable}
        if committed and None not in sources.values():
            agreed.append(Agreed(tag, key, sources))
    return agreed


def agreed_checkpoints(cfg: CheckpointConfig, read_data: bool = True) -> list[store.Checkpoint]:
    """The checkpoints every rank can load, oldest first (collective where the job has several ranks).

    ``node_local``: a rank whose own part is gone or damaged gets it back from the replica
    first, and the files DeepSpeed reads across ranks come to every node (replica.py), so
    that DeepSpeed loads every rank from its own directory.
    """
    if not _several():
        return store.loadable_checkpoints(cfg.dir, read_data)
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.storage == "shared":
        verified = store.loadable_checkpoints(cfg.dir, read_data)
        common = set.intersection(*(set(tags) for tags in _gathered([c.tag for c in verified])))
        if len(common) < len(verified):
            log.error("cpsr recovery: rank %d verified checkpoints %s that other ranks did not; using those every "
                      "rank verified", rank, sorted({c.tag for c in verified} - common))
        return [c for c in verified if c.tag in common]
    nodes = _nodes_of(cfg, world)
    reports = _gathered(holdings(cfg.dir, rank, nodes, read_data))
    agreed = agree(reports)
    _log_rejected(rank, reports[rank]["own"], agreed)
    replica.restore(cfg.dir, rank, agreed)
    replica.share_model_states(cfg.dir, rank, nodes, [a.tag for a in agreed])
    found = {c.tag: c for c in store.scan(cfg.dir)}
    return [as_agreed(found[a.tag]) for a in agreed]


def as_agreed(ckpt: store.Checkpoint) -> store.Checkpoint:
    """``ckpt`` as agreed: committed (this node may not have written its record), nothing wrong."""
    return dataclasses.replace(ckpt, committed=True, problems=[])


def _log_rejected(rank: int, own: dict, agreed: list[Agreed]) -> None:
    newest = agreed[-1].key if agreed else None
    for tag, part in own.items():
        if (newest is None or part["key"] > newest) and part["problems"]:
            log.error("checkpoint %s: rank %d's part is not loadable: %s", tag, rank, "; ".join(part["problems"]))
