"""The one check of a state before recovery resumes from it, whatever its source.

A state (a dict of tensors by key, ``kind/name`` as :func:`~cpsr_ds.integration.deepspeed.engine_state.engine_state` keys them, or a layer's
state dict) may be resumed from only where every tensor is finite, has the shape and dtype the engine holds
in its place (no tensor missing, none the engine has no place for), and Adam's second moments
(``exp_avg_sq``, a running mean of squared gradients) are nowhere negative: the optimizer divides by their
square root, and one negative value makes every later loss NaN. A source whose state fails is left out and
the next one is tried; :func:`problem` says why, naming the tensor.

A prediction is an estimate, not a copy: where it extrapolates a second moment that is shrinking towards
zero past it, :func:`clamp_second_moments` takes it to zero, the nearest value Adam can hold, which is never
further from the true (non-negative) value than the prediction was.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import torch

from cpsr_ds.checkpoint.storage.fileformat import is_finite
from cpsr_ds.integration.deepspeed.engine_state import MOMENTS, own_views, partitioned

SECOND_MOMENT = MOMENTS[1]


class Spec(NamedTuple):
    """What the engine holds in a tensor's place."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def specs_of(state: Mapping[str, torch.Tensor]) -> dict[str, Spec]:
    return {key: Spec(tuple(t.shape), t.dtype) for key, t in state.items()}


def is_second_moment(key: str) -> bool:
    return key.startswith(f"{SECOND_MOMENT}/")


def problem(state: Mapping[str, torch.Tensor], expected: Mapping[str, Spec] | None = None) -> str | None:
    """Why ``state`` may not be resumed from, naming the first tensor at fault ("non-finite values in
    param/3.weight"); None where it may. ``expected``: the engine's tensors by key (None: ``state`` is the
    engine's own, as a checkpoint DeepSpeed loaded)."""
    if expected is not None:
        missing, extra = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
        if missing:
            return f"no tensor {missing[0]}" + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else "")
        if extra:
            return f"a tensor {extra[0]} the engine has no place for"
    for key, t in state.items():
        if expected is not None and Spec(tuple(t.shape), t.dtype) != expected[key]:
            want = expected[key]
            return (f"shape {tuple(t.shape)} and dtype {t.dtype} in {key}, where the engine holds "
                    f"{want.shape} and {want.dtype}")
        wrong = _wrong_values(key, t)
        if wrong is not None:
            return f"{wrong} in {key}"
    return None


def _wrong_values(key: str, t: torch.Tensor) -> str | None:
    """What is wrong with ``t``'s values: NaN or infinity, or a negative second moment (reductions only, no
    temporary of the tensor's size)."""
    if not t.is_floating_point() or t.numel() == 0:
        return None
    if not is_finite(t):
        return "non-finite values"
    if is_second_moment(key) and t.min() < 0:
        return f"a negative second moment ({float(t.min()):.3g})"
    return None


def clamp_second_moments(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    """(``state`` with every negative second moment set to zero, how many values were): the clamped tensors are
    new ones, the others ``state``'s own (a prediction's may be views of the kept history)."""
    clamped, count = dict(state), 0
    for key, t in state.items():
        if is_second_moment(key) and t.numel() and t.min() < 0:
            count += int((t < 0).sum())
            clamped[key] = t.clamp(min=0)
    return clamped, count


def local_specs(engine) -> tuple[dict[str, Spec], dict[str, tuple[int, int]]]:
    """(the shape and dtype of each tensor :func:`~cpsr_ds.integration.deepspeed.engine_state.local_state` gives, the fragments it gives), from
    the engine's parameters alone: a restart asks before the optimizer holds any state. Under ZeRO/bf16 a
    fragment is flat and fp32, and a fragment covering the whole tensor has its shape and is not listed."""
    specs, fragments = {}, {}
    zero = partitioned(engine)
    for name, p in engine.module.named_parameters():
        spec = Spec(tuple(p.shape), p.dtype)
        if zero:
            mapping = p._hp_mapping
            start, numel = (0, 0) if mapping is None else (mapping.lp_fragment_address.start,
                                                           mapping.lp_fragment_address.numel)
            dtype = torch.get_default_dtype() if mapping is None else mapping.hp_fragment.dtype
            whole = start == 0 and numel == p.numel()
            spec = Spec(tuple(p.shape) if whole else (numel,), dtype)
            if not whole:
                fragments[name] = (start, numel)
        specs.update((f"{kind}/{name}", spec) for kind in ("param", *MOMENTS))
    return specs, fragments


def share_specs(engine) -> dict[str, Spec]:
    """The shape and dtype (fp32) of each tensor :func:`~cpsr_ds.integration.deepspeed.engine_state.own_share` gives, nothing copied."""
    return {key: Spec(tuple(t.shape), torch.float32) for key, t in own_views(engine).items() if t.numel()}
