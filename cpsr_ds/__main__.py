"""Command line: ``python -m cpsr_ds inspect CKPT_DIR`` lists checkpoints and journal progress;
``python -m cpsr_ds plan --lambda L --ts S --alpha1 ...`` plans a checkpoint interval for given inputs."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from cpsr_ds import planner
from cpsr_ds.checkpoint import store
from cpsr_ds.checkpoint.journal import reached_iteration


def inspect_report(ckpt_dir: str, read_data: bool = True) -> dict:
    """Every checkpoint with iteration, size, status and problems; which is latest, which would load.

    ``valid``: it would load (``status`` valid, or unverified: DeepSpeed's format, no manifest vouches for it).
    """
    latest = store.read_latest(ckpt_dir)
    rows = [{"tag": c.tag, "kind": c.kind, "iteration": c.iteration, "attempt": c.attempt, "size_bytes": c.size,
             "committed": c.committed, "status": c.status, "valid": c.valid, "latest": c.tag == latest,
             "problems": c.problems}
            for c in store.list_checkpoints(ckpt_dir, read_data)]
    usable = next((r["tag"] for r in reversed(rows) if r["valid"]), None)
    return {"dir": ckpt_dir, "latest": latest, "usable": usable, "checkpoints": rows,
            "journal_iteration": reached_iteration(ckpt_dir)}


def _print_table(report: dict) -> None:
    print(f"{'tag':<24} {'iteration':>9} {'size MiB':>10}  {'kind':<9} {'status':<13} problems")
    for r in report["checkpoints"]:
        mark = "<- latest " if r["latest"] else ""
        iteration = "-" if r["iteration"] is None else r["iteration"]
        print(f"{r['tag']:<24} {iteration:>9} {r['size_bytes'] / 2**20:>10.1f}  {r['kind']:<9} {r['status']:<13} "
              f"{mark}{'; '.join(r['problems'])}")
    print(f"latest: {report['latest']}   loads: {report['usable']}   "
          f"journal reached iteration: {report['journal_iteration']}")


def _print_plan(report: dict) -> None:
    print(f"T_c = {report['T_c']} iterations ({report['method']}; Theorem 1: {report['T_c_theorem1']:.1f}, "
          f"numerical: {report['T_c_numerical']:.1f}), cost {100 * report['cost_rate']:.3f} % of training time")
    for problem in report["violations"]:
        print(f"  Theorem 1 does not apply: {problem}")
    print("baselines: " + ", ".join(f"{name} {value:.1f}" for name, value in report["baselines"].items()))
    if "at_t" in report:
        at = report["at_t"]
        print(f"failure at t = {at['t']:g}: Delta F {at['delta_F']:.4g}, T_p {at['T_p_eq13']:.4g} (Eq. 13), "
              f"{at['T_p_eq14']:.4g} (Eq. 14) iterations")


def _emit(report: dict, as_json: bool, print_text) -> int:
    if as_json:
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        print_text(report)
    return 0


def _plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        p = planner.PbrParams(args.alpha1, args.alpha2, args.tau1, args.tau2, args.xi, args.np)
        report = planner.what_if(args.lam, args.ts, p, t=args.t, persist=args.persist, in_flight=args.in_flight,
                                 budget=args.budget, max_interval=args.max_interval)
    except ValueError as e:
        parser.error(str(e))
    return _emit(report, args.json, _print_plan)


def _inspect(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if not os.path.isdir(args.ckpt_dir):
        parser.error(f"{args.ckpt_dir}: not a directory")
    return _emit(inspect_report(args.ckpt_dir, read_data=not args.no_checksums), args.json, _print_table)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cpsr_ds")
    sub = parser.add_subparsers(dest="command", required=True)
    insp = sub.add_parser("inspect", help="list the checkpoints of a directory and the journal's progress")
    insp.add_argument("ckpt_dir")
    insp.add_argument("--json", action="store_true", help="print the report as JSON")
    insp.add_argument("--no-checksums", action="store_true", help="check sizes only, do not read the data")
    plan = sub.add_parser("plan", help="plan the checkpoint interval for given inputs (times in iterations)")
    for flag, dest, text in (("--lambda", "lam", "failures per iteration"), ("--ts", "ts", "T_s: checkpoint cost"),
                             ("--alpha1", "alpha1", "loss curve exp(-alpha1 t + alpha2) (Eq. 11)"),
                             ("--alpha2", "alpha2", "loss curve (Eq. 11)"),
                             ("--tau1", "tau1", "predictor error exp(-tau1 t / T_c + tau2) (Eq. 8)"),
                             ("--tau2", "tau2", "predictor error (Eq. 8)"), ("--xi", "xi", "curvature (Eq. 7)"),
                             ("--np", "np", "N_p: parameters of the stage")):
        plan.add_argument(flag, dest=dest, type=float, required=True, help=text)
    plan.add_argument("--t", type=float, help="report Delta F and T_p for a failure at this iteration")
    plan.add_argument("--persist", type=float, default=0.0, help="persist time of one checkpoint")
    plan.add_argument("--in-flight", type=int, default=1, help="checkpoints persisting at once")
    plan.add_argument("--budget", type=float, default=0.02, help="CheckFreq's and PCcheck's overhead budget")
    plan.add_argument("--max-interval", type=float, default=planner.MAX_INTERVAL, help="longest interval planned")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    return (_plan if args.command == "plan" else _inspect)(parser, args)


if __name__ == "__main__":
    sys.exit(main())
