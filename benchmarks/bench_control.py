"""Whether the predict-or-recompute control transfers: the bench_recovery protocol over a matrix of workloads, the
default's choice against the cheapest choice in hindsight.

    python -m benchmarks.bench_control [--quick] [--json PATH] [--workloads FILE] [--resume]

Each workload (``--workloads``, a JSON list; default ``benchmarks/workloads/control.json``, with ``--quick``
``control_quick.json``) names a model size, a corpus, a learning-rate schedule (cosine, linear, constant, wsd:
bench_recovery's ``--schedule``), a peak learning rate, T_c and the seeds. Per workload and seed: a reference run,
failures at 25/50/75 % of it with d in {T_c/2, T_c - 1}, each recovered through the product's own recovery path by
recomputing, by each predictor forced to predict, and by the default (``recovery.mode: auto``), which trains on to
the end of the run (bench_recovery's protocol, lags over [2d, 4d] after f).

Per failure: the default's lag and its loss excess at the end; the oracle's lag, the least of recomputing's and
every predictor's (chosen in hindsight); regret = the default's lag - the oracle's. Per workload and overall:
``mean_regret_over_d`` (mean and 95 % interval), ``guard_violations`` (failures whose final loss excess is above
``recovery.max_loss_excess``), ``default_reduction`` and ``oracle_reduction`` (1 - lag / d), and per failure the
lag the default's decision estimated beside the lag its predictor measured. The measurement's own noise beside them:
``skip_lag_over_d``, skip's lag over d (c's state resumed at f: its lag is d up to the batches it skipped, so its
spread is the protocol's noise), and ``noise_oracle_reduction``, what an oracle choosing in hindsight between
recomputing and skip "saves" (1 - skip's lag / d where skip measured below d): the share of the oracle's
reduction noise alone can give a choice between two methods of the same lag. Each workload's cases are appended to
``bench_control[_quick].cases.jsonl`` in ``--out-dir`` as it ends; ``--resume`` skips the workloads there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections import defaultdict

from benchmarks.common.jobs import finish_benchmark  # noqa: E402  (first: it sets the jobs' environment)

import deepspeed  # noqa: E402
import torch  # noqa: E402

from benchmarks import bench_recovery as br  # noqa: E402
from benchmarks.common.lag import summarize as summarize_values  # noqa: E402
from benchmarks.common.paths import ROOT, with_default_outputs  # noqa: E402
from benchmarks.common.processes import free_port  # noqa: E402
from cpsr_ds.config import RecoveryConfig  # noqa: E402

WORKLOADS = os.path.join(ROOT, "benchmarks", "workloads")
# The acceptance figures of the control (issue "Control that transfers").
MAX_MEAN_REGRET_OVER_D = 0.15
ORACLE_SAVES = 0.20  # where the oracle saves at least this share of d, the default must save at least half of it
ESTIMATE = re.compile(r"estimates a lag of (-?[0-9.]+)")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the quick matrix (control_quick.json)")
    p.add_argument("--workloads", help="a JSON list of workloads (default: control.json; --quick: control_quick.json)")
    p.add_argument("--json", help="write the results here (default, where no output is named: into "
                   "benchmarks/results/bench_control/)")
    p.add_argument("--resume", action="store_true", help="skip the workloads the cases file already holds")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "runs", "bench_control"))
    args = p.parse_args(argv)
    args.workloads = args.workloads or os.path.join(WORKLOADS, "control_quick.json" if args.quick else "control.json")
    return args


def workload_argv(w: dict, out_dir: str) -> list[str]:
    """bench_recovery's arguments for workload ``w``."""
    argv = ["--intervals", str(w["Tc"]), "--intervals-per-run", str(w["intervals_per_run"]),
            "--seeds", str(w.get("seeds", 1)), "--schedule", w["schedule"], "--lr", str(w["lr"]),
            "--num-layers", str(w["num_layers"]), "--hidden-size", str(w["hidden_size"]),
            "--num-attention-heads", str(w["num_attention_heads"]), "--seq-length", str(w["seq_length"]),
            "--micro-batch", str(w["micro_batch"]), "--eval-every", str(w.get("eval_every", 20)),
            "--valid-sequences", str(w.get("valid_sequences", 256)), "--vitp-steps", str(w.get("vitp_steps", 10)),
            "--no-cost-model", "--out-dir", os.path.join(out_dir, w["name"]), "--methods", *w["methods"]]
    if w.get("data") not in (None, "stdlib"):
        argv += ["--data", w["data"]]
    return argv


def failure_rows(cases: list[dict], max_loss_excess: float) -> list[dict]:
    """One row per failure: the default's lag and final loss excess, the oracle's lag and method, the regret,
    and the lag the default's decision estimated beside the lag of the predictor it named (None: recomputed)."""
    failures = defaultdict(dict)
    for case in cases:
        failures[(case["seed"], case["c"], case["d"])][case["method"]] = case
    rows = []
    for (seed, c, d), by_method in sorted(failures.items()):
        default = by_method["default"]
        candidates = {m: case["lag_iters"] for m, case in by_method.items()
                      if m != "default" and case["lag_iters"] is not None}
        oracle = min(candidates, key=candidates.get)
        predictor = br.predicted_with(default["decision"])
        estimated = ESTIMATE.search(default["decision"] or "")
        final = default["final_loss_excess"]
        rows.append({"seed": seed, "c": c, "d": d, "default_lag": default["lag_iters"],
                     "default_method": predictor or "recompute", "oracle_lag": candidates[oracle],
                     "oracle_method": oracle, "regret": (default["lag_iters"] - candidates[oracle]
                                                         if default["lag_iters"] is not None else None),
                     "final_loss_excess": final, "violation": final is not None and final > max_loss_excess,
                     "estimated_lag": float(estimated.group(1)) if estimated else None,
                     "skip_lag": candidates.get("skip"),
                     "measured_lag_of_estimate": candidates.get(predictor) if predictor else None})
    return rows


