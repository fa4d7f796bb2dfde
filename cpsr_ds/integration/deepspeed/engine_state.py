"""The engine-state I/O: a stage's fp32 parameters and Adam moments read from and written into DeepSpeed's
engine (plain, ZeRO-1/2 and bf16 partitions), this data-parallel rank's share of them, and the step counters.

Checked against DeepSpeed 0.19.8. Private names used: a parameter's ``_hp_mapping`` (its fragment of the fp32
partition: utils/mixed_precision_linkage.py and utils/tensor_fragment.py, ``lp_fragment_address``, ``get_hp_fragment``,
``optim_fragment``); the ZeRO-1/2 optimizer's ``_lazy_init_hp_params_optimizer_state`` and
``_hp_optimizer_states_linked`` (runtime/zero/stage_1_and_2.py and runtime/bf16_optimizer.py), its
``parallel_partitioned_bit16_groups``, ``single_partition_of_fp32_groups`` and ``real_dp_process_group``
(runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer.__init__); ``update_lp_params`` (both optimizers). Under
ZeRO-3 (runtime/zero/stage3.py DeepSpeedZeroOptimizer_Stage3): a parameter's ``ds_tensor`` (this rank's partition,
``ds_numel`` elements of ``ds_shape`` in all), ``get_local_fp32_param`` (its fp32 partition and moments, views of
the sub-group's flat partition) and ``_reassign_or_swap_out_partitioned_parameters`` (what each step does after).
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
import torch.distributed as dist
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.lr_schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupLR
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)

from cpsr_ds.planning.fitter import XiSums, xi_sums
from cpsr_ds.planning.lr_schedule import CONSTANT, UNKNOWN, Shape, shape
from cpsr_ds.integration.deepspeed.shard import assemble, pack, packed_length, share, unpack

MOMENTS = ("exp_avg", "exp_avg_sq")
# DeepSpeed's schedules compute the rate from the batch index, which step() takes.
INDEXED_SCHEDULERS = (LRRangeTest, OneCycle, WarmupLR, WarmupCosineLR)


def base_optimizer(engine):
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def stepped_tensors(engine) -> list[tuple[int, torch.Tensor]]:
    """(param group, tensor) for every tensor the base optimizer keeps Adam's state for. ZeRO-3 hands its torch
    optimizer each sub-group's fp32 flat partition only while it steps that sub-group (DeepSpeed 0.19.8,
    stage3.py ``_optimizer_step``), so its param groups are empty between steps."""
    if zero3(engine):
        zero = engine.optimizer
        return [(zero.sub_group_to_group_id[i], flat) for i, flat in enumerate(zero.fp32_partitioned_groups_flat)]
    return [(g, p) for g, group in enumerate(base_optimizer(engine).param_groups) for p in group["params"]]


def partitioned(engine) -> bool:
    """ZeRO-1/2 and bf16 keep fp32 masters and moments in partitions behind ``_hp_mapping``; ZeRO-3 in its
    sub-groups' flat partitions (:func:`zero3`)."""
    return zero3(engine) or any(hasattr(p, "_hp_mapping") for p in engine.module.parameters())


def zero3(engine) -> bool:
    """ZeRO-3: each rank holds its partition of every parameter, the module's own tensors are empty."""
    return isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3)


def param_shape(p: torch.Tensor) -> torch.Size:
    """A parameter's whole shape, where ZeRO-3 has partitioned it too (the module's tensor then is empty)."""
    return getattr(p, "ds_shape", p.shape)


def fragment_of(engine, p) -> tuple[int, int, torch.dtype]:
    """(start, numel, dtype): where this rank's fp32 fragment of a partitioned ``p`` lies in the flattened
    parameter, from the parameters alone (a restart asks before the optimizer holds any state)."""
    if zero3(engine):
        size = p.ds_tensor.ds_numel
        start = data_parallel(engine).rank * size
        return start, max(0, min(size, p.ds_numel - start)), torch.float32
    mapping = p._hp_mapping
    if mapping is None:
        return 0, 0, torch.get_default_dtype()
    return mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel, mapping.hp_fragment.dtype


