"""The learning-rate schedule's shape (planning/lr_schedule.py), and reading it from the schedulers users run
(integration/deepspeed/engine_state.schedule_shape)."""

from types import SimpleNamespace

import pytest
import torch
from deepspeed.runtime.lr_schedules import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

from cpsr_ds.integration.deepspeed.engine_state import schedule_shape
from cpsr_ds.planning.lr_schedule import CONSTANT, DECAY, UNKNOWN, remaining_at, shape, warmup_cosine

T = 2000


def test_the_share_of_the_rate_area_ahead_of_a_decay():
    assert shape([2.0] * 3, [2.0, 1.0, 1.0]) == shape([2.0] * 3, [2.0, 1.0, 1.0])
    assert shape([2.0] * 3, [2.0, 1.0, 1.0]).remaining == pytest.approx(4 / 10)
    cosine = warmup_cosine(T, 0.1)
    assert [round(remaining_at(cosine, p), 3) for p in (0.25, 0.5, 0.75)] == [0.566, 0.24, 0.066]
    assert shape(cosine[:500], cosine[500:]).kind == DECAY and shape(cosine[:500], cosine[500:]).place == 0.25


def test_a_flat_rate_is_constant_and_a_rising_one_or_none_unknown():
    assert shape([1.0] * 10, [1.0] * 10).kind == CONSTANT
    rising = shape([1.0] * 10, [1.0, 1.0, 0.5, 0.9])
    assert rising.kind == UNKNOWN and "rises ahead of the failure (0.5 to 0.9, 3 iterations on)" in rising.reason
    assert shape([1.0], []).kind == UNKNOWN and "planned end is not known" in shape([1.0], []).reason
    assert shape([1.0], [1.0, float("nan")]).kind == UNKNOWN


def optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.01)


def engine_with(make):
    """What schedule_shape reads of an engine: its scheduler, on a real optimizer."""
    return SimpleNamespace(lr_scheduler=make(optimizer()))


def wsd(opt):
    """Warmup-stable-decay as a user builds it: a LambdaLR, warm-up 100, decay over the last 20 %."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: min(1.0, (k + 1) / 100) if k < 0.8 * T else max(0.0, (T - k) / (0.2 * T)))


@pytest.mark.parametrize("make, train_iters, kind", [
    (lambda o: WarmupCosineLR(o, total_num_steps=T, warmup_num_steps=10, cos_min_ratio=0.1), None, DECAY),
    (lambda o: WarmupDecayLR(o, total_num_steps=T, warmup_num_steps=10), None, DECAY),
    (lambda o: WarmupLR(o, warmup_num_steps=10), None, CONSTANT),
    (wsd, T, DECAY),
    (wsd, None, UNKNOWN),
    (lambda o: OneCycle(o, cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=T), T, UNKNOWN),
    (lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=100), T, UNKNOWN),
])
def test_schedule_shape_reads_deepspeeds_and_torchs_schedules_without_stepping_them(make, train_iters, kind):
    engine = engine_with(make)
    scheduler = engine.lr_scheduler
    before = (getattr(scheduler, "last_batch_iteration", None), scheduler.optimizer.param_groups[0]["lr"])
    got = schedule_shape(engine, T // 2, train_iters)
    assert got.kind == kind, got
    assert (getattr(scheduler, "last_batch_iteration", None), scheduler.optimizer.param_groups[0]["lr"]) == before
    if kind == UNKNOWN:
        assert got.reason


def test_a_warmup_stable_decay_has_more_of_its_area_ahead_than_a_cosine_at_the_same_place():
    cosine = schedule_shape(engine_with(lambda o: WarmupCosineLR(o, total_num_steps=T, warmup_num_steps=10,
                                                                  cos_min_ratio=0.1)), T // 2, None)
    stable = schedule_shape(engine_with(wsd), T // 2, T)
    # Ahead of 1000: 600 stable iterations and a linear decay over 400 (200); behind: 900 and a warm-up over 100 (50.5).
    assert cosine.remaining == pytest.approx(0.24, abs=0.01) and stable.remaining == pytest.approx(800 / 1750.5, abs=2e-3)
    missing = schedule_shape(engine_with(wsd), T // 2, None)
    assert "LambdaLR schedule is not known: set cpsr.planner.train_iters" in missing.reason