def summarize(rows: list[dict]) -> dict:
    """The control's figures over ``rows`` (failure_rows)."""
    measured = [r for r in rows if r["regret"] is not None]
    skipped = [r for r in rows if r.get("skip_lag") is not None]
    return {"failures": len(rows),
            "mean_regret_over_d": summarize_values([r["regret"] / r["d"] for r in measured], []),
            "guard_violations": sum(r["violation"] for r in rows),
            "default_reduction": summarize_values([1 - r["default_lag"] / r["d"] for r in measured], []),
            "oracle_reduction": summarize_values([1 - r["oracle_lag"] / r["d"] for r in rows], []),
            "skip_lag_over_d": summarize_values([r["skip_lag"] / r["d"] for r in skipped], []),
            "noise_oracle_reduction": summarize_values([max(0.0, 1 - r["skip_lag"] / r["d"]) for r in skipped], [])}


def acceptance(per_workload: dict, overall: dict) -> dict:
    """The issue's checks: no guard violation, mean regret at most MAX_MEAN_REGRET_OVER_D of d, and on each
    workload whose oracle saves at least ORACLE_SAVES the default saving at least half of what the oracle saves."""
    def mean(s):
        return s["mean"] if s["mean"] is not None else 0.0

    short = sorted(name for name, s in per_workload.items()
                   if mean(s["oracle_reduction"]) >= ORACLE_SAVES
                   and mean(s["default_reduction"]) < mean(s["oracle_reduction"]) / 2)
    return {"no_guard_violations": overall["guard_violations"] == 0,
            "mean_regret_at_most": mean(overall["mean_regret_over_d"]) <= MAX_MEAN_REGRET_OVER_D,
            "default_saves_half_of_oracle": not short, "workloads_short_of_half": short}


def print_table(per_workload: dict, overall: dict, checks: dict) -> None:
    def pct(s):
        return "      -" if s["mean"] is None else f"{s['mean']:+7.1%}"

    def spread(s):
        return "          -" if s["sd"] is None else f"{s['mean']:4.2f} sd {s['sd']:4.2f}"

    print(f"\n{'workload':30s} {'failures':>8s} {'regret/d':>9s} {'default':>8s} {'oracle':>8s} {'violations':>10s} "
          f"{'skip lag/d':>12s} {'noise':>7s}")
    for name, s in [*per_workload.items(), ("all", overall)]:
        print(f"{name:30s} {s['failures']:8d} {pct(s['mean_regret_over_d']):>9s} {pct(s['default_reduction']):>8s} "
              f"{pct(s['oracle_reduction']):>8s} {s['guard_violations']:10d} {spread(s['skip_lag_over_d']):>12s} "
              f"{pct(s['noise_oracle_reduction']):>7s}")
    print(f"\nacceptance: {checks}")


def read_done(path: str) -> dict[str, list]:
    """The cases of each workload a run appended to ``path``."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {row["workload"]: row["cases"] for row in map(json.loads, filter(str.strip, f))}


def main(argv=None) -> None:
    args = with_default_outputs(parse_args(argv), "bench_control")
    start = time.time()
    with open(args.workloads) as f:
        workloads = json.load(f)
    # Beside the runs, not the results: --resume reads it, the JSON holds every failure's figures.
    cases_path = os.path.join(args.out_dir, f"bench_control{'_quick' * args.quick}.cases.jsonl")
    os.makedirs(args.out_dir, exist_ok=True)
    if not args.resume and os.path.exists(cases_path):
        os.remove(cases_path)
    done = read_done(cases_path)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")
    for w in workloads:
        if w["name"] in done:
            print(f"== {w['name']}: in {cases_path}, skipped")
            continue
        print(f"== {w['name']}: {json.dumps(w)}", flush=True)
        result = br.run(br.parse_args(workload_argv(w, args.out_dir)))
        done[w["name"]] = result["cases"]
        with open(cases_path, "a") as f:
            f.write(json.dumps({"workload": w["name"], "cases": result["cases"]}) + "\n")
    torch.distributed.destroy_process_group()
    limit = RecoveryConfig().max_loss_excess
    rows = {w["name"]: failure_rows(done[w["name"]], limit) for w in workloads}
    per_workload = {name: summarize(r) for name, r in rows.items()}
    overall = summarize([r for rs in rows.values() for r in rs])
    checks = acceptance(per_workload, overall)
    print_table(per_workload, overall, checks)
    result = {"workloads": workloads, "per_workload": per_workload, "overall": overall, "acceptance": checks,
              "failures": rows, "max_loss_excess": limit, "seconds": time.time() - start}
    finish_benchmark("bench_control", result, args.json, None, None)


if __name__ == "__main__":
    main()
