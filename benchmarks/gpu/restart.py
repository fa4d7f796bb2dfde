"""Restart after an injected failure, and the predictor's GPU memory while training (the paper's Fig. 11).

    python -m benchmarks.gpu.restart --json PATH [--config configs/gpt2_0.35b.json] [--toy] ...

Two runs of ``examples/gpt/train_gpt.py``'s job, one process each (PP = DP = 1), in a run
directory of their own: the first trains with a checkpoint every ``--interval``
iterations until the fault injector kills it after iteration ``--kill-at``; the second
is the restart, which recovers (``recovery.mode: predict``, so that every part of PB-R
runs), takes one training step and stops. This script runs itself as each job (with
``RESTART_PROBE_OUT`` set), wrapping the functions whose time or memory it reports:

- while training: every call of the predictor's work (the state it is given at a
  checkpoint, ``observe``, ``step``, ``validation_error``, ``state_dict``) with the
  growth of ``torch.cuda.max_memory_allocated`` over what was allocated before it;
- at the restart, seconds of: the process start (interpreter and imports, from just
  before this script starts it), ``deepspeed.initialize``, reading the checkpoints (DeepSpeed's
  load and each share copied into the predictor's history), prediction (the predictor given
  its saved weights, predicting), writing the prediction into the engine, building the model, the
  plugin's own setup besides recovery (checkpoint engine, survivor watcher, coordinator),
  reading the corpus, the rest of the job's setup, and the first training step.

Beside them: the recovery report and the restart's downtime from the progress journal
(its last line before the kill to its first after the restart).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.common.paths import ROOT
from benchmarks.common.processes import free_port
from cpsr_ds.config import PredictorConfig  # noqa: E402
TRAIN = os.path.join(ROOT, "examples", "gpt", "train_gpt.py")
PREDICTOR_WORK = ("observe", "step", "validation_error", "state_dict")
PARTS = ("process_start_s", "model_build_s", "deepspeed_init_s", "reading_s", "prediction_s", "writing_s",
         "plugin_setup_s", "corpus_s", "other_setup_s", "first_step_s")
RECOVERY_PARTS = ("reading_s", "prediction_s", "writing_s")  # inside the plugin's setup (Runtime), which recovers
TOY_SHAPE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, help="write the results here")
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "gpt2_0.35b.json"))
    p.add_argument("--micro-batch", type=int, help="default: the config's")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--interval", type=int, default=5, help="checkpoint interval, iterations")
    p.add_argument("--kill-at", type=int, default=33, help="the injected failure: after this iteration")
    p.add_argument("--predictor", help="predictor.name (default: the product's)")
    p.add_argument("--toy", action="store_true", help="the config's model at the tiny GPT's shape (a CPU check)")
    p.add_argument("--dir", help="parent of the run directory (default: a temporary one)")
    p.add_argument("--timeout", type=int, default=300, help="seconds each run may take")
    return p.parse_args(argv)


# ---------------------------------------------------------------- the job

def _append(path: str, row: dict) -> None:
    # One line per call: the first run is killed, and what it measured until then must be on disk.
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _timed(fn, totals: dict, part: str):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[part] = totals.get(part, 0.0) + time.perf_counter() - t0
    return wrapped


def _gpu_measured(fn, what: str, engine, out: str):
    """``fn`` recording, per call, its seconds and its peak CUDA memory above what was allocated before it."""
    cuda = torch.cuda.is_available()

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            peak = None
            if cuda:
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            _append(out, {"kind": "predictor", "what": what, "iteration": engine.global_steps,
                          "seconds": time.perf_counter() - t0, "gpu_peak_mib": peak})
    return wrapped


def job() -> None:
    """One run of train_gpt.py's job, measured (see the module's docstring); writes rows to RESTART_PROBE_OUT."""
    import deepspeed

    from cpsr_ds.runtime.runtime import Runtime
    from cpsr_ds.recovery import decision
    from cpsr_ds.recovery.sources import checkpoint

    from examples.gpt import train_gpt

    out = os.environ["RESTART_PROBE_OUT"]
    entered = time.time()
    totals: dict[str, float] = {}
    deepspeed.initialize = _timed(deepspeed.initialize, totals, "deepspeed_init_s")
    for module, name, part in ((checkpoint, "_load_checked", "reading_s"), (decision, "load_weights", "prediction_s"),
                               (decision, "_prediction", "prediction_s"), (decision, "load_own_share", "writing_s"),
                               (decision, "restore_dump", "writing_s"), (train_gpt, "load_corpus", "corpus_s"),
                               (train_gpt, "gpt_pipeline", "model_build_s")):
        setattr(module, name, _timed(getattr(module, name), totals, part))
    Runtime.__init__ = _timed(Runtime.__init__, totals, "runtime_s")
    run = train_gpt.setup()
    totals["plugin_setup_s"] = totals.pop("runtime_s") - sum(totals.get(part, 0.0) for part in RECOVERY_PARTS)
    ready = time.time()
    engine = run.engine
    if engine.cpsr.recovery.reached is None:
        work = engine.cpsr.work
        work._share = _gpu_measured(work._share, "share", engine, out)
        if work.predictor is not None:
            for what in PREDICTOR_WORK:
                if hasattr(work.predictor, what):
                    setattr(work.predictor, what, _gpu_measured(getattr(work.predictor, what), what, engine, out))
        train_gpt.train(run)
        train_gpt.finish(run)
        return
    t0 = time.time()
    engine.train_batch(iter(run.batches.micro_batches(engine.global_steps)))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    done = time.time()
    launched = float(os.environ["RESTART_LAUNCHED_AT"])
    parts = {"process_start_s": entered - launched, **totals, "first_step_s": done - t0}
    parts["other_setup_s"] = ready - entered - sum(totals.values())
    report = engine.cpsr.recovery
    _append(out, {"kind": "restart", "parts": {k: parts.get(k, 0.0) for k in PARTS},
                  "total_s": done - launched, "report": dataclasses.asdict(report),
                  "description": report.describe()})


# ---------------------------------------------------------------- the measurement

def job_config(args, run_dir: str) -> dict:
    with open(args.config) as f:
        config = json.load(f)
    if args.toy:
        config["gpt"] = {**config["gpt"], **TOY_SHAPE}
        config["train_micro_batch_size_per_gpu"] = 2
    if args.micro_batch:
        config["train_micro_batch_size_per_gpu"] = args.micro_batch
    config["gradient_accumulation_steps"] = args.grad_accum
    config["pipeline"] = {"stages": 1}
    # DeepSpeed's FusedAdam is compiled at first use, which needs a CUDA compiler; torch's AdamW needs none.
    config["optimizer"]["params"]["torch_adam"] = True
    cpsr = {"checkpoint": {"dir": run_dir, "interval": args.interval},
            "faults": {"kill_rank": 0, "kill_at_iteration": args.kill_at}, "recovery": {"mode": "predict"}}
    if args.predictor:
        cpsr["predictor"] = {"name": args.predictor}
    config["cpsr"] = cpsr
    return config


def run_job(args, config_path: str, out: str) -> subprocess.CompletedProcess:
    """One process as DeepSpeed's launcher would start it (one GPU holds one NCCL rank)."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), RESTART_PROBE_OUT=out, PYTHONUNBUFFERED="1",
               RESTART_LAUNCHED_AT=repr(time.time()))
    command = [sys.executable, "-m", "benchmarks.gpu.restart", "--deepspeed_config", config_path,
               "--train-iters", str(args.kill_at + 10), "--eval-interval", str(10**6), "--valid-sequences", "16"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)


