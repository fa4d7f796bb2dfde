"""Each checkpoint's training slowdown at one fixed interval, by strategy and with cpsr's predictor work on and off:
where bench_ftcost's checkpoint cost (T_s summed, Eq. 1) comes from.

    python -m benchmarks.checkpoint_slowdown [--interval 18] [--interval-of VARIANT=N ...] [--rounds 4] \\
        [--iters 1200] [--json PATH] | tee benchmarks/results/checkpoint_slowdown/checkpoint_slowdown.txt

bench_ftcost's model, storage limit (``write_mbps`` from its warm-up, or ``--write-mbps``) and jobs: every variant
trains ``--iters`` iterations without failures, checkpointing every ``--interval`` iterations (``--interval-of``: a
variant's own), in a child of its own; the variants run interleaved, round by round, so that the machine's drifting
load falls on all of them alike.

- ``checkfreq``, ``pccheck``: their engines, ``recovery.mode: recompute`` (as in bench_ftcost);
- ``cpsr_recompute``: cpsr's engine, ``recovery.mode: recompute`` (nothing observes the checkpoints);
- ``cpsr_skip``: cpsr's engine, predictor ``skip`` (the checkpoint's share is observed, its held-out error and xi
  measured, its summary written; nothing is extrapolated);
- ``cpsr``: cpsr's engine and defaults (predictor ``trend``), as bench_ftcost's ``cpsr_fix``;
- ``none``: no checkpoint at all: each round's baseline for the mean iteration time.

Per run: the median slowdown per checkpoint (runlog's CostRow, what bench_ftcost sums), the median time of
the checkpoint on the training loop's path (``Checkpoints._checkpoint``: DeepSpeed's save and cpsr's work there)
the median and the mean iteration time. Over the rounds: the median, mean and 95 % interval of the runs' medians,
and per round each variant's slowdown over checkfreq's in the same round (its median and interval). With ``none``,
per round each variant's mean iteration time above none's: what its checkpoints cost without a baseline of clean
iterations (the slowdown per checkpoint needs such iterations near each checkpoint, and where persists fill the
interval there are few), per iteration and per checkpoint.
JSON: ``slowdown_ms``, ``on_loop_ms``, ``iteration_ms``, ``mean_iteration_ms``, ``slowdown_over_checkfreq``,
``excess_over_none_ms``, ``excess_per_checkpoint_ms`` (each keyed by variant), ``intervals``, ``rounds``, ``iters``,
``write_mbps``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

from benchmarks.common.jobs import Child, finish_benchmark  # noqa: E402  (first: it sets the jobs' environment)

from benchmarks import bench_ftcost  # noqa: E402
from benchmarks.common.paths import ROOT, with_default_outputs  # noqa: E402
from cpsr_ds.runtime.checkpoints import Checkpoints  # noqa: E402
from benchmarks.common.lag import summarize  # noqa: E402

VARIANTS = {
    "checkfreq": ("checkfreq", {}),
    "pccheck": ("pccheck", {}),
    "cpsr_recompute": ("cpsr", {"recovery": {"mode": "recompute"}}),
    "cpsr_skip": ("cpsr", {"predictor": {"name": "skip"}}),
    "cpsr": ("cpsr", {}),
    "none": ("cpsr", {"recovery": {"mode": "recompute"}, "checkpoint": {"interval": bench_ftcost.NEVER}}),
}
NONE = "none"


def cpsr_block(variant: str, interval: int, write_mbps: float) -> dict:
    strategy, overrides = VARIANTS[variant]
    block = bench_ftcost.strategy_block(strategy, interval, write_mbps, [])
    for section, values in overrides.items():
        block.setdefault(section, {}).update(values)
    return block


def timed_train(config: str, iters: int, valid_sequences: int, out: str) -> None:
    """Child: bench_ftcost's training job, with each checkpoint's time on the loop's path written to ``out``."""
    on_loop = []
    checkpoint = Checkpoints._checkpoint

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return checkpoint(*args, **kwargs)
        finally:
            on_loop.append(time.perf_counter() - t0)

    Checkpoints._checkpoint = timed
    bench_ftcost.train(config, iters, iters, iters, valid_sequences)
    with open(out, "w") as f:
        json.dump(on_loop, f)


def one_run(run_dir: str, cpsr: dict, args) -> dict:
    """One variant's run: the medians of its checkpoints (ms; None without any) and its iteration time.

    ``checkpoints``: those taken, one every interval (no failure, no skip); ``measured``: those with a cost row (a
    checkpoint whose persists overlap the next ones until the run ends gets none).
    """
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    config, on_loop_path = f"{run_dir}.json", f"{run_dir}.on_loop.json"
    with open(config, "w") as f:
        json.dump(bench_ftcost.ds_config(args.iters, run_dir, cpsr), f)
    code = Child(f"{run_dir}.log", timed_train, config, args.iters, args.valid_sequences, on_loop_path).wait()
    if code != 0:
        raise RuntimeError(f"{run_dir}: exit code {code} (log {run_dir}.log)")
    checkpoints = args.iters // cpsr["checkpoint"]["interval"]
    rows = bench_ftcost.cost_rows(run_dir) if checkpoints else []
    with open(on_loop_path) as f:
        on_loop = json.load(f)
    seconds = bench_ftcost.run_iteration_seconds(run_dir, [])
    return {"checkpoints": checkpoints, "measured": len(rows),
            "slowdown_ms": 1e3 * statistics.median(r.slowdown_s for r in rows) if rows else None,
            "on_loop_ms": 1e3 * statistics.median(on_loop) if on_loop else None,
            "iteration_ms": 1e3 * statistics.median(seconds), "mean_iteration_ms": 1e3 * statistics.fmean(seconds)}


