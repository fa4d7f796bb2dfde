"""Train a GPT (megatron-core layers, DeepSpeed pipeline) on a code corpus with cpsr_ds.

    deepspeed --num_gpus 2 examples/gpt/train_gpt.py --deepspeed_config configs/gpt_tiny_cpu.json

Several nodes, restarted as one job when a rank fails: on the head node,
``launch/resilient.sh -- deepspeed --hostfile H examples/gpt/train_gpt.py ...``; or on every
node ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes N --max-restarts K
--rdzv-backend c10d ... examples/gpt/train_gpt.py ...`` (see cpsr_ds/runtime/elastic.py for why).

Pipeline degree: ``"pipeline": {"stages": S}`` in the DeepSpeed config; the
data-parallel degree is the world size over S. ``--plain``: the GPT as one plain module on DeepSpeed's plain
engine (no pipeline; ZeRO 0-3), trained by ``engine(batch)``, ``engine.backward``, ``engine.step``. Model shape: the ``"gpt"`` block;
``--layers-per-stage 1 3`` puts 1 transformer block on stage 0 (say, on an A30) and
3 on stage 1 (an H100).
Failure recovery: the ``"cpsr"`` block (see the README); a restarted job resumes at
the iteration ``cpsr_ds.initialize`` restored, with the batches the failure-free
run would have seen from there on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # examples.gpt

import cpsr_ds  # noqa: E402
from cpsr_ds.checkpoint.capture.journal import append_validation, finished_run, record_finished  # noqa: E402
from examples.gpt.corpus import Batches, load_corpus  # noqa: E402
from cpsr_ds.runtime.elastic import check_restartable  # noqa: E402
from cpsr_ds.integration.deepspeed.install import release_shm_allreduce_name  # noqa: E402
from examples.gpt.model import GPTConfig, gpt_pipeline, gpt_plain  # noqa: E402


def positive_int(text: str) -> int:
    """An argparse type: an integer > 0 (an interval of 0 would divide by zero mid-run)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.add_argument("--train-iters", type=int, default=100)
    p.add_argument("--data", default=None, help="directory of text files (default: the Python standard library's sources)")
    p.add_argument("--eval-interval", type=positive_int, default=50, help="iterations between validation evaluations")
    p.add_argument("--eval-at", type=int, nargs="+", default=[], metavar="K",
                   help="also evaluate after these iterations (a benchmark's points around a failure)")
    p.add_argument("--log-interval", type=positive_int, default=10, help="iterations between log lines")
    p.add_argument("--valid-sequences", type=int, default=64, help="size of the fixed validation set, in sequences")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--plain", action="store_true", help="one plain module on DeepSpeed's plain engine (ZeRO 0-3), "
                   "no pipeline: the config's \"pipeline\" block is ignored")
    model = p.add_argument_group("model (overrides the config's \"gpt\" block)")
    model.add_argument("--num-layers", type=int)
    model.add_argument("--hidden-size", type=int)
    model.add_argument("--num-attention-heads", type=int)
    model.add_argument("--seq-length", type=int)
    split = model.add_mutually_exclusive_group()
    split.add_argument("--partition-method", help="gpt.partition_method: DeepSpeed's (uniform, parameters, "
                       "type:REGEX) or blocks:N,N,...")
    split.add_argument("--layers-per-stage", type=positive_int, nargs="+", metavar="N",
                       help="transformer blocks on each pipeline stage, in order (fewer on smaller GPUs): "
                       "gpt.partition_method blocks:N,N,...")
    cpsr = p.add_argument_group("cpsr (overrides the config's \"cpsr\" block)")
    cpsr.add_argument("--checkpoint-dir", help="cpsr.checkpoint.dir")
    cpsr.add_argument("--checkpoint-interval", type=interval, help='cpsr.checkpoint.interval: iterations, or "auto"')
    cpsr.add_argument("--kill-rank", type=int, help="cpsr.faults.kill_rank")
    cpsr.add_argument("--kill-at-iteration", type=int, nargs="+", metavar="K",
                      help="cpsr.faults.kill_at_iteration: one iteration or several (a failure trace)")
    cpsr.add_argument("--poisson-rate-per-hour", type=float, help="cpsr.faults.poisson_rate_per_hour")
    deepspeed.add_config_arguments(p)
    return p.parse_args(argv)


