"""The coordinator's overhead: training throughput with predictor work in the pipeline bubbles and without.

    python -m benchmarks.bench_overhead [--quick] [--json PATH] [--plot PATH] [--out-dir DIR] [--pairs N] ...
    python -m benchmarks.bench_overhead --quick | tee benchmarks/results/bench_overhead/bench_overhead_quick.txt

Without --json and --plot it writes both into benchmarks/results/bench_overhead/ (``_quick`` with --quick).

The GPT of ``configs/gpt_tiny_cpu.json`` (4 layers, hidden 128, sequence 128), with
``--micro-batches`` (2) micro-batches of ``--micro-batch`` (64) sequences and ZeRO stage 1,
trains through ``examples/gpt/train_gpt.py`` under ``deepspeed --num_gpus N`` (CPU, gloo, one
thread per process) with predictor ``vitp`` (its defaults) learning a fixed number
of steps after each checkpoint (``predictor.train_steps``, no time limit, so that the
predictor's work does not depend on the machine's load), a checkpoint every
``--interval`` iterations and ``coordinator.log_every`` 1. The same config runs with
``coordinator.enabled`` true ("on": the work in the bubbles) and false ("off": at the
checkpoint, on the training loop's path), interleaved: on, off, on, off, ...
With ``--fill`` the on runs set ``coordinator.fill``: vitp keeps training in the bubbles
left after a checkpoint's work, so the on runs' predictor has trained more by the same
iteration (the accuracy lines compare it with the off runs' as before).
The batch is large enough that the bubbles hold pieces of vitp's work (a micro-batch of
64 chunks of a training step, about 20 ms on one thread, or the held-out check); with
the base config's 8 sequences per micro-batch the bubbles are a few ms long.

- PP = 2 (two processes on the two cores: a bubble leaves a core idle) is the headline;
  PP = 4 with DP = 1 and DP = 2 (4 and 8 processes) are reported, oversubscribed on 2 cores.
- PP = 1 with DP = 1 and DP = 2 (no pipeline: the work runs on a nice-19 background thread of
  each rank, what is left at the next checkpoint inline there): the throughput ratio on/off by
  DP degree (``throughput_ratio_pp1``) and the predictor seconds per iteration in the background
  and inline. With ``--plain`` only these layouts run, on DeepSpeed's plain engine: the GPT as one
  module (``train_gpt.py --plain``) under ZeRO-3, each rank's predictor learning its own partition;
  written as ``bench_overhead_plain``.
- Throughput: iterations per second from rank 0's progress journal (its wall times) over
  the iterations after the warm-up (``--warm-up``, default: until vitp has the window of
  checkpoints it learns from, so that every measured iteration has predictor work to
  place), checkpoints and predictor work at the checkpoint included; not the process's
  wall time. Per pair (on_k, off_k) the ratio on/off; its median, mean and Student-t
  95 % interval over the pairs.
- Bubbles (Fig. 10): from the on runs' coordinator records (``coordinator/rankNNNNN.jsonl``)
  after the warm-up, per stage (summed over its data-parallel ranks, divided by their
  iterations): the bubble time measured (``bubble_s``: the slots' spans), the predictor
  time placed in them (``predictor_s``), run on the background thread (``background_s``, PP = 1) and run inline (``inline_s``, on the training
  loop's path), and the share of the bubbles filled, predictor_s / bubble_s. A rank's
  predictor work (placed and inline) at PP = 4, DP = 2 over DP = 1, per stage: wall
  seconds, so with 8 processes on 2 cores it holds the oversubscription too; and its
  CPU time (``predictor_cpu_s``, each thread's own), which does not.
- Accuracy: the held-out error (runlog StateRow ``held_out_error``, Eq. 9) per stage of
  each on and off run at the newest checkpoint both recorded (the on run's last
  checkpoint's check may be left queued at the end of the job), paired as above; and per
  pair the geometric mean of on / off over every checkpoint after the warm-up both
  recorded, with its median, mean and 95 % interval over the pairs (``accuracy_ratio``):
  once the on runs train differently (``--fill``), one checkpoint's ratio swings by several
  per cent from checkpoint to checkpoint.
- Predictor memory (Fig. 11): ``python -m cpsr_ds.predictor.footprint`` (peak resident
  memory above its baseline of vitp's training steps and of a prediction, one thread)
  for a shard the size of the benchmark's pipeline stage (``n_p`` of its StateRows), and
  without ``--quick`` for footprint's default shard (8192 chunks of 1024 parameters).
- Recovery host memory: PP = 2 with DP = 1 and DP = 2 of a larger model (RECOVERY_MODEL,
  about 50 M parameters: 300 MB of fp32 parameters and Adam moments per stage; at the base
  config's size a stage's state is 6 MB, below recovery's fixed costs, so the DP degrees
  would differ in nothing but noise) at a small batch (RECOVERY_BATCH: recovery's memory
  does not depend on it), ``recovery.mode`` predict with the default predictor, rank 1
  killed RECOVERY_KILL_AT iterations in and the job restarted; every rank of the restart
  measures its peak resident memory while ``recover`` runs (VmHWM reset before it;
  ``benchmarks/common/overhead_job.py``). Per DP degree: the largest peak above the rank's memory
  before recovery among stage 0's ranks, and per rank that peak over the rank's own share
  of the stage's state (the acceptance bound is the predictor's history + 2).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict

from benchmarks.common.jobs import finish_benchmark, tail  # noqa: E402  (first: it sets the jobs' environment)

from benchmarks.common.overhead_job import RECORD_DIR as MEMORY_DIR  # noqa: E402
from benchmarks.common.paths import ROOT, with_default_outputs  # noqa: E402
from benchmarks.common.processes import JOB_ENV, finish, free_port, start  # noqa: E402

from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal  # noqa: E402
from cpsr_ds.coordinator import read_records  # noqa: E402
from benchmarks.common.lag import summarize  # noqa: E402
from cpsr_ds.predictor import VITPPredictor  # noqa: E402
from cpsr_ds.runlog import StateRow, held_out_errors, read_measurements  # noqa: E402

BASE_CONFIG = os.path.join(ROOT, "configs", "gpt_tiny_cpu.json")
TRAIN = (os.path.join(ROOT, "examples", "gpt", "train_gpt.py"),)
# Run as a module (DeepSpeed's runner's --module: python -m, from the repository root, where start() runs it).
JOB = ("--module", "benchmarks.common.overhead_job")
DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")
HISTORY = 6
LAYOUTS = ((2, 1), (4, 1), (4, 2))  # (PP, DP); the first is the headline
PP1_LAYOUTS = ((1, 1), (1, 2))  # no pipeline: the work on a background thread
RECOVERY_DP = (1, 2)
RECOVERY_INTERVAL = 3
RECOVERY_KILL_AT = 14  # two iterations after the checkpoint of 12: PB-R predicts
RECOVERY_ITERS = 16
RECOVERY_MODEL = {"num_layers": 4, "hidden_size": 1024, "num_attention_heads": 8}
RECOVERY_BATCH = (1, 2)  # sequences per micro-batch, micro-batches
JOB_TIMEOUT_S = 600
PAPER_CHUNKS = 8192  # footprint's default shard: 8.4 M parameters


# ---------------------------------------------------------------- pure parts


def throughput(entries, warm_up: int) -> float:
    """Iterations per second from one attempt's journal ``entries`` over the iterations after ``warm_up``."""
    after = [e for e in entries if e.iteration >= warm_up]
    if len(after) < 2 or after[-1].wall_time <= after[0].wall_time:
        raise ValueError(f"fewer than two journaled iterations from {warm_up} on: no throughput")
    return (after[-1].iteration - after[0].iteration) / (after[-1].wall_time - after[0].wall_time)


