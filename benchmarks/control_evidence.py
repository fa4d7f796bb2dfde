"""Which evidence a run has of what a prediction costs: candidate estimates of a predicting recovery's lag, each
checked against the lag the bench_recovery protocol measured for the same recovery.

    python -m benchmarks.control_evidence [--result JSON] [--runs DIR] [--json PATH]

Reads a bench_recovery result (default: the --quick one) and the run directories it left (``--runs``, its
``--out-dir``): each predicting case's journal holds the training losses up to f, copied from the reference, and
those after the restart. The candidates, each from what a real run has (its own journal, no reference):

- ``loss_probe``: the validation loss right after restoring the prediction, minus the reference's at f (the loss
  probe at the checkpoint would measure this gap on a held-out prediction), in iterations of the loss curve fitted
  on the journal before f (fitter.fit_recent);
- ``realised``: the training losses of [f + 2d, f + 4d] after the restart against that fit extrapolated, in the
  same iterations: what a run can measure of a recovery once it is over;
- ``realised_paired``: the same losses against the reference's own journal over the window (a reference a run does
  not have: the floor the journal's noise leaves);
- ``along``: (1 - a) d, where a is the share of the parameters' step from the checkpoint before c to c that the
  predictor's held-out check covers along the step (its prediction of c from the reference's checkpoints before
  c: what the measuring rank's check at c sees). Error across the step heals after a restart; a shortfall along
  it would be progress lost.

Per candidate: Spearman's rank correlation with the protocol's lag, the median error over d, and how often it
picks the cheapest predictor of each failure (the one with the least protocol lag).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import time
from collections import defaultdict

import numpy as np
import torch

from benchmarks.common.paths import ROOT, result_path, with_default_outputs
from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal
from cpsr_ds.checkpoint.storage.fileformat import read_snapshot
from cpsr_ds.planning.fitter import fit_recent
from cpsr_ds.predictor import make_predictor

CANDIDATES = ("loss_probe", "realised", "realised_paired", "along")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--result", default=result_path("bench_recovery", "json", quick=True),
                   help="a bench_recovery result (default: the --quick one)")
    p.add_argument("--runs", default=os.path.join(ROOT, "runs", "bench_recovery"),
                   help="the run directories it left (its --out-dir)")
    p.add_argument("--json", help="write the results here (default, where no output is named: into "
                   "benchmarks/results/control_evidence/)")
    return p.parse_args(argv)


def journal(run_dir: str) -> dict[int, float]:
    return {e.iteration: e.loss for e in read_journal(journal_path(run_dir, 0))}


def candidates(case: dict, run_dir: str, reference: dict[int, float], a: float | None) -> dict | None:
    """Each candidate's estimate of ``case``'s lag, iterations (``a``: the held-out check's along, None: none, as
    for vitp, whose check needs its trained network); None where its run left no journal to read."""
    if not os.path.isdir(run_dir):
        return None
    f, d = case["c"] + case["d"], case["d"]
    losses = journal(run_dir)
    fit = fit_recent({i: loss for i, loss in losses.items() if i <= f}, f)
    window = [t for t in range(f + 2 * d, f + 4 * d + 1) if t in losses and t in reference]
    if fit is None or not window:
        return None

    def slope(ts) -> float:  # the fitted curve's fall per iteration over ts (> 0)
        return -float(np.mean([fit(t + 0.5) - fit(t - 0.5) for t in ts]))

    return {"loss_probe": case["gap_after_restore"] / slope([f]),
            "realised": float(np.mean([losses[t] - fit(t) for t in window])) / slope(window),
            "realised_paired": float(np.mean([losses[t] - reference[t] for t in window])) / slope(window),
            "along": None if a is None else (1.0 - a) * d}


def layer_params(checkpoint_dir: str) -> dict[str, torch.Tensor]:
    """The parameters of a pipeline checkpoint's layer files, keyed as the predictors take them."""
    found = {}
    for path in sorted(glob.glob(os.path.join(checkpoint_dir, "layer_*-model_states.pt"))):
        for key, value in read_snapshot(path).items():
            if torch.is_tensor(value) and value.is_floating_point():
                found[f"param/{os.path.basename(path)}/{key}"] = value.float()
    return found


def along_step(pred: torch.Tensor, truth: torch.Tensor, prev: torch.Tensor) -> float:
    """<pred - prev, truth - prev> / ||truth - prev||^2: the share of the step prev -> truth ``pred`` covers."""
    step = truth - prev
    return float(torch.dot(pred - prev, step) / torch.dot(step, step))


def held_out_along(reference: str, method: str, c: int, Tc: int, params) -> float | None:
    """a of ``method``'s prediction of checkpoint c from the reference's checkpoints before it (``params``: the
    checkpoints' parameters by iteration, loaded once); None where it has too few."""
    made = make_predictor(method, params="predict", moments="keep")
    for k in range(max(Tc, c - made.history.capacity * Tc), c, Tc):
        made.observe(k, params(k))
    if not made.ready():
        return None
    flat = lambda state: torch.cat([state[k].flatten() for k in sorted(state)])  # noqa: E731
    return along_step(flat(made.predict(c)), flat(params(c)), flat(params(c - Tc)))


