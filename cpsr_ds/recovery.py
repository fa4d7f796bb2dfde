"""Recovery on restart: find the failure point, choose how to recover, resume there.

The progress journal says the failed job reached iteration f; the last committed
checkpoint is c <= f, d = f - c iterations were lost. Two ways back (Section IV):

- RB-R, recompute-based: restore c and let the training loop recompute c..f. Costs
  d iterations; since batch i is a function of i, the recomputed iterations are
  bit-for-bit those of the failure-free run.
- PB-R, predicting-based: restore the last checkpoints, let the predictor
  (Section III-A) predict parameters and Adam's moments at f, write them into the
  engine and resume at batch f. Costs the lag T_p the prediction error causes
  (Eq. 13-14), which training heals by itself.

"Controlled": the choice is made by the recovery cost model (cost_model.py, the model
``planner.cost_model`` names) and logged with its numbers: PB-R when its estimated lag
T_p is below d and a pessimistic lag (cost_model.PESSIMISM times T_p, on top of the
lags the run's earlier predictions left: :func:`carried_lag`) leaves a loss excess at f of at most ``max_loss_excess`` by the job's own loss curve (under a
decaying learning rate a lag stays as a loss excess to the end of training; early in
training, where the loss falls fast, this means RB-R). The predictor's held-out error
``r`` (predicting the newest retained checkpoint from the older ones, relative to not
predicting at all) did not predict the measured lag on the recovery benchmark
(correlation -0.01 over 96 cases), so it serves as a guard against a diverging
prediction: ``r >= max_relative_error`` means RB-R. An unready predictor means RB-R too.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass
from functools import partial
from statistics import median
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
from deepspeed.runtime.lr_schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupLR
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)

from cpsr_ds.checkpoint.fileformat import is_finite
from cpsr_ds.checkpoint.journal import Progress, journal_path, plausible, read_journal
from cpsr_ds.checkpoint.layout import agreed_checkpoints, agreed_progress
from cpsr_ds.config import CPSRConfig, RecoveryConfig
from cpsr_ds.cost_model import PESSIMISM, RECOMPUTE, Choice, CostModel, EmpiricalModel, paper_model, recovery_choice
from cpsr_ds.fitter import (
    MIN_CHECKPOINTS,
    TOO_FEW,
    AccuracyFit,
    NoFit,
    StageCurvature,
    fit_loss_o,
    fit_loss_p,
    fit_recent,
    loss_excess,
    recent_losses,
    stage_xi,
)
from cpsr_ds.predictor import NotReady, make_predictor
from cpsr_ds.runlog import MEASUREMENTS_DIR, held_out_errors, read_measurements
from cpsr_ds.shard import assemble, pack, packed_length, share, unpack

log = logging.getLogger(__name__)

MOMENTS = ("exp_avg", "exp_avg_sq")
REPORTS = "recovery.jsonl"  # one line per start of the job, in the run directory
PREDICTOR_STATE = "cpsr_predictor"  # key of the predictor's weights in DeepSpeed's client state
# DeepSpeed's schedules compute the rate from the batch index, which step() takes.
INDEXED_SCHEDULERS = (LRRangeTest, OneCycle, WarmupLR, WarmupCosineLR)


@dataclass(frozen=True)
class RecoveryReport:
    method: str  # "fresh", "restart" (no checkpoint yet), "recompute" (RB-R), "predict" (PB-R) or "refused"
    reached: int | None  # f: the last iteration every rank finished before the failure
    checkpoint: int | None  # c: the iteration of the restored checkpoint
    resume_iteration: int  # the next batch index the training loop must feed
    reason: str = ""
    predictor: str | None = None
    relative_error: float | None = None  # r: the predictor's held-out error
    estimated_cost: float | None = None  # T_p estimate, iterations
    cost_model: str | None = None  # the model that estimated it (planner.cost_model)
    guard_lag: float | None = None  # the pessimistic lag the loss-excess guard assumes, iterations
    loss_excess: float | None = None  # the relative loss excess guard_lag iterations of lag leave at f
    world_change: str | None = None  # how the job's layout changed since its last start (world.adapt)
    # checkpoint.per_stage PB-R: the checkpoint each pipeline stage was predicted from (c is the newest full cut)
    stage_checkpoints: list[int] | None = None

    @property
    def lost_iterations(self) -> int:
        """d = f - c (f for a restart from scratch)."""
        if self.reached is None:
            return 0
        return self.reached - (self.checkpoint or 0)

    def describe(self) -> str:
        if self.method == "refused":
            return f"cpsr recovery: cannot resume: {self.reason}"
        if self.method == "fresh":
            return "cpsr recovery: no earlier progress, starting at iteration 0"
        if self.method == "restart":
            return f"cpsr recovery: job reached iteration {self.reached} but no checkpoint was committed; restarting from iteration 0"
        head = f"cpsr recovery: job reached iteration {self.reached}, last checkpoint {self.checkpoint}; "
        if self.stage_checkpoints:
            head = (f"cpsr recovery: job reached iteration {self.reached}, last full cut {self.checkpoint}, stages' "
                    f"last checkpoints {', '.join(map(str, self.stage_checkpoints))}; ")
        if self.method == "predict":
            cost = "" if self.estimated_cost is None else f"estimated lag {self.estimated_cost:.1f} iterations against "
            return head + (
                f"predict (PB-R) with {self.predictor}: resuming at iteration {self.resume_iteration}, "
                f"{cost}{self.lost_iterations} to recompute ({self.reason})"
            )
        return head + (
            f"recompute (RB-R): {self.lost_iterations} iterations to redo, {self.checkpoint} saved against a restart "
            f"from scratch" + (f" ({self.reason})" if self.reason else "")
        )


def append_report(directory: str, report: RecoveryReport) -> None:
    with open(os.path.join(directory, REPORTS), "a") as f:
        f.write(json.dumps({**asdict(report), "description": report.describe()}) + "\n")


def read_reports(directory: str) -> list[RecoveryReport]:
    """Every start's recovery decision, oldest first."""
    with open(os.path.join(directory, REPORTS)) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [RecoveryReport(**{k: v for k, v in row.items() if k != "description"}) for row in rows]