def ratios(on: list[float], off: list[float]) -> dict:
    """Per pair on_k / off_k; their median, mean and 95 % interval (``benchmarks.common.lag.summarize``)."""
    if len(on) != len(off):
        raise ValueError(f"{len(on)} on runs and {len(off)} off runs: not pairs")
    values = [a / b for a, b in zip(on, off)]
    return {**summarize(values, []), "ratios": values}


def per_stage(rows: list[dict], warm_up: int) -> dict[int, dict]:
    """Per stage, from coordinator record lines covering only iterations after ``warm_up``: bubble, predictor and
    inline seconds per iteration (summed over the stage's ranks, divided by their iterations) and the bubble share
    the predictor filled."""
    sums: dict[int, dict] = defaultdict(lambda: {"iterations": 0, "bubble_s": 0.0, "predictor_s": 0.0,
                                                 "background_s": 0.0, "inline_s": 0.0, "predictor_cpu_s": 0.0})
    slices: dict[int, list] = defaultdict(list)
    for r in rows:
        if r["iteration"] - r["iterations"] < warm_up:
            continue
        total = sums[r["stage"]]
        for key in total:
            total[key] += r.get(key, 0.0)  # lines written before background_s or predictor_cpu_s have none
        slices[r["stage"]] += r["slices"]
    return {stage: {"iterations": s["iterations"],
                    **{f"{k}_per_iter": s[k] / s["iterations"]
                       for k in ("bubble_s", "predictor_s", "background_s", "inline_s", "predictor_cpu_s")},
                    "filled_fraction": filled(s["predictor_s"], s["bubble_s"]), "slices": len(slices[stage]),
                    "overruns": sum(spent > budget for _, budget, spent in slices[stage])}
            for stage, s in sorted(sums.items()) if s["iterations"]}


