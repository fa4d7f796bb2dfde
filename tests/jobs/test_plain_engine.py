"""cpsr_ds.initialize on a model that is not a PipelineModule (world size 1, gloo): DeepSpeed's plain engine with
CPSR's hooks where the optimizer steps, under ZeRO 0-3."""

import threading

import deepspeed
import pytest
import torch
from deepspeed.runtime.engine import DeepSpeedEngine

import cpsr_ds
from cpsr_ds.integration.deepspeed.plain_engine import CPSRPlainEngine
from cpsr_ds.recovery import journal_losses
from cpsr_ds.runlog import CostRow, StateRow, read_measurements, read_plans
from support.plain import Regression, micro_batch, plain_config
from support.training import process_group  # noqa: F401 (autouse: one process group for the module)


def built(config, with_cpsr=True):
    torch.manual_seed(0)
    model = Regression()
    initialize = cpsr_ds.initialize if with_cpsr else deepspeed.initialize
    if not with_cpsr:
        config = {k: v for k, v in config.items() if k != "cpsr"}
    engine, *_ = initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train(engine, micro_batches, dtype=torch.float32) -> list[float]:
    """The user's loop, unchanged by cpsr_ds; the loss of each micro-batch."""
    losses = []
    for i in range(micro_batches):
        loss = engine(*micro_batch(i, dtype))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_a_plain_module_gets_the_plain_engine_with_hooks_at_each_optimizer_step(tmp_path, zero_stage):
    """The engine DeepSpeed would build, training as it would, with one journal entry per optimizer step."""
    config = plain_config(tmp_path / "run", zero_stage, accumulation=2)
    engine = built(config)
    assert type(engine) is CPSRPlainEngine and isinstance(engine, DeepSpeedEngine)
    assert deepspeed.DeepSpeedEngine is DeepSpeedEngine  # restored after initialize
    assert engine.cpsr.recovery.method == "fresh"
    losses = train(engine, 8)
    engine.destroy()
    reference = built(plain_config(tmp_path / "reference", zero_stage, accumulation=2), with_cpsr=False)
    assert type(reference) is DeepSpeedEngine
    assert losses == train(reference, 8)
    journal = journal_losses(str(tmp_path / "run"))
    assert sorted(journal) == [1, 2, 3, 4]
    for iteration, loss in journal.items():  # the mean of the iteration's two micro-batches
        assert loss == pytest.approx(sum(losses[2 * iteration - 2:2 * iteration]) / 2, rel=1e-6)


def test_bf16_under_zero3_checkpoints_on_schedule(tmp_path):
    engine = built(plain_config(tmp_path / "run", 3, bf16={"enabled": True}))
    train(engine, 7, torch.bfloat16)
    engine.destroy()
    assert sorted(journal_losses(str(tmp_path / "run"))) == list(range(1, 8))
    assert {"global_step3", "global_step6"} <= {p.name for p in (tmp_path / "run").iterdir()}


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_the_users_own_save_and_load_restore_the_plain_engine(tmp_path, zero_stage):
    """The user's checkpoint, taken and loaded back between two of cpsr_ds's (the predictor's history of those
    only grows)."""
    config = plain_config(tmp_path / "run", zero_stage)
    config["cpsr"]["checkpoint"]["interval"] = 100
    engine = built(config)
    train(engine, 2)
    engine.save_checkpoint(str(tmp_path / "mine"), tag="mine")
    expected = train(engine, 3)
    engine.load_checkpoint(str(tmp_path / "mine"), tag="mine")
    assert engine.global_steps == 2
    assert train(engine, 3) == expected
    engine.destroy()


def test_the_planner_plans_the_interval_of_a_plain_engine_from_its_measured_checkpoints(tmp_path):
    """interval auto under ZeRO-3: planner.first_interval until checkpoints have been measured, each measured one
    a cost record; then the first plan from those costs."""
    config = plain_config(tmp_path / "run", 3, cpsr={"planner": {"first_interval": 2, "train_iters": 40}})
    config["cpsr"]["checkpoint"]["interval"] = "auto"
    engine = built(config)
    train(engine, 24)
    engine.destroy()
    rows, _ = read_measurements(str(tmp_path / "run"))
    assert [r.iteration for r in rows if isinstance(r, StateRow)][:3] == [2, 4, 6]
    assert any(isinstance(r, CostRow) for r in rows)
    plans, _ = read_plans(str(tmp_path / "run"))
    assert [p.reason for p in plans][:2] == ["warm-up", "first"] and plans[0].T_c == 2, plans
    # A new interval, or (on a loaded machine, where a checkpoint's measured cost can come out below 0) the
    # reason the interval stays.
    assert plans[1].inputs["iteration_time_s"] > 0 and (plans[1].T_c != 2 or plans[1].fallback), plans[1]


def test_the_engine_s_end_leaves_no_thread_holding_its_state(tmp_path, shm_path):
    """A cpsr_ds thread that lets go of tensors while the interpreter exits aborts the process ("terminate called
    without an active exception"): the predictor summaries' writer and the host snapshots' are done at destroy()
    (the signal watcher, which holds none, stays)."""
    config = plain_config(tmp_path / "run", 3)
    config["cpsr"]["checkpoint"].update(survivor_dir=str(shm_path), memory_interval=1)
    before = set(threading.enumerate())
    engine = built(config)
    train(engine, 7)
    engine.destroy()
    assert [t.name for t in set(threading.enumerate()) - before if t.name != "cpsr-signals"] == []


def test_step_without_engine_backward_is_refused_with_a_clear_error(tmp_path):
    """DeepSpeed takes loss.backward() under ZeRO 1-3; the iteration's loss the journal needs then is unknown."""
    engine = built(plain_config(tmp_path / "run", zero_stage=1))
    engine(*micro_batch(0)).backward()
    with pytest.raises(RuntimeError, match="without engine.backward"):
        engine.step()
    engine.destroy()