def earlier_reports(directory: str) -> list[RecoveryReport]:
    """:func:`read_reports`, none for a run directory without any (a node that never held rank 0's)."""
    try:
        return read_reports(directory)
    except FileNotFoundError:
        return []


def carried_lag(reports: list[RecoveryReport], c: int) -> float:
    """The lag, in iterations, that a run resumed from checkpoint c carries from its earlier predictions.

    Each PB-R's estimated lag stays with the run, unless a later start restored a
    checkpoint from before that prediction's f (recomputing past it undid it) or
    started from scratch; a checkpoint after f holds the predicted state and its lag.
    """
    carried: list[tuple[int, float]] = []  # (f, estimated lag) of the predictions in the run's lineage
    for report in reports:
        restored = report.checkpoint if report.checkpoint is not None else 0
        carried = [(f, lag) for f, lag in carried if f <= restored]
        if report.method == "predict" and report.estimated_cost is not None:
            carried.append((report.reached, report.estimated_cost))
    return sum(lag for f, lag in carried if f <= c)


# ---------------------------------------------------------------- engine state


def _base_optimizer(engine):
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def _partitioned(engine) -> bool:
    """ZeRO-1/2 and bf16 keep fp32 masters and moments in partitions behind ``_hp_mapping``."""
    return any(hasattr(p, "_hp_mapping") for p in engine.module.parameters())


