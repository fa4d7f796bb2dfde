"""``inspect`` for node-local checkpoint directories: what each node holds, and what recovery would agree on.

With ``checkpoint.storage: node_local`` each node's directory holds its own ranks' parts,
its own ``latest``, its ranks' journals, and under ``replicas/`` the parts of the node
before it. One directory shows one node; given every node's directory (copied to one
place) the report adds the checkpoint c and the failure point f the ranks would agree on
at a restart, by recovery's own rules (agreement.holdings, agreement.agree,
agreement.combine_progress), offline: a node whose directory is missing holds nothing, and
its ranks' replicas stand in, as at a restart after losing that node's disk.

A directory's ranks are those that left a token there at the newest start
(topology.TOKENS); a directory without tokens (a one-process run) is known by its journals
and manifests.
"""

from __future__ import annotations

import os
import re
from typing import Optional

from cpsr_ds.checkpoint.storage import agreement, catalog, ondisk, records, topology
from cpsr_ds.checkpoint.capture.journal import JOURNAL_DIR, JOURNAL_NAME_RE, read_progress

TOKEN_RE = re.compile(r"^rank(\d{5})$")


def _tokens(ckpt_dir: str) -> dict[int, tuple[float, str]]:
    """Each rank's start token in ``ckpt_dir``: (when it was written, the start's id)."""
    found = {}
    for name in _names(os.path.join(ckpt_dir, topology.TOKENS)):
        m = TOKEN_RE.match(name)
        path = os.path.join(ckpt_dir, topology.TOKENS, name)
        try:
            with open(path) as f:
                if m:
                    found[int(m.group(1))] = (os.path.getmtime(path), f.read())
        except OSError:
            continue
    return found


def _manifest_ranks(ckpt_dir: str) -> set[int]:
    """The ranks with a manifest in any checkpoint of ``ckpt_dir``."""
    return {int(m.group(1)) for c in catalog.scan(ckpt_dir) for name in _names(os.path.join(ckpt_dir, c.tag))
            if (m := ondisk.MANIFEST_RE.match(name))}


def _names(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def held_ranks(ckpt_dir: str) -> list[int]:
    """The ranks whose own files ``ckpt_dir`` holds: the newest start's tokens, else its journals and manifests."""
    tokens = _tokens(ckpt_dir)
    if tokens:
        newest = max(tokens.values())[1]
        return sorted(r for r, (_, run) in tokens.items() if run == newest)
    journals = {int(m.group(1)) for name in _names(os.path.join(ckpt_dir, JOURNAL_DIR))
                if (m := JOURNAL_NAME_RE.match(name))}
    return sorted(journals | _manifest_ranks(ckpt_dir))


def replica_ranks(ckpt_dir: str) -> list[int]:
    """The ranks whose replicas ``ckpt_dir`` keeps (those of the node before it)."""
    return sorted(_manifest_ranks(os.path.join(ckpt_dir, ondisk.REPLICAS)))


def _newest_commit(ckpt_dir: str) -> Optional[dict]:
    """The commit record of the newest committed checkpoint of ``ckpt_dir``."""
    for c in reversed(catalog.scan(ckpt_dir)):
        try:
            record = records.read_commit(os.path.join(ckpt_dir, c.tag))
        except (OSError, ValueError):
            continue
        if record is not None:
            return record
    return None


def world_size(ckpt_dir: str) -> Optional[int]:
    """The world size of the newest checkpoint committed in ``ckpt_dir`` or its replicas."""
    record = _newest_commit(ckpt_dir) or _newest_commit(os.path.join(ckpt_dir, ondisk.REPLICAS))
    return record["world_size"] if record else None


def is_node_local(ckpt_dir: str) -> bool:
    """Whether ``ckpt_dir`` holds one node's share of a job: it keeps replicas, or a rank of the newest
    checkpoint's world never left a start token there (every start leaves every rank's in a shared one)."""
    world, seen = world_size(ckpt_dir), set(_tokens(ckpt_dir))
    return bool(replica_ranks(ckpt_dir)) or (bool(seen) and world is not None and not set(range(world)) <= seen)


def job_nodes(dirs: list[str]) -> tuple[topology.Nodes, dict[int, str]]:
    """The job's nodes from its directories (a lost node's ranks from the replicas the next node keeps of them),
    and the directory of each rank found."""
    owner = {r: d for d in dirs for r in held_ranks(d)}
    groups = {tuple(held_ranks(d)) for d in dirs} | {tuple(replica_ranks(d)) for d in dirs}
    return topology.Nodes(tuple(sorted(g for g in groups if g))), owner


def newest_valid(parts: dict[str, dict]) -> Optional[str]:
    """The newest committed part without problems, of agreement.holdings' parts."""
    sound = [(p["key"], tag) for tag, p in parts.items() if p["committed"] and not p["problems"]]
    return max(sound)[1] if sound else None


def rank_reports(dirs: list[str], read_data: bool = True) -> tuple[topology.Nodes, dict[int, str], list[dict]]:
    """The nodes, each rank's directory, and every rank's holdings as recovery gathers them (empty for a rank
    whose directory is missing)."""
    nodes, owner = job_nodes(dirs)
    world = max([r for g in nodes.groups for r in g] + [(world_size(d) or 0) - 1 for d in dirs]) + 1
    empty = {"parts": {}, "replicas": {}}
    return nodes, owner, [agreement.holdings(owner[r], r, nodes, read_data) if r in owner else empty for r in range(world)]


def agreed(dirs: list[str], reports: list[dict]) -> dict:
    """The checkpoint c every rank can load (where from) and the journals' f, as recovery agrees on them."""
    found = agreement.agree(reports)
    progress = agreement.combine_progress([read_progress(d) for d in dirs])
    newest = found[-1] if found else None
    return {"checkpoint": newest.tag if newest else None, "iteration": newest.key[0] if newest else None,
            "from_replica": {str(r): holder for r, holder in newest.sources.items()} if newest else {},
            "reached": progress.reached, "problems": list(progress.problems)}


def rank_rows(nodes: topology.Nodes, reports: list[dict], owner: dict[int, str], node: int) -> list[dict]:
    """Node ``node``'s ranks: each one's newest valid own part, and its replica's on the next node (None there too
    where that node's directory is not given: ``replica_dir``)."""
    keeper = nodes.ranks(node + 1)[0]
    return [{"rank": r, "newest_valid": newest_valid(reports[r]["parts"].get(r, {})),
             "replica_node": (node + 1) % len(nodes.groups), "replica_dir": owner.get(keeper),
             "replica_newest_valid": newest_valid(reports[keeper]["replicas"].get(r, {}))}
            for r in nodes.ranks(node)]


def replicas_kept(reports: list[dict], ranks: list[int]) -> dict[str, Optional[str]]:
    """The newest valid replica the node of ``ranks`` keeps of each rank of the node before."""
    return {str(r): newest_valid(parts) for r, parts in reports[ranks[0]]["replicas"].items()}