def filled(predictor_s: float, bubble_s: float) -> float | None:
    """The share of the bubbles' time the predictor's work filled; None without bubble time."""
    return predictor_s / bubble_s if bubble_s > 0 else None


def filled_fraction(stages: dict[int, dict]) -> float | None:
    """The share of all stages' bubble time filled (each stage weighted by its bubble time)."""
    return filled(sum(s["predictor_s_per_iter"] * s["iterations"] for s in stages.values()),
                  sum(s["bubble_s_per_iter"] * s["iterations"] for s in stages.values()))


def dp_ratio(dp1: dict, dp2: dict) -> dict:
    """Per key (a stage, or one figure), DP = 2's value over DP = 1's; None where DP = 1's is 0 or either is
    missing."""
    return {k: dp2[k] / dp1[k] if dp1.get(k) and dp2.get(k) is not None else None for k in dp1}


def at_pp(layouts: dict, pp: int) -> dict[int, dict]:
    """The results of the layouts with ``pp`` stages (keys (PP, DP)), by DP degree."""
    return {dp: r for (p, dp), r in sorted(layouts.items()) if p == pp}


def median_ratios(by_dp: dict[int, dict]) -> dict[int, float]:
    """Per DP degree, the median throughput ratio on/off over its pairs."""
    return {dp: r["throughput_ratio"]["median"] for dp, r in by_dp.items()}


def work_per_iter(stages: dict[int, dict]) -> dict[int, float]:
    """Per stage, a rank's predictor seconds per iteration, in the bubbles and inline."""
    return {stage: f["predictor_s_per_iter"] + f["inline_s_per_iter"] for stage, f in stages.items()}


def cpu_per_iter(stages: dict[int, dict]) -> dict[int, float]:
    """Per stage, a rank's predictor CPU seconds per iteration, wherever the work ran."""
    return {stage: f["predictor_cpu_s_per_iter"] for stage, f in stages.items()}


def per_iteration(rows: list[dict], stage: int) -> tuple[list[int], list[float], list[float]]:
    """Fig. 10's series for ``stage``: iterations, and per iteration the bubble and predictor seconds, each the
    mean over the stage's ranks of its lines' per-iteration values."""
    acc: dict[int, list] = defaultdict(list)
    for r in rows:
        if r["stage"] == stage:
            acc[r["iteration"]].append((r["bubble_s"] / r["iterations"], r["predictor_s"] / r["iterations"]))
    its = sorted(acc)
    return (its, [sum(b for b, _ in acc[i]) / len(acc[i]) for i in its],
            [sum(p for _, p in acc[i]) / len(acc[i]) for i in its])


def accuracy(on_rows, off_rows, predictor: str, warm_up: int) -> dict[int, dict]:
    """Per stage: the held-out error of the on and the off run at the newest checkpoint both measured, and over
    every checkpoint after ``warm_up`` both measured the geometric mean of on / off (``ratio_after_warm_up``;
    None where the errors are not all positive)."""
    out = {}
    for stage in sorted({r.stage for r in on_rows if isinstance(r, StateRow)}):
        on, off = (dict(held_out_errors(rows, stage, predictor)) for rows in (on_rows, off_rows))
        common = sorted(set(on) & set(off))
        if common:
            late = [(on[i], off[i]) for i in common if i > warm_up]
            positive = late and all(a > 0 and b > 0 for a, b in late)
            out[stage] = {"iteration": common[-1], "on": on[common[-1]], "off": off[common[-1]],
                          "checkpoints_after_warm_up": len(late),
                          "ratio_after_warm_up": (math.exp(sum(math.log(a / b) for a, b in late) / len(late))
                                                  if positive else None)}
    return out