def _override(config: dict, path: str, value) -> None:
    """Set ``config[a][b][c] = value`` for ``path`` "a.b.c", unless ``value`` is None."""
    if value is None:
        return
    *parents, key = path.split(".")
    for name in parents:
        config = config.setdefault(name, {})
    config[key] = value


def interval(text: str) -> int | str:
    """An argparse type: "auto" or an integer (the config's check names a bad one)."""
    return text if text == "auto" else int(text)


def build_config(args: argparse.Namespace) -> dict:
    if not args.deepspeed_config:
        raise SystemExit("train_gpt.py: --deepspeed_config is required")
    config = load_ds_config(args.deepspeed_config)
    config.setdefault("gpt", {})
    for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "partition_method"):
        _override(config, f"gpt.{key}", getattr(args, key))
    if args.layers_per_stage:
        _override(config, "gpt.partition_method", "blocks:" + ",".join(map(str, args.layers_per_stage)))
    _override(config, "cpsr.checkpoint.dir", args.checkpoint_dir)
    _override(config, "cpsr.checkpoint.interval", args.checkpoint_interval)
    _override(config, "cpsr.faults.kill_rank", args.kill_rank)
    _override(config, "cpsr.faults.kill_at_iteration", args.kill_at_iteration)
    _override(config, "cpsr.faults.poisson_rate_per_hour", args.poisson_rate_per_hour)
    return config


def evaluate(engine, validation) -> float:
    if hasattr(engine, "eval_batch"):
        return float(engine.eval_batch(iter(validation), num_micro_batches=len(validation)))
    engine.eval()
    with torch.no_grad():
        total = torch.stack([engine(tokens, labels).float() for tokens, labels in validation]).mean()
    engine.train()
    torch.distributed.all_reduce(total, group=engine.grid.get_data_parallel_group())
    return float(total) / engine.grid.get_data_parallel_world_size()


def train_step(engine, micro_batches) -> float:
    """One iteration: the pipeline engine's ``train_batch``, or the plain engine's loop over the micro-batches."""
    if hasattr(engine, "train_batch"):
        return float(engine.train_batch(micro_batches))
    losses = []
    for tokens, labels in micro_batches:
        loss = engine(tokens, labels)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return sum(losses) / len(losses)


@dataclass
class Job:
    args: argparse.Namespace
    cpsr_cfg: cpsr_ds.CPSRConfig
    gpt_cfg: GPTConfig
    engine: deepspeed.DeepSpeedEngine  # the pipeline engine, or with --plain the plain one
    batches: Batches


def setup(argv=None) -> Job:
    """Parse arguments, build the model and the engine (recovering if needed), and the data."""
    cpsr_ds.mark_start("imports")
    args = parse_args(argv)
    config = build_config(args)
    # Fail on a bad "cpsr" block before any process group or model exists.
    cpsr_cfg = cpsr_ds.CPSRConfig.from_ds_config(config)
    gpt_cfg = GPTConfig.model_validate(config.pop("gpt"))
    check_restartable()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    cpsr_ds.mark_start("distributed_init")
    exit_if_finished(args, cpsr_cfg)
    torch.manual_seed(args.seed)

    dtype = torch.bfloat16 if config.get("bf16", {}).get("enabled") else torch.float32
    if args.plain:
        config.pop("pipeline", None)
        model = gpt_plain(gpt_cfg, seed=args.seed, params_dtype=dtype)
    else:
        stages = int(config.get("pipeline", {}).get("stages", 1))
        model = gpt_pipeline(gpt_cfg, num_stages=stages, seed=args.seed, params_dtype=dtype)
    cpsr_ds.mark_start("model")
    engine, _, _, _ = cpsr_ds.initialize(model=model, model_parameters=model.parameters(), config=config)

    train, valid = load_corpus(args.data)
    batches = Batches(
        train,
        valid,
        seq_length=gpt_cfg.seq_length,
        micro_batch=engine.train_micro_batch_size_per_gpu(),
        grad_accum=engine.gradient_accumulation_steps(),
        dp_rank=engine.grid.get_data_parallel_rank(),
        dp_size=engine.grid.get_data_parallel_world_size(),
        seed=args.seed,
        valid_sequences=args.valid_sequences,
    )
    return Job(args, cpsr_cfg, gpt_cfg, engine, batches)


