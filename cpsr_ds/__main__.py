"""Command line: ``python -m cpsr_ds inspect CKPT_DIR`` lists checkpoints and journal progress."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

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


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cpsr_ds")
    sub = parser.add_subparsers(dest="command", required=True)
    insp = sub.add_parser("inspect", help="list the checkpoints of a directory and the journal's progress")
    insp.add_argument("ckpt_dir")
    insp.add_argument("--json", action="store_true", help="print the report as JSON")
    insp.add_argument("--no-checksums", action="store_true", help="check sizes only, do not read the data")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.ckpt_dir):
        parser.error(f"{args.ckpt_dir}: not a directory")
    report = inspect_report(args.ckpt_dir, read_data=not args.no_checksums)
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        _print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