def accuracy_over_pairs(accuracies: list[dict[int, dict]]) -> dict[int, dict]:
    """Per stage: the pairs' ``ratio_after_warm_up`` (on / off), their median, mean and 95 % interval."""
    stages = sorted({s for pair in accuracies for s in pair})
    out = {}
    for stage in stages:
        values = [pair[stage]["ratio_after_warm_up"] for pair in accuracies if stage in pair]
        out[stage] = {**summarize([v for v in values if v is not None],
                                  ["errors not all positive"] * sum(v is None for v in values)), "ratios": values}
    return out


def recovery_peaks(rows: list[dict], stage: int = 0) -> dict:
    """Per DP degree, from the restarts' memory lines (``overhead_job.py``): the largest peak above the rank's
    memory before recovery among ``stage``'s ranks, MiB."""
    out: dict[int, float] = {}
    for r in rows:
        if r["stage"] == stage:
            out[r["dp"]] = max(out.get(r["dp"], 0.0), (r["peak_kib"] - r["baseline_kib"]) / 1024)
    return dict(sorted(out.items()))


def recovery_over_share(rows: list[dict]) -> dict:
    """Per DP degree, from the restarts' memory lines: the largest ratio among the ranks of a rank's recovery peak
    (above its memory before recovery) to its own share of its stage's state."""
    out: dict[int, float] = {}
    for r in rows:
        out[r["dp"]] = max(out.get(r["dp"], 0.0), (r["peak_kib"] - r["baseline_kib"]) / r["share_kib"])
    return dict(sorted(out.items()))


# ---------------------------------------------------------------- running jobs


def ds_config(run_dir: str, stages: int, cpsr: dict, batch: tuple[int, int] | None = None,
              plain: bool = False) -> dict:
    """The base config with ``stages`` pipeline stages, ZeRO stage 1 and ``batch`` (sequences per micro-batch,
    micro-batches; None: the base config's); ``plain``: for the plain engine, ZeRO-3."""
    with open(BASE_CONFIG) as f:
        config = json.load(f)
    if batch is not None:
        config.update(train_micro_batch_size_per_gpu=batch[0], gradient_accumulation_steps=batch[1])
    config["pipeline"] = {"stages": stages}
    # Each data-parallel rank writes its partition. Without ZeRO, PP = 4 with DP = 2 fails: the ranks of
    # data-parallel rank 1 settle a checkpoint cost with no persist time (checkpoint_cost.CostMeter.settle).
    config["zero_optimization"] = {"stage": 3 if plain else 1}
    config["cpsr"] = {**cpsr, "checkpoint": {"dir": run_dir, **cpsr.get("checkpoint", {})}}
    return config


def launch(base: str, name: str, config: dict, nprocs: int, iters: int, script: tuple = TRAIN,
           plain: bool = False) -> int:
    """``script`` (a path, or --module and a module) under ``deepspeed --num_gpus nprocs`` with ``config``, to
    ``iters`` (``plain``: on DeepSpeed's plain engine); the launcher's exit code."""
    path = os.path.join(base, f"{name}.json")
    with open(path, "w") as f:
        json.dump(config, f)
    command = [DEEPSPEED, "--num_gpus", str(nprocs), "--master_port", str(free_port()), *script,
               "--deepspeed_config", path, "--train-iters", str(iters), "--eval-interval", str(iters),
               "--log-interval", str(iters),
               # The fewest validation sequences train_gpt takes: it evaluates only at the start and the end.
               "--valid-sequences", str(config["train_micro_batch_size_per_gpu"] * nprocs),
               *(["--plain"] if plain else [])]
    return finish([start(command, os.path.join(base, f"{name}.log"), dict(os.environ, **JOB_ENV))], JOB_TIMEOUT_S)[0]


def check(code: int, base: str, name: str) -> None:
    if code != 0:
        with open(os.path.join(base, f"{name}.log"), errors="replace") as f:
            raise RuntimeError(f"{name}: the job ended with exit code {code} (log {base}/{name}.log): {tail(f.read())}")


def overhead_block(args, enabled: bool) -> dict:
    return {"checkpoint": {"interval": args.interval, "keep_last": HISTORY},
            "predictor": {"name": "vitp", "history": HISTORY, "train_steps": args.train_steps, "train_budget_s": None},
            "coordinator": {"enabled": enabled, "log_every": 1, "fill": args.fill}}


