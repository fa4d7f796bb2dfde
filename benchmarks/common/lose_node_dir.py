"""Run a training script, first deleting a node's checkpoint directory once a failure has happened: the node's
disk lost between the failure and the restart (bench_multinode's ``dir_lost`` scenario).

    python benchmarks/common/lose_node_dir.py LOST_DIR MARKER RECORD SCRIPT [ARGS...]

The launcher starts this in place of SCRIPT on every node, at every start. Rank 0 (of
the node whose directory is lost) of the first start that finds MARKER (the fault
injection's marker of the failure) writes RECORD, the commit records LOST_DIR held,
deletes LOST_DIR, and only then runs SCRIPT; every other start runs SCRIPT at once. A
launcher restarts a job only once all of the failed start's processes are gone, so
nothing writes into LOST_DIR while it goes.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

# ondisk.COMMIT. Not imported from there: that imports torch, a second or more before the restart being timed.
COMMIT = "cpsr_commit.json"
REPLICAS = "replicas"  # ondisk.REPLICAS


def commit_records(root: str) -> list[dict]:
    """Every commit record of a checkpoint directory under ``root``: its iteration and when it was written (the
    file's mtime, the clock the journals' wall times use). Not the replicas': a replica carries rank 0's
    decision, which commits only once every rank's replica is there."""
    found = []
    for where, dirs, names in os.walk(root):
        if REPLICAS in dirs:
            dirs.remove(REPLICAS)
        if COMMIT not in names:
            continue
        path = os.path.join(where, COMMIT)
        try:
            with open(path) as f:
                found.append({"path": path, "iteration": json.load(f)["iteration"],
                              "written": os.path.getmtime(path)})
        except (OSError, ValueError, KeyError):
            continue
    return found


def lose(lost: str, marker: str, record: str) -> bool:
    """Delete ``lost`` (its commit records into ``record`` first) if this is the start to do it; whether it was."""
    if os.environ.get("RANK") != "0" or not os.path.exists(marker) or os.path.exists(record):
        return False
    with open(record, "w") as f:
        json.dump(commit_records(lost), f)
    shutil.rmtree(lost)
    return True


def command(argv: list[str]) -> tuple[tuple[str, str, str], list[str]]:
    """(LOST_DIR, MARKER, RECORD) and the command to run. DeepSpeed's launcher puts ``--local_rank=N`` before
    every other argument: it goes on to SCRIPT."""
    launcher = [a for a in argv if a.startswith("--local_rank")]
    lost, marker, record, script, *args = [a for a in argv if a not in launcher]
    return (lost, marker, record), [sys.executable, "-u", script, *launcher, *args]


def main(argv: list[str]) -> None:
    paths, run = command(argv)
    lose(*paths)
    os.execv(run[0], run)


if __name__ == "__main__":
    main(sys.argv[1:])
