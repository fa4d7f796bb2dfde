"""The survivor source: a rank's own dump of its exact state at the failure point, which
``cpsr_ds/checkpoint/capture/survivor.py`` wrote when the job failed around the rank (the
launcher's SIGTERM, or a failed collective). A stage whose every rank has its dump at
the failure point f resumes there exactly: nothing of it is predicted (N_p = 0). A dump
(or a host snapshot, in the same format) that fails :mod:`cpsr_ds.recovery.validate`
against what the engine holds is left out, and the next source serves."""

from __future__ import annotations

import logging

from cpsr_ds.checkpoint.capture import dumps, rng, run_id
from cpsr_ds.config import CheckpointConfig
from cpsr_ds.integration.deepspeed.engine_state import load_local_state
from cpsr_ds.recovery.validate import Spec, local_specs, problem

log = logging.getLogger(__name__)

SOURCE = "survivor"


def dump_at(cfg: CheckpointConfig, engine, attempt: int, f: int) -> dumps.Survivor | None:
    """This rank's dump of the job attempt before ``attempt``, if it holds the state after exactly f iterations
    on this rank's stage of a job of this world size; None otherwise (why logged)."""
    if not cfg.survivor or attempt <= 1:
        return None
    dump = dumps.read_survivor(dumps.survivor_root(cfg), engine.global_rank, run_id.run_identity(cfg.dir),
                              attempt=attempt - 1)
    if dump is None:
        return None
    if (dump.iteration, dump.stage, dump.world_size) != (f, engine.stage_id, engine.world_size):
        log.info("cpsr recovery: rank %d's survivor dump (iteration %d, stage %d of a world of %d) is not this "
                 "rank's state at iteration %d (stage %d of %d): not used", engine.global_rank, dump.iteration,
                 dump.stage, dump.world_size, f, engine.stage_id, engine.world_size)
        return None
    return dump if usable(engine, dump, "survivor dump") else None


def usable(engine, dump: dumps.Survivor, what: str) -> bool:
    """Whether ``dump`` (``what`` it is: a survivor dump, a host snapshot) passes :func:`dump_problem`; why not
    is logged."""
    bad = dump_problem(engine, dump)
    if bad is not None:
        log.warning("cpsr recovery: rank %d's %s of iteration %d is left out, the next source serves: it holds %s",
                    engine.global_rank, what, dump.iteration, bad)
    return bad is None


def dump_problem(engine, dump: dumps.Survivor) -> str | None:
    """Why this rank may not resume from ``dump``: its fragments of the ZeRO partitions are not the rank's, or its
    state or its weights fail :func:`~cpsr_ds.recovery.validate.problem` against the engine's; None: it may."""
    expected, fragments = local_specs(engine)
    found = {name: tuple(span) for name, span in dump.fragments.items()}
    differs = sorted(name for name in found.keys() | fragments.keys() if found.get(name) != fragments.get(name))
    if differs:
        name = differs[0]
        return (f"{_fragment(found.get(name))} of {name}, where this rank's partition holds "
                f"{_fragment(fragments.get(name))}")
    bad = problem(dump.state, expected)
    if bad is None and dump.weights is not None:
        weights = {name: Spec(tuple(p.shape), p.dtype) for name, p in engine.module.named_parameters()}
        bad = problem(dump.weights, weights)
    return bad


def restore_dump(engine, dump: dumps.Survivor) -> None:
    """Write the dumped state and its random-number state into the engine (a collective over the stage's
    data-parallel group under ZeRO)."""
    load_local_state(engine, dump.state, dump.fragments)
    rng.resume(engine, dump.counters.get("rng"), f"the dump of iteration {dump.iteration}")


def _fragment(span: tuple[int, int] | None) -> str:
    """A fragment (start, numel) of a flattened parameter in words; None: the whole parameter."""
    return "the whole tensor" if span is None else f"the fragment [{span[0]}, {span[0] + span[1]})"