def _zero3_fragment(engine, p) -> tuple[int, int, dict[str, torch.Tensor]]:
    """(start, numel, parts): this rank's ZeRO-3 partition of ``p`` in the flattened parameter, its fp32 master
    and moments (views, the partition's padding cut off). A KeyError before the first step made the moments."""
    optimizer = engine.optimizer
    start, numel, _ = fragment_of(engine, p)
    parts = {"param": optimizer.get_local_fp32_param(p),
             **{kind: optimizer.get_local_fp32_param(p, kind) for kind in MOMENTS}}
    return start, numel, {kind: t.narrow(0, 0, numel) for kind, t in parts.items()}


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
    zero = partitioned(engine)
    if zero:
        _link_partitions(engine)
    opt_state = base_optimizer(engine).state
    for name, p in engine.module.named_parameters():
        if zero:
            state[f"param/{name}"] = safe_get_full_fp32_param(p).detach().float().cpu()
            for kind in MOMENTS:
                state[f"{kind}/{name}"] = safe_get_full_optimizer_state(p, kind).detach().float().cpu()
        else:
            state[f"param/{name}"] = p.detach().float().cpu().clone()
            for kind in MOMENTS:
                state[f"{kind}/{name}"] = opt_state[p][kind].detach().float().cpu().clone()
    return state


def local_state(engine) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, int]]]:
    """(state, fragments): this rank's parameters and Adam moments keyed as ``engine_state`` keys them, no collective.

    Unpartitioned, each is the whole tensor (the live one, not a copy). Under ZeRO/bf16
    each is this rank's fragment of the fp32 master or moment, flat, at ``fragments[name]``
    = (start, numel) of the flattened tensor; a fragment covering the whole tensor is
    given in its shape and not listed. Before the optimizer's first step there are no moments:
    a KeyError, as without partitions.
    """
    state, fragments = {}, {}
    if not partitioned(engine):
        opt_state = base_optimizer(engine).state
        for name, p in engine.module.named_parameters():
            state[f"param/{name}"] = p.detach()
            for kind in MOMENTS:
                state[f"{kind}/{name}"] = opt_state[p][kind].detach()
        return state, fragments
    if not zero3(engine) and any(p._hp_mapping is not None and p._hp_mapping.optim_fragment is None
                                 for p in engine.module.parameters()):
        _link_partitions(engine)
    for name, p in engine.module.named_parameters():
        start, numel, parts = _zero3_fragment(engine, p) if zero3(engine) else _hp_fragment(p)
        whole = start == 0 and numel == param_shape(p).numel()
        for kind, t in parts.items():
            state[f"{kind}/{name}"] = t.detach().view(param_shape(p)) if whole else t.detach()
        if not whole:
            fragments[name] = (start, numel)
    return state, fragments


def _hp_fragment(p) -> tuple[int, int, dict[str, torch.Tensor]]:
    """(start, numel, parts): this rank's ZeRO-1/2 or bf16 fragment of ``p`` behind its ``_hp_mapping``."""
    mapping = p._hp_mapping
    if mapping is None:
        return 0, 0, {k: torch.empty(0) for k in ("param", *MOMENTS)}
    try:
        parts = {"param": mapping.get_hp_fragment(), **{k: mapping.get_hp_fragment(k) for k in MOMENTS}}
    except ValueError as err:  # DeepSpeed's words for a moment no optimizer step has made yet
        raise KeyError(str(err)) from err
    return mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel, parts


def replica_weights(engine) -> dict[str, torch.Tensor] | None:
    """The module's whole weights by parameter name (live tensors), where a data-parallel peer that lost its state
    needs them: under ZeRO-1/2 (and bf16) every replica holds the module's weights whole but only its own partition
    of the fp32 masters and moments. None where the rank's own state already is whole, or it has no replica."""
    if not partitioned(engine) or zero3(engine) or data_parallel(engine).size == 1:
        return None
    return {name: p.detach() for name, p in engine.module.named_parameters()}


