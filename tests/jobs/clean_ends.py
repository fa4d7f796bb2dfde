"""Run by test_clean_end.py: many 2-rank jobs of examples/gpt/train_gpt.py trained to their end, each rank a process
forked from this one once torch, DeepSpeed and cpsr_ds are imported (seconds per process saved over dozens of
jobs), and each ending as a script's process does: its code returns and the interpreter exits (atexit, the
modules' teardown, daemon threads stopped). One JSON line per rank on stdout: job, rank and exit code (negative:
the signal that ended it).

    python tests/jobs/clean_ends.py --config C --out DIR --jobs N --at-once K --ends END,... -- TRAIN_GPT_ARGS...

Job I ends as the (I mod their number)th of ``--ends`` says. main: train_gpt.main, which destroys the engine and
the process group; train: setup and train only, as DeepSpeed's own examples end, everything left to the
interpreter's exit; collected: the same, the engine dropped and its cycles collected on a thread of its own as
the script returns (the garbage collector runs on whichever thread allocates: in such a script, often a
checkpoint's writer; here the script returns just after that collection has begun). Each job trains in DIR/jobI/run
and writes each rank's output to DIR/jobI/rankR.log.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import threading
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))
sys.path.insert(0, ROOT)

import train_gpt  # noqa: E402
from benchmarks.common.processes import JOB_ENV, free_port  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True, help="the DeepSpeed config; cpsr.checkpoint.dir is set per job")
    p.add_argument("--out", required=True)
    p.add_argument("--jobs", type=int, required=True)
    p.add_argument("--at-once", type=int, default=1)
    p.add_argument("--limit-s", type=float, default=120.0, help="how long a rank may run")
    p.add_argument("--ends", type=lambda text: text.split(","), default=["main"])
    p.add_argument("train_args", nargs=argparse.REMAINDER)
    return p.parse_args()


def job_config(template: str, directory: str) -> str:
    """The path of ``template``'s copy that trains in ``directory``/run."""
    with open(template) as f:
        config = json.load(f)
    config["cpsr"]["checkpoint"]["dir"] = os.path.join(directory, "run")
    path = os.path.join(directory, "ds_config.json")
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def spawn(job: int, args: argparse.Namespace) -> tuple[dict, Optional[dict]]:
    """Fork job ``job``'s two ranks: (pid: rank) in this process; in a child, what it is to run."""
    directory = os.path.join(args.out, f"job{job}")
    os.makedirs(directory)
    config, port = job_config(args.config, directory), free_port()
    pids = {}
    for rank in (0, 1):
        pid = os.fork()
        if pid == 0:
            return {}, {"rank": rank, "port": port, "config": config, "log": os.path.join(directory, f"rank{rank}.log"),
                        "end": args.ends[job % len(args.ends)]}
        pids[pid] = rank
    return pids, None


def serve(args: argparse.Namespace) -> Optional[dict]:
    """Run the jobs, ``at_once`` at a time, printing each rank's exit (a rank still running ``limit_s`` after its
    start is killed: -9); in a forked child, what it is to run."""
    running, started = {}, 0
    while started < args.jobs or running:
        while started < args.jobs and len(running) < 2 * args.at_once:
            pids, child = spawn(started, args)
            if child is not None:
                return child
            deadline = time.monotonic() + args.limit_s
            running.update({pid: (started, rank, deadline) for pid, rank in pids.items()})
            started += 1
        time.sleep(0.05)
        for pid, (job, rank, deadline) in list(running.items()):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                del running[pid]
                print(json.dumps({"job": job, "rank": rank, "code": os.waitstatus_to_exitcode(status)}), flush=True)
    return None


def become(child: dict, args: argparse.Namespace) -> None:
    """This forked process made rank ``child["rank"]`` of its job, as DeepSpeed's launcher starts one."""
    os.environ.update(JOB_ENV, RANK=str(child["rank"]), LOCAL_RANK=str(child["rank"]), WORLD_SIZE="2",
                      LOCAL_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(child["port"]))
    log = os.open(child["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    extra = [a for a in args.train_args if a != "--"]
    sys.argv = ["train_gpt.py", "--deepspeed_config", child["config"], *extra]


HEAD_START_S = 0.05  # the collection's head start: the script returns while it is ending the engine


def end(how: str) -> None:
    """Train the job and end it as ``how`` says (the module's docstring)."""
    if how == "main":
        train_gpt.main()
        return
    job = train_gpt.setup()
    train_gpt.train(job)
    if how == "collected":
        del job
        collecting = threading.Event()
        threading.Thread(target=collect, args=(collecting,), name="collector", daemon=True).start()
        collecting.wait(60)
        time.sleep(HEAD_START_S)


def collect(started: threading.Event) -> None:
    """A full collection on this thread, ``started`` set once it has begun (the script returns then)."""
    gc.callbacks.append(lambda phase, info: phase == "start" and threading.current_thread().name == "collector"
                        and started.set())
    gc.collect()


if __name__ == "__main__":
    ARGS = parse_args()
    CHILD = serve(ARGS)
    if CHILD is not None:
        become(CHILD, ARGS)
        end(CHILD["end"])
