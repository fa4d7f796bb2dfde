"""Predictor work without a pipeline: on a low-priority background thread, the rest inline at the next checkpoint,
training unchanged (one process, world size 1, gloo)."""

import os
import threading
import time

import deepspeed
import pytest
import torch

import cpsr_ds
from benchmarks.common.processes import TEST_MODEL, free_port, tiny_config
from conftest import ROOT, probe_rows, run_job, train_on_random_tokens
from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal
from cpsr_ds.config import CoordinatorConfig
from cpsr_ds.coordinator import Background, CallJob, FillJob, PieceCost, read_records
from examples.gpt.model import GPTConfig, gpt_pipeline


def slow_call(log, name, seconds):
    def call():
        me = threading.get_native_id()
        log.append((name, me, os.getpriority(os.PRIO_PROCESS, me)))
        time.sleep(seconds)
    return CallJob(call, PieceCost())


def test_queued_work_runs_on_a_nice_thread_and_what_has_not_started_runs_inline_at_the_flush(tmp_path):
    c = Background(CoordinatorConfig(log_every=1), str(tmp_path), rank=2, stage=0)
    log = []
    for name in ("a", "b", "c"):
        c.submit(slow_call(log, name, 0.2))
    while not log:
        time.sleep(0.01)
    c.flush()
    loop = threading.get_native_id()
    assert [n for n, _, _ in log] == ["a", "b", "c"]  # in order: the running job ends before the rest runs
    (_, thread, nice), *inline = log
    assert thread != loop and nice == 19
    assert all(tid == loop for _, tid, _ in inline)
    c.end_iteration(1)
    c.submit(slow_call(log, "d", 0.05))
    while len(log) < 4:
        time.sleep(0.01)
    time.sleep(0.2)
    c.end_iteration(2)
    first, second = read_records(str(tmp_path))
    assert first["rank"] == 2 and first["background_s"] >= 0.2 and first["inline_s"] >= 0.4
    assert second["background_s"] >= 0.05 and second["inline_s"] == 0
    c.drop()
    assert not c.thread.is_alive()


def test_a_failure_on_the_background_thread_is_raised_at_the_next_flush_naming_the_rank(tmp_path):
    c = Background(CoordinatorConfig(), str(tmp_path), rank=5, stage=0)

    def fail():
        raise ValueError("no history")

    c.submit(CallJob(fail, PieceCost()))
    while c.queue or c.running:  # the thread has taken it
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="rank 5: the predictor's work on the background thread failed: no history"):
        c.flush()
    c.flush()  # raised once
    c.drop()


def test_work_meant_for_bubbles_only_is_dropped_where_there_are_none(tmp_path):
    """coordinator.fill's job has no step limit: on the thread, or inline at the flush, it would never end."""
    c = Background(CoordinatorConfig(fill=True), str(tmp_path), rank=0, stage=0)

    class Untouchable:
        def filling(self):
            raise AssertionError("a FillJob ran without a pipeline")
            yield

    c.submit(FillJob(Untouchable(), PieceCost()))
    assert not c.queue and not c.running
    c.flush()
    c.drop()


# ---------------------------------------------------------------- a PP = 1 job, coordinator on and off

ITERS, STEPS = 16, 4


def observing_threads(predictor) -> list:
    """From now on, for each checkpoint ``predictor`` observes (in order), the threads that ran the pieces of its
    copy into the history (Predictor.observing)."""
    threads, observing = [], predictor.observing

    def spy(*args):
        seen = {threading.get_native_id()}
        threads.append(seen)
        for piece in observing(*args):
            yield piece
            seen.add(threading.get_native_id())

    predictor.observing = spy
    return threads


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same fp32 job (same seed), PP = 1, vitp learning after each checkpoint, with the coordinator on (its
    thread given the time to end its work after each iteration) and off."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for enabled in (True, False):
        run_dir = tmp_path_factory.mktemp(f"background_{enabled}") / "run"
        config = tiny_config(run_dir, stages=1, predictor={"name": "vitp", "history": 6, "train_budget_s": None,
                                                           "train_steps": STEPS},
                             coordinator={"enabled": enabled, "log_every": 1})
        config["cpsr"]["checkpoint"].update(interval=2, keep_last=6)
        model = gpt_pipeline(GPTConfig(**TEST_MODEL), num_stages=1, seed=1)
        engine, *_ = cpsr_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
        observers = observing_threads(engine.cpsr.work.predictor)
        c = engine.cpsr.work.coordinator

        def thread_done():
            """The thread's work ended, bounded: on a loaded machine the nice thread may get no core for longer
            than two iterations, and the next checkpoint would then run what it had not started inline."""
            deadline = time.monotonic() + 60
            while (c.queue or c.running) and time.monotonic() < deadline:
                time.sleep(0.01)

        train_on_random_tokens(engine, ITERS, between=thread_done if enabled else None)
        if enabled:
            c.flush()
        out[enabled] = (run_dir, engine.cpsr.work.predictor.trainer.steps, observers)
        assert engine.checkpoint_engine.flush(timeout_s=60)
        engine.cpsr.close()
    yield out
    torch.distributed.destroy_process_group()