def overhead_run(args, stages: int, dp: int, pair: int, enabled: bool) -> dict:
    """One job of a pair; its throughput, coordinator lines and measurements."""
    name = f"{'plain' if args.plain else f'pp{stages}'}-dp{dp}-{pair}-{'on' if enabled else 'off'}"
    run_dir = os.path.join(args.out_dir, name)
    t0 = time.monotonic()
    check(launch(args.out_dir, name, ds_config(run_dir, stages, overhead_block(args, enabled),
                                                (args.micro_batch, args.micro_batches), args.plain), stages * dp,
                 args.iters, plain=args.plain), args.out_dir, name)
    rows, problems = read_measurements(run_dir)
    run = {"dir": run_dir, "wall_s": time.monotonic() - t0,
           "throughput": throughput(read_journal(journal_path(run_dir, 0)), args.warm_up),
           "records": read_records(run_dir), "measurements": rows, "problems": problems}
    print(f"  {name}: {run['throughput']:.3f} it/s ({run['wall_s']:.0f} s)", flush=True)
    return run


def layout_result(args, stages: int, dp: int, runs: list[tuple[dict, dict]]) -> dict:
    """A layout's figures from its (on, off) pairs."""
    on_rows = [r for on, _ in runs for r in on["records"]]
    stage_figures = per_stage(on_rows, args.warm_up)
    accuracies = [accuracy(on["measurements"], off["measurements"], "vitp", args.warm_up) for on, off in runs]
    return {"pp": stages, "dp": dp, "processes": stages * dp, "oversubscribed": stages * dp > (os.cpu_count() or 1),
            "throughput_on": [on["throughput"] for on, _ in runs], "throughput_off": [off["throughput"] for _, off in runs],
            "throughput_ratio": ratios([on["throughput"] for on, _ in runs], [off["throughput"] for _, off in runs]),
            "stages": stage_figures, "bubble_filled_fraction": filled_fraction(stage_figures),
            "accuracy": accuracies, "accuracy_ratio": accuracy_over_pairs(accuracies),
            "fig10": {s: per_iteration(runs[0][0]["records"], s) for s in stage_figures},
            "n_p": {r.stage: r.n_p for on, _ in runs for r in on["measurements"] if isinstance(r, StateRow)},
            "dirs": [[on["dir"], off["dir"]] for on, off in runs]}


def overhead(args, stages: int, dp: int, pairs: int) -> dict:
    runs = [(overhead_run(args, stages, dp, k, True), overhead_run(args, stages, dp, k, False)) for k in range(pairs)]
    return layout_result(args, stages, dp, runs)


