"""The controlled choice (Section IV): RB-R or PB-R for the failure the journals record, by the recovery cost
model, with its guards; see the package's docstring."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from functools import partial
from typing import Callable, NamedTuple

import torch.distributed as dist

from cpsr_ds.checkpoint.capture.journal import Progress, journal_path, plausible, read_journal
from cpsr_ds.checkpoint.storage.agreement import agreed_checkpoints, agreed_progress
from cpsr_ds.checkpoint.storage.loading import bytes_loaded
from cpsr_ds.config import CPSRConfig, RecoveryConfig
from cpsr_ds.planning.calibration import PESSIMISM
from cpsr_ds.planning.cost_model import (
    RECOMPUTE,
    SKIP,
    Choice,
    CostModel,
    EmpiricalModel,
    diverging,
    paper_model,
    recovery_choice,
)
from cpsr_ds.planning.fitter import NoFit, StageCurvature, accuracy_fit, fit_loss_o, fit_recent, loss_excess, recent_losses
from cpsr_ds.planning.lr_schedule import Shape
from cpsr_ds.recovery.agree import gathered, on_any_rank
from cpsr_ds.integration.deepspeed.engine_state import (advance_counters, data_parallel, load_own_share, partitioned,
                                                        planned_iterations, schedule_shape)
from cpsr_ds.recovery.report import RecoveryReport, carried_lag, earlier_reports
from cpsr_ds.recovery.sources.checkpoint import load_history, restore, stage_history
from cpsr_ds.recovery.sources.prediction import checkpoint_as_prediction, load_weights, predicted_share
from cpsr_ds.recovery.sources import Ahead, host_snapshot, in_flight, replica, summaries, survivor
from cpsr_ds.recovery.sources.survivor import dump_at, restore_dump
from cpsr_ds.recovery.validate import Spec, share_specs
from cpsr_ds.runtime import restart_time
from cpsr_ds.runlog import MEASUREMENTS_DIR, held_out_errors, read_measurements

log = logging.getLogger(__name__)

# Sources that give a rank its exact state at f (nothing predicted).
EXACT = (survivor.SOURCE, replica.SOURCE, "checkpoint")


def recover(engine, cfg: CPSRConfig, predictor, attempt: int = 0) -> RecoveryReport:
    """Restore ``engine`` from ``cfg.checkpoint.dir`` if an earlier run left progress there.

    ``predictor`` (fresh, from :func:`new_predictor`) is given the retained history
    (this data-parallel rank's share of it: :func:`own_share`) and, if the checkpoint
    carries them, its trained weights. No state with a NaN or
    an infinity is resumed from: such checkpoints are left out, such a prediction
    means RB-R. RB-R restores a full cut (every stage's state at one iteration); with
    ``checkpoint.per_stage`` PB-R predicts each stage from its own checkpoints
    (:func:`_recover_stages`).
    """
    directory = cfg.checkpoint.dir
    progress = agreed_progress(cfg.checkpoint)
    for problem in progress.problems:
        log.error("cpsr recovery: %s", problem)
    reached = progress.reached
    # Every rank gets the same checkpoints, verified on each node from their metadata (checkpoint/storage/
    # agreement.py); a checkpoint's data is read and checked only when it is loaded (sources/checkpoint.py).
    verified = agreed_checkpoints(cfg.checkpoint, read_data=False)
    restart_time.mark("finding_state")
    full = [ck for ck in verified if ck.full]
    ahead = host_snapshot.ahead(cfg.checkpoint, engine, attempt, (full[-1].iteration or 0) if full else 0, reached)
    if ahead is not None and (cfg.recovery.mode == "recompute" or ahead.iteration == reached or not full):
        # Nothing to decide (or, before the first checkpoint, nothing to predict from): recomputing starts from
        # the snapshot, which needs no checkpoint under it.
        m = ahead.alone(engine)
        if m is not None:
            restart_time.mark("reading")
            reason = "recovery.mode is recompute" if cfg.recovery.mode == "recompute" and reached > m else ""
            return RecoveryReport("recompute", reached, m, m, reason=reason, sources=ahead_sources(ahead))
    if not full:
        return RecoveryReport("fresh" if reached is None else "restart", reached, None, 0)
    newest = full[-1]
    nothing_lost = reached is None or newest.iteration is None or reached <= newest.iteration
    if nothing_lost or cfg.recovery.mode == "recompute":
        restore(engine, directory, reversed(full))
        c = engine.global_steps
        if ahead is not None:
            c = ahead.resume(engine, c)
        if reached is not None and reached < c:
            # Every rank finished c before it was committed: a journal ending earlier is stale.
            log.error("cpsr recovery: the journals end at iteration %d, before committed checkpoint %d: a journal "
                      "of a rank no longer in the job, or one that lost lines; taking %d", reached, c, c)
            reached = c
        reason = "recovery.mode is recompute" if reached is not None and reached > c else ""
        restart_time.mark("reading")
        return RecoveryReport("recompute", reached, c, c, reason=reason, sources=ahead_sources(ahead))
    if cfg.checkpoint.per_stage and engine.num_stages > 1:
        return _recover_stages(engine, cfg, predictor, progress, verified, full)

    read_before = bytes_loaded()
    # Not exact (Adam's moments are c's), so only here, past recovery.mode recompute.
    ahead = ahead or in_flight.ahead(cfg.checkpoint, engine, newest.iteration or 0, reached)
    survived = survivors(engine, cfg, attempt, reached)
    restart_time.mark("finding_state")
    history, summary_bytes = _newest_with_summary(engine, cfg, predictor, full, survived.exact)
    if history is None:
        # The predictor learns from the retained checkpoints up to c.
        history, client_state = load_history(engine, directory, full, cfg.predictor.history, predictor.observe)
        load_weights(predictor, client_state)
    bytes_read = sum(gathered(bytes_loaded() - read_before + summary_bytes))
    restart_time.mark("reading")
    # The newest of the history is c's state, the one the engine holds.
    report = _decide(engine, cfg, predictor, progress, engine.global_steps, history[-1].curvature, attempt=attempt,
                     ahead=ahead, survived=survived)
    return dataclasses.replace(report, bytes_read=bytes_read, checkpoint_bytes=newest.size)


def _newest_with_summary(engine, cfg: CPSRConfig, predictor, full: list, exact: bool) -> tuple[list | None, int]:
    """(the history PB-R needs, the bytes of summaries read): the newest checkpoint alone, where every rank's
    predictor takes the summary kept with it (:mod:`summaries`) or its stage is ``exact`` (from survivor dumps:
    nothing to predict); else (None, those bytes): the full history.
    """
    newest, summary, size = full[-1], None, 0
    if not exact and predictor.summarizes and newest.iteration is not None:
        summary, size = summaries.read(cfg.checkpoint.dir, engine.global_rank, newest.iteration, newest.attempt)
    if not all(gathered(exact or summary is not None)):
        return None, size
    # A newest state found non-finite leaves an older one in the engine, which the summary does not fit.
    history, client_state = load_history(engine, cfg.checkpoint.dir, full, 1, predictor.observe)
    load_weights(predictor, client_state)
    fits = history[-1].iteration == newest.iteration and (exact or summaries.load(predictor, summary, newest.tag))
    if all(gathered(fits)):
        return history, size
    log.warning("cpsr recovery: the predictor's summary of checkpoint %s does not fit its state on every rank: "
                "reading the full history", newest.tag)
    predictor.history.clear()
    return None, size


class Cut(NamedTuple):
    """Per stage: the newest full cut RB-R restores, and each stage's own newest checkpoint."""

    iteration: int
    stages: list[int]
    restore: Callable[[], int]  # restores the full cut on every rank (collective); its iteration


def _recover_stages(engine, cfg: CPSRConfig, predictor, progress: Progress, verified: list, full: list) -> RecoveryReport:
    """PB-R with ``checkpoint.per_stage``: each stage predicted to f from its own retained checkpoints, the
    newest c_k (a checkpoint of its stage alone, or a full cut); RB-R from the newest full cut where any
    stage cannot predict."""
    directory = cfg.checkpoint.dir
    own = [ck for ck in verified if ck.holds(engine.global_rank)]
    history, client_state = stage_history(engine, directory, own, cfg.predictor.history, engine.stage_id,
                                          predictor.observe)

    def restore() -> int:
        restore(engine, directory, reversed(full))
        return engine.global_steps

    missing = on_any_rank(None if history else f"stage {engine.stage_id} has no checkpoint with a finite state")
    if missing is not None:
        c = restore()
        return RecoveryReport("recompute", progress.reached, c, c, reason=missing)
    load_weights(predictor, client_state)
    newest = dict(gathered((engine.stage_id, history[-1].iteration)))
    cut = Cut(full[-1].iteration, [newest[s] for s in sorted(newest)], restore)
    return _decide(engine, cfg, predictor, progress, engine.global_steps, history[-1].curvature, cut)


def implausible_reach(progress: Progress, c: int, planned: int | None) -> str | None:
    """Why the journal's f is not to be predicted to from the state at c (a checkpoint, or a state ahead of the
    last one); None: it is plausible."""
    f = progress.reached
    if planned is not None and f > planned:
        return (f"the journal's iteration {f} is beyond the planned training length, {planned} iterations "
                "(the LR schedule's total_num_steps)")
    start = progress.covered_from(f)
    if start is None or start > c + 1:
        return f"the journals do not record every iteration from {c + 1} to {f}"
    return None


class Survived(NamedTuple):
    """This rank's survivor dump at f (None: none), which ranks of its data-parallel group hold one, whether a
    replica's serves, whether the stage is exact at f (every rank's dump, or a replica's), and, under ZeRO,
    which replica's dump gives the ranks without one their parameters (None: none does)."""

    dump: object
    holders: list[bool]
    from_replica: bool
    exact: bool
    weights_from: int | None = None


def survivors(engine, cfg: CPSRConfig, attempt: int, f: int | None, cut: Cut | None = None) -> Survived:
    """What the previous attempt's survivor dumps give this rank's stage at f (collective in its DP group)."""
    dump = dump_at(cfg.checkpoint, engine, attempt, f) if cut is None and f is not None else None
    held = gathered((dump is not None, dump is not None and dump.weights is not None), data_parallel(engine).group)
    holders, with_weights = [h for h, _ in held], [w for _, w in held]
    from_replica = replica.covers(engine, holders)
    weights_from = with_weights.index(True) if replica.covers_weights(engine, holders, with_weights) else None
    return Survived(dump, holders, from_replica, all(holders) or from_replica, weights_from)


def _decide(engine, cfg: CPSRConfig, predictor, progress: Progress, c: int, curvature: StageCurvature | NoFit,
            cut: Cut | None = None, attempt: int = 0, ahead: Ahead | None = None,
            survived: Survived | None = None) -> RecoveryReport:
    """PB-R or RB-R for a failure at the journal's f, the engine holding checkpoint c, ``curvature`` its stage_xi.

    ``predictor`` holds this data-parallel rank's share of the stage: each rank predicts
    its share and checks its own held-out error; the stage's error is the worst of them,
    so that the stage's ranks decide alike, and each rank writes its predicted share into the
    engine (:func:`load_own_share`: under ZeRO into its own partition, else assembled with the others').

    ``ahead``: a state at iteration m > c (every rank's host snapshot, or the parameters of the checkpoint in
    flight: :mod:`cpsr_ds.recovery.sources`); recomputing resumes there, so PB-R is weighed against d = f - m.

    ``cut`` (per stage): c is this stage's own; recomputing restores the newest full cut
    and redoes the iterations from there, the cost PB-R is weighed against.

    A stage whose every rank has its survivor dump at f from the job's previous attempt
    (``attempt`` is this one's) takes its exact state from the dumps instead; without ZeRO
    one replica's dump serves every rank of the stage. Under ZeRO a replica's dump gives
    the ranks without one their parameters, and only their moments come from the predictor
    (:func:`replica.fill_partition`). Only the other stages are
    predicted; where any stage must recompute, every stage does. The report's ``sources``
    say where each rank's state came from.
    """
    f = progress.reached
    base = ahead.iteration if ahead is not None else c if cut is None else cut.iteration
    d = f - base

    def recompute(reason: str, **numbers) -> RecoveryReport:
        restored = ahead.resume(engine, c) if ahead is not None else c if cut is None else cut.restore()
        restart_time.mark("reading")
        return RecoveryReport("recompute", f, restored, restored, reason=reason, sources=ahead_sources(ahead),
                              **numbers)

    # From a state ahead of c the journal need only cover that state's iteration on: a restart that resumed there
    # journaled from it, not from c.
    covered_from = base if ahead is not None else c if cut is None else min(cut.stages)
    implausible = implausible_reach(progress, covered_from, planned_iterations(engine))
    if implausible is not None:
        log.error("cpsr recovery: %s: recomputing from checkpoint %d", implausible, base)
        return recompute(implausible)
    numbers = {"predictor": predictor.name}
    dp_group = data_parallel(engine).group
    # A stage is exact at f where every data-parallel rank of it has its dump, or, without ZeRO, some replica has.
    dump, holders, from_replica, exact, weights_from = survived or survivors(engine, cfg, attempt, f, cut)
    # Under ZeRO each rank writes its own partition alone: a rank with its own dump at f restores it, exact, and
    # predicts nothing of its own (with a replica's weights the others predict only their moments). Every rank of
    # the stage still predicts its share, to assemble the stage's state.
    own_dump = dump is not None and partitioned(engine)
    share = predicted_share_of_job(engine, predicting=not exact and f != c and not own_dump)
    ready = not exact and f != c and predictor.ready()
    held_out = predictor.validation_error() if ready else None
    r = None if exact else worst_error(gathered(None if held_out is None else held_out.relative, dp_group))
    fell_back = False  # from the predictor to skip
    if exact or f == c:  # survivors' dumps at f, or (per stage) this stage's own checkpoint at f
        why, predicted = None, None
    elif ready:
        losses = progress_losses(progress)
        fell_back = cfg.recovery.mode == "auto" and diverging(r, cfg.recovery.max_relative_error) \
            and predictor.name != SKIP
        if fell_back:
            # The stage's predictor is worse than its checkpoint: c's state at f may still cost less than d.
            diverged = (f"{predictor.name}'s held-out error r = {r:.3f}, not below max_relative_error "
                        f"{cfg.recovery.max_relative_error}: {SKIP}, c's state at f")
            predictor = checkpoint_as_prediction(predictor)
        model = recovery_model(cfg.planner.cost_model, cfg.checkpoint.dir, losses, engine.stage_id, predictor.name,
                               f, c, curvature, share, schedule_shape(engine, f, cfg.planner.train_iters),
                               held_out.horizon if held_out is not None else None)
        carried = carried_lag(earlier_reports(cfg.checkpoint.dir), c)
        choice = recovery_choice(model.estimate(f, c, predictor.name), d, excess_at(losses, f),
                                 cfg.recovery.max_loss_excess, PESSIMISM, carried)
        if fell_back:
            choice = dataclasses.replace(choice, reason=f"{diverged}; {choice.reason}")
        numbers.update(predictor=predictor.name, relative_error=r, estimated_cost=choice.estimate.lag,
                       cost_model=model.name, guard_lag=choice.guard_lag, loss_excess=choice.loss_excess,
                       predicted_share=share)
        why, predicted = _prediction(cfg.recovery, predictor, f, r, choice, share_specs(engine))
    else:
        why, predicted = f"predictor {predictor.name} not ready", None
    # Readiness and the held-out error are each rank's own (its stage, its shard): one
    # rank's reason to recompute is every rank's.
    why = on_any_rank(why)
    restart_time.mark("prediction")
    if why is not None:
        return recompute(why, **numbers)
    if exact and dump is not None:
        restore_dump(engine, dump)
    # Every other rank keeps the random-number state saved with checkpoint c, the nearest saved (rng.py): a
    # predicted state is not exact anyway, and a replica's copy holds the state at f but not this rank's streams.
    if from_replica:
        replica.copy_from_replica(engine, holders.index(True))
    elif predicted is not None and weights_from is not None:
        replica.fill_partition(engine, dump, weights_from, predicted)
    elif predicted is not None and own_dump:
        restore_dump(engine, dump)
    elif predicted is not None:
        load_own_share(engine, predicted)
    advance_counters(engine, f - c)
    restart_time.mark("writing")
    source = (survivor.SOURCE if dump is not None and (exact or own_dump)
              else replica.SOURCE if from_replica else "checkpoint" if predicted is None
              else replica.partial_source(predictor.name) if weights_from is not None else predictor.name)
    reason = ("recovery.mode is predict" if cfg.recovery.mode == "predict"
              else f"stage {engine.stage_id} {'dumped' if exact else 'checkpointed'} at {f}" if predicted is None
              else choice.reason if fell_back else f"held-out error r = {r:.3f}, {choice.reason}")
    ranks = gathered((source, numbers, reason))
    sources = {str(rank): src for rank, (src, _, _) in enumerate(ranks)}
    # The report speaks for the job: its numbers are those of the first rank whose state was predicted.
    _, numbers, reason = next((r for r in ranks if r[0] not in EXACT), ranks[0])
    if all(src in EXACT for src in sources.values()):
        numbers = {**numbers, "predictor": None}
    mixed = len(set(sources.values())) > 1 or any(src in (survivor.SOURCE, replica.SOURCE) for src in sources.values())
    return RecoveryReport("predict", f, c if cut is None else cut.iteration, f, reason=reason,
                          stage_checkpoints=cut and cut.stages, sources=sources if mixed else None, **numbers)


def ahead_sources(ahead: Ahead | None) -> dict[str, str] | None:
    """The report's ``sources`` of a resumption from a state after c: every rank's from the same source."""
    if ahead is None:
        return None
    world = dist.get_world_size() if dist.is_initialized() else 1
    return {str(rank): ahead.source for rank in range(world)}


def worst_error(errors: list[float | None]) -> float | None:
    """The stage's held-out error from its data-parallel ranks' own (each of its share): the worst, NaN the
    worst of all; None where any rank has none."""
    if any(e is None for e in errors):
        return None
    return max(errors, key=lambda e: math.inf if math.isnan(e) else e)


def _prediction(rc: RecoveryConfig, predictor, f: int, r: float | None, choice: Choice,
                expected: dict[str, Spec]) -> tuple[str | None, dict | None]:
    """This rank's (reason to recompute, None) or (None, its share of the predicted state at f, valid against
    ``expected``)."""
    if rc.mode == "auto":
        # r measures a predictor against skip: skip cannot diverge, only the cost model's choice applies to it.
        why = ((choice.reason if choice.method == RECOMPUTE else None) if predictor.name == SKIP
               else fallback_reason(rc, r, choice))
        if why is not None:
            return why, None
    return predicted_share(predictor, f, expected)


def fallback_reason(rc: RecoveryConfig, r: float | None, choice: Choice) -> str | None:
    """Why ``recovery.mode: auto`` recomputes rather than predicts with a ready predictor; None: predict.

    ``r``: the held-out error (a NaN fails the comparison, so recomputes); ``choice``: the
    cost model's, with its loss-excess guard.
    """
    if r is None:
        return "the predictor has no held-out checkpoint to check it against"
    if diverging(r, rc.max_relative_error):
        return f"held-out error r = {r:.3f}, not below max_relative_error {rc.max_relative_error}: a diverging prediction"
    if choice.method == RECOMPUTE:
        return choice.reason
    return None


def journal_losses(directory: str) -> dict[int, float]:
    """Rank 0's journaled losses by iteration, from its journal in ``directory`` (rank 0's node's)."""
    path = journal_path(directory, 0)
    entries, _ = plausible(path, read_journal(path))
    return {e.iteration: e.loss for e in entries}


def progress_losses(progress: Progress) -> dict[int, float]:
    """Rank 0's journaled losses by iteration, from the progress every rank agreed on: all ranks make the same
    choice from the same losses, also where rank 0's journal is on another node (``checkpoint.storage: node_local``)."""
    return {e.iteration: e.loss for e in progress.entries.get(0, ())}


def excess_at(losses: dict[int, float], f: int) -> Callable[[float], float | None]:
    """lag -> the relative loss excess a lag of that many iterations costs at f, by ``losses`` (by
    iteration), fitted once; None where there are too few losses to fit.

    A non-finite loss where the fit looks gives NaN, not a fit: the run diverged there.
    """
    recent = recent_losses(losses, f)
    if not all(math.isfinite(loss) for loss in recent.values()):
        return lambda lag: math.nan
    curve = fit_recent(recent, f)
    return (lambda lag: None) if curve is None else partial(loss_excess, curve, f)


def expected_loss_excess(directory: str, f: int, lag: float) -> float | None:
    """:func:`excess_at` by the run's journal (rank 0's)."""
    return excess_at(journal_losses(directory), f)(lag)


def predicted_share_of_job(engine, predicting: bool) -> float:
    """N_p / N: the share of the job's parameters whose state is predicted, ``predicting`` being this rank's
    (a collective). Data-parallel replicas hold their stage's parameters each, so each counts its 1/dp."""
    # ZeRO-3's module tensors are empty: ds_numel is each parameter's size.
    held = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()) / data_parallel(engine).size
    counts = gathered((held if predicting else 0.0, held))
    total = sum(n for _, n in counts)
    return sum(p for p, _ in counts) / total if total else 1.0


def recovery_model(name: str, directory: str, losses: dict[int, float], stage: int, predictor: str, f: int, c: int,
                   curvature: StageCurvature | NoFit, share: float = 1.0,
                   schedule: Shape | None = None, horizon: int | None = None) -> CostModel:
    """The recovery cost model ``planner.cost_model`` names, for a failure at f restored from checkpoint c.

    The paper's (Eq. 13; Eq. 14 for ``paper-eq14``) is built from the run's own records:
    Eq. 11 over ``losses`` (rank 0's journaled losses) up to f (the recent window fit_loss_o takes),
    Eq. 8 over the held-out errors the measurements hold for ``stage`` and ``predictor``
    at the checkpoints up to c (fitter.accuracy_fit, the planner's fit), and xi and N_p (Eq. 7) of
    ``curvature``, stage_xi of the stage's state at c. A missing input (no measurements: a run from before they
    were recorded, or one in recovery.mode recompute) or a NoFit leaves the model
    without params, and its estimate says why. The empirical model's is scaled by ``share``,
    the share of the job's parameters predicted (:func:`predicted_share_of_job`); the paper's
    N_p is the stage's already. ``schedule``: the learning-rate schedule's shape at f (engine_state.schedule_shape),
    which the empirical model's end-of-training rho depends on; ``horizon``: how far ahead
    the predictor's held-out check predicted, beyond which the empirical lag grows faster.
    """
    if name == "empirical":
        return EmpiricalModel(share=share, schedule=schedule, horizon=horizon)
    if name not in ("paper", "paper-eq14"):
        raise ValueError(f"planner.cost_model {name!r}: not a recovery cost model (empirical, paper, paper-eq14)")
    rows, problems = read_measurements(directory)
    for problem in problems:
        log.warning("cpsr recovery: skipping a damaged measurement: %s", problem)
    whose = f"{predictor} for stage {stage} up to iteration {c} in {os.path.join(directory, MEASUREMENTS_DIR)}"
    accuracy = accuracy_fit(held_out_errors(rows, stage, predictor, upto=c), whose)
    return paper_model(fit_loss_o(losses, f), accuracy, curvature, exact=name == "paper")