def exit_if_finished(args: argparse.Namespace, cpsr_cfg: cpsr_ds.CPSRConfig) -> None:
    """Exit 0, every rank, where an earlier attempt of this run finished at ``--train-iters`` or beyond and nothing
    trained since (its journal's clean end, :func:`finish`): a supervisor's restart of a job that finished trains
    nothing, and no recovery report counts it as a failure. Rank 0 reads the run directory, every rank answers."""
    if not cpsr_cfg.enabled:
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(args.local_rank)  # NCCL's object collectives use the current device
    leader = torch.distributed.get_rank() == 0
    box = [finished_run(cpsr_cfg.checkpoint.dir) if leader else None]
    torch.distributed.broadcast_object_list(box, src=0)
    finished = box[0]
    if finished is None or finished < args.train_iters:
        return
    if leader:
        print(f"train_gpt.py: the run in {cpsr_cfg.checkpoint.dir} finished at iteration {finished} "
              f"(--train-iters {args.train_iters}): nothing to train", flush=True)
    release_shm_allreduce_name(torch.distributed.get_rank())
    torch.distributed.destroy_process_group()
    sys.exit(0)


def train(job: Job) -> None:
    """Train from wherever recovery put the engine to ``--train-iters``."""
    args, engine, cpsr_cfg = job.args, job.engine, job.cpsr_cfg
    validation = job.batches.validation()
    leader = engine.global_rank == 0

    def report_validation(iteration: int) -> None:
        started = time.perf_counter()
        loss = evaluate(engine, validation)
        if leader:
            print(f"iteration {iteration:6d} | validation loss {loss:.4f} | evaluated in "
                  f"{time.perf_counter() - started:.2f} s", flush=True)
            if cpsr_cfg.enabled:
                append_validation(cpsr_cfg.checkpoint.dir, iteration, loss)

    eval_at = set(args.eval_at)
    start = engine.global_steps
    if start == 0 or start in eval_at:
        report_validation(start)
    tick, tick_iter = time.perf_counter(), start
    for iteration in range(start, args.train_iters):
        loss = train_step(engine, iter(job.batches.micro_batches(iteration)))
        done = iteration + 1
        if leader and (done % args.log_interval == 0 or done == args.train_iters):
            now = time.perf_counter()
            rate = (done - tick_iter) / (now - tick)
            print(f"iteration {done:6d} | loss {float(loss):.4f} | {rate:.2f} it/s", flush=True)
            tick, tick_iter = now, done
        if done % args.eval_interval == 0 or done == args.train_iters or done in eval_at:
            report_validation(done)
    if leader and cpsr_cfg.enabled:
        print(json.dumps({"final_iteration": engine.global_steps, "recovery": engine.cpsr.recovery.method}), flush=True)


def finish(job: Job) -> None:
    """End a job that trained to the end: its checkpoints persisted and committed (``engine.destroy``), the clean
    end recorded in the run's journal (rank 0; a restart then exits at once, :func:`exit_if_finished`), then its
    process group destroyed while the interpreter still runs. Gloo's threads left to the interpreter's teardown
    can abort a process that finished cleanly ("terminate called without an active exception"). A job that
    failed skips this: a peer still inside a collective would keep the destroy waiting."""
    job.engine.destroy()
    if job.cpsr_cfg.enabled and job.engine.global_rank == 0:
        record_finished(job.cpsr_cfg.checkpoint.dir, job.engine.global_steps)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main(argv=None) -> None:
    job = setup(argv)
    train(job)
    finish(job)


if __name__ == "__main__":
    main()
