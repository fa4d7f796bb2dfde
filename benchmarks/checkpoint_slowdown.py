"""Each checkpoint's training slowdown at one fixed interval, by strategy and with cpsr's predictor work on and off:
where bench_ftcost's checkpoint cost (T_s summed, Eq. 1) comes from.

    python benchmarks/checkpoint_slowdown.py [--interval 18] [--rounds 4] [--iters 1200] [--json PATH] \\
        | tee benchmarks/results/checkpoint_slowdown.txt

bench_ftcost's model, storage limit (``write_mbps`` from its warm-up, or ``--write-mbps``) and jobs: every variant
trains ``--iters`` iterations without failures, checkpointing every ``--interval`` iterations, in a child of its own;
the variants run interleaved, round by round, so that the machine's drifting load falls on all of them alike.

- ``checkfreq``, ``pccheck``: their engines, ``recovery.mode: recompute`` (as in bench_ftcost);
- ``cpsr_recompute``: cpsr's engine, ``recovery.mode: recompute`` (nothing observes the checkpoints);
- ``cpsr_skip``: cpsr's engine, predictor ``skip`` (the checkpoint's share is observed, its held-out error and xi
  measured, its summary written; nothing is extrapolated);
- ``cpsr``: cpsr's engine and defaults (predictor ``trend``), as bench_ftcost's ``cpsr_fix``.

Per run: the median slowdown per checkpoint (runlog's CostRow, what bench_ftcost sums), the median time of
the checkpoint on the training loop's path (``plugin.Runtime._checkpoint``: DeepSpeed's save and cpsr's work there)
and the median iteration time. Over the rounds: the median, mean and 95 % interval of the runs' medians, and per
round each variant's slowdown over checkfreq's in the same round (its median and interval).
JSON: ``slowdown_ms``, ``on_loop_ms``, ``iteration_ms``, ``slowdown_over_checkfreq`` (each keyed by variant),
``interval``, ``rounds``, ``iters``, ``write_mbps``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from jobs import ROOT, Child, finish_benchmark  # noqa: E402  (first: it sets the jobs' environment)

import bench_ftcost  # noqa: E402
from cpsr_ds import plugin  # noqa: E402
from cpsr_ds.lag import summarize  # noqa: E402

VARIANTS = {
    "checkfreq": ("checkfreq", {}),
    "pccheck": ("pccheck", {}),
    "cpsr_recompute": ("cpsr", {"recovery": {"mode": "recompute"}}),
    "cpsr_skip": ("cpsr", {"predictor": {"name": "skip"}}),
    "cpsr": ("cpsr", {}),
}


def cpsr_block(variant: str, interval: int, write_mbps: float) -> dict:
    strategy, overrides = VARIANTS[variant]
    block = bench_ftcost.strategy_block(strategy, interval, write_mbps, [])
    for section, values in overrides.items():
        block.setdefault(section, {}).update(values)
    return block


def timed_train(config: str, iters: int, valid_sequences: int, out: str) -> None:
    """Child: bench_ftcost's training job, with each checkpoint's time on the loop's path written to ``out``."""
    on_loop = []
    checkpoint = plugin.Runtime._checkpoint

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return checkpoint(*args, **kwargs)
        finally:
            on_loop.append(time.perf_counter() - t0)

    plugin.Runtime._checkpoint = timed
    bench_ftcost.train(config, iters, iters, iters, valid_sequences)
    with open(out, "w") as f:
        json.dump(on_loop, f)


def one_run(run_dir: str, cpsr: dict, args) -> dict:
    """One variant's run: the medians of its checkpoints (ms) and its iteration time."""
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    config, on_loop_path = f"{run_dir}.json", f"{run_dir}.on_loop.json"
    with open(config, "w") as f:
        json.dump(bench_ftcost.ds_config(args.iters, run_dir, cpsr), f)
    code = Child(f"{run_dir}.log", timed_train, config, args.iters, args.valid_sequences, on_loop_path).wait()
    if code != 0:
        raise RuntimeError(f"{run_dir}: exit code {code} (log {run_dir}.log)")
    rows = bench_ftcost.cost_rows(run_dir)
    with open(on_loop_path) as f:
        on_loop = json.load(f)
    return {"checkpoints": len(rows),
            "slowdown_ms": 1e3 * statistics.median(r.slowdown_s for r in rows),
            "on_loop_ms": 1e3 * statistics.median(on_loop),
            "iteration_ms": 1e3 * bench_ftcost.median_iteration_s(run_dir)}


