"""How far apart the final validation losses of two runs that differ only by a small perturbation end up: the noise
floor under ``bench_ftcost``'s end-of-training lag and ``bench_recovery``'s end_of_training table.

    python -m benchmarks.divergence_floor [--json PATH] [--eps 1e-6 1e-3] [--at 500 1000]

``bench_recovery``'s reference (seed 1000, T_c 50, 40 intervals: 2000 iterations, its corpus, model and learning
rate schedule) is trained once. For each checkpoint c in ``--at`` and each relative size eps, the product's
recovery restores c exactly (``recovery.mode: recompute``), every weight w is moved by eps * |w| * N(0, 1) (two
noise seeds; eps 0 once: the exact recomputation), and training goes on with the same batches to the end, where
the validation loss is compared with the reference's. If training amplified small differences, a prediction's
final loss excess would be noise of about that size; if it damps them, an excess that stays is the prediction's.
"""

from __future__ import annotations

import argparse
import os
import time

from benchmarks.common.jobs import finish_benchmark  # noqa: E402  (first: it sets the jobs' environment)

from benchmarks import bench_recovery as br  # noqa: E402
from benchmarks.common.paths import with_default_outputs  # noqa: E402
import torch  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the results here (default, where no output is "
                   "named: into benchmarks/results/NAME/)")
    p.add_argument("--eps", type=float, nargs="+", default=[1e-6, 1e-3], help="relative perturbation sizes")
    p.add_argument("--at", type=int, nargs="+", default=[500, 1000], help="checkpoints perturbed (multiples of 50)")
    p.add_argument("--out-dir", default=os.path.join(br.ROOT, "runs", "divergence_floor"))
    return p.parse_args(argv)


def perturb(engine, eps: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in engine.module.parameters():
            w.add_(eps * w.abs() * torch.randn(w.shape, generator=gen).to(w.device))


def main(argv=None) -> None:
    args = with_default_outputs(parse_args(argv), "divergence_floor")
    start = time.time()
    seed = br.one_reference(args.out_dir, "29561")
    end = seed.train_iters
    reference = seed.reference[end]
    print(f"reference: {end} iterations, final validation loss {reference:.5f}")
    print(f"{'c':>6s} {'eps':>7s} {'noise seed':>10s} | final loss excess")
    rows = []
    for c in args.at:
        for eps, noise in [(0.0, 0)] + [(e, n) for e in args.eps for n in (1, 2)]:
            run_dir = seed.failure_dir(c, c, f"perturbed-c{c}-eps{eps:g}-{noise}")
            report = seed.recover(run_dir, {"recovery": {"mode": "recompute"}})
            if report.resume_iteration != c:
                raise RuntimeError(f"recovery resumed at {report.resume_iteration}, not at checkpoint {c}")
            perturb(seed.engine, eps, noise)
            loss = seed.train(c, end, evaluate_at={end})[end]
            rows.append({"c": c, "eps": eps, "noise_seed": noise, "final_loss_excess": (loss - reference) / reference})
            print(f"{c:6d} {eps:7.0e} {noise:10d} | {rows[-1]['final_loss_excess']:+.4%}", flush=True)
    seed.close()
    result = {"reference_final_loss": reference, "train_iters": end, "runs": rows, "seconds": time.time() - start,
              "settings": vars(args)}
    finish_benchmark("divergence_floor", result, args.json, None, None)


if __name__ == "__main__":
    main()