def _link_partitions(engine) -> None:
    """(Re)link each parameter's view of the ZeRO optimizer's moments.

    load_checkpoint rebuilds the parameters' fragment mappings without their moment
    views but leaves the optimizer's "linked" flag set, so the flag is cleared first.
    """
    optimizer = engine.optimizer
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def engine_state(engine) -> dict[str, torch.Tensor]:
    """This stage's full fp32 parameters and Adam moments, keyed ``kind/name``.

    Under ZeRO the values are gathered over the data-parallel group (every rank of it
    must call this, in the same order).
    """
    state = {}
    partitioned = _partitioned(engine)
    if partitioned:
        _link_partitions(engine)
    opt_state = _base_optimizer(engine).state
    for name, p in engine.module.named_parameters():
        if partitioned:
            state[f"param/{name}"] = safe_get_full_fp32_param(p).detach().float().cpu()
            for kind in MOMENTS:
                state[f"{kind}/{name}"] = safe_get_full_optimizer_state(p, kind).detach().float().cpu()
        else:
            state[f"param/{name}"] = p.detach().float().cpu().clone()
            for kind in MOMENTS:
                state[f"{kind}/{name}"] = opt_state[p][kind].detach().float().cpu().clone()
    return state


class DataParallel(NamedTuple):
    """This rank's place among its stage's data-parallel replicas (one replica: no process group)."""

    rank: int
    size: int
    group: object = None


def data_parallel(engine) -> DataParallel:
    grid = getattr(engine, "grid", None)
    if grid is None:
        return DataParallel(0, 1)
    return DataParallel(grid.get_data_parallel_rank(), grid.get_data_parallel_world_size(),
                        grid.get_data_parallel_group())


def own_share(engine, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This data-parallel rank's share of its stage's ``state`` (:mod:`cpsr_ds.shard`), the predictor's part.

    An even slice of each flattened tensor, whatever the optimizer partitions: under
    ZeRO, owning exactly the rank's own partition (and reading it without the gather
    engine_state makes) is left for later.
    """
    dp = data_parallel(engine)
    return share(state, dp.rank, dp.size)


def state_shapes(engine) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor :func:`engine_state` gives, by key."""
    return {f"{kind}/{name}": tuple(p.shape) for name, p in engine.module.named_parameters()
            for kind in ("param", *MOMENTS)}


