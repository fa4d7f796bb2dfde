"""Command line: ``python -m cpsr_ds inspect CKPT_DIR`` lists checkpoints and journal progress;
``python -m cpsr_ds plan RUN_DIR [--plot FILE.png]`` shows a run's plans beside the checkpoints it took;
``python -m cpsr_ds plan --lambda L --ts S --alpha1 ...`` plans a checkpoint interval for given inputs."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from cpsr_ds import plan_report, planner
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


# The what-if plan's inputs: (flag, dest, help); all are needed.
WHAT_IF_INPUTS = (("--lambda", "lam", "failures per iteration"), ("--ts", "ts", "T_s: checkpoint cost"),
                  ("--alpha1", "alpha1", "loss curve exp(-alpha1 t + alpha2) (Eq. 11)"),
                  ("--alpha2", "alpha2", "loss curve (Eq. 11)"),
                  ("--tau1", "tau1", "predictor error exp(-tau1 t / T_c + tau2) (Eq. 8)"),
                  ("--tau2", "tau2", "predictor error (Eq. 8)"), ("--xi", "xi", "curvature (Eq. 7)"),
                  ("--np", "np", "N_p: parameters of the stage"))
# The what-if plan's options: (flag, dest, type, default, help).
WHAT_IF_OPTIONS = (("--t", "t", float, None, "report Delta F and T_p for a failure at this iteration"),
                   ("--persist", "persist", float, 0.0, "persist time of one checkpoint"),
                   ("--in-flight", "in_flight", int, 1, "checkpoints persisting at once"),
                   ("--budget", "budget", float, 0.02, "CheckFreq's and PCcheck's overhead budget"),
                   ("--max-interval", "max_interval", float, planner.MAX_INTERVAL, "longest interval planned"))


def _what_if(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    missing = [flag for flag, dest, _ in WHAT_IF_INPUTS if getattr(args, dest) is None]
    if missing:
        parser.error(f"give RUN_DIR, or every what-if input: missing {', '.join(missing)}")
    options = {dest: default if getattr(args, dest) is None else getattr(args, dest)
               for _, dest, _, default, _ in WHAT_IF_OPTIONS}
    try:
        p = planner.PbrParams(args.alpha1, args.alpha2, args.tau1, args.tau2, args.xi, args.np)
        report = planner.what_if(args.lam, args.ts, p, **options)
    except ValueError as e:
        parser.error(str(e))
    return _emit(report, args.json, _print_plan)


def _run_plans(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if not os.path.isdir(args.run_dir):
        parser.error(f"{args.run_dir}: not a directory")
    report = plan_report.run_report(args.run_dir)
    if args.plot:
        try:
            plan_report.plot_run(args.run_dir, report, args.plot)
        except (plan_report.PlotUnavailable, OSError) as err:
            print(f"python -m cpsr_ds plan: cannot plot to {args.plot}: {err}", file=sys.stderr)
            return 1
    return _emit(report, args.json, plan_report.print_report)


def _plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    given = [flag for flag, dest, *_ in WHAT_IF_INPUTS + WHAT_IF_OPTIONS if getattr(args, dest) is not None]
    if args.run_dir is None:
        if args.plot:
            parser.error("--plot needs RUN_DIR")
        return _what_if(parser, args)
    if given:
        parser.error(f"give RUN_DIR ({args.run_dir}) or the what-if inputs ({', '.join(given)}), not both")
    return _run_plans(parser, args)


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
    plan = sub.add_parser("plan", help="a run's plans and checkpoints (RUN_DIR), or a what-if plan for given "
                                        "inputs (times in iterations)")
    plan.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="a run directory (checkpoint.dir)")
    plan.add_argument("--plot", metavar="FILE.png", help="with RUN_DIR: plot the losses, the plans' fits, the "
                                                         "checkpoints and the planned interval")
    for flag, dest, text in WHAT_IF_INPUTS:
        plan.add_argument(flag, dest=dest, type=float, help=text)
    for flag, dest, kind, default, text in WHAT_IF_OPTIONS:
        plan.add_argument(flag, dest=dest, type=kind, help=text if default is None else f"{text} (default {default:g})")
    plan.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    return _plan(plan, args) if args.command == "plan" else _inspect(insp, args)


if __name__ == "__main__":
    sys.exit(main())
