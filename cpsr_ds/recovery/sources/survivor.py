"""The survivor source: a rank's own dump of its exact state at the failure point, which
``cpsr_ds/checkpoint/survivor.py`` wrote when the job failed around the rank (the
launcher's SIGTERM, or a failed collective). A stage whose every rank has its dump at
the failure point f resumes there exactly: nothing of it is predicted (N_p = 0)."""

from __future__ import annotations

import logging

# A module import: the dump's writer imports this package's engine_io, so this may run while it is half loaded.
from cpsr_ds.checkpoint import rng, survivor as dumps
from cpsr_ds.config import CheckpointConfig
from cpsr_ds.recovery.engine_io import load_local_state

log = logging.getLogger(__name__)

SOURCE = "survivor"


def dump_at(cfg: CheckpointConfig, engine, attempt: int, f: int) -> dumps.Survivor | None:
    """This rank's dump of the job attempt before ``attempt``, if it holds the state after exactly f iterations
    on this rank's stage of a job of this world size; None otherwise (why logged)."""
    if not cfg.survivor or attempt <= 1:
        return None
    dump = dumps.read_survivor(dumps.survivor_root(cfg), engine.global_rank, dumps.run_identity(cfg.dir),
                              attempt=attempt - 1)
    if dump is None:
        return None
    if (dump.iteration, dump.stage, dump.world_size) != (f, engine.stage_id, engine.world_size):
        log.info("cpsr recovery: rank %d's survivor dump (iteration %d, stage %d of a world of %d) is not this "
                 "rank's state at iteration %d (stage %d of %d): not used", engine.global_rank, dump.iteration,
                 dump.stage, dump.world_size, f, engine.stage_id, engine.world_size)
        return None
    return dump


def restore_dump(engine, dump: dumps.Survivor) -> None:
    """Write the dumped state and its random-number state into the engine (a collective over the stage's
    data-parallel group under ZeRO)."""
    load_local_state(engine, dump.state, dump.fragments)
    rng.resume(engine, dump.counters.get("rng"), f"the dump of iteration {dump.iteration}")
