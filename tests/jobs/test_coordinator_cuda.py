"""The coordinator's CUDA path (``predictor.device: cuda``): the predictor's work issued on a side stream that
starts where the compute stream is, and the compute stream waiting for it before the training loop's thread uses the
predictor again; training unchanged. Needs a GPU: ``benchmarks/gpu/run.sh`` runs it there (coordinator_test), and
``make test`` skips it."""

import os
import time

# Deterministic cuBLAS, set before CUDA starts: the runs with the coordinator on and off compare exactly.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import deepspeed  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import cpsr_ds  # noqa: E402
from benchmarks.common.processes import TEST_MODEL, free_port, tiny_config  # noqa: E402
from conftest import train_on_random_tokens  # noqa: E402
from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal  # noqa: E402
from cpsr_ds.config import CoordinatorConfig  # noqa: E402
from cpsr_ds.coordinator import Background, Coordinator, PiecesJob, read_records  # noqa: E402
from examples.gpt.model import GPTConfig, gpt_pipeline  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the coordinator's CUDA path needs a GPU")

N = 4096


def slow_write(x: torch.Tensor) -> torch.Tensor:
    """Queue on the current stream a product that takes milliseconds, then write its result into ``x``: a stream
    that did not wait for this one would read ``x`` before it is written."""
    a = torch.randn(N, N, device=x.device, generator=torch.Generator(x.device).manual_seed(0))
    for _ in range(4):
        a = a @ a / N ** 0.5
    return x.copy_(a[0])


def pieces(x: torch.Tensor, streams: list, sums: list, n: int):
    """``n`` pieces of work, each noting the stream it runs on and reading ``x``."""
    for _ in range(n):
        streams.append(torch.cuda.current_stream())
        sums.append(x.sum())
        yield


def bubble(c: Coordinator, slot: str) -> None:
    """A slot, then a receive that returns once the GPU has done what is queued, some 30 ms later."""
    c.slot(slot)
    torch.cuda._sleep(50_000_000)
    torch.cuda.synchronize()
    c.waited()


def test_slot_work_runs_on_the_side_stream_after_what_the_compute_stream_queued(tmp_path):
    c = Coordinator(CoordinatorConfig(window=4, log_every=1), str(tmp_path), rank=0, stage=0)
    assert c.side is not None
    for _ in range(4):  # nothing queued: the slot's spans are measured
        bubble(c, "RecvGrad@3")
    x = torch.zeros(N, device="cuda")
    # CUDA loads a kernel's module at its first launch (lazy loading); a piece timed with that in it would not fit
    # the slot, and this test is about where the work runs, not about a first launch.
    x.sum()
    streams, sums = [], []
    c.submit(PiecesJob(pieces(x, streams, sums, 3), c.piece("observe")))  # one piece inline, to measure it
    assert streams == [torch.cuda.current_stream()]
    assert c.piece("observe").estimate() < c.budget("RecvGrad@3"), "the measured piece must fit the slot's budget"
    expected = slow_write(x).sum()
    bubble(c, "RecvGrad@3")
    assert len(streams) > 1 and all(s == c.side for s in streams[1:])
    assert all(torch.equal(s, expected) for s in sums[1:])  # the side stream waited for the write
    # Written on the side stream, read on the compute stream after the flush: the compute stream waited.
    y = torch.zeros(N, device="cuda")
    with torch.cuda.stream(c.side):
        slow_write(y)
    c.flush()
    assert torch.equal(y.clone(), x)


def test_the_background_threads_work_runs_on_the_side_stream_and_the_flush_joins_it(tmp_path):
    c = Background(CoordinatorConfig(log_every=1), str(tmp_path), rank=0, stage=0)
    x = torch.zeros(N, device="cuda")
    expected = slow_write(x).sum()
    streams, sums = [], []
    c.submit(PiecesJob(pieces(x, streams, sums, 2), c.piece("observe")))
    y = torch.zeros(N, device="cuda")

    def write_y():
        slow_write(y)
        yield

    c.submit(PiecesJob(write_y(), c.piece("observe")))
    while c.queue or c.running:  # both taken by the thread (a job not started by the flush would run inline)
        time.sleep(0.01)
    c.flush()
    assert streams and all(s == c.side for s in streams)
    assert all(torch.equal(s, expected) for s in sums)
    assert torch.equal(y.clone(), x)  # the compute stream waited for the thread's write
    c.drop()


# ---------------------------------------------------------------- a PP = 1 job, vitp on the GPU, coordinator on and off

ITERS, STEPS = 16, 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same fp32 job (same seed), PP = 1, vitp on the GPU learning after each checkpoint: coordinator on, off,
    and off again (what two identical runs differ by on this GPU)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="nccl")
    out = {}
    for name, enabled in (("on", True), ("off", False), ("off again", False)):
        run_dir = tmp_path_factory.mktemp("cuda_" + name.replace(" ", "_")) / "run"
        config = tiny_config(run_dir, stages=1, predictor={"name": "vitp", "history": 6, "train_budget_s": None,
                                                           "train_steps": STEPS, "device": "cuda"},
                             coordinator={"enabled": enabled, "log_every": 1})
        config["cpsr"]["checkpoint"].update(interval=2, keep_last=6)
        model = gpt_pipeline(GPTConfig(**TEST_MODEL), num_stages=1, seed=1)
        engine, *_ = cpsr_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
        train_on_random_tokens(engine, ITERS)
        if enabled:
            engine.cpsr.work.coordinator.flush()
        trainer = engine.cpsr.work.predictor.trainer
        out[name] = {"dir": run_dir, "steps": trainer.steps, "on": next(trainer.model.parameters()).device,
                     "weights": {k: v.detach().cpu() for k, v in trainer.model.state_dict().items()}}
        assert engine.checkpoint_engine.flush(timeout_s=60)
        engine.cpsr.close()
    yield out
    deepspeed.comm.destroy_process_group()  # torch's, and the groups DeepSpeed cached from it


def losses(run) -> dict:
    return {e.iteration: e.loss for e in read_journal(journal_path(str(run["dir"]), 0))}


def test_vitp_trains_on_the_gpu(runs):
    for run in runs.values():
        assert run["on"].type == "cuda"
        assert run["steps"] == 3 * STEPS  # checkpoints 12, 14, 16 have the window vitp learns from


def test_training_with_the_work_on_the_side_stream_is_the_training_without(runs):
    on, off, again = (losses(runs[k]) for k in ("on", "off", "off again"))
    assert sorted(on) == list(range(1, ITERS + 1))
    if off == again:  # this GPU repeats a run exactly: the coordinator must change nothing
        assert on == off
    else:  # no closer than two identical runs
        spread = max(abs(off[i] - again[i]) for i in off)
        assert max(abs(on[i] - off[i]) for i in off) <= 2 * spread


def test_vitp_trained_on_the_side_stream_is_the_one_trained_at_the_checkpoints(runs):
    on, off, again = (runs[k]["weights"] for k in ("on", "off", "off again"))
    spread = max(float((off[k] - again[k]).abs().max()) for k in off)
    assert max(float((on[k] - off[k]).abs().max()) for k in off) <= 2 * spread
    assert sum(r["background_s"] for r in read_records(str(runs["on"]["dir"]))) > 0