def test_training_is_the_same_with_the_work_on_a_background_thread(runs):
    on, off = ({e.iteration: e.loss for e in read_journal(journal_path(str(runs[k][0]), 0))} for k in (True, False))
    assert sorted(on) == list(range(1, ITERS + 1))
    assert on == off
    # Checkpoints 6, 7 and 8 have the window vitp learns from: the same training on and off.
    assert runs[True][1] == runs[False][1] == 3 * STEPS


def test_the_predictor_observes_each_checkpoint_off_the_training_loops_thread_with_the_coordinator(runs):
    loop = threading.get_native_id()
    on, off = runs[True][2], runs[False][2]
    assert len(on) == len(off) == ITERS // 2
    assert all(loop not in pieces for pieces in on) and all(pieces == {loop} for pieces in off)


def test_a_simple_predictor_without_a_pipeline_works_at_the_checkpoint_on_the_training_loops_thread(runs, tmp_path):
    """trend's work per checkpoint (copies and reductions) runs inline: no background thread, no coordinator."""
    config = tiny_config(tmp_path / "run", stages=1, coordinator={"enabled": True})
    config["cpsr"]["checkpoint"].update(interval=2)
    model = gpt_pipeline(GPTConfig(**TEST_MODEL), num_stages=1, seed=1)
    engine, *_ = cpsr_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    predictor = engine.cpsr.work.predictor
    observers = observing_threads(predictor)
    gpt = GPTConfig(**TEST_MODEL)
    batch = (torch.randint(0, gpt.vocab_size, (engine.train_micro_batch_size_per_gpu(), gpt.seq_length)),) * 2
    for _ in range(4):
        engine.train_batch(iter([batch] * engine.gradient_accumulation_steps()))
    assert engine.cpsr.work.coordinator is None and predictor.name == "trend"
    assert not [t for t in threading.enumerate() if t.name.startswith("cpsr-predictor")]
    assert observers == [{threading.get_native_id()}] * 2
    assert engine.checkpoint_engine.flush(timeout_s=60)
    engine.cpsr.close()


def test_the_record_says_what_ran_in_the_background_and_inline(runs):
    rows = read_records(str(runs[True][0]))
    assert [r["iteration"] for r in rows] == list(range(1, ITERS + 1))
    assert sum(r["background_s"] for r in rows) > 0
    assert all(r["bubble_s"] == 0 and r["predictor_s"] == 0 and not r["slices"] for r in rows)
    assert not read_records(str(runs[False][0]))


def test_a_job_that_ends_without_destroy_exits_cleanly_with_work_on_the_thread(tmp_path):
    """DP = 2, one stage: the last checkpoint's vitp training is still on the background thread when the script
    returns without engine.destroy() (tests/jobs/end_probe.py, PROBE_END=train); the processes must still exit 0."""
    config = tiny_config(tmp_path / "run", stages=1,
                         predictor={"name": "vitp", "history": 6, "train_steps": 4, "train_budget_s": None})
    config["cpsr"]["checkpoint"].update(interval=2, keep_last=6)
    result = run_job(tmp_path, config, "--train-iters", 14, "--eval-interval", 14,
                     script=os.path.join(ROOT, "tests", "jobs", "end_probe.py"), env={"PROBE_END": "train"})
    rows = probe_rows(result.stdout)
    assert len(rows) == 2 and all(row["process_group"] for row in rows), rows
    assert all("cpsr-predictor-rank" + str(row["rank"]) in row["threads"] for row in rows), rows
