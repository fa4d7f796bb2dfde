"""The demo: train the tiny GPT, kill a rank mid-run, restart, recover, and say what it cost.

    python launch/demo.py [--config configs/gpt_tiny_cpu.json] [--train-iters 100] [--kill-at 70]

Runs ``launch/resilient.sh -- deepspeed launch/train_gpt.py ...`` on 2 processes in
a fresh run directory, then reads the run's journal, fault markers and validation
log to report the failure, the recovery decision and the time it cost.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cpsr_ds.checkpoint.journal import journal_path, read_journal, read_validation  # noqa: E402


def attempts(entries):
    """Split one rank's journal into the runs that wrote it (iterations restart lower)."""
    runs = [[]]
    for entry in entries:
        if runs[-1] and entry.iteration <= runs[-1][-1].iteration:
            runs.append([])
        runs[-1].append(entry)
    return runs


def summarize(run_dir: str) -> str:
    runs = attempts(read_journal(journal_path(run_dir, 0)))
    lines = [f"attempts: {len(runs)}"]
    for failed, restarted in zip(runs, runs[1:]):
        f = failed[-1].iteration
        c = restarted[0].iteration - 1
        back = next(e for e in restarted if e.iteration == f)
        redo_s = back.wall_time - restarted[0].wall_time
        down_s = restarted[0].wall_time - failed[-1].wall_time
        lines += [
            f"failure after iteration {f}; restored the checkpoint of iteration {c}",
            f"recompute (RB-R): redid {f - c} iterations in {redo_s:.1f} s; "
            f"restart downtime {down_s:.1f} s; back at iteration {f} {back.wall_time - failed[-1].wall_time:.1f} s after the failure",
            f"a restart from scratch would have redone {f} iterations; the checkpoint saved {c}",
        ]
    val = read_validation(run_dir)
    first, last = min(val), max(val)
    lines.append(f"validation loss: {val[first]:.4f} at iteration {first} -> {val[last]:.4f} at iteration {last}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "gpt_tiny_cpu.json"))
    p.add_argument("--run-dir", default=os.path.join(ROOT, "runs", "demo"))
    p.add_argument("--train-iters", type=int, default=100)
    p.add_argument("--kill-at", type=int, default=70, help="iteration after which rank 1 is SIGKILLed")
    args = p.parse_args()

    shutil.rmtree(args.run_dir, ignore_errors=True)
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    command = [
        os.path.join(ROOT, "launch", "resilient.sh"), "--max-restarts", "2", "--",
        deepspeed, "--num_gpus", "2", os.path.join(ROOT, "launch", "train_gpt.py"),
        "--deepspeed_config", args.config,
        "--train-iters", str(args.train_iters),
        "--eval-interval", "25",
        "--checkpoint-dir", args.run_dir,
        "--kill-rank", "1", "--kill-at-iteration", str(args.kill_at),
    ]  # fmt: skip
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"), PYTHONWARNINGS="ignore")
    print("$ " + " ".join(command), flush=True)
    code = subprocess.call(command, env=env, cwd=ROOT)
    if code != 0:
        sys.exit(f"demo: the job failed for good (exit code {code}); see the output above")
    print("\n=== what happened ===")
    print(summarize(args.run_dir))


if __name__ == "__main__":
    main()
