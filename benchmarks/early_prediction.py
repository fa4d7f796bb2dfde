"""What a predicting recovery early in training costs at the end of it: one failure, several recoveries, each trained
on to the end of training, its final validation loss against the reference's.

    python -m benchmarks.early_prediction [--json PATH] [--c 500] [--d 25]

``bench_recovery``'s reference (seed 1000, T_c 50, 40 intervals: 2000 iterations under warmup and a cosine decay to
10 % of the peak learning rate) fails at f = c + d; the product's recovery (``recovery.mode: predict``) restores it
with each variant below and trains on from f with the same batches to the end. Per variant: the loss excess at
f + 4d and at the end, and the lag at the end that the final excess amounts to (``bench_recovery.end_lag``, as
``bench_ftcost`` charges it), against the d iterations recomputing costs.

- ``trend``: the default predictor (Adam's moments kept from c);
- ``trend, moments predict``: the moments extrapolated too;
- ``linear``;
- ``skip``: c's state resumed at f, no prediction: only the d skipped updates.
"""

from __future__ import annotations

import argparse
import os
import time

from benchmarks.common.jobs import finish_benchmark  # noqa: E402  (first: it sets the jobs' environment)

from benchmarks import bench_recovery as br  # noqa: E402
from benchmarks.common.paths import with_default_outputs  # noqa: E402

VARIANTS = {
    "trend": {"name": "trend"},
    "trend, moments predict": {"name": "trend", "moments": "predict"},
    "linear": {"name": "linear"},
    "skip": {"name": "skip"},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the results here (default, where no output is "
                   "named: into benchmarks/results/NAME/)")
    p.add_argument("--c", type=int, default=500, help="the last checkpoint before the failure (a multiple of 50)")
    p.add_argument("--d", type=int, default=25, help="iterations from c to the failure")
    p.add_argument("--out-dir", default=os.path.join(br.ROOT, "runs", "early_prediction"))
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = with_default_outputs(parse_args(argv), "early_prediction")
    start = time.time()
    c, d = args.c, args.d
    f, window_end = c + d, c + 5 * d
    seed = br.one_reference(args.out_dir, "29571", [(c, d)])
    end = seed.train_iters
    print(f"reference: {end} iterations; failure at f = {f} (c = {c}, d = {d}); recomputing costs {d} iterations")
    print(f"{'recovery':24s} | {'excess at f+4d':>14s} {'at the end':>10s} | {'lag at the end':>14s}")
    rows = {}
    for name, predictor in VARIANTS.items():
        run_dir = seed.failure_dir(c, f, name.replace(", ", "-").replace(" ", "_"))
        report = seed.recover(run_dir, {"recovery": {"mode": "predict"}, "predictor": predictor})
        if report.method != "predict":
            raise RuntimeError(f"{name}: recovery did not predict: {report.describe()}")
        losses = seed.train(f, end, evaluate_at={window_end, end})
        excess = {i: (losses[i] - seed.reference[i]) / seed.reference[i] for i in (window_end, end)}
        lag = br.end_lag(seed.reference, excess[end])
        rows[name] = {"window_end_excess": excess[window_end], "final_loss_excess": excess[end], "end_lag_iters": lag}
        print(f"{name:24s} | {excess[window_end]:+14.3%} {excess[end]:+10.3%} | "
              f"{'unmeasurable' if lag is None else f'{lag:.1f}':>14s}", flush=True)
    seed.close()
    result = {"c": c, "d": d, "train_iters": end, "variants": rows, "seconds": time.time() - start,
              "settings": vars(args)}
    finish_benchmark("early_prediction", result, args.json, None, None)


if __name__ == "__main__":
    main()
