"""At recovery, which checkpoints every rank can load, whichever node keeps their parts.

With ``shared`` storage every rank verifies the one directory and they keep the checkpoints
all verified. With ``node_local`` storage each rank reports the parts it vouches for
(:func:`holdings`), in its own directory and among its node's replicas; a checkpoint whose
every part is sound somewhere is agreed (:func:`agree`), and the parts a node lacks are
copied to it (:func:`placement`, replica.restore) before DeepSpeed loads.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch.distributed as dist

from cpsr_ds.checkpoint.capture.journal import Progress, agreed_reach, read_progress
from cpsr_ds.checkpoint.storage import catalog, ondisk, replica
from cpsr_ds.checkpoint.storage.topology import Nodes, found_nodes
from cpsr_ds.config import CheckpointConfig

log = logging.getLogger(__name__)


def _nodes_of(cfg: CheckpointConfig, world_size: int) -> Nodes:
    return found_nodes(cfg.dir) or Nodes.single(world_size)


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