def full_state(engine, own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The stage's state from every data-parallel rank's share of it, ``own`` this rank's (:func:`own_share`).

    A collective over the stage's data-parallel group: one all_gather of each rank's
    share packed into a vector, padded to the longest share.
    """
    dp, shapes = data_parallel(engine), state_shapes(engine)
    if dp.size == 1:
        return assemble([own], shapes)
    lengths = [packed_length(shapes, r, dp.size) for r in range(dp.size)]
    flat = pack(own)
    if flat.numel() != lengths[dp.rank]:
        raise ValueError(f"cpsr recovery: data-parallel rank {dp.rank} of stage {engine.stage_id} holds "
                         f"{flat.numel()} values of the predicted state, its share is {lengths[dp.rank]}")
    longest = max(lengths)
    padded = torch.zeros(longest, device=engine.device)
    padded[:flat.numel()] = flat.to(engine.device)
    gathered = [torch.empty_like(padded) for _ in range(dp.size)]
    dist.all_gather(gathered, padded, group=dp.group)
    return assemble([unpack(g[:n].cpu(), shapes, r, dp.size) for r, (g, n) in enumerate(zip(gathered, lengths))],
                    shapes)


def load_engine_state(engine, state: dict[str, torch.Tensor]) -> None:
    """Write ``state`` (as from :func:`engine_state`) into the engine: masters, moments, model weights."""
    partitioned = _partitioned(engine)
    if partitioned:
        _link_partitions(engine)
    opt_state = _base_optimizer(engine).state
    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            if partitioned:
                safe_set_full_fp32_param(p, state[f"param/{name}"].to(p.device))
                for kind in MOMENTS:
                    safe_set_full_optimizer_state(p, state[f"{kind}/{name}"].to(p.device), kind)
            else:
                p.copy_(state[f"param/{name}"])
                for kind in MOMENTS:
                    opt_state[p][kind].copy_(state[f"{kind}/{name}"])
    if partitioned:
        # The low-precision (or, for fp32 ZeRO, the module's own) weights the forward
        # pass uses are refreshed from the fp32 partitions.
        engine.optimizer.update_lp_params()


def advance_counters(engine, iterations: int) -> None:
    """Move the step counters as if ``iterations`` optimizer steps had run."""
    engine.global_steps += iterations
    engine.global_samples += iterations * engine.train_batch_size()
    for st in _base_optimizer(engine).state.values():
        if "step" in st:
            st["step"] += iterations
    scheduler = engine.lr_scheduler
    if isinstance(scheduler, INDEXED_SCHEDULERS):
        scheduler.step(scheduler.last_batch_iteration + iterations)
    elif scheduler is not None:
        # A torch scheduler only steps one at a time; the journal's checks bound d.
        for _ in range(iterations):
            scheduler.step()


def planned_iterations(engine) -> int | None:
    """The training length the LR schedule plans (DeepSpeed's decaying schedules); None: unknown."""
    total = getattr(engine.lr_scheduler, "total_num_steps", None)
    return total if isinstance(total, int) else None


# ---------------------------------------------------------------- finiteness


def nonfinite_tensor(state: dict[str, torch.Tensor]) -> str | None:
    """The key of the first floating tensor of ``state`` holding a NaN or an infinity."""
    return next((k for k, t in state.items() if t.is_floating_point() and not is_finite(t)), None)


def on_any_rank(local: str | None, among=None) -> str | None:
    """The first rank's non-None ``local`` (naming the rank when there are several), on every rank.

    Each rank holds its own stage or partition, so what one rank finds must make all
    of them decide alike. ``among``: only the ranks that pass the same (their pipeline
    stage, where each stage decides for itself) count.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, (among, local))
    return next((f"rank {r}: {value}" for r, (group, value) in enumerate(found)
                 if value is not None and group == among), None)


class Retained(NamedTuple):
    """A loaded checkpoint as recovery keeps it: this rank's share of the stage's state, and the stage's xi."""

    iteration: int
    share: dict[str, torch.Tensor]  # own_share of its engine_state
    curvature: StageCurvature | NoFit  # stage_xi of the stage's whole state, for the paper's cost model


def _load_checked(engine, directory: str, tag: str | None, among=None) -> tuple[dict, Retained | None]:
    """Load ``tag``; (client state, what recovery keeps of it), None where a rank (of those ``among`` names, see
    :func:`on_any_rank`) holds a non-finite value. ``tag`` None: load nothing, only join the others' check.

    Each rank keeps its share only: the full state goes as soon as it is sliced, and the
    shares, together the whole state, are checked for finiteness each by its rank.
    """
    if tag is None:
        on_any_rank(None, among)
        return {}, None
    client_state = _load(engine, directory, tag)
    state = engine_state(engine)
    kept = Retained(engine.global_steps, own_share(engine, state), stage_xi(state))
    del state
    bad = on_any_rank(nonfinite_tensor(kept.share), among)
    if bad is None:
        return client_state, kept
    log.error("cpsr recovery: checkpoint %s in %s has non-finite values in %s: leaving it out", tag, directory, bad)
    return client_state, None


def _restore(engine, directory: str, candidates) -> tuple[dict, Retained]:
    """Load the first of ``candidates`` (newest first) whose state is finite; (client state, what is kept of it)."""
    tags = [ck.tag for ck in candidates]
    for tag in tags:
        client_state, kept = _load_checked(engine, directory, tag)
        if kept is not None:
            return client_state, kept
    raise RuntimeError(f"cpsr recovery: no checkpoint in {directory} has a finite state (tried {', '.join(tags)}); "
                       "move them away to start from scratch")


def _load_history(engine, directory: str, verified: list, n: int) -> tuple[list[Retained], dict]:
    """The finite states among the ``n`` newest checkpoints (this rank's shares), oldest first, and c's client state.

    c is the newest checkpoint with a finite state, and the engine is left holding it,
    the state RB-R falls back to.
    """
    window = verified[-n:]
    history, good, client_state = [], [], {}
    for ck in window:
        loaded, kept = _load_checked(engine, directory, ck.tag)
        if kept is not None:
            history.append(kept)
            good.append(ck)
            client_state = loaded
    if good and good[-1] is window[-1]:
        return history, client_state
    client_state, kept = _restore(engine, directory, [*reversed(good), *reversed(verified[:-n])])
    return history or [kept], client_state


# ---------------------------------------------------------------- the decision


def _load(engine, directory: str, tag: str) -> dict:
    """Load ``tag`` into the engine, at whatever data-parallel degree it was written (:func:`zero_resharded`)."""
    resharded = zero_resharded(engine, directory, tag)
    load_path, client_state = engine.load_checkpoint(directory, tag=tag, load_optimizer_states=resharded is None)
    if load_path is None:
        raise RuntimeError(f"cpsr recovery: DeepSpeed could not load checkpoint {tag} in {directory}")
    if resharded is not None:
        state, saved = resharded
        _restore_groups(_base_optimizer(engine), saved)
        load_engine_state(engine, state)
    return client_state or {}


def zero_resharded(engine, directory: str, tag: str) -> tuple[dict[str, torch.Tensor], dict] | None:
    """Under ZeRO, a checkpoint written at another data-parallel degree: (its engine_state, its first rank's
    base optimizer state: the groups' settings and step); else None.

    DeepSpeed refuses to load ZeRO partitions into another degree. Its universal
    checkpoint would convert every checkpoint to a new folder first (ds_to_universal, a
    separate pass writing as much again); instead this reads the old ranks' partitions
    (every rank reads them all: the stage's full state in host memory, as engine_state
    needs anyway) and reassembles the full fp32 parameters and moments, which
    load_engine_state writes into the new partitions, the way a predicted state is
    written. Model weights, counters and the LR schedule load through DeepSpeed as usual.
    """
    if not engine.zero_optimization():
        return None
    model_states = engine.checkpoint_engine.load(engine._get_ckpt_name(directory, tag), map_location="cpu")
    old = model_states["dp_world_size"]
    if old == engine.dp_world_size:
        return None
    log.info("cpsr recovery: checkpoint %s was written by %d data-parallel ranks, this job has %d: "
             "reassembling its ZeRO partitions", tag, old, engine.dp_world_size)
    names = engine._get_mp_rank_zero_checkpoint_names(load_dir=directory, tag=tag, mp_rank=engine.checkpoint_mp_rank,
                                                      dp_world_size=old, bf16_mode=engine.bfloat16_enabled())
    parts = [engine.checkpoint_engine.load(name, map_location="cpu")["optimizer_state_dict"] for name in names]
    return full_zero_state(parts, model_states["param_shapes"]), parts[0]["base_optimizer_state"]


def _restore_groups(optimizer, saved: dict) -> None:
    """A ZeRO checkpoint's per-group settings (the learning rate the schedule set) and step, from one rank's
    ``saved`` base optimizer state, and zero moments for load_engine_state to fill: loaded without its
    optimizer states, the engine's Adam has none yet."""
    for g, group in enumerate(optimizer.param_groups):
        group.update({k: v for k, v in saved["param_groups"][g].items() if k != "params"})
        step = saved["state"][g]["step"]
        for p in group["params"]:
            optimizer.state[p].update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p),
                                      step=step.clone() if torch.is_tensor(step) else step)