def load_local_state(engine, state: dict[str, torch.Tensor], fragments: dict[str, tuple[int, int]]) -> None:
    """Write ``state``, as :func:`local_state` read it on this rank, back into the engine; under ZeRO/bf16 a
    collective over the stage's data-parallel group (the module's weights are refreshed from the partitions)."""
    zero = partitioned(engine)
    with torch.no_grad():
        if not zero:
            opt_state = base_optimizer(engine).state
            for name, p in engine.module.named_parameters():
                p.copy_(state[f"param/{name}"])
                for kind in MOMENTS:
                    opt_state[p][kind].copy_(state[f"{kind}/{name}"])
            return
        _link_partitions(engine)
        for name, p in engine.module.named_parameters():
            if not zero3(engine) and p._hp_mapping is None:
                continue
            start, numel, parts = _zero3_fragment(engine, p) if zero3(engine) else _hp_fragment(p)
            if fragments.get(name, (0, param_shape(p).numel())) != (start, numel):
                saved = fragments.get(name, (0, param_shape(p).numel()))
                raise ValueError(f"cpsr recovery: rank {engine.global_rank}'s saved fragment of {name} is "
                                 f"[{saved[0]}, {saved[0] + saved[1]}), its partition now holds another")
            if numel == 0:  # a ZeRO-3 partition of padding only: own_share leaves it out
                continue
            for kind, fragment in parts.items():
                fragment.copy_(state[f"{kind}/{name}"].reshape(fragment.shape))
    update_weights(engine)


def update_weights(engine) -> None:
    """Refresh the module's weights from the fp32 partitions: the optimizer's ``update_lp_params``, what every
    optimizer step does, except that under ZeRO-1/2 on the host each rank's partition is broadcast into the
    others' buffers in place.

    DeepSpeed gathers each group's whole flat buffer with one all_gather_into_tensor, which gloo
    stages through a temporary as large as the stage's weights: at every load of a restart, on top
    of the predictor's history. A broadcast of a dense tensor needs none.
    """
    optimizer = engine.optimizer
    if zero3(engine):
        # As DeepSpeed wraps a checkpoint load (0.19.8, stage3.py ``checkpoint_event_prologue``/``_epilogue``):
        # every parameter released to its partition first, and after the partitions are written the persistent
        # ones (small parameters kept whole on every rank) gathered again. Without it the forward after a restore
        # runs on the persistent parameters as they were before it.
        optimizer.checkpoint_event_prologue()
        for sub_group in range(len(optimizer.fp32_partitioned_groups_flat)):
            optimizer._reassign_or_swap_out_partitioned_parameters(sub_group)
        optimizer.checkpoint_event_epilogue()
        return
    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or engine.device.type != "cpu":
        optimizer.update_lp_params()
        return
    for parts, fp32, group in zip(optimizer.parallel_partitioned_bit16_groups,
                                  optimizer.single_partition_of_fp32_groups, optimizer.real_dp_process_group):
        parts[dist.get_rank(group=group)].data.copy_(fp32.data)
        if len(parts) > 1:
            for r, part in enumerate(parts):
                dist.broadcast(part, src=dist.get_global_rank(group, r), group=group)


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


def own_share(engine, copy: bool = True) -> dict[str, torch.Tensor]:
    """This data-parallel rank's share of its stage's fp32 parameters and Adam moments (:mod:`cpsr_ds.integration.deepspeed.shard`), the
    predictor's part, on the host in fp32 and keyed as :func:`engine_state` keys them; no collective.

    Under ZeRO/bf16 the share is the rank's own partition, as :func:`local_state` reads it (a
    parameter outside it is left out), so that nothing gathers the stage's state and a
    prediction goes back into the partition it came from (:func:`load_own_share`). Otherwise
    every replica holds the whole state and the share is an even slice of each flattened tensor.

    ``copy`` False: the engine's own tensors wherever they are fp32 on the host already, for a
    reader that copies what it keeps before the engine changes (recovery's predictor, which
    would otherwise hold each checkpoint twice).
    """
    return {k: t.to("cpu", torch.float32, copy=copy) for k, t in own_views(engine).items() if t.numel()}


def own_views(engine) -> dict[str, torch.Tensor]:
    """:func:`own_share`'s tensors as the engine holds them: views, in the engine's dtypes and on its device."""
    state, _ = local_state(engine)
    dp = data_parallel(engine)
    if not partitioned(engine) and dp.size > 1:
        state = share(state, dp.rank, dp.size, copy=False)
    return state