def footprint(chunks: int, steps: int) -> dict:
    """``cpsr_ds.predictor.footprint`` for a shard of ``chunks`` x 1024 parameters, in its own process."""
    out = subprocess.run([sys.executable, "-m", "cpsr_ds.predictor.footprint", "--chunks", str(chunks),
                          "--checkpoints", str(HISTORY), "--steps", str(steps), "--threads", "1"],
                         cwd=ROOT, env=dict(os.environ, **JOB_ENV), capture_output=True, text=True,
                         timeout=JOB_TIMEOUT_S, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["peak_mib"] = max(result["train_peak_mib"], result["predict_working_peak_mib"])
    return result


def recovery_memory(args, dp: int) -> list[dict]:
    """A PP = 2 job with DP = ``dp`` killed and restarted with recovery.mode predict; the restart's memory lines."""
    name = f"recovery-dp{dp}"
    run_dir = os.path.join(args.out_dir, name)
    block = {"checkpoint": {"interval": RECOVERY_INTERVAL}, "recovery": {"mode": "predict"},
             "faults": {"kill_rank": 1, "kill_at_iteration": RECOVERY_KILL_AT}}
    config = ds_config(run_dir, 2, block, RECOVERY_BATCH)
    config["gpt"].update(RECOVERY_MODEL)
    first = launch(args.out_dir, f"{name}-first", config, 2 * dp, RECOVERY_ITERS, JOB)
    if first == 0:
        raise RuntimeError(f"{name}: the job finished although rank 1 was to be killed at {RECOVERY_KILL_AT}")
    check(launch(args.out_dir, f"{name}-restart", config, 2 * dp, RECOVERY_ITERS, JOB), args.out_dir,
          f"{name}-restart")
    lines = []
    folder = os.path.join(run_dir, MEMORY_DIR)
    for file in sorted(os.listdir(folder)):
        with open(os.path.join(folder, file)) as f:
            lines.append([json.loads(line) for line in f if line.strip()][-1])  # the restart's
    print(f"  {name}: recovered by {', '.join(sorted({r['method'] for r in lines}))}", flush=True)
    return lines


# ---------------------------------------------------------------- the result


def summarize_all(args, layouts: dict, footprints: dict, memory: list[dict]) -> dict:
    """The figures of every layout that ran; the headline layout's are None where it did not (``--plain``)."""
    head = layouts.get(LAYOUTS[0])
    peaks = recovery_peaks(memory)
    pp4, pp1 = at_pp(layouts, 4), at_pp(layouts, 1)
    per_stage_of_head = lambda key: None if head is None else {s: f[key] for s, f in head["stages"].items()}  # noqa: E731
    return {
        "throughput_ratio": None if head is None else head["throughput_ratio"]["median"],
        "throughput_ratio_summary": None if head is None else head["throughput_ratio"],
        "predictor_s_per_iter": per_stage_of_head("predictor_s_per_iter"),
        "bubble_s_per_iter": per_stage_of_head("bubble_s_per_iter"),
        "inline_s_per_iter": per_stage_of_head("inline_s_per_iter"),
        "bubble_filled_fraction": None if head is None else head["bubble_filled_fraction"],
        "predictor_peak_mb": max(f["peak_mib"] for f in footprints.values()) if footprints else None,
        "predictor_footprint": footprints,
        "recovery_peak_host_mb": peaks,
        "recovery_peak_dp2_over_dp1": peaks[2] / peaks[1] if {1, 2} <= set(peaks) and peaks[1] > 0 else None,
        "recovery_peak_over_share": recovery_over_share(memory),
        "recovery_memory": memory,
        "throughput_ratio_pp4": median_ratios(pp4),
        "throughput_ratio_pp1": median_ratios(pp1),
        "background_s_per_iter_pp1": {dp: r["stages"][0]["background_s_per_iter"] for dp, r in pp1.items()
                                      if 0 in r["stages"]},
        "inline_s_per_iter_pp1": {dp: r["stages"][0]["inline_s_per_iter"] for dp, r in pp1.items()
                                  if 0 in r["stages"]},
        "predictor_s_per_iter_pp4": {dp: {s: f["predictor_s_per_iter"] for s, f in r["stages"].items()}
                                     for dp, r in pp4.items()},
        "bubble_s_per_iter_pp4": {dp: {s: f["bubble_s_per_iter"] for s, f in r["stages"].items()}
                                  for dp, r in pp4.items()},
        "bubble_filled_fraction_pp4": {dp: r["bubble_filled_fraction"] for dp, r in pp4.items()},
        # A rank's predictor work (in the bubbles and inline) at DP = 2 over DP = 1, per stage of PP = 4.
        "predictor_work_dp2_over_dp1": (dp_ratio(work_per_iter(pp4[1]["stages"]), work_per_iter(pp4[2]["stages"]))
                                        if {1, 2} <= set(pp4) else None),
        # The same in CPU time: 8 processes on 2 cores wait for a core, which the wall seconds above hold.
        "predictor_cpu_dp2_over_dp1": (dp_ratio(cpu_per_iter(pp4[1]["stages"]), cpu_per_iter(pp4[2]["stages"]))
                                       if {1, 2} <= set(pp4) else None),
        "layouts": {f"{'plain' if args.plain else f'pp{pp}'}_dp{dp}": r for (pp, dp), r in layouts.items()},
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
    }


def num(value, spec: str, width: int) -> str:
    return f"{'-':>{width}s}" if value is None else f"{value:{width}{spec}}"


def summary_text(t: dict) -> str:
    """A ``summarize`` result as "median, mean [low, high] over n"."""
    lo, hi = t["ci95"] or (None, None)
    return (f"{num(t['median'], '.4f', 6)}, {num(t['mean'], '.4f', 6)} [{num(lo, '.4f', 6)}, {num(hi, '.4f', 6)}] "
            f"over {t['measured']}")


def print_result(result: dict) -> None:
    s = result["settings"]
    fill = ", then on in the bubbles left (coordinator.fill)" if s.get("fill") else ""
    print(f"\nvitp, {s['train_steps']} steps after each checkpoint{fill}, a checkpoint every {s['interval']} "
          f"iterations, {s['iters']} iterations, measured after {s['warm_up']}" + (f"; {s['note']}" if s["note"] else ""))
    print(f"{'layout':10s} {'procs':>5s} | {'on it/s':>8s} {'off it/s':>8s} | ratio on/off: median, mean [95 % interval]"
          f" over pairs")
    for name, r in result["layouts"].items():
        over = " (oversubscribed on 2 cores)" if r["oversubscribed"] else ""
        print(f"{name:10s} {r['processes']:5d} | {sum(r['throughput_on']) / len(r['throughput_on']):8.3f} "
              f"{sum(r['throughput_off']) / len(r['throughput_off']):8.3f} | {summary_text(r['throughput_ratio'])}{over}")
    print("\nper stage and iteration, coordinator on (ms): bubble measured, predictor placed in it, predictor on the "
          "background thread (PP = 1), predictor inline; filled share")
    for name, r in result["layouts"].items():
        for stage, f in r["stages"].items():
            print(f"{name:10s} stage {stage} | bubble {f['bubble_s_per_iter'] * 1e3:8.2f} | placed "
                  f"{f['predictor_s_per_iter'] * 1e3:8.2f} | background {f['background_s_per_iter'] * 1e3:8.2f} | "
                  f"inline {f['inline_s_per_iter'] * 1e3:8.2f} | "
                  f"filled {num(f['filled_fraction'], '.1%', 6)} | slices {f['slices']}, over budget {f['overruns']}")
        print(f"{name:10s} all stages filled {num(r['bubble_filled_fraction'], '.1%', 6)}")
    print("\nheld-out error (Eq. 9) at the newest checkpoint both runs measured: on (in bubbles) / off (at checkpoints)")
    for name, r in result["layouts"].items():
        for k, pair in enumerate(r["accuracy"]):
            print(f"{name:10s} pair {k} | " + " | ".join(
                f"stage {st} it {a['iteration']}: {a['on']:.4g} / {a['off']:.4g}" for st, a in pair.items()))
    print("\nheld-out error on / off over every checkpoint after the warm-up (geometric mean per pair): median, mean "
          "[95 % interval] over pairs")
    for name, r in result["layouts"].items():
        for stage, a in r["accuracy_ratio"].items():
            print(f"{name:10s} stage {stage} | {summary_text(a)} | per pair "
                  + " ".join(num(v, '.4f', 6) for v in a["ratios"]))
    print("\npredictor peak memory (footprint.py, MiB above baseline: training, prediction less its output)")
    for chunks, f in result["predictor_footprint"].items():
        print(f"  {chunks} chunks: train {f['train_peak_mib']:.1f}, predict {f['predict_working_peak_mib']:.1f} "
              f"(output {f['predict_output_mib']:.1f}), step {f['train_step_s'] * 1e3:.1f} ms")
    print("\nrecovery peak host memory (MiB above the rank's memory before recovery; absolute VmHWM)")
    for r in result["recovery_memory"]:
        print(f"  dp {r['dp']} rank {r['rank']} stage {r['stage']} | {r['method']:9s} | "
              f"{(r['peak_kib'] - r['baseline_kib']) / 1024:8.1f} | {r['peak_kib'] / 1024:8.1f} | own share "
              f"{r['share_kib'] / 1024:7.1f} | peak / share {(r['peak_kib'] - r['baseline_kib']) / r['share_kib']:5.2f}"
              f" (history + 2 = {r['history'] + 2})")
    print(f"recovery_peak_host_mb (stage 0, by DP degree): {result['recovery_peak_host_mb']}; DP = 2 over DP = 1: "
          f"{num(result['recovery_peak_dp2_over_dp1'], '.2f', 4)}")
    print(f"a rank's predictor work at PP = 4, DP = 2 over DP = 1, per stage: {result['predictor_work_dp2_over_dp1']}")
    print(f"  the same in CPU time: {result['predictor_cpu_dp2_over_dp1']}")
    print(f"no pipeline (PP = 1), work on a background thread: throughput ratio on/off by DP degree "
          f"{result['throughput_ratio_pp1']}")


def plot(result: dict, path: str) -> None:
    """Fig. 10: per stage of the headline layout's first on run, per iteration, the bubble time measured and the
    predictor time placed in it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = result["layouts"][f"pp{LAYOUTS[0][0]}_dp{LAYOUTS[0][1]}"]["fig10"]
    fig, axes = plt.subplots(len(series), 1, figsize=(9, 2.6 * len(series)), sharex=True, squeeze=False)
    for ax, (stage, (its, bubble, placed)) in zip(axes[:, 0], series.items()):
        ax.bar(its, [b * 1e3 for b in bubble], color="lightgrey", label="bubble measured")
        ax.bar(its, [p * 1e3 for p in placed], color="tab:blue", label="predictor in the bubble")
        ax.axvline(result["settings"]["warm_up"] + 0.5, color="k", lw=0.8, ls=":")  # measured from here on
        ax.set_ylabel(f"stage {stage}, ms")
        ax.legend(fontsize=8, loc="upper left")
    axes[-1, 0].set_xlabel("iteration")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer pairs and iterations (within 8 minutes on 2 cores)")
    p.add_argument("--json", help="write the results here (default, where no output is "
                   "named: into benchmarks/results/NAME/)")
    p.add_argument("--plot", help="write Fig. 10 (bubble and predictor time per stage and iteration) here (PNG)")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "runs", "bench_overhead"),
                   help="the runs' directories and logs (emptied first)")
    p.add_argument("--pairs", type=int, help="on/off pairs at PP = 2 (default 5; --quick: 2)")
    p.add_argument("--pairs-pp4", type=int, help="on/off pairs at PP = 4, each DP (default 2; --quick: 1)")
    p.add_argument("--pairs-pp1", type=int, help="on/off pairs at PP = 1, each DP (default 2; --quick: 1)")
    p.add_argument("--iters", type=int, help="iterations per job (default 40; --quick: 20)")
    p.add_argument("--micro-batch", type=int, default=64, help="sequences per micro-batch")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per iteration")
    p.add_argument("--interval", type=int, default=2, help="checkpoint interval, iterations")
    p.add_argument("--train-steps", type=int, default=4, help="vitp's training steps after each checkpoint")
    p.add_argument("--warm-up", type=int,
                   help="iterations left out of the measurement (default: until vitp has the checkpoints it learns "
                        "from)")
    p.add_argument("--fill", action="store_true",
                   help="coordinator.fill in the on runs: vitp keeps training in the bubbles until the next checkpoint")
    p.add_argument("--no-recovery", action="store_true", help="leave out the recovery memory jobs")
    p.add_argument("--plain", action="store_true", help="only the PP = 1 layouts, on DeepSpeed's plain engine (the GPT "
                   "as one module, ZeRO-3); no recovery memory jobs")
    p.add_argument("--note", default="", help="what else ran on the machine meanwhile, for the record")
    args = p.parse_args(argv)
    args.pairs = args.pairs or (2 if args.quick else 5)
    args.pairs_pp4 = args.pairs_pp4 if args.pairs_pp4 is not None else (1 if args.quick else 2)
    args.pairs_pp1 = args.pairs_pp1 if args.pairs_pp1 is not None else (1 if args.quick else 2)
    args.iters = args.iters or (20 if args.quick else 40)
    if args.warm_up is None:
        args.warm_up = VITPPredictor(history=HISTORY).min_history * args.interval
    if args.warm_up + 2 > args.iters:
        p.error(f"--iters {args.iters} leaves fewer than two iterations after the warm-up of {args.warm_up}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    args = with_default_outputs(args, "bench_overhead", "plain" if args.plain else "", plot=not args.plain)
    shutil.rmtree(args.out_dir, ignore_errors=True)
    os.makedirs(args.out_dir)
    started = time.monotonic()
    layouts = {}
    for stages, dp in PP1_LAYOUTS if args.plain else LAYOUTS + PP1_LAYOUTS:
        pairs = args.pairs if (stages, dp) == LAYOUTS[0] else args.pairs_pp1 if stages == 1 else args.pairs_pp4
        if pairs:
            print(f"PP = {stages}, DP = {dp}: {pairs} pair(s)", flush=True)
            layouts[(stages, dp)] = overhead(args, stages, dp, pairs)
    stage_params = max(n for layout in layouts.values() for n in layout["n_p"].values())
    shards = [math.ceil(stage_params / 1024)] + ([] if args.quick else [PAPER_CHUNKS])
    footprints = {chunks: footprint(chunks, 20) for chunks in shards}
    memory = [] if args.no_recovery or args.plain else [r for dp in RECOVERY_DP for r in recovery_memory(args, dp)]
    result = summarize_all(args, layouts, footprints, memory)
    result["seconds"] = time.monotonic() - started
    print_result(result)
    finish_benchmark("bench_overhead", result, args.json, args.plot, plot)


if __name__ == "__main__":
    main()