def full_zero_state(parts: list[dict], param_shapes: list[dict]) -> dict[str, torch.Tensor]:
    """engine_state's dict from ZeRO-1/2 optimizer state dicts of every data-parallel rank, in rank order.

    Each param group is one flat tensor, cut into consecutive partitions, one per rank;
    ``param_shapes`` (the checkpoint's) names the parameters in their order in it, each
    followed by its alignment padding.
    """
    state = {}
    for g, shapes in enumerate(param_shapes):
        flat = {"param": torch.cat([p["single_partition_of_fp32_groups"][g] for p in parts])}
        for kind in MOMENTS:
            flat[kind] = torch.cat([p["base_optimizer_state"]["state"][g][kind] for p in parts])
        offset = 0
        for (name, shape), padding in zip(shapes.items(), parts[0]["param_alignment_paddings"][g]):
            n = math.prod(shape)
            for kind, t in flat.items():
                state[f"{kind}/{name}"] = t[offset:offset + n].view(shape).float().clone()
            offset += n + padding
    return state


def new_predictor(cfg: CPSRConfig):
    p = cfg.predictor
    return make_predictor(p.name, history=p.history, params=p.params, moments=p.moments)


def recover(engine, cfg: CPSRConfig, predictor) -> RecoveryReport:
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
    # Every rank gets the same checkpoints, verified on each node (layout.py).
    verified = agreed_checkpoints(cfg.checkpoint)
    full = [ck for ck in verified if ck.full]
    if not full:
        return RecoveryReport("fresh" if reached is None else "restart", reached, None, 0)
    newest = full[-1]
    nothing_lost = reached is None or newest.iteration is None or reached <= newest.iteration
    if nothing_lost or cfg.recovery.mode == "recompute":
        _restore(engine, directory, reversed(full))
        c = engine.global_steps
        if reached is not None and reached < c:
            # Every rank finished c before it was committed: a journal ending earlier is stale.
            log.error("cpsr recovery: the journals end at iteration %d, before committed checkpoint %d: a journal "
                      "of a rank no longer in the job, or one that lost lines; taking %d", reached, c, c)
            reached = c
        reason = "recovery.mode is recompute" if reached is not None and reached > c else ""
        return RecoveryReport("recompute", reached, c, c, reason=reason)
    if cfg.checkpoint.per_stage and engine.num_stages > 1:
        return _recover_stages(engine, cfg, predictor, progress, verified, full)

    # The predictor learns from the retained checkpoints up to c.
    history, client_state = _load_history(engine, directory, full, cfg.predictor.history)
    _prepare(predictor, history, client_state)
    # The newest of the history is c's state, the one the engine holds.
    return _decide(engine, cfg, predictor, progress, engine.global_steps, history[-1].curvature)


