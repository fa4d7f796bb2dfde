"""The host-snapshot source: every rank's snapshot of its exact state at one iteration m,
taken every ``checkpoint.memory_interval`` iterations into shared memory
(``cpsr_ds/checkpoint/host_snapshot.py``). Where every rank of the job has one at the
same m after the newest checkpoint c (the processes crashed, the nodes survived),
recomputing starts at m rather than c: d = f - m <= memory_interval iterations."""

from __future__ import annotations

# A module import: the snapshot's writer imports this package's engine_io, so this may run while it is half loaded.
from cpsr_ds.checkpoint import host_snapshot as snapshots
from cpsr_ds.config import CheckpointConfig
from cpsr_ds.recovery.agree import gathered
from cpsr_ds.recovery.engine_io import advance_counters
from cpsr_ds.recovery.sources.survivor import restore_dump

SOURCE = "host snapshot"


def agreed_snapshot(cfg: CheckpointConfig, engine, attempt: int, c: int,
                    f: int | None) -> snapshots.survivor.Survivor | None:
    """This rank's host snapshot of the previous attempt where every rank has one of the same iteration m, with
    c < m <= f, on its own stage of a job of this world size; else None on every rank (a collective, unless the
    config, the attempt or f, the same on every rank, rule snapshots out)."""
    if cfg.memory_interval is None or attempt <= 1 or f is None:
        return None
    snap = snapshots.read_snapshot(cfg, engine.global_rank, attempt - 1)
    if snap is not None and (snap.stage, snap.world_size) != (engine.stage_id, engine.world_size):
        snap = None
    found = set(gathered(None if snap is None else snap.iteration))
    (m,) = found if len(found) == 1 else (None,)
    return snap if m is not None and c < m <= f else None


def resume_from(engine, snap: snapshots.survivor.Survivor, c: int) -> int:
    """Write the snapshot into the engine, which holds checkpoint c, with the counters of its iteration m; m.
    A collective over the stage's data-parallel group under ZeRO, like every rank's own snapshot."""
    restore_dump(engine, snap)
    advance_counters(engine, snap.iteration - c)
    return snap.iteration