def stage_sums(engine, own: dict[str, torch.Tensor]) -> XiSums:
    """The :class:`~cpsr_ds.planning.fitter.XiSums` of the stage's whole state from every data-parallel rank's ``own`` share
    (:func:`own_share`): a collective over the stage's data-parallel group, three numbers all-reduced."""
    sums = xi_sums(own)
    dp = data_parallel(engine)
    if dp.size == 1:
        return sums
    total = torch.tensor(sums, dtype=torch.float64, device=engine.device)
    dist.all_reduce(total, group=dp.group)
    v_sum, count, n_p = total.tolist()
    return XiSums(v_sum, round(count), round(n_p))


def load_own_share(engine, own: dict[str, torch.Tensor]) -> None:
    """Write this rank's ``own`` share (as :func:`own_share` reads it: a predicted one) into the engine.

    Under ZeRO/bf16 into the rank's own partition, no gather; the module's weights are refreshed
    from the partitions (:func:`update_weights`, what every optimizer step does). Otherwise each
    replica holds the whole state, so it is assembled from every replica's share
    (:func:`full_state`, a collective over the stage's data-parallel group).
    """
    if partitioned(engine):
        _, fragments = local_state(engine)
        load_local_state(engine, own, fragments)
    else:
        load_local_state(engine, full_state(engine, own), {})


