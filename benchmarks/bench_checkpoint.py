"""Checkpoint cost: training stall per checkpoint and persist throughput of every strategy.

Measured in one run on the same directory, beside the physical floors: a raw host copy
of the same bytes (the floor of the stall when nothing overlaps it) and the disk's
sequential write speed with fsync (the ceiling of persist throughput).

The stall, as docs/design/measurement-protocols.md defines it, is the time the training loop is blocked by a
checkpoint: measured in a training loop, as DeepSpeed runs one, it is the time spent
inside the engine's calls when a checkpoint is requested at an iteration boundary
(``create``, ``save`` per file, and for non-decoupled engines ``commit``) and when a
decoupled engine is committed before the next optimizer step. Beside it, ``slowdown``
= wall time from the request to the end of the next iteration minus the median
checkpoint-free iteration: the stall plus whatever the copy and writer threads take
from compute meanwhile (on a GPU the copy is a DMA and takes little; on a 2-core CPU
it competes with the matmuls). ``total`` adds everything the checkpointing phase
cost beyond its checkpoint-free time (persist interference in later iterations
included), per checkpoint. The states (``--states``; default the first two):

* ``gpt_tiny``: the real tiny GPT (``configs/gpt_tiny_cpu.json``, one stage) in a
  single-process DeepSpeed engine, checkpointed by ``engine.save_checkpoint`` with
  each strategy installed as ``cpsr_ds.initialize`` installs it; compute is its own
  ``train_batch``.
* ``synthetic_1g``: 1 GiB of mixed-precision model and optimizer state in DeepSpeed's
  two files, driven through the same engine classes; compute is matmuls on separate
  tensors, the optimizer step an in-place update of every state tensor.
* ``gpt2_0.35b`` and ``gpt3_3.35b``: the GPT of ``configs/gpt2_0.35b.json`` and
  ``configs/gpt3_3.35b.json`` as ``gpt_tiny`` is run (bf16 with fp32 masters and Adam,
  ZeRO-1, on one device: pipeline and data-parallel degree 1), with the micro-batch
  and accumulation of ``--micro-batch`` / ``--grad-accum`` and ``--layers`` transformer
  blocks of the config's shape (GPT3-3.35B's 16 do not fit one 80 GB GPU with Adam,
  nor two of its 45 GB checkpoints a 64 GB disk). Between two measured checkpoints the
  asynchronous engines are flushed, untimed, so that each window starts with none in
  flight (a checkpoint interval shorter than the persist time is the planner's
  concern, not the stall's). ``--toy``: the same code path at the tiny GPT's shape.

Persist throughput = checkpoint bytes / time from its first write until it is durable
(files and manifest fsynced, ``latest`` moved); for ``torch`` and ``ds_decoupled``,
which do not fsync, the time of writing plus an fsync of their files.

    python -m benchmarks.bench_checkpoint [--quick] [--json PATH] [--dir DIR] [--states S ...]
        [--strategies S ...] [--repeats N] [--layers N] [--micro-batch N] [--grad-accum N] [--toy]

Without --json it writes benchmarks/results/bench_checkpoint/bench_checkpoint[_quick].json.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass

from benchmarks.common.processes import free_port

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for _key, _value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0",
                     "WORLD_SIZE": "1", "CROSS_RANK": "0", "CROSS_SIZE": "1"}.items():
    os.environ.setdefault(_key, _value)
import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo  # noqa: E402
from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config  # noqa: E402

import cpsr_ds  # noqa: E402
from cpsr_ds.integration.deepspeed import install  # noqa: E402
from cpsr_ds.checkpoint.engines.factory import create_engine  # noqa: E402
from cpsr_ds.checkpoint.storage.fileformat import PAGE, flatten  # noqa: E402
from cpsr_ds.config import CheckpointConfig  # noqa: E402
from examples.gpt.model import GPTConfig, gpt_pipeline  # noqa: E402

from benchmarks.common.paths import ROOT, with_default_outputs  # noqa: E402

STRATEGIES = ("torch", "checkfreq", "pccheck", "cpsr", "ds_decoupled")
OURS = ("checkfreq", "pccheck", "cpsr")
GB = 1e9
# DeepSpeed's own decoupled engine: a writer subprocess fed through a queue, one writer for world size 1.
DECOUPLED = {"writer": {"decoupled": True, "type": "python", "data_parallel": "replica"}}
MODEL_FILE = "mp_rank_00_model_states.pt"
OPTIM_FILE = "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
STATES = ("gpt_tiny", "synthetic_1g", "gpt2_0.35b", "gpt3_3.35b")
# The disk probe writes this much at most: its speed is steady long before a 10 GB state's size.
DISK_PROBE_MAX = 2 << 30
# --toy: the model states at the tiny GPT's shape, for a check of the code path on a CPU.
TOY_SHAPE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64}


# ---------------------------------------------------------------- floors

def tensors_of(state) -> list[torch.Tensor]:
    return flatten(state)[1]


def state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


def raw_copy_s(state, repeats: int) -> float:
    """Median time of copying the state's tensors into preallocated host buffers (the first, faulting, excluded)."""
    tensors = tensors_of(state)
    dst = [torch.empty_like(t, device="cpu", pin_memory=torch.cuda.is_available()) for t in tensors]
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for a, b in zip(dst, tensors):
            a.copy_(b)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def disk_gbps(root: str, nbytes: int, repeats: int = 3) -> dict:
    """Sequential write of ``nbytes`` plus fsync on ``root``: through the page cache and with O_DIRECT."""
    nbytes = max(nbytes, 64 << 20) // PAGE * PAGE
    chunk = 64 << 20
    raw = torch.randint(0, 255, (chunk + PAGE,), dtype=torch.uint8)
    start = -raw.data_ptr() % PAGE
    buf = memoryview(raw[start:start + chunk].numpy())
    out = {}
    for mode, flag in (("buffered", 0), ("direct", os.O_DIRECT)):
        speeds = []
        for _ in range(repeats + 1):
            path = os.path.join(root, "disk-probe")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
            t0 = time.perf_counter()
            written = 0
            while written < nbytes:
                written += os.write(fd, buf[:min(chunk, nbytes - written)])
            os.fsync(fd)
            speeds.append(written / (time.perf_counter() - t0) / GB)
            os.close(fd)
            os.unlink(path)
        out[mode] = statistics.median(speeds[1:])
    return out