def _prepare(predictor, history: list[Retained], client_state: dict) -> None:
    """Give ``predictor`` its history (this rank's shares) and, where the checkpoint carries a predictor of its
    kind, its weights (the first data-parallel rank's, which wrote the checkpoint's client state)."""
    if client_state.get(PREDICTOR_STATE, {}).get("name") == predictor.name:
        predictor.load_state_dict(client_state[PREDICTOR_STATE])
    for kept in history:
        predictor.observe(kept.iteration, kept.share)


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
    history, client_state = _stage_history(engine, directory, own, cfg.predictor.history, engine.stage_id)

    def restore() -> int:
        _restore(engine, directory, reversed(full))
        return engine.global_steps

    missing = on_any_rank(None if history else f"stage {engine.stage_id} has no checkpoint with a finite state")
    if missing is not None:
        c = restore()
        return RecoveryReport("recompute", progress.reached, c, c, reason=missing)
    _prepare(predictor, history, client_state)
    newest = dict(_gathered((engine.stage_id, history[-1].iteration)))
    cut = Cut(full[-1].iteration, [newest[s] for s in sorted(newest)], restore)
    return _decide(engine, cfg, predictor, progress, engine.global_steps, history[-1].curvature, cut)


def _gathered(local, group=None) -> list:
    """Every rank's ``local`` (of ``group``, default all), in rank order (just ``[local]`` without a process
    group)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [local]
    found = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, local, group=group)
    return found


def _stage_history(engine, directory: str, own: list, n: int, stage: int) -> tuple[list[Retained], dict]:
    """This stage's finite states among the ``n`` newest of ``own`` checkpoints (this rank's shares), oldest
    first, and the newest's client state; the engine is left holding the newest finite one.

    Stages hold different numbers of checkpoints: every rank loads as often as the one
    with the most (an empty round where it has fewer), so that the checks' collectives pair up.
    """
    window = own[-n:]
    rounds = max(_gathered(len(window)))
    history, client_state, newest = [], {}, None
    for ck in [None] * (rounds - len(window)) + window:
        loaded, kept = _load_checked(engine, directory, ck and ck.tag, among=stage)
        if kept is not None:
            history.append(kept)
            client_state, newest = loaded, ck
    if newest is not None and newest is not window[-1]:
        # Loading involves no rank beyond this stage's.
        client_state = _load(engine, directory, newest.tag)
    return history, client_state


def implausible_reach(progress: Progress, c: int, planned: int | None) -> str | None:
    """Why the journal's f is not to be predicted to from checkpoint c; None: it is plausible."""
    f = progress.reached
    if planned is not None and f > planned:
        return (f"the journal's iteration {f} is beyond the planned training length, {planned} iterations "
                "(the LR schedule's total_num_steps)")
    start = progress.covered_from(f)
    if start is None or start > c + 1:
        return f"the journals do not record every iteration from {c + 1} to {f}"
    return None