def run_all(args) -> dict:
    """Every round's runs, keyed by variant; the write limit."""
    os.makedirs(args.out_dir, exist_ok=True)
    write_mbps = args.write_mbps or bench_ftcost.warm_up(args)["write_mbps"]
    runs = {v: [] for v in args.variants}
    for r in range(args.rounds):
        for v in args.variants:
            run = one_run(os.path.join(args.out_dir, f"round{r}-{v}"), cpsr_block(v, args.interval, write_mbps), args)
            runs[v].append(run)
            print(f"round {r} {v:15s} {run['checkpoints']:4d} checkpoints | slowdown {run['slowdown_ms']:6.1f} ms | "
                  f"on the loop {run['on_loop_ms']:5.1f} ms | iteration {run['iteration_ms']:5.1f} ms", flush=True)
    return {"runs": runs, "write_mbps": write_mbps}


def summarize_runs(runs: dict, args, write_mbps: float) -> dict:
    def over_rounds(key):
        return {v: summarize([run[key] for run in rs], []) for v, rs in runs.items()}

    result = {"interval": args.interval, "rounds": args.rounds, "iters": args.iters, "write_mbps": write_mbps,
              "slowdown_ms": over_rounds("slowdown_ms"), "on_loop_ms": over_rounds("on_loop_ms"),
              "iteration_ms": over_rounds("iteration_ms"), "runs": runs}
    if "checkfreq" in runs:
        result["slowdown_over_checkfreq"] = {
            v: summarize([run["slowdown_ms"] / ref["slowdown_ms"] for run, ref in zip(rs, runs["checkfreq"])], [])
            for v, rs in runs.items()}
    return result


def print_result(result: dict) -> None:
    def cell(summary, spec=".1f"):
        lo, hi = summary["ci95"]
        return f"{summary['median']:6{spec}} ({summary['mean']:6{spec}} [{lo:6{spec}}, {hi:6{spec}}])"

    print(f"\nslowdown per checkpoint at interval {result['interval']}, write_mbps {result['write_mbps']:.3f}, "
          f"{result['rounds']} rounds of {result['iters']} iterations: median over the rounds (mean [95 % interval])")
    width = len(cell(next(iter(result["slowdown_ms"].values()))))
    print(f"{'variant':15s} | {'slowdown ms':{width}s} | {'on the loop ms':{width}s} | {'over checkfreq':{width}s} | "
          f"iteration ms")
    for v in result["slowdown_ms"]:
        ratio = result.get("slowdown_over_checkfreq", {}).get(v)
        print(f"{v:15s} | {cell(result['slowdown_ms'][v])} | {cell(result['on_loop_ms'][v])} | "
              f"{cell(ratio, '.2f') if ratio else '':{width}s} | {result['iteration_ms'][v]['median']:6.1f}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interval", type=int, default=18, help="iterations between checkpoints (bench_ftcost's "
                   "CheckFreq interval is 15-18)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--iters", type=int, default=1200)
    p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    p.add_argument("--write-mbps", type=float, help="default: bench_ftcost's, from a warm-up run")
    p.add_argument("--warm-up-interval", type=int, default=20, help="bench_ftcost's warm-up")
    p.add_argument("--valid-sequences", type=int, default=64)
    p.add_argument("--out-dir", default=os.path.join(ROOT, "runs", "checkpoint_slowdown"))
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error("--rounds must be at least 2 (an interval over the rounds)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.time()
    measured = run_all(args)
    result = summarize_runs(measured["runs"], args, measured["write_mbps"])
    result["seconds"] = time.time() - start
    print_result(result)
    finish_benchmark("checkpoint_slowdown", result, args.json, None, None)


if __name__ == "__main__":
    main()
