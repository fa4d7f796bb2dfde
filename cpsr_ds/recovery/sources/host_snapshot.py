"""The host-snapshot source: every rank's snapshot of its exact state at one iteration m,
taken every ``checkpoint.memory_interval`` iterations into shared memory
(``cpsr_ds/checkpoint/capture/host_snapshot.py``, two per rank). Where every rank of the job has
one at the same m after the newest checkpoint c (the processes crashed, the nodes
survived), recomputing starts at the newest such m rather than c: d = f - m <=
memory_interval iterations, unless the killed process was still writing its snapshot of
f's interval, which leaves the one before (2 memory_interval)."""

from __future__ import annotations

# A module import: the snapshot's writer imports this package's engine_io, so this may run while it is half loaded.
from cpsr_ds.checkpoint.capture import host_snapshot as snapshots
from cpsr_ds.config import CheckpointConfig
from cpsr_ds.recovery.agree import gathered
from cpsr_ds.integration.deepspeed.engine_state import advance_counters, materialize_moments, set_counters
from cpsr_ds.recovery.sources import Ahead
from cpsr_ds.recovery.sources.survivor import restore_dump, usable

SOURCE = "host snapshot"


def ahead(cfg: CheckpointConfig, engine, attempt: int, c: int, f: int | None) -> Ahead | None:
    """:func:`agreed_snapshot` as the state recomputing starts from (:func:`resume_from`)."""
    snap = agreed_snapshot(cfg, engine, attempt, c, f)
    if snap is None:
        return None
    return Ahead(snap.iteration, SOURCE, lambda engine, c: resume_from(engine, snap, c),
                 lambda engine: resume_alone(engine, snap))


def agreed_snapshot(cfg: CheckpointConfig, engine, attempt: int, c: int,
                    f: int | None) -> snapshots.dumps.Survivor | None:
    """This rank's host snapshot of the previous attempt at the newest iteration m, c < m <= f, of which every
    rank has one, on its own stage of a job of this world size, valid (survivor.usable); else None on every rank
    (a collective, unless the config, the attempt or f, the same on every rank, rule snapshots out).

    The ranks agree on the manifests first, then read the newest common one; where it fails on any rank, the one
    before it: one state read per rank where nothing is damaged."""
    if cfg.memory_interval is None or attempt <= 1 or f is None:
        return None
    mine = {m: found for m, found in snapshots.snapshot_manifests(cfg, engine.global_rank, attempt - 1).items()
            if (found[1].get("stage", 0), found[1].get("world_size", 0)) == (engine.stage_id, engine.world_size)
            and c < m <= f}
    for m in sorted(set.intersection(*map(set, gathered(sorted(mine)))), reverse=True):
        snap = snapshots.load(mine[m])
        ok = snap is not None and usable(engine, snap, SOURCE)
        if all(gathered(ok)):
            return snap
    return None


def resume_from(engine, snap: snapshots.dumps.Survivor, c: int) -> int:
    """Write the snapshot into the engine, which holds checkpoint c, with the counters of its iteration m; m.
    A collective over the stage's data-parallel group under ZeRO, like every rank's own snapshot."""
    restore_dump(engine, snap)
    advance_counters(engine, snap.iteration - c)
    return snap.iteration


def resume_alone(engine, snap: snapshots.dumps.Survivor) -> int | None:
    """Write the snapshot, its counters and its optimizer settings into an engine that holds no checkpoint; m.
    None on every rank, where some rank's snapshot predates the settings it needs or its engine cannot hold
    moments yet (a collective); the engine's state is then for a checkpoint to overwrite."""
    counters = snap.counters
    fits = "param_groups" in counters and len(counters["optimizer_steps"]) == 1 and materialize_moments(engine)
    if not all(gathered(fits)):
        return None
    restore_dump(engine, snap)
    set_counters(engine, counters)
    return snap.iteration