def _decide(engine, cfg: CPSRConfig, predictor, progress: Progress, c: int, curvature: StageCurvature | NoFit,
            cut: Cut | None = None) -> RecoveryReport:
    """PB-R or RB-R for a failure at the journal's f, the engine holding checkpoint c, ``curvature`` its stage_xi.

    ``predictor`` holds this data-parallel rank's share of the stage: each rank predicts
    its share and checks its own held-out error; the stage's error is the worst of them,
    so that the stage's ranks decide alike, and the predicted shares are assembled
    (:func:`full_state`) into the state written into the engine.

    ``cut`` (per stage): c is this stage's own; recomputing restores the newest full cut
    and redoes the iterations from there, the cost PB-R is weighed against.
    """
    f = progress.reached
    base = c if cut is None else cut.iteration
    d = f - base

    def recompute(reason: str, **numbers) -> RecoveryReport:
        restored = c if cut is None else cut.restore()
        return RecoveryReport("recompute", f, restored, restored, reason=reason, **numbers)

    implausible = implausible_reach(progress, c if cut is None else min(cut.stages), planned_iterations(engine))
    if implausible is not None:
        log.error("cpsr recovery: %s: recomputing from checkpoint %d", implausible, base)
        return recompute(implausible)
    numbers = {"predictor": predictor.name}
    ready = f != c and predictor.ready()
    held_out = predictor.validation_error() if ready else None
    r = worst_error(_gathered(None if held_out is None else held_out.relative, data_parallel(engine).group))
    if f == c:  # per stage: this stage's own checkpoint is at f, nothing to predict
        why, predicted = None, None
    elif ready:
        losses = progress_losses(progress)
        model = recovery_model(cfg.planner.cost_model, cfg.checkpoint.dir, losses, engine.stage_id, predictor.name,
                               f, c, curvature)
        choice = recovery_choice(model.estimate(f, c, predictor.name), d, excess_at(losses, f),
                                 cfg.recovery.max_loss_excess, PESSIMISM, carried_lag(earlier_reports(cfg.checkpoint.dir), c))
        numbers.update(relative_error=r, estimated_cost=choice.estimate.lag, cost_model=model.name,
                       guard_lag=choice.guard_lag, loss_excess=choice.loss_excess)
        why, predicted = _prediction(cfg.recovery, predictor, f, r, choice)
    else:
        why, predicted = f"predictor {predictor.name} not ready", None
    # Readiness and the held-out error are each rank's own (its stage, its shard): one
    # rank's reason to recompute is every rank's.
    why = on_any_rank(why)
    if why is not None:
        return recompute(why, **numbers)
    if predicted is not None:
        load_engine_state(engine, full_state(engine, predicted))
    advance_counters(engine, f - c)
    reason = ("recovery.mode is predict" if cfg.recovery.mode == "predict"
              else f"stage {engine.stage_id} checkpointed at {f}" if predicted is None
              else f"held-out error r = {r:.3f}, {choice.reason}")
    return RecoveryReport("predict", f, base, f, reason=reason, stage_checkpoints=cut and cut.stages, **numbers)