def run_all(args) -> dict:
    """Every round's runs, keyed by variant; the write limit."""
    os.makedirs(args.out_dir, exist_ok=True)
    write_mbps = args.write_mbps or bench_ftcost.warm_up(args)["write_mbps"]
    runs = {v: [] for v in args.variants}
    for r in range(args.rounds):
        for v in args.variants:
            run = one_run(os.path.join(args.out_dir, f"round{r}-{v}"),
                          cpsr_block(v, args.intervals[v], write_mbps), args)
            runs[v].append(run)
            print(f"round {r} {v:15s} {run['checkpoints']:4d} checkpoints ({run['measured']} measured) | slowdown "
                  f"{number(run['slowdown_ms'])} ms | on the loop {number(run['on_loop_ms'])} ms | iteration "
                  f"{run['iteration_ms']:5.1f} ms, mean {run['mean_iteration_ms']:5.1f}", flush=True)
    return {"runs": runs, "write_mbps": write_mbps}


def number(value) -> str:
    return "     -" if value is None else f"{value:6.1f}"


def summarize_runs(runs: dict, args, write_mbps: float) -> dict:
    def over_rounds(key):
        return {v: summarize([run[key] for run in rs if run[key] is not None], []) for v, rs in runs.items()}

    def paired(against, value):
        """Per round, ``value(run, against's run of the round)`` for every variant with checkpoints."""
        return {v: summarize([value(run, ref) for run, ref in zip(rs, runs[against])], [])
                for v, rs in runs.items() if v != NONE}

    result = {"intervals": {v: args.intervals[v] for v in runs if v != NONE}, "rounds": args.rounds,
              "iters": args.iters, "write_mbps": write_mbps,
              "slowdown_ms": over_rounds("slowdown_ms"), "on_loop_ms": over_rounds("on_loop_ms"),
              "iteration_ms": over_rounds("iteration_ms"), "mean_iteration_ms": over_rounds("mean_iteration_ms"),
              "runs": runs}
    if "checkfreq" in runs:
        result["slowdown_over_checkfreq"] = paired("checkfreq", lambda run, ref: run["slowdown_ms"] /
                                                   ref["slowdown_ms"])
    if NONE in runs:
        def excess(run, ref):
            return run["mean_iteration_ms"] - ref["mean_iteration_ms"]

        result["excess_over_none_ms"] = paired(NONE, excess)
        result["excess_per_checkpoint_ms"] = paired(NONE, lambda run, ref: excess(run, ref) * args.iters /
                                                    run["checkpoints"])
    return result


def print_result(result: dict) -> None:
    def cell(summary, spec=".1f"):
        if summary is None or summary["median"] is None:
            return f"{'-':>6s}" + " " * 27
        lo, hi = summary["ci95"]
        return f"{summary['median']:6{spec}} ({summary['mean']:6{spec}} [{lo:6{spec}}, {hi:6{spec}}])"

    intervals = ", ".join(f"{v} {n}" for v, n in result["intervals"].items())
    print(f"\ncheckpoint intervals: {intervals}; write_mbps {result['write_mbps']:.3f}, {result['rounds']} rounds of "
          f"{result['iters']} iterations: median over the rounds (mean [95 % interval])")
    width = len(cell(None))
    columns = [("slowdown ms", "slowdown_ms", ".1f"), ("on the loop ms", "on_loop_ms", ".1f"),
               ("over checkfreq", "slowdown_over_checkfreq", ".2f"), ("mean iteration ms", "mean_iteration_ms", ".2f"),
               ("over none ms/iteration", "excess_over_none_ms", ".2f"),
               ("over none ms/checkpoint", "excess_per_checkpoint_ms", ".1f")]
    columns = [c for c in columns if c[1] in result]
    print(f"{'variant':15s} | " + " | ".join(f"{title:{width}s}" for title, _, _ in columns))
    for v in result["slowdown_ms"]:
        print(f"{v:15s} | " + " | ".join(cell(result[key].get(v), spec) for _, key, spec in columns))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interval", type=int, default=18, help="iterations between checkpoints (bench_ftcost's "
                   "CheckFreq interval is 15-18)")
    p.add_argument("--interval-of", nargs="+", default=[], metavar="VARIANT=N",
                   help="a variant's own interval (e.g. pccheck=13 cpsr=45), where it differs from --interval")
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
    args.intervals = {v: args.interval for v in args.variants}
    for spec in args.interval_of:
        variant, _, n = spec.partition("=")
        if variant not in args.variants or variant == NONE or not n.isdigit() or int(n) < 1:
            p.error(f"--interval-of {spec}: give VARIANT=N, N a positive number of iterations, VARIANT one of "
                    f"--variants but none")
        args.intervals[variant] = int(n)
    return args


def main(argv=None) -> None:
    args = with_default_outputs(parse_args(argv), "checkpoint_slowdown")
    start = time.time()
    measured = run_all(args)
    result = summarize_runs(measured["runs"], args, measured["write_mbps"])
    result["seconds"] = time.time() - start
    print_result(result)
    finish_benchmark("checkpoint_slowdown", result, args.json, None, None)


if __name__ == "__main__":
    main()
