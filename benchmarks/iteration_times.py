"""A cross-check of bench_ftcost's checkpoint cost that needs no baseline: each run's mean iteration time.

bench_ftcost measures each checkpoint's slowdown against the iterations with no checkpoint in
flight nearest before and after it (``checkpoint_cost.CostMeter``). Where persists fill the
interval (the baselines' rules at 2 % set it near the persist time) such iterations are few,
and those there are follow a persist. A run's mean time per trained iteration holds every
checkpoint's slowdown without a baseline, and the host's drift too: the runs of a trace ran one
after the other, minutes apart, in the order of ``bench_ftcost.STRATEGIES``. Per trace it
prints each strategy's mean, and cpsr's against the better of checkfreq and pccheck, paired
per trace as bench_ftcost pairs T_l. The strategies' runs evaluate at the same iterations; the
failure-free reference evaluates over a longer span, so its mean is not comparable and is left out.

    python -m benchmarks.iteration_times OUT_DIR    (bench_ftcost's --out-dir, its manifest.json)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from benchmarks import bench_ftcost as bench
from benchmarks.common.lag import summarize

BASELINES = ("checkfreq", "pccheck")


def mean_iteration_ms(run_dir: str, trace: list[int]) -> float:
    return 1e3 * statistics.fmean(bench.run_iteration_seconds(run_dir, trace))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", help="bench_ftcost's --out-dir")
    args = p.parse_args()
    with open(os.path.join(args.out_dir, "manifest.json")) as f:
        manifest = json.load(f)
    print("mean wall ms per trained iteration (journal; evaluations in, restarts out)")
    strategies = [s for s in bench.STRATEGIES if all(s in t["runs"] for t in manifest["traces"])]
    print("trace  " + "".join(f"{s:>11s}" for s in strategies) + "   cpsr vs better baseline")
    paired = []
    for number, trace in enumerate(manifest["traces"]):
        means = {s: mean_iteration_ms(trace["runs"][s]["dir"], trace["failures"]) for s in strategies}
        better = min(means[s] for s in BASELINES)
        paired.append(100 * (means["cpsr"] / better - 1))
        print(f"{number:5d}  " + "".join(f"{means[s]:11.2f}" for s in strategies) + f"   {paired[-1]:+7.2f} %")
    summary = summarize(paired, [])
    lo, hi = summary["ci95"]
    print(f"cpsr's mean iteration time against the better baseline's, per trace: median {summary['median']:+.2f} %, "
          f"mean {summary['mean']:+.2f} % [{lo:+.2f}, {hi:+.2f}] over {summary['measured']}")


if __name__ == "__main__":
    main()