def worst_error(errors: list[float | None]) -> float | None:
    """The stage's held-out error from its data-parallel ranks' own (each of its share): the worst, NaN the
    worst of all; None where any rank has none."""
    if any(e is None for e in errors):
        return None
    return max(errors, key=lambda e: math.inf if math.isnan(e) else e)


def _prediction(rc: RecoveryConfig, predictor, f: int, r: float | None,
                choice: Choice) -> tuple[str | None, dict | None]:
    """This rank's (reason to recompute, None) or (None, its share of the predicted state at f)."""
    if rc.mode == "auto":
        why = fallback_reason(rc, r, choice)
        if why is not None:
            return why, None
    try:
        predicted = predictor.predict(f)
    except NotReady as err:
        return str(err), None
    bad = nonfinite_tensor(predicted)
    if bad is not None:
        return f"the predicted state has non-finite values in {bad}", None
    return None, predicted


def fallback_reason(rc: RecoveryConfig, r: float | None, choice: Choice) -> str | None:
    """Why ``recovery.mode: auto`` recomputes rather than predicts with a ready predictor; None: predict.

    ``r``: the held-out error (a NaN fails the comparison, so recomputes); ``choice``: the
    cost model's, with its loss-excess guard.
    """
    if r is None:
        return "the predictor has no held-out checkpoint to check it against"
    if not r < rc.max_relative_error:
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


# ---------------------------------------------------------------- the cost model


def recovery_model(name: str, directory: str, losses: dict[int, float], stage: int, predictor: str, f: int, c: int,
                   curvature: StageCurvature | NoFit) -> CostModel:
    """The recovery cost model ``planner.cost_model`` names, for a failure at f restored from checkpoint c.

    The paper's (Eq. 13; Eq. 14 for ``paper-eq14``) is built from the run's own records:
    Eq. 11 over ``losses`` (rank 0's journaled losses) up to f (the recent window fit_loss_o takes),
    Eq. 8 over the held-out errors the measurements hold for ``stage`` and ``predictor``
    at the checkpoints up to c, and xi and N_p (Eq. 7) of ``curvature``, stage_xi of the stage's state at c.
    Each error was measured predicting a checkpoint one interval ahead; under interval
    auto the intervals differ, so T_c is the median spacing of the checkpoints the
    errors were measured at. A missing input (no measurements: a run from before they
    were recorded, or one in recovery.mode recompute) or a NoFit leaves the model
    without params, and its estimate says why.
    """
    if name == "empirical":
        return EmpiricalModel()
    if name not in ("paper", "paper-eq14"):
        raise ValueError(f"planner.cost_model {name!r}: not a recovery cost model (empirical, paper, paper-eq14)")
    rows, problems = read_measurements(directory)
    for problem in problems:
        log.warning("cpsr recovery: skipping a damaged measurement: %s", problem)
    whose = f"{predictor} for stage {stage} up to iteration {c} in {os.path.join(directory, MEASUREMENTS_DIR)}"
    accuracy = accuracy_fit(held_out_errors(rows, stage, predictor, upto=c), whose)
    return paper_model(fit_loss_o(losses, f), accuracy, curvature, exact=name == "paper")


def accuracy_fit(points: list[tuple[int, float]], where: str) -> AccuracyFit | NoFit:
    """Eq. 8 over (checkpoint iteration, held-out error) ``points`` at their median spacing; ``where``: whose."""
    if len(points) < MIN_CHECKPOINTS:
        return NoFit(TOO_FEW, f"{len(points)} held-out errors of {where}, need at least {MIN_CHECKPOINTS}")
    iterations = [t for t, _ in points]
    return fit_loss_p(points, float(median(b - a for a, b in zip(iterations, iterations[1:]))))