def fsync_files(tag_dir: str) -> float:
    """fsync every file of a checkpoint DeepSpeed's engines wrote (they do not); returns the seconds taken."""
    t0 = time.perf_counter()
    for name in os.listdir(tag_dir):
        fd = os.open(os.path.join(tag_dir, name), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return time.perf_counter() - t0


def last_write_s(tag_dir: str, wall_start: float) -> float:
    """Seconds from ``wall_start`` (time.time()) to the last modification of a file in ``tag_dir``."""
    names = os.listdir(tag_dir)
    if not names:
        raise RuntimeError(f"DeepSpeed's decoupled writer left {os.path.basename(tag_dir)} empty after commit()")
    return max(os.stat(os.path.join(tag_dir, n)).st_mtime_ns for n in names) / 1e9 - wall_start


# ---------------------------------------------------------------- the training-loop protocol

class Protocol:
    """One strategy in a training loop: warm-up checkpoints, baseline, ``repeats`` checkpoints, baseline.

    Subclasses give ``iteration()`` (one training iteration; a decoupled engine is
    committed before its optimizer step), ``request(tag)`` (a checkpoint as
    DeepSpeed's ``save_checkpoint`` takes it) and ``engine`` (the checkpoint engine).
    """

    def __init__(self, strategy: str, engine, ckpt_dir: str, repeats: int, warmup: int, baseline: int,
                 drain: bool = False):
        self.strategy = strategy
        self.drain = drain
        self.engine = engine
        self.dir = ckpt_dir
        self.repeats = repeats
        self.warmup = warmup
        self.baseline = baseline
        self.blocked = 0.0
        self.save_s = 0.0
        commit = engine.commit

        def timed_commit(info):
            t0 = time.perf_counter()
            try:
                return commit(info)
            finally:
                self.blocked += time.perf_counter() - t0

        engine.commit = timed_commit

    def run(self) -> dict:
        step = 0
        for _ in range(self.warmup):
            step += 1
            self.checkpoint(f"global_step{step}")
            self.iteration()
            self.after_window(f"global_step{step}", time.time(), step)
            self.flush()
        base = [self._time_iteration() for _ in range(self.baseline)]
        stalls, blocked, persists, untimed = [], [], [], 0.0
        phase_t0 = time.perf_counter()
        for _ in range(self.repeats):
            step += 2
            self.iteration()
            tag = f"global_step{step}"
            wall0, t0 = time.time(), time.perf_counter()
            self.blocked = 0.0
            self.checkpoint(tag)
            self.iteration()
            stalls.append(time.perf_counter() - t0)
            blocked.append(self.blocked)
            t1 = time.perf_counter()
            persists.append(self.after_window(tag, wall0, step))
            untimed += time.perf_counter() - t1
        self.flush()
        phase_s = time.perf_counter() - phase_t0 - untimed
        base += [self._time_iteration() for _ in range(self.baseline)]
        it = statistics.median(base)
        if self.strategy in OURS:
            recent = {tag: s for tag, _, s in self.engine.stats.recent}
            persists = [recent[tag] for tag in persists if recent.get(tag) is not None]
        return {"iteration_s": it, "stall_s": statistics.median(blocked),
                "slowdown_s": statistics.median(s - it for s in stalls),
                "total_s": (phase_s - 2 * self.repeats * it) / self.repeats,
                "persist_s": statistics.median(persists) if persists else None}

    def checkpoint(self, tag: str) -> None:
        t0 = time.perf_counter()
        self.request(tag)
        self.save_s = time.perf_counter() - t0
        self.blocked += self.save_s

    def _time_iteration(self) -> float:
        t0 = time.perf_counter()
        self.iteration()
        return time.perf_counter() - t0

    def after_window(self, tag: str, wall0: float, step: int):
        """Untimed bookkeeping after a checkpoint's window: its persist time, or its tag when the engine reports it."""
        if self.strategy in OURS:
            if self.drain:
                self.engine.flush()
            return tag
        tag_dir = os.path.join(self.dir, tag)
        if self.strategy == "torch":
            persist = self.save_s + fsync_files(tag_dir)
        else:
            persist = last_write_s(tag_dir, wall0) + fsync_files(tag_dir)
        # Two checkpoints kept, as by the asynchronous engines (keep_last = 2).
        shutil.rmtree(os.path.join(self.dir, f"global_step{step - 4}"), ignore_errors=True)
        return persist

    def flush(self) -> None:
        if self.strategy in OURS:
            self.engine.flush()


class SyntheticProtocol(Protocol):
    """A DeepSpeed-like state in two files, the checkpoint engine driven as DeepSpeed drives it."""

    def __init__(self, strategy: str, engine, files: dict, compute, ckpt_dir: str, **kw):
        super().__init__(strategy, engine, ckpt_dir, **kw)
        self.files = files
        self.compute = compute
        self.state = tensors_of(files)

    def iteration(self) -> None:
        self.compute()
        # DeepSpeedEngine._commit_decoupled_checkpoint, before the optimizer step.
        if self.engine.is_decoupled():
            info = self.engine.get_commit_info()
            if info is not None:
                self.engine.commit(info)
        for t in self.state:
            t.mul_(1.0)

    def request(self, tag: str) -> None:
        info = CheckpointCommitInfo(tag=tag, save_dir=self.dir, save_latest=True)
        tag_dir = os.path.join(self.dir, tag)
        self.engine.makedirs(tag_dir, exist_ok=True)
        self.engine.create(info)
        for name, sd in self.files.items():
            self.engine.save(sd, os.path.join(tag_dir, name))
        if not self.engine.is_decoupled():
            self.engine.commit(info)


class GPTProtocol(Protocol):
    """A GPT in a one-stage DeepSpeed pipeline engine, checkpointed by ``save_checkpoint``."""

    def __init__(self, strategy: str, ds, gpt: GPTConfig, ckpt_dir: str, **kw):
        super().__init__(strategy, ds.checkpoint_engine, ckpt_dir, **kw)
        self.ds = ds
        gen = torch.Generator().manual_seed(0)
        shape = (ds.train_micro_batch_size_per_gpu(), gpt.seq_length)
        self.batches = [(torch.randint(0, gpt.vocab_size, shape, generator=gen),
                         torch.randint(0, gpt.vocab_size, shape, generator=gen))
                        for _ in range(ds.gradient_accumulation_steps())]

    def iteration(self) -> None:
        # cpsr_ds's pipeline engine commits a decoupled checkpoint engine before its optimizer step.
        self.ds.train_batch(iter(self.batches))

    def request(self, tag: str) -> None:
        self.ds.save_checkpoint(self.dir, tag)


# ---------------------------------------------------------------- states and engines

def synthetic_files(total_bytes: int) -> dict:
    """Mixed-precision state in DeepSpeed's two files: bf16 weights; fp32 master weights and Adam moments."""
    n = total_bytes // 14
    half = n // 2
    return {
        MODEL_FILE: {"module": {"layers.0.weight": torch.randn(half, dtype=torch.bfloat16),
                                "layers.1.weight": torch.randn(n - half, dtype=torch.bfloat16)},
                     "global_steps": 1, "ds_version": deepspeed.__version__},
        OPTIM_FILE: {"optimizer_state_dict": {"fp32_flat_groups": [torch.randn(n)],
                                              "state": {0: {"exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n),
                                                            "step": 1}},
                                              "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.95)}]},
                     "ds_version": deepspeed.__version__},
    }


def matmul_compute(target_s: float):
    """A compute phase of about ``target_s`` seconds: matmuls on tensors of their own."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    for _ in range(3):
        t0 = time.perf_counter()
        torch.mm(a, b)
        one = time.perf_counter() - t0
    count = max(1, round(target_s / one))

    def compute():
        for _ in range(count):
            torch.mm(a, b)

    return compute


def decoupled_engine(ckpt_dir: str):
    """DeepSpeed's DecoupledCheckpointEngine, built by DeepSpeed for a one-process engine with a decoupled writer."""
    model = torch.nn.Linear(8, 8)
    config = {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "checkpoint": DECOUPLED}
    ds, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return ds.checkpoint_engine


def synthetic_engine(strategy: str, ckpt_dir: str):
    if strategy == "ds_decoupled":
        return decoupled_engine(ckpt_dir)
    return create_engine(CheckpointConfig(dir=ckpt_dir, strategy=strategy, keep_last=2), 0, 1)


@contextlib.contextmanager
def deepspeed_factory_for(strategy: str):
    """ds_decoupled: DeepSpeed's own checkpoint-engine factory (its config asks for the decoupled writer)."""
    if strategy != "ds_decoupled":
        yield
        return
    ours, ds_own = install.deepspeed_factory, install.DEEPSPEED_FACTORY
    install.deepspeed_factory = lambda cfg, **_: ds_own
    try:
        yield
    finally:
        install.deepspeed_factory = ours


@dataclass(frozen=True)
class ModelSpec:
    """A GPT state: its config in configs/, overrides of the config's "gpt" block and batch (None: the config's)."""

    config: str
    gpt: dict
    micro_batch: int | None = None
    grad_accum: int | None = None


def model_spec(label: str, args) -> ModelSpec:
    if label == "gpt_tiny":
        return ModelSpec("gpt_tiny_cpu.json", {})
    shape = {**(TOY_SHAPE if args.toy else {}), **({"num_layers": args.layers} if args.layers else {})}
    return ModelSpec(f"{label}.json", shape, args.micro_batch, args.grad_accum)


def gpt_engine(strategy: str, ckpt_dir: str, spec: ModelSpec):
    config = load_ds_config(os.path.join(ROOT, "configs", spec.config))
    gpt = GPTConfig.model_validate({**config.pop("gpt"), **spec.gpt})
    config.pop("pipeline", None)
    for key, value in (("train_micro_batch_size_per_gpu", spec.micro_batch),
                       ("gradient_accumulation_steps", spec.grad_accum)):
        if value:
            config[key] = value
    # DeepSpeed's FusedAdam is compiled at first use, which needs a CUDA compiler; torch's AdamW needs none.
    config["optimizer"]["params"]["torch_adam"] = True
    # The interval is never reached: the benchmark calls save_checkpoint itself.
    config["cpsr"] = {"checkpoint": {"dir": ckpt_dir, "strategy": "torch" if strategy == "ds_decoupled" else strategy,
                                     "interval": 10**9}}
    if strategy == "ds_decoupled":
        config["checkpoint"] = DECOUPLED
    dtype = torch.bfloat16 if config.get("bf16", {}).get("enabled") else torch.float32
    model = gpt_pipeline(gpt, num_stages=1, seed=0, params_dtype=dtype)
    with deepspeed_factory_for(strategy):
        ds, _, _, _ = cpsr_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    return ds, gpt


def describe_model(ds, gpt: GPTConfig) -> dict:
    """What a GPT state is: its shape, parameters, batch and precision."""
    return {"layers": gpt.num_layers, "hidden": gpt.hidden_size, "heads": gpt.num_attention_heads,
            "seq_length": gpt.seq_length, "params": sum(p.numel() for p in ds.module.parameters()),
            "micro_batch": ds.train_micro_batch_size_per_gpu(), "grad_accum": ds.gradient_accumulation_steps(),
            "bf16": ds.bfloat16_enabled(), "zero_stage": ds.zero_optimization_stage()}


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"


def release() -> None:
    """Free the last strategy's engine before the next one is built (a large state twice may not fit)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def close(engine) -> None:
    engine.cleanup()


# ---------------------------------------------------------------- main

def measure(label: str, root: str, repeats: int, compute_s: float, strategies=STRATEGIES,
            spec: ModelSpec | None = None, toy: bool = False) -> dict:
    """Every strategy on one state (``spec``: a GPT's, else the synthetic one); the floors for its size."""
    row = {"strategies": {}}
    files = synthetic_files(2**30) if spec is None else None
    compute = matmul_compute(compute_s) if files else None
    for strategy in strategies:
        d = os.path.join(root, label, strategy)
        os.makedirs(d)
        # The tiny GPT keeps its measurements as they were; a large state's persist would hold up the next window.
        row["drained"] = label not in ("gpt_tiny", "synthetic_1g")
        kw = dict(repeats=repeats, warmup=1 if toy else 2, baseline=2 if toy else 5, drain=row["drained"])
        if files is not None:
            engine = synthetic_engine(strategy, d)
            proto = SyntheticProtocol(strategy, engine, files, compute, d, **kw)
            row["bytes"] = state_bytes(files)
        else:
            ds = proto = engine = None
            release()
            ds, gpt = gpt_engine(strategy, d, spec)
            engine = ds.checkpoint_engine
            proto = GPTProtocol(strategy, ds, gpt, d, **kw)
            row["model"] = describe_model(ds, gpt)
        try:
            result = proto.run()
        except RuntimeError as err:
            result = {"stall_s": None, "persist_s": None, "error": str(err)}
        else:
            # The state as it was checkpointed: Adam's moments exist only after the first optimizer step, so the
            # bytes and the raw copy are taken from the first strategy that trained, before its engine closes.
            if "raw_copy_s" not in row:
                state = files if files is not None else {"m": ds.module.state_dict(), "o": ds.optimizer.state_dict()}
                row["bytes"] = state_bytes(state)
                row["raw_copy_s"] = raw_copy_s(state, repeats)
        finally:
            close(engine)
            shutil.rmtree(d, ignore_errors=True)
        row["strategies"][strategy] = result
        if result["stall_s"] is None:
            print(f"  {label} {strategy}: n/a ({result['error']})", flush=True)
            continue
        print(f"  {label} {strategy}: stall {result['stall_s'] * 1e3:.1f} ms", flush=True)
    if "raw_copy_s" not in row:
        raise RuntimeError(f"{label}: no strategy ran, so there is no state to measure")
    for result in row["strategies"].values():
        if result["stall_s"] is not None:
            result["persist_gbps"] = row["bytes"] / result["persist_s"] / GB if result["persist_s"] else None
    row["disk"] = disk_gbps(root, min(row["bytes"], DISK_PROBE_MAX))
    row["disk_gbps"] = max(row["disk"].values())
    row["compute_s"] = compute_s if files is not None else None
    return row


def print_table(label: str, row: dict) -> None:
    disk = row["disk"]
    it = statistics.median(r["iteration_s"] for r in row["strategies"].values() if r["stall_s"] is not None)
    what = f"matmul compute ~{row['compute_s']:.2f} s + in-place update" if row["compute_s"] else "train_batch"
    model = row.get("model")
    if model:
        what += (f" of {model['layers']} layers, hidden {model['hidden']}, seq {model['seq_length']}, "
                 f"{model['params'] / 1e6:.1f} M parameters, micro-batch {model['micro_batch']} x "
                 f"{model['grad_accum']}, {'bf16' if model['bf16'] else 'fp32'}, ZeRO-{model['zero_stage']}")
    print(f"\n{label}: {row['bytes'] / 2**20:.1f} MiB; iteration {it * 1e3:.0f} ms ({what}); "
          f"raw host copy {row['raw_copy_s'] * 1e3:.1f} ms; disk with fsync {disk['buffered']:.2f} GB/s buffered, "
          f"{disk['direct']:.2f} GB/s O_DIRECT")
    print("stall = training loop blocked inside the engine's calls; slowdown = (request + next iteration) - median "
          "checkpoint-free iteration; medians of checkpoints; total = whole phase beyond checkpoint-free time, per checkpoint"
          + ("; the asynchronous engines flushed, untimed, after each checkpoint's window" if row["drained"] else ""))
    print(f"{'strategy':<13} {'stall ms':>9} {'x raw copy':>10} {'slowdown ms':>11} {'total ms':>9} "
          f"{'persist GB/s':>12} {'x disk':>7}")
    for strategy, r in row["strategies"].items():
        if r["stall_s"] is None:
            print(f"{strategy:<13} {'n/a':>9}  {r['error']}")
            continue
        gbps = r["persist_gbps"]
        tail = f"{gbps:>12.2f} {gbps / row['disk_gbps']:>7.2f}" if gbps else f"{'-':>12} {'-':>7}"
        print(f"{strategy:<13} {r['stall_s'] * 1e3:>9.1f} {r['stall_s'] / row['raw_copy_s']:>10.2f} "
              f"{r['slowdown_s'] * 1e3:>11.1f} {r['total_s'] * 1e3:>9.1f} {tail}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10 checkpoints per strategy, ~0.5 s iterations")
    ap.add_argument("--json", help="write the results here (default, where no output is "
                    "named: into benchmarks/results/NAME/)")
    ap.add_argument("--dir", help="directory on the storage to measure (default: a temporary one)")
    ap.add_argument("--states", nargs="+", choices=STATES, default=list(STATES[:2]),
                    help="the states to measure; the JSON's headline fields are the last one's")
    ap.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    ap.add_argument("--repeats", type=int, help="measured checkpoints per strategy (default 20; --quick 10)")
    ap.add_argument("--layers", type=int, help="gpt2_0.35b, gpt3_3.35b: transformer blocks of the config's shape")
    ap.add_argument("--micro-batch", type=int, help="gpt2_0.35b, gpt3_3.35b: micro-batch (default: the config's)")
    ap.add_argument("--grad-accum", type=int, help="gpt2_0.35b, gpt3_3.35b: accumulation steps (default: the config's)")
    ap.add_argument("--toy", action="store_true", help="gpt2_0.35b, gpt3_3.35b at the tiny GPT's shape, fewer "
                    "warm-up and baseline iterations: a check of the code path")
    args = with_default_outputs(ap.parse_args(), "bench_checkpoint")
    repeats, compute_s = (10, 0.45) if args.quick else (20, 0.8)
    repeats = args.repeats or repeats
    # ZeRO's collectives on CUDA tensors need NCCL, as in training.
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    root = tempfile.mkdtemp(prefix="cpsr-bench-", dir=args.dir)
    sizes = {}
    try:
        for label in args.states:
            spec = None if label == "synthetic_1g" else model_spec(label, args)
            sizes[label] = measure(label, root, repeats, compute_s, args.strategies, spec, args.toy)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # Left to the interpreter's teardown, gloo's threads can abort a process that finished (see train_gpt.finish).
    torch.distributed.destroy_process_group()
    for label, row in sizes.items():
        print_table(label, row)
    large = sizes[args.states[-1]]
    results = {"stall_s": {s: r["stall_s"] for s, r in large["strategies"].items()},
               "slowdown_s": {s: r.get("slowdown_s") for s, r in large["strategies"].items()},
               "raw_copy_s": large["raw_copy_s"],
               "persist_gbps": {s: r.get("persist_gbps") for s, r in large["strategies"].items()},
               "disk_gbps": large["disk_gbps"], "repeats": repeats,
               "device": device_name(), "states": args.states, "sizes": sizes}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
