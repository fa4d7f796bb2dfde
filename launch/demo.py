"""The demo: train the tiny GPT, kill a rank mid-run, restart, recover, and say what it cost.

    python launch/demo.py [--config configs/gpt_tiny_cpu.json] [--train-iters 150] [--kill-at 78]

Runs the tiny GPT twice on 2 processes: once failure-free (the reference), once under
``launch/resilient.sh`` with rank 1 SIGKILLed after ``--kill-at``. The restarted job
recovers by predicting the state at the failure point (PB-R): the demo sets
``recovery.mode`` to ``predict``, since in a run this short the loss still falls so
fast that the default, ``auto``, would recompute, and it prints what ``auto`` would
have chosen. The demo then reads both runs' journals and validation logs and reports
the recovery and its cost: the lag behind the reference, against the d iterations
recomputing would have cost.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal, read_validation  # noqa: E402
from cpsr_ds.config import CPSRConfig  # noqa: E402
from cpsr_ds.planning.calibration import PESSIMISM  # noqa: E402
from cpsr_ds.planning.cost_model import Estimate, recovery_choice  # noqa: E402
from benchmarks.common.lag import late_lag  # noqa: E402
from cpsr_ds.planning.fitter import fit_curve  # noqa: E402
from cpsr_ds.recovery import fallback_reason, read_reports  # noqa: E402

INTERVAL = 10  # T_c of the demo: frequent enough for the predictor to have a history by the failure
EVAL_INTERVAL = 5


def run(command: list[str], env: dict) -> None:
    print("$ " + " ".join(command), flush=True)
    code = subprocess.call(command, env=env, cwd=ROOT)
    if code != 0:
        sys.exit(f"demo: the job failed for good (exit code {code}); see the output above")


def summarize(run_dir: str, reference_dir: str) -> str:
    entries = read_journal(journal_path(run_dir, 0))
    restarts = [r for r in read_reports(run_dir) if r.reached is not None]
    lines = [f"attempts: {len(restarts) + 1}"]
    reference = read_validation(reference_dir)
    recovered = read_validation(run_dir)
    last = max(recovered)
    for report in restarts:
        f, c, d = report.reached, report.checkpoint, report.lost_iterations
        lines.append(f"failure after iteration {f}; {report.describe().removeprefix('cpsr recovery: ')}")
        # The restarted job's first journal entry follows the failed job's entry for f.
        died = next(i for i, e in enumerate(entries) if e.iteration == f)
        failed, restarted = entries[died], entries[died + 1]
        back = next(e for e in entries[died + 1:] if e.iteration >= f)
        lines.append(f"restart downtime {restarted.wall_time - failed.wall_time:.1f} s; "
                     f"training back at iteration {back.iteration} {back.wall_time - failed.wall_time:.1f} s after the failure")
        if report.method == "predict":
            rc = CPSRConfig().recovery
            # The report holds the cost model's estimate and the loss excess its guard found.
            choice = recovery_choice(Estimate(report.cost_model, report.estimated_cost), d,
                                     lambda lag: report.loss_excess, rc.max_loss_excess, PESSIMISM)
            why = fallback_reason(rc, report.relative_error, choice)
            lines.append("recovery.mode auto would have " + ("predicted too" if why is None else f"recomputed: {why}"))
            its = sorted(reference)
            fit = fit_curve(its, [reference[i] for i in its], lo=max(EVAL_INTERVAL, c - 4 * INTERVAL), hi=last)
            points = {i - f: loss for i, loss in recovered.items() if i >= f}
            lag = late_lag(fit, f, d, points, margin=2 * INTERVAL, reference=reference)
            lines.append(f"predicting-based recovery: {lag:.1f} iterations behind the failure-free run once the "
                         f"transient has passed (k in [{2 * d}, {4 * d}]), against {d} to recompute: "
                         f"saved {d - lag:.1f} iterations ({1 - lag / d:.0%})")
        else:
            lines.append(f"recompute-based recovery: redid iterations {c + 1}..{f} ({d} iterations); "
                         f"a restart from scratch would have redone {f}")
    lines.append(f"validation loss at iteration {last}: {recovered[last]:.4f} "
                 f"(failure-free run: {reference[last]:.4f}); at iteration 0: {recovered[0]:.4f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "gpt_tiny_cpu.json"))
    p.add_argument("--run-dir", default=os.path.join(ROOT, "runs", "demo"))
    p.add_argument("--train-iters", type=int, default=150)
    p.add_argument("--kill-at", type=int, default=78, help="iteration after which rank 1 is SIGKILLed")
    args = p.parse_args()

    reference_dir = args.run_dir + "-reference"
    for d in (args.run_dir, reference_dir):
        shutil.rmtree(d, ignore_errors=True)
    with open(args.config) as f:
        config = json.load(f)
    config.setdefault("cpsr", {}).setdefault("recovery", {})["mode"] = "predict"
    config_path = args.run_dir + "-config.json"
    os.makedirs(os.path.dirname(config_path), exist_ok=True)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=1)
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    train = [deepspeed, "--num_gpus", "2", os.path.join(ROOT, "examples", "gpt", "train_gpt.py"),
             "--deepspeed_config", config_path, "--train-iters", str(args.train_iters),
             "--eval-interval", str(EVAL_INTERVAL), "--checkpoint-interval", str(INTERVAL)]  # fmt: skip
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"), PYTHONWARNINGS="ignore")
    print("=== 1/2: the failure-free reference run ===", flush=True)
    run([*train, "--checkpoint-dir", reference_dir], env)
    print("\n=== 2/2: the same run, rank 1 killed after iteration %d, restarted by launch/resilient.sh ===" % args.kill_at)
    run([os.path.join(ROOT, "launch", "resilient.sh"), "--max-restarts", "2", "--", *train,
                     "--checkpoint-dir", args.run_dir, "--kill-rank", "1", "--kill-at-iteration", str(args.kill_at)], env)
    print("\n=== what happened ===")
    print(summarize(args.run_dir, reference_dir))


if __name__ == "__main__":
    main()