def state_shapes(engine) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor :func:`engine_state` gives, by key."""
    return {f"{kind}/{name}": tuple(param_shape(p)) for name, p in engine.module.named_parameters()
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
    """Write the stage's whole ``state`` (as from :func:`engine_state`) into the engine: masters, moments, model
    weights. Under ZeRO each rank keeps its partition of it."""
    if not partitioned(engine):
        load_local_state(engine, state, {})
        return
    _link_partitions(engine)
    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            safe_set_full_fp32_param(p, state[f"param/{name}"].to(p.device))
            for kind in MOMENTS:
                safe_set_full_optimizer_state(p, state[f"{kind}/{name}"].to(p.device), kind)
    # The low-precision (or, for fp32 ZeRO, the module's own) weights the forward
    # pass uses are refreshed from the fp32 partitions.
    update_weights(engine)


# A param group's settings a snapshot keeps: plain values only (the learning rate the schedule set, betas, ...).
_PLAIN = (int, float, bool, str, type(None))


def group_settings(engine) -> list[dict]:
    """Each of the base optimizer's param groups' settings but its parameters: what the schedule set for the
    next step, which a restart from a snapshot alone (:func:`set_counters`) cannot take from a checkpoint."""
    def plain(v):
        return isinstance(v, _PLAIN) or isinstance(v, (tuple, list)) and all(isinstance(x, _PLAIN) for x in v)
    return [{k: v for k, v in group.items() if k != "params" and plain(v)}
            for group in base_optimizer(engine).param_groups]


def materialize_moments(engine) -> bool:
    """Give every tensor the base optimizer steps Adam's state where the engine holds none yet (before its first
    step), as DeepSpeed's ZeRO-1/2 optimizer can when it is built (stage_1_and_2.py ``initialize_optimizer_states``:
    one step of zero gradients on the fp32 partitions). Its values are to be overwritten (the parameters too:
    weight decay moves them). ZeRO-3 hands its sub-groups to the optimizer only while stepping, so is left as it
    is. Whether every stepped tensor now has its moments."""
    optimizer = base_optimizer(engine)
    tensors = [p for _, p in stepped_tensors(engine)]
    if not zero3(engine) and any(not optimizer.state.get(p) for p in tensors):
        grads = [p.grad for p in tensors]
        for p in tensors:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        for p, grad in zip(tensors, grads):
            p.grad = grad
    return all(all(kind in optimizer.state.get(p, {}) for kind in MOMENTS) for p in tensors)


def set_counters(engine, counters: dict) -> None:
    """Set the step counters, every stepped tensor's Adam step, the LR scheduler's state and the param groups'
    settings to ``counters`` (a snapshot's: checkpoint/capture/dumps.py ``counters``), with Adam's moments
    already there (:func:`materialize_moments`)."""
    engine.global_steps = counters["global_steps"]
    engine.global_samples = counters["global_samples"]
    engine.skipped_steps = counters["skipped_steps"]
    engine.micro_steps = counters["micro_steps"]
    (step,) = counters["optimizer_steps"]  # Adam steps every group together
    optimizer = base_optimizer(engine)
    for _, p in stepped_tensors(engine):
        state = optimizer.state[p]
        state["step"] = torch.full_like(state["step"], step) if torch.is_tensor(state.get("step")) else step
    if engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(counters["lr_scheduler"])
    for group, settings in zip(optimizer.param_groups, counters["param_groups"]):
        group.update(settings)


def advance_counters(engine, iterations: int) -> None:
    """Move the step counters as if ``iterations`` optimizer steps had run."""
    engine.global_steps += iterations
    engine.global_samples += iterations * engine.train_batch_size()
    for st in base_optimizer(engine).state.values():
        if "step" in st:
            st["step"] += iterations
    scheduler = engine.lr_scheduler
    if isinstance(scheduler, INDEXED_SCHEDULERS):
        scheduler.step(scheduler.last_batch_iteration + iterations)
    elif scheduler is not None:
        _step_scheduler(scheduler, iterations, engine.train_batch_size())


def _step_scheduler(scheduler, iterations: int, batch_samples: int) -> None:
    """Step a scheduler that is not DeepSpeed's past ``iterations`` iterations of ``batch_samples`` samples each.

    megatron-core's (and Megatron-DeepSpeed's) OptimizerParamScheduler counts samples, ``step(increment)``, checked
    against megatron-core 0.16.1: one call for them all. A torch scheduler steps one iteration at a time; the
    journal's checks bound d. One whose ``step`` needs other arguments is not guessed at."""
    parameters = inspect.signature(scheduler.step).parameters
    required = [name for name, p in parameters.items() if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if required == ["increment"]:
        scheduler.step(increment=iterations * batch_samples)
    elif required:
        raise TypeError(f"cpsr recovery: cannot advance the learning-rate scheduler {type(scheduler).__name__} "
                        f"by {iterations} iterations: its step() requires {', '.join(required)}")
    else:
        for _ in range(iterations):
            scheduler.step()


def planned_iterations(engine) -> int | None:
    """The training length the LR schedule plans (DeepSpeed's decaying schedules); None: unknown."""
    total = getattr(engine.lr_scheduler, "total_num_steps", None)
    return total if isinstance(total, int) else None


# Points at which schedule_shape reads a schedule: enough for its area to a part in a thousand.
SCHEDULE_SAMPLES = 4096


def schedule_shape(engine, f: int, train_iters: int | None) -> Shape:
    """The learning-rate schedule's shape at iteration ``f`` (planning/lr_schedule.py), read without stepping it.

    Its planned end: DeepSpeed's ``total_num_steps``, else ``train_iters`` (planner.train_iters); DeepSpeed's
    WarmupLR without either is constant after its warm-up. A rate is read from DeepSpeed's schedules by their
    batch index (``last_batch_iteration`` set and restored around ``get_lr()``) and from torch's LambdaLR by its
    lambdas; any other scheduler is unknown.
    """
    scheduler = engine.lr_scheduler
    if scheduler is None:
        return Shape(CONSTANT)
    rate = _rate_reader(scheduler)
    if rate is None:
        return Shape(UNKNOWN, reason=f"cpsr_ds cannot read the rates of a {type(scheduler).__name__}")
    end = planned_iterations(engine) or train_iters
    if end is None and type(scheduler) is WarmupLR:
        end = max(scheduler.warmup_num_steps, f) + 1
    if end is None:
        return Shape(UNKNOWN, reason=f"the planned end of the {type(scheduler).__name__} schedule is not known: "
                                     "set cpsr.planner.train_iters")
    stride = max(1, end // SCHEDULE_SAMPLES)
    rates = [rate(k) for k in range(0, end, stride)]
    cut = -(-f // stride)
    return shape(rates[:cut], rates[cut:])


def _rate_reader(scheduler):
    """k -> the first parameter group's rate at batch index k, or None for a scheduler of another kind."""
    if isinstance(scheduler, INDEXED_SCHEDULERS) or hasattr(scheduler, "last_batch_iteration"):
        def rate(k):
            saved = scheduler.last_batch_iteration
            try:
                scheduler.last_batch_iteration = k
                return float(scheduler.get_lr()[0])
            finally:
                scheduler.last_batch_iteration = saved
        return rate
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return lambda k: float(scheduler.base_lrs[0] * scheduler.lr_lambdas[0](k))
    return None
