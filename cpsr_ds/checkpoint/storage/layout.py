"""Where checkpoints live: one directory every rank shares, or one per node (``checkpoint.storage``).

``shared``: every rank writes its part and manifest into the one directory; rank 0's
committer reads the manifests there and alone writes the commit record, ``latest`` and
retention (committing.py, retention.py).

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
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

import torch.distributed as dist

from cpsr_ds.checkpoint.storage import catalog, filesystem, ondisk, records, replica
from cpsr_ds.checkpoint.storage.filesystem import fs
from cpsr_ds.checkpoint.capture.journal import Progress, agreed_reach, read_progress
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

    @property
    def world_size(self) -> int:
        return sum(map(len, self.groups))

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
        return records.read_manifests(tag_dir)

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

    def announce(self, job_key: str, decision: Decision) -> None:
        self._kv.set(self._key(job_key, "decision"), json.dumps({"record": decision.record, "reason": decision.reason}))
        for r in range(self.nodes.world_size):
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
                time.sleep(filesystem.POLL_S)
                released = self._kv.add(key, 0)
        except RuntimeError as err:  # torch's DistError: the store's process ended, nobody to wait for
            log.info("the job's store is gone (%s); nothing to release", err)


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
        fs.write_atomic(path, [run.encode()])
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
    """Every rank's ``local``, in rank order (collective where the job has several ranks)."""
    if not _several():
        return [local]
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


def _full_owners(tag_dir: str) -> dict[int, dict]:
    """The ranks whose whole part ``tag_dir`` holds, with their manifests: those not marked partial (replica.py's
    model-states files alone); a damaged manifest counts, as {}, so that its verification names the damage."""
    owners = {}
    for name in _names(tag_dir):
        if (m := ondisk.MANIFEST_RE.match(name)) is None:
            continue
        try:
            with open(os.path.join(tag_dir, name)) as f:
                manifest = json.load(f)
            manifest = manifest if isinstance(manifest, dict) else {}
        except (OSError, ValueError):
            manifest = {}
        if manifest.get(replica.PARTIAL) is not True:
            owners[int(m.group(1))] = manifest
    return owners