def spearman(x, y) -> float | None:
    from scipy import stats

    return float(stats.spearmanr(x, y).statistic) if len(x) >= 3 else None


def median_over_d(rows: list[dict], key: str) -> float | None:
    values = [r[key] / r["d"] for r in rows if r[key] is not None]
    return float(np.median(values)) if values else None


def evaluate(rows: list[dict]) -> dict:
    """Per candidate: Spearman with the protocol's lag, median |error| / d and error / d, the share of failures
    whose cheapest predictor it picks; per predictor: the median lag / d by the protocol and by each candidate."""
    out = {}
    failures = defaultdict(list)
    for row in rows:
        failures[(row["seed"], row["c"], row["d"])].append(row)
    for name in CANDIDATES:
        having = [r for r in rows if r[name] is not None]
        est = np.array([r[name] for r in having])
        lag = np.array([r["lag"] for r in having])
        d = np.array([r["d"] for r in having], dtype=float)
        picks = [min(fr, key=lambda r: r[name])["method"] == min(fr, key=lambda r: r["lag"])["method"]
                 for fr in ([r for r in rs if r[name] is not None] for rs in failures.values()) if len(fr) > 1]
        out[name] = {"spearman": spearman(est, lag), "median_abs_error_over_d": float(np.median(np.abs(est - lag) / d)),
                     "median_error_over_d": float(np.median((est - lag) / d)),
                     "picks_cheapest": float(np.mean(picks)) if picks else None, "failures": len(picks)}
    by_method = defaultdict(list)
    for row in rows:
        by_method[row["method"]].append(row)
    out["by_predictor"] = {m: {k: median_over_d(rs, k) for k in ("lag",) + CANDIDATES}
                           for m, rs in sorted(by_method.items())}
    return out


def main(argv=None) -> None:
    args = with_default_outputs(parse_args(argv), "control_evidence")
    start = time.time()
    with open(args.result) as f:
        result = json.load(f)
    rows, missing = [], 0
    references, loaded = {}, {}
    defaults = {(c["seed"], c["c"], c["d"]): c["decision"] for c in result["cases"] if c["method"] == "default"}
    for case in result["cases"]:
        if case["method"] in ("recompute", "default") or case["lag_iters"] is None or "(RB-R)" in case["decision"]:
            continue  # not a predicting recovery (vitp not ready recomputes)
        seed_dir = os.path.join(args.runs, f"seed{case['seed']}-Tc{case['Tc']}")
        if seed_dir not in references:
            references[seed_dir] = journal(os.path.join(seed_dir, "reference"))
        # Where the default predicted with this predictor, bench_recovery took its run for the predictor's case.
        name = "default" if case["decision"] == defaults.get((case["seed"], case["c"], case["d"])) else case["method"]

        def params(k: int, ref=os.path.join(seed_dir, "reference")) -> dict[str, torch.Tensor]:
            if (ref, k) not in loaded:
                loaded[(ref, k)] = layer_params(os.path.join(ref, f"global_step{k}"))
            return loaded[(ref, k)]

        a = None if case["method"] == "vitp" else held_out_along(seed_dir, case["method"], case["c"], case["Tc"], params)
        got = candidates(case, os.path.join(seed_dir, f"{name}-c{case['c']}-d{case['d']}"), references[seed_dir], a)
        if got is None:
            missing += 1
            continue
        rows.append({"seed": case["seed"], "method": case["method"], "c": case["c"], "d": case["d"],
                     "lag": case["lag_iters"], **got})
    if not rows:
        raise SystemExit(f"control_evidence: no run directory of {args.result}'s cases under {args.runs}")
    summary = evaluate(rows)
    print(f"{len(rows)} predicting recoveries of {os.path.relpath(args.result, ROOT)} ({missing} without their run "
          "directory)")
    print(f"{'candidate':16s} {'spearman':>8s} {'|err|/d':>8s} {'err/d':>7s} {'picks cheapest':>15s}")
    for name in CANDIDATES:
        s = summary[name]
        print(f"{name:16s} {s['spearman']:+8.2f} {s['median_abs_error_over_d']:8.2f} {s['median_error_over_d']:+7.2f} "
              f"{s['picks_cheapest']:10.0%} of {s['failures']}")
    print(f"\nmedian lag / d by predictor\n{'predictor':10s} {'protocol':>9s}" + "".join(f"{n:>16s}" for n in CANDIDATES))
    for m, s in summary["by_predictor"].items():
        print(f"{m:10s} {s['lag']:+9.2f}" + "".join(f"{s[n]:+16.2f}" if s[n] is not None else f"{'-':>16s}"
                                                    for n in CANDIDATES))
    out = {"result": os.path.relpath(args.result, ROOT), "rows": rows, "summary": summary,
           "seconds": time.time() - start}
    if args.json:
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
