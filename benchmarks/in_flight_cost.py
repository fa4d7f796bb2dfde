"""What resuming from the parameters of the checkpoint in flight costs at the end of training: the in-flight source
(``cpsr_ds.recovery.sources.in_flight``) trained on to the end, its final validation loss against the reference's.

    python -m benchmarks.in_flight_cost [--json PATH] [--pairs 50:100 450:500 950:1000]

``bench_recovery``'s reference (seed 1000, T_c 50, 40 intervals: 2000 iterations under warmup and a cosine decay to
10 % of the peak learning rate) is trained once. For each pair c:c' the product's recovery restores checkpoint c
exactly (``recovery.mode: recompute``); then the in-flight source reads the layer files of the reference's checkpoint
c' as it reads those of a checkpoint that had not committed (``in_flight.read_layers``) and resumes from them
(``in_flight.resume``: c''s parameters, Adam's moments of c, the counters moved on to c'), and training goes on
with the same batches to the end. Recomputing from c would cost c' - c iterations more; the resumption costs its
lag at the end (``bench_recovery.end_lag``, as ``bench_ftcost`` charges it). Per pair: the loss excess every 200
iterations and at the end, the lag, and the share of c' - c it saved (1 - lag / (c' - c)).
"""

from __future__ import annotations

import argparse
import os
import time

from benchmarks.common.jobs import finish_benchmark  # noqa: E402  (first: it sets the jobs' environment)

from benchmarks import bench_recovery as br  # noqa: E402
from benchmarks.common.paths import with_default_outputs  # noqa: E402
from cpsr_ds.recovery.sources import in_flight  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the results here (default, where no output is "
                   "named: into benchmarks/results/NAME/)")
    p.add_argument("--pairs", nargs="+", default=["50:100", "450:500", "950:1000"],
                   help="c:c', the committed checkpoint and the one in flight (multiples of 50)")
    p.add_argument("--out-dir", default=os.path.join(br.ROOT, "runs", "in_flight_cost"))
    return p.parse_args(argv)


def resume_in_flight(seed: br.Seed, c: int, ahead: int) -> None:
    """Checkpoint c restored exactly, then the parameters of the reference's checkpoint ``ahead`` as in flight."""
    report = seed.recover(seed.failure_dir(c, c, f"in-flight-c{c}-{ahead}"), {"recovery": {"mode": "recompute"}})
    if report.resume_iteration != c:
        raise RuntimeError(f"recovery resumed at {report.resume_iteration}, not at checkpoint {c}")
    tag = seed.tag_of(ahead)
    found, problem = in_flight.read_layers(seed.engine, os.path.join(seed.ref_dir, tag), ahead, tag)
    if found is None:
        raise RuntimeError(f"the layer files of {tag}: {problem}")
    if in_flight.resume(seed.engine, found, c) != ahead:
        raise RuntimeError(f"the in-flight source did not resume at {ahead}")


def main(argv=None) -> None:
    args = with_default_outputs(parse_args(argv), "in_flight_cost")
    start = time.time()
    pairs = [tuple(int(x) for x in pair.split(":")) for pair in args.pairs]
    seed = br.one_reference(args.out_dir, "29591")
    end = seed.train_iters
    print(f"reference: {end} iterations, final validation loss {seed.reference[end]:.5f}")
    rows = []
    for c, ahead in pairs:
        resume_in_flight(seed, c, ahead)
        at = [i for i in range(ahead + 200, end, 200) if i in seed.reference] + [end]
        losses = seed.train(ahead, end, evaluate_at=set(at))
        excess = {i: (losses[i] - seed.reference[i]) / seed.reference[i] for i in at}
        lag = br.end_lag(seed.reference, excess[end])
        saved = None if lag is None else 1 - lag / (ahead - c)
        rows.append({"c": c, "in_flight": ahead, "excess": excess, "final_loss_excess": excess[end],
                     "end_lag_iters": lag, "saved": saved})
        print(f"c {c:5d}, in flight {ahead:5d} | excess " + " ".join(f"{i}: {e:+.3%}" for i, e in excess.items())
              + f" | lag at the end {'unmeasurable' if lag is None else f'{lag:.1f}'} of {ahead - c} iterations"
              + ("" if saved is None else f", saved {saved:.0%}"), flush=True)
    seed.close()
    result = {"train_iters": end, "pairs": rows, "seconds": time.time() - start, "settings": vars(args)}
    finish_benchmark("in_flight_cost", result, args.json, None, None)


if __name__ == "__main__":
    main()