def downtime_s(run_dir: str, kill_at: int) -> float | None:
    """Wall time from the journal's line of ``kill_at`` (the killed run's last) to the next one (the restart's)."""
    from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal

    entries = read_journal(journal_path(run_dir, 0))
    before = [e.wall_time for e in entries if e.iteration == kill_at]
    after = [e.wall_time for e in entries if e.iteration == kill_at + 1]
    return after[-1] - before[0] if before and after else None


def summarize(rows: list[dict]) -> dict:
    """Per predictor call kind, the largest CUDA memory growth and the mean seconds; the restart's parts."""
    work = [r for r in rows if r["kind"] == "predictor"]
    by_what = {}
    for what in dict.fromkeys(r["what"] for r in work):
        mine = [r for r in work if r["what"] == what]
        peaks = [r["gpu_peak_mib"] for r in mine if r["gpu_peak_mib"] is not None]
        by_what[what] = {"calls": len(mine), "gpu_peak_mib": max(peaks) if peaks else None,
                         "mean_s": sum(r["seconds"] for r in mine) / len(mine)}
    peaks = [w["gpu_peak_mib"] for w in by_what.values() if w["gpu_peak_mib"] is not None]
    restart = next(r for r in rows if r["kind"] == "restart")
    return {"predictor_gpu_peak_mib": max(peaks) if peaks else None, "predictor_work": by_what,
            "restart": {**restart["parts"], "total_s": restart["total_s"]}, "report": restart["report"],
            "description": restart["description"]}