def _names(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _describe(c: catalog.Checkpoint, manifest: dict) -> dict:
    """What a part is of: ``c`` as its directory's commit record says, or, for a part an earlier attempt left
    under a tag a later one wrote again, that attempt's uncommitted checkpoint of its own world."""
    attempt = manifest.get("attempt", c.attempt)
    if attempt == c.attempt:
        return {"key": c.key, "committed": c.committed, "world_size": c.world_size, "ranks": c.ranks}
    return {"key": ondisk.order_key(c.iteration, attempt), "committed": False,
            "world_size": manifest.get("world_size", c.world_size), "ranks": None}


def _parts(ckpt_dir: str, vouches: Callable[[int], bool], read_data: bool) -> dict[int, dict[str, dict]]:
    """By owner (the rank that wrote it), of the owners ``vouches`` for: its whole part of each of our
    checkpoints in ``ckpt_dir``: which checkpoint it is of (:func:`_describe`) and its problems."""
    found: dict[int, dict[str, dict]] = {}
    for c in catalog.scan(ckpt_dir):
        if c.kind != "cpsr":
            continue
        for owner, manifest in sorted(_full_owners(os.path.join(ckpt_dir, c.tag)).items()):
            if vouches(owner):
                found.setdefault(owner, {})[c.tag] = {
                    **_describe(c, manifest),
                    "problems": catalog.verify(ckpt_dir, c, read_data, ranks={owner}, need_commit=False)}
    return found


def holdings(ckpt_dir: str, rank: int, nodes: Nodes, read_data: bool = True) -> dict:
    """The parts this rank vouches for, by owner: in ``parts`` its own rank's in its directory and, on its node's
    lowest rank, those of every other owner there that no rank of its node has (a departed rank's, a rank's of
    another numbering); in ``replicas`` (the lowest rank) every owner's the node keeps."""
    if not nodes.leads(rank):
        return {"parts": _parts(ckpt_dir, lambda owner: owner == rank, read_data), "replicas": {}}
    others = set(nodes.ranks(nodes.node_of(rank))) - {rank}
    return {"parts": _parts(ckpt_dir, lambda owner: owner not in others, read_data),
            "replicas": _parts(replica.replica_dir(ckpt_dir), lambda owner: True, read_data)}


@dataclass(frozen=True)
class Held:
    """A sound copy of a part: in ``rank``'s checkpoint directory, or in its replicas (``replica``)."""

    rank: int
    replica: bool


@dataclass(frozen=True)
class Agreed:
    """A checkpoint whose every part is sound somewhere: ``holders``, by owner, where it is (reports' order)."""

    tag: str
    key: tuple
    world_size: int
    ranks: Optional[tuple]  # the owners of a checkpoint of some stages; None: every rank of ``world_size``
    holders: dict

    @property
    def sources(self) -> dict[int, int]:
        """Owner -> the first rank holding its part, for the owners whose own rank does not hold it in its directory."""
        return {owner: held[0].rank for owner, held in self.holders.items() if Held(owner, False) not in held}


def agree(reports: list[dict]) -> list[Agreed]:
    """The checkpoints whose every part (every rank of the world that wrote them, whatever ranks the job has
    now) is sound in some rank's directory or replicas, oldest first.

    No commit record is needed: rank 0 commits once every rank's manifest is durable and
    none gave up or holds a non-finite tensor, which is what every part being sound
    says, and the record itself waits for the replicas (a node may have died before
    writing it). A checkpoint rank 0 gave up has lost at least one part.
    """
    found = [(tag, owner, Held(rank, in_replicas), part) for rank, report in enumerate(reports)
             for in_replicas, kept in ((False, report["parts"]), (True, report["replicas"]))
             for owner, parts in sorted(kept.items()) for tag, part in parts.items()]
    # Each tag stands for its newest committed checkpoint: a later attempt may have written the tag again.
    described: dict[str, dict] = {}
    for tag, _, _, part in found:
        best = described.get(tag)
        if best is None or (part["committed"], tuple(part["key"])) > (best["committed"], tuple(best["key"])):
            described[tag] = part
    holders: dict[str, dict[int, list[Held]]] = {}
    for tag, owner, held, part in found:
        if not part["problems"] and tuple(part["key"]) == tuple(described[tag]["key"]):
            holders.setdefault(tag, {}).setdefault(owner, []).append(held)
    agreed = []
    for tag, part in sorted(described.items(), key=lambda item: (tuple(item[1]["key"]), item[0])):
        owners = range(part["world_size"]) if part["ranks"] is None else part["ranks"]
        held = holders.get(tag, {})
        if all(owner in held for owner in owners):
            agreed.append(Agreed(tag, tuple(part["key"]), part["world_size"],
                                 None if part["ranks"] is None else tuple(part["ranks"]),
                                 {owner: tuple(held[owner]) for owner in owners}))
    return agreed


def placement(agreed: list[Agreed], nodes: Nodes) -> list[replica.Move]:
    """The copies that let every rank load the ``agreed`` checkpoints from its node's directory.

    At the world size that wrote a checkpoint, owner o's part belongs in rank o's node's
    directory, and the other owners' model-states files there too (DeepSpeed reads them
    whichever rank loads); at another world size every node's directory gets every
    owner's part (recovery reassembles ZeRO partitions from all of them). Each missing
    part comes from a replica on the same node where there is one, else from the first
    rank holding it.
    """
    world = nodes.world_size
    moves = []
    for a in agreed:
        for node in range(len(nodes.groups)):
            here = nodes.ranks(node)
            placed = {owner for owner, held in a.holders.items() if any(h.rank in here and not h.replica for h in held)}
            needed = set(a.holders) if world != a.world_size else set(a.holders) & set(here)
            for owner in sorted(set(a.holders) - placed):
                src = next((h for h in a.holders[owner] if h.rank in here), a.holders[owner][0])
                moves.append(replica.Move(a.tag, owner, src.rank, src.replica, here[0], only=owner not in needed))
    return moves


def agreed_checkpoints(cfg: CheckpointConfig, read_data: bool = True) -> list[catalog.Checkpoint]:
    """The checkpoints every rank can load, oldest first (collective where the job has several ranks).

    ``node_local``: the parts of the ranks that wrote a checkpoint, whichever node keeps
    them (as its own or as replicas), come to the nodes that load them first
    (:func:`placement`, replica.restore), so that DeepSpeed loads every rank from its own
    directory, also on a job of another world size or rank numbering.
    """
    if cfg.storage == "shared":
        return _shared_checkpoints(cfg, read_data)
    rank, world = (dist.get_rank(), dist.get_world_size()) if _several() else (0, 1)
    nodes = _nodes_of(cfg, world)
    local = holdings(cfg.dir, rank, nodes, read_data)
    reports = _gathered(local)
    agreed = agree(reports)
    _log_rejected(rank, local["parts"].get(rank, {}), agreed)
    lost = replica.restore(cfg.dir, rank, nodes, placement(agreed, nodes))
    found = {c.tag: c for c in catalog.scan(cfg.dir)}
    return replica.whole(cfg.dir, [as_agreed(found[a.tag], a) for a in agreed if a.tag in found], lost)


def _shared_checkpoints(cfg: CheckpointConfig, read_data: bool) -> list[catalog.Checkpoint]:
    """The valid checkpoints of the one shared directory that every rank verified."""
    verified = catalog.loadable_checkpoints(cfg.dir, read_data)
    if not _several():
        return verified
    common = set.intersection(*(set(tags) for tags in _gathered([c.tag for c in verified])))
    if len(common) < len(verified):
        log.error("cpsr recovery: rank %d verified checkpoints %s that other ranks did not; using those every "
                  "rank verified", dist.get_rank(), sorted({c.tag for c in verified} - common))
    return [c for c in verified if c.tag in common]


def as_agreed(ckpt: catalog.Checkpoint, agreed: Agreed) -> catalog.Checkpoint:
    """``ckpt`` as agreed: committed (this node may not have written its record), of the world and ranks that
    wrote it, nothing wrong."""
    return dataclasses.replace(ckpt, committed=True, problems=[], world_size=agreed.world_size, ranks=agreed.ranks)


def _log_rejected(rank: int, own: dict, agreed: list[Agreed]) -> None:
    newest = agreed[-1].key if agreed else None
    for tag, part in own.items():
        if (newest is None or part["key"] > newest) and part["problems"]:
            log.error("checkpoint %s: rank %d's part is not loadable: %s", tag, rank, "; ".join(part["problems"]))
