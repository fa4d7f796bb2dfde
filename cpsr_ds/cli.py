"""The command line, ``python -m cpsr_ds`` (docs/reference/cli.md).

``inspect CKPT_DIR`` lists checkpoints and journal progress; ``inspect NODE0_DIR NODE1_DIR ...`` shows each
node's part of a node-local job and the checkpoint and failure point its ranks would agree on;
``plan RUN_DIR [--plot FILE.png]`` shows a run's plans beside the checkpoints it took;
``plan --lambda L --ts S --alpha1 ...`` plans a checkpoint interval for given inputs. The report goes to
``out`` (stdout), alone: ``cpsr_ds/__main__.py`` sends every log line to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Optional

from cpsr_ds import node_view
from cpsr_ds.planning import failure_mix, fault_tolerance_cost, levels, plan_report, planner, projection
from cpsr_ds.checkpoint.storage import catalog, records
from cpsr_ds.checkpoint.capture.journal import reached_iteration
from cpsr_ds.recovery import earlier_reports


def inspect_report(ckpt_dir: str, read_data: bool = True, ranks: Optional[set[int]] = None) -> dict:
    """Every checkpoint with iteration, size, status and problems; which is latest, which would load.

    ``valid``: it would load (``status`` valid, or unverified: DeepSpeed's format, no manifest vouches for it).
    ``ranks``: the parts of these ranks only (a node-local directory holds no others'). A directory
    of a node-local job also gets :func:`nodes_report`'s view of that one node.
    """
    if ranks is None and node_view.is_node_local(ckpt_dir):
        # One node's directory: the agreed checkpoint needs the others'.
        return {**nodes_report([ckpt_dir], read_data)["nodes"][0], "agreed": None}
    latest = records.read_latest(ckpt_dir)
    rows = [{"tag": c.tag, "kind": c.kind, "iteration": c.iteration, "attempt": c.attempt, "size_bytes": c.size,
             "committed": c.committed, "status": c.status, "valid": c.valid, "latest": c.tag == latest,
             "problems": c.problems}
            for c in catalog.list_checkpoints(ckpt_dir, read_data, ranks)]
    usable = next((r["tag"] for r in reversed(rows) if r["valid"]), None)
    return {"dir": ckpt_dir, "latest": latest, "usable": usable, "checkpoints": rows,
            "journal_iteration": reached_iteration(ckpt_dir), "recoveries": recoveries(ckpt_dir)}


def recoveries(ckpt_dir: str) -> list[dict]:
    """Each restart's recovery decision (``recovery.jsonl``): method, f, c, where each rank's state came from."""
    return [{"method": r.method, "reached": r.reached, "checkpoint": r.checkpoint, "sources": r.sources,
             "description": r.describe()} for r in earlier_reports(ckpt_dir) if r.reached is not None]


def nodes_report(dirs: list[str], read_data: bool = True) -> dict:
    """Each node's directory (its own checkpoints, ranks, their newest valid parts and replicas) and, for more
    than one, the checkpoint c and failure point f its ranks would agree on; a missing directory (a lost
    node's) holds nothing, its ranks' replicas stand in."""
    present = [d for d in dirs if os.path.isdir(d)]
    nodes, owner, reports = node_view.rank_reports(present, read_data)
    shown = []
    for d in present:
        ranks = node_view.held_ranks(d)
        node = nodes.node_of(ranks[0]) if ranks else None
        shown.append({**inspect_report(d, read_data, set(ranks)), "storage": "node_local", "node": node,
                      "ranks": ranks, "world_size": len(reports),
                      "parts": [] if node is None else node_view.rank_rows(nodes, reports, owner, node),
                      "replicas_kept": node_view.replicas_kept(reports, ranks) if ranks else {}})
    agreed = node_view.agreed(present, reports) if len(dirs) > 1 else None
    return {"nodes": shown, "missing": [d for d in dirs if d not in present], "agreed": agreed}


def _print_table(report: dict) -> None:
    if "nodes" in report:
        _print_nodes(report)
        return
    print(f"{'tag':<24} {'iteration':>9} {'size MiB':>10}  {'kind':<9} {'status':<13} problems")
    for r in report["checkpoints"]:
        mark = "<- latest " if r["latest"] else ""
        iteration = "-" if r["iteration"] is None else r["iteration"]
        print(f"{r['tag']:<24} {iteration:>9} {r['size_bytes'] / 2**20:>10.1f}  {r['kind']:<9} {r['status']:<13} "
              f"{mark}{'; '.join(r['problems'])}")
    print(f"latest: {report['latest']}   loads: {report['usable']}   "
          f"journal reached iteration: {report['journal_iteration']}")
    for r in report.get("recoveries", ()):
        print(f"recovered: {r['description'].removeprefix('cpsr recovery: ')}")
    if report.get("storage") == "node_local":
        _print_node(report)
    if report.get("agreed", {}) is None:
        _print_needs_every_node()


def _print_node(report: dict) -> None:
    """A node-local directory's ranks: their newest valid parts, their replicas', the replicas kept here."""
    print(f"node-local directory of node {report['node']}: ranks {report['ranks']} of {report['world_size']}")
    print(f"{'rank':>6}  {'newest valid part':<24} replica on the next node")
    for p in report["parts"]:
        replica = p["replica_newest_valid"] if p["replica_dir"] else f"(node {p['replica_node']}'s directory not given)"
        print(f"{p['rank']:>6}  {p['newest_valid'] or '-':<24} {replica or '-'}")
    for rank, tag in report["replicas_kept"].items():
        print(f"replica kept here of rank {rank}: newest valid {tag or '-'}")


def _print_needs_every_node() -> None:
    print("the checkpoint and failure point the ranks agree on need every node's directory: "
          "python -m cpsr_ds inspect NODE0_DIR NODE1_DIR ... (a lost node's directory may be missing)")


def _print_nodes(report: dict) -> None:
    for node in report["nodes"]:
        print(f"== {node['dir']}")
        _print_table(node)
    for d in report["missing"]:
        print(f"== {d}: missing; its ranks' parts only where replicas keep them")
    agreed = report["agreed"]
    stand_in = "".join(f"; rank {r}'s part from the replica on rank {holder}"
                       for r, holder in agreed["from_replica"].items())
    print(f"agreed: checkpoint {agreed['checkpoint']} (c = {agreed['iteration']}){stand_in}")
    print(f"agreed: journals reached iteration {agreed['reached']} (f)")
    for problem in agreed["problems"]:
        print(f"  {problem}")


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


def _emit(report: dict, as_json: bool, print_text, out) -> int:
    """The report on ``out``: one JSON object, or ``print_text``'s table."""
    with contextlib.redirect_stdout(out):
        if as_json:
            print(json.dumps(report, indent=1))
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
        p = fault_tolerance_cost.PbrParams(args.alpha1, args.alpha2, args.tau1, args.tau2, args.xi, args.np)
        report = planner.what_if(args.lam, args.ts, p, **options)
    except ValueError as e:
        parser.error(str(e))
    return _emit(report, args.json, _print_plan, args.out)


# The projection's cluster: (flag, dest, type, default, help); defaults: the Llama 3 job (docs/concepts/cost-model.md).
SIMULATE_OPTIONS = (("--gpus", "gpus", int, 16_384, "GPUs of the job"),
                    ("--state-gb", "state_gb", float, 6480.0, "the whole training state, GB"),
                    ("--storage-gbps", "storage_gbps", float, 1000.0, "the job's storage bandwidth, GB/s"),
                    ("--host-copy-gbps", "host_copy_gbps", float, 25.0, "one GPU's device-to-host copy, GB/s"),
                    ("--iteration-s", "iteration_s", float, 6.0, "seconds per iteration"),
                    ("--failures-per-hour", "failures_per_hour", float, failure_mix.LLAMA3_RATE_PER_HOUR,
                     "the job's failures per hour"),
                    ("--crash-share", "crash_share", float, failure_mix.LLAMA3_SHARES[failure_mix.PROCESS_CRASH],
                     "share of failures that are process crashes (the rest lose their node)"),
                    ("--run-hours", "run_hours", float, 54 * 24.0, "hours of training"),
                    ("--process-start-s", "process_start_s", float, 60.0, "seconds to start the job's processes"),
                    ("--node-replace-s", "node_replace_s", float, 300.0, "seconds to replace a lost node"),
                    ("--rho", "rho", float, 0.5, "share of a lost node's lost iterations cpsr's prediction saves"))


def _print_projection(report: dict) -> None:
    print(f"{'strategy':<10} {'k it':>6} {'n it':>6} {'T_l h':>8}  " + " ".join(f"{t:>13}" for t in report["terms"]))
    for row in report["strategies"]:
        k = "-" if row["memory_interval"] is None else f"{row['memory_interval']:.0f}"
        print(f"{row['strategy']:<10} {k:>6} {row['storage_interval']:>6.0f} {row['T_l_hours']:>8.2f}  "
              + " ".join(f"{row['hours'][t]:>13.3f}" for t in report["terms"]))
    plan = report["cpsr_plan"]
    memory = plan["memory_interval"] or "none (snapshots cost more than the crashes they save)"
    print(f"cpsr plan ({plan['method']}): host snapshots every {memory}, storage every {plan['storage_interval']} "
          f"iterations")
    for cls, cost in plan["per_failure"].items():
        print(f"  {cls}: {plan['rates'][cls]:.3g} per iteration, {cost:.1f} iterations per failure")


def _simulate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    values = {dest: default if getattr(args, dest) is None else getattr(args, dest)
              for _, dest, _, default, _ in SIMULATE_OPTIONS}
    crash = values.pop("crash_share")
    try:
        cluster = projection.Cluster(**values, shares={failure_mix.PROCESS_CRASH: crash,
                                                       failure_mix.NODE_LOST: 1 - crash})
        rows = projection.project(cluster)
        plan = levels.plan_levels(projection.rates(cluster), projection.strategies(cluster)["cpsr"][2])
    except ValueError as e:
        parser.error(str(e))
    report = {"cluster": values | {"crash_share": crash}, "seconds": projection.seconds(cluster),
              "terms": list(rows[0]["hours"]), "strategies": rows, "cpsr_plan": plan.to_dict()}
    return _emit(report, args.json, _print_projection, args.out)


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
    return _emit(report, args.json, plan_report.print_report, args.out)


def _plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    given = [flag for flag, dest, *_ in WHAT_IF_INPUTS + WHAT_IF_OPTIONS if getattr(args, dest) is not None]
    if args.simulate:
        if args.run_dir is not None or given:
            parser.error("--simulate takes the cluster's options only, not RUN_DIR or the what-if inputs")
        return _simulate(parser, args)
    if args.run_dir is None:
        if args.plot:
            parser.error("--plot needs RUN_DIR")
        return _what_if(parser, args)
    if given:
        parser.error(f"give RUN_DIR ({args.run_dir}) or the what-if inputs ({', '.join(given)}), not both")
    return _run_plans(parser, args)


def _inspect(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    dirs = args.ckpt_dirs
    if not any(os.path.isdir(d) for d in dirs) or (len(dirs) == 1 and not os.path.isdir(dirs[0])):
        parser.error(f"{', '.join(dirs)}: not a directory")
    read_data = not args.no_checksums
    report = inspect_report(dirs[0], read_data) if len(dirs) == 1 else nodes_report(dirs, read_data)
    return _emit(report, args.json, _print_table, args.out)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m cpsr_ds`` and its two commands (the reference page prints their help)."""
    parser = argparse.ArgumentParser(prog="python -m cpsr_ds")
    sub = parser.add_subparsers(dest="command", required=True)
    insp = sub.add_parser("inspect", help="list the checkpoints of a directory and the journal's progress; "
                                          "with node-local storage, give every node's directory")
    insp.add_argument("ckpt_dirs", nargs="+", metavar="CKPT_DIR",
                      help="a checkpoint directory; several: one per node (node_local), a lost node's may be missing")
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
    plan.add_argument("--simulate", action="store_true", help="project T_l per strategy for the cluster the options "
                                                               "below describe (docs/concepts/cost-model.md)")
    for flag, dest, kind, default, text in SIMULATE_OPTIONS:
        plan.add_argument(flag, dest=dest, type=kind, help=f"--simulate: {text} (default {default:g})")
    plan.add_argument("--json", action="store_true", help="print the report as JSON")
    insp.set_defaults(run=_inspect, parser=insp)
    plan.set_defaults(run=_plan, parser=plan)
    return parser


def main(argv: Optional[list[str]] = None, out=None) -> int:
    """Run one command; its report (and ``--help``) goes to ``out``, by default stdout."""
    out = sys.stdout if out is None else out
    with contextlib.redirect_stdout(out):
        args = build_parser().parse_args(argv)
    args.out = out
    return args.run(args.parser, args)