def print_table(result: dict) -> None:
    model = result["model"]
    print(f"\nrestart of a GPT of {model['num_layers']} layers, hidden {model['hidden_size']}, seq {model['seq_length']} "
          f"on {result['device']}, one process; failure injected after iteration {result['kill_at']}, "
          f"checkpoint every {result['interval']}")
    print(result["description"])
    peak = result["predictor_gpu_peak_mib"]
    print(f"predictor ({result['predictor']}) GPU memory while training: "
          f"{'no CUDA device' if peak is None else f'{peak:.1f} MiB at most'} (growth over what was allocated "
          f"before each call)")
    print(f"{'predictor work':16s} {'calls':>5s} {'GPU MiB':>8s} {'mean s':>8s}")
    for what, w in result["predictor_work"].items():
        mib = "-" if w["gpu_peak_mib"] is None else f"{w['gpu_peak_mib']:.1f}"
        print(f"{what:16s} {w['calls']:5d} {mib:>8s} {w['mean_s']:8.3f}")
    print(f"\n{'restart part':18s} {'s':>8s}")
    for part, seconds in result["restart"].items():
        print(f"{part:18s} {seconds:8.2f}")
    down = result["downtime_s"]
    print(f"downtime in the journal (last line before the kill to the first after): "
          f"{'-' if down is None else f'{down:.1f} s'}")


def measure(args) -> dict:
    parent = tempfile.mkdtemp(prefix="cpsr-restart-", dir=args.dir)
    try:
        run_dir, rows_path = os.path.join(parent, "run"), os.path.join(parent, "rows.jsonl")
        config = job_config(args, run_dir)
        config_path = os.path.join(parent, "ds_config.json")
        with open(config_path, "w") as f:
            json.dump(config, f)
        failed = run_job(args, config_path, rows_path)
        if failed.returncode == 0:
            raise SystemExit(f"restart.py: the failure injected after iteration {args.kill_at} did not stop the job:\n"
                             f"{failed.stdout[-3000:]}")
        restarted = run_job(args, config_path, rows_path)
        if restarted.returncode != 0:
            raise SystemExit(f"restart.py: the restarted job failed with exit code {restarted.returncode}:\n"
                             f"{restarted.stdout[-3000:]}\n{restarted.stderr[-3000:]}")
        with open(rows_path) as f:
            rows = [json.loads(line) for line in f]
        if not any(r["kind"] == "predictor" for r in rows):
            raise SystemExit("restart.py: the predictor did no work before the failure (no checkpoint before it?)")
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        return {"device": device, "model": config["gpt"], "micro_batch": config["train_micro_batch_size_per_gpu"],
                "grad_accum": args.grad_accum, "kill_at": args.kill_at, "interval": args.interval,
                "predictor": args.predictor or PredictorConfig().name, **summarize(rows),
                "downtime_s": downtime_s(run_dir, args.kill_at)}
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    result = measure(args)
    print_table(result)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    if "RESTART_PROBE_OUT" in os.environ:
        job()
    else:
        main()
