"""Every GPU measurement, in parts that each fit one 10-minute command; see run.sh for how to run it.

    python -m benchmarks.gpu.run OUT_DIR [--toy | --dry-run] [--part 1|2|3|quick|all]

Each measurement writes OUT_DIR/NAME.json (its results) and OUT_DIR/NAME.txt (its
output, tables included); one whose JSON exists is skipped, so that a part cut short
is resumed by running it again. A measurement that fails leaves its .txt (no JSON)
and the others still run; the exit status is then 1. The knobs (environment
variables, KNOBS below) set sizes and counts. ``--toy`` runs every measurement at toy
sizes on the device in use (a check, in about three minutes on the GPU, that the code
paths work there before the full parts spend their time); ``--dry-run`` is ``--toy`` on
the CPU, where the tests are only collected (``make test`` runs them, or skips those that need CUDA).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# bench_recovery's knobs at toy size (--toy, --dry-run), for each reduced run of it: PREFIX_NAME.
RECOVERY_TOY = {"TC": 4, "SEEDS": 1, "LAYERS": 2, "HIDDEN": 64, "HEADS": 4, "SEQ": 64, "MICRO": 16, "VALID": 64,
                "EVAL_EVERY": 4}


def recovery_knobs(prefix: str, **gpu: int) -> dict[str, tuple[int, int]]:
    """A reduced bench_recovery's knobs ``prefix``_NAME: (``gpu``[NAME], its RECOVERY_TOY value)."""
    return {f"{prefix}_{name}": (gpu[name], toy) for name, toy in RECOVERY_TOY.items()}


# name: (value on the GPU, value with --toy or --dry-run); the environment overrides either. The GPU values are
# sized for one H100 80 GB (run.sh's header gives each part's measured time there).
KNOBS = {
    "GPT2_REPEATS": (5, 1),  # measured checkpoints per strategy, GPT2-0.35B
    # The dry run takes one strategy of each code path of the benchmark's protocol (checkfreq's and pccheck's are cpsr's).
    "GPT2_STRATEGIES": ("torch checkfreq pccheck cpsr ds_decoupled", "torch cpsr ds_decoupled"),
    "GPT2_MICRO": (8, 2),  # micro-batch (sequences of 1024)
    "GPT2_ACCUM": (2, 1),  # accumulation steps
    "GPT3_LAYERS": (4, 2),  # transformer blocks of GPT3-3.35B's shape: 4 = 0.81 B parameters, 11.4 GB of state
    "GPT3_REPEATS": (3, 1),
    "GPT3_MICRO": (1, 2),  # sequences of 2048
    "GPT3_ACCUM": (4, 1),
    "GPT3_STRATEGIES": ("torch cpsr", "torch cpsr"),
    "RESTART_MICRO": (8, 2),  # GPT2-0.35B's restart: micro-batch, one accumulation step
    "RESTART_INTERVAL": (5, 5),
    "RESTART_KILL_AT": (33, 23),
    "FOOTPRINT_CHUNKS": (294912, 16),  # vitp's host memory for a shard of chunks x 1024 parameters: GPT2-0.35B's
    # Reduced bench_recovery (part 3): T_c 10, 20 intervals per reference, 3 failures per seed each with 2 values of d,
    # a GPT of 8 x hidden 768 (57 M parameters), 512 validation sequences (evaluated 64 at a time).
    **recovery_knobs("RECOVERY", TC=10, SEEDS=1, LAYERS=8, HIDDEN=768, HEADS=12, SEQ=256, MICRO=16, VALID=512,
                     EVAL_EVERY=10),
    # Part quick's at GPT2-0.35B's shape (24 x hidden 1024, 16 heads: 0.30 B parameters with the byte vocabulary;
    # bf16, ZeRO-1): T_c 20, one seed (6 failures), 128 validation sequences.
    **recovery_knobs("GPT2_RECOVERY", TC=20, SEEDS=1, LAYERS=24, HIDDEN=1024, HEADS=16, SEQ=1024, MICRO=8, VALID=128,
                     EVAL_EVERY=20),
    # Part quick's whole time: each measurement's timeout is cut to what is left of it, so that the part is one
    # command of at most 8 minutes, run.sh's installation of the wheels (about 20 s) included.
    "QUICK_LIMIT_S": (450, 450),
}


def knobs(toy: bool) -> dict[str, str]:
    return {name: os.environ.get(name, str(values[toy])) for name, values in KNOBS.items()}


@dataclass(frozen=True)
class Measurement:
    name: str  # OUT_DIR/NAME.json and .txt
    parts: tuple[str, ...]  # the parts (--part) that run it; "all" runs every measurement
    # (knobs, OUT_DIR, mode, scratch) -> argv, mode one of MODES; scratch: a directory for checkpoints and run directories,
    # emptied after each measurement (OUT_DIR keeps only results).
    command: Callable[[dict, str, bool, str], list[str]]
    timeout_s: int
    summary: Callable[[dict], str]
    # The command prints its JSON instead of writing it (None: it writes NAME.json itself).
    stdout_json: bool = False
    # The command is pytest's (pytest_command): its JSON says that it passed and pytest's last line.
    pytest: bool = False


MODES = ("full", "toy", "dry-run")
PARTS = ("1", "2", "3", "quick")


def python() -> list[str]:
    return [sys.executable]


def checkpoint_command(state: str, prefix: str):
    def command(k: dict, out: str, mode: str, scratch: str) -> list[str]:
        return [*python(), "-m", "benchmarks.bench_checkpoint", "--states", state,
                "--strategies", *k[f"{prefix}_STRATEGIES"].split(),
                "--repeats", k[f"{prefix}_REPEATS"], "--micro-batch", k[f"{prefix}_MICRO"],
                "--grad-accum", k[f"{prefix}_ACCUM"], "--dir", scratch,
                "--json", os.path.join(out, f"checkpoint_{state}.json"),
                *(["--layers", k["GPT3_LAYERS"]] if prefix == "GPT3" else []), *(["--toy"] if mode != "full" else [])]
    return command


def checkpoint_summary(result: dict) -> str:
    state = result["sizes"][result["states"][-1]]
    stalls = ", ".join(f"{s} {'n/a' if v is None else f'{v * 1e3:.1f} ms'}" for s, v in result["stall_s"].items())
    persist = result["persist_gbps"].get("cpsr")
    return (f"{state['bytes'] / 1e9:.2f} GB, {state['model']['layers']} layers; stall {stalls}; raw pinned copy "
            f"{result['raw_copy_s'] * 1e3:.1f} ms; cpsr persist "
            f"{'-' if persist is None else f'{persist:.2f}'} GB/s, disk {result['disk_gbps']:.2f} GB/s")


def pytest_command(*selection: str):
    """pytest on ``selection``. On the CPU the tests are `make test`'s (where the CUDA ones are skipped): the dry
    run checks that pytest selects them here."""
    def command(k: dict, out: str, mode: str, scratch: str) -> list[str]:
        return [*python(), "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection,
                *(["--collect-only"] if mode == "dry-run" else [])]
    return command


def pytest_summary(result: dict) -> str:
    return f"{'passed' if result['passed'] else 'FAILED'} ({result['summary']})"


def restart_command(k: dict, out: str, mode: str, scratch: str) -> list[str]:
    return [*python(), "-m", "benchmarks.gpu.restart", "--json", os.path.join(out, "restart_gpt2_0.35b.json"),
            "--micro-batch", k["RESTART_MICRO"], "--interval", k["RESTART_INTERVAL"], "--kill-at", k["RESTART_KILL_AT"],
            "--dir", scratch, *(["--toy"] if mode != "full" else [])]


def restart_summary(result: dict) -> str:
    peak = result["predictor_gpu_peak_mib"]
    parts = ", ".join(f"{k[:-2]} {v:.1f}" for k, v in result["restart"].items())
    return (f"predictor GPU memory {'-' if peak is None else f'{peak:.1f} MiB'}; restart (s): {parts}; "
            f"{result['report']['method']} from {result['report']['checkpoint']} to {result['report']['reached']}")


def footprint_command(k: dict, out: str, mode: str, scratch: str) -> list[str]:
    return [*python(), "-m", "cpsr_ds.predictor.footprint", "--chunks", k["FOOTPRINT_CHUNKS"], "--steps", "5",
            "--threads", str(min(8, os.cpu_count() or 1))]


def footprint_summary(result: dict) -> str:
    return (f"vitp on {result['chunks'] * result['token_size'] / 1e6:.0f} M parameters: host peak training "
            f"{result['train_peak_mib']} MiB, predicting {result['predict_working_peak_mib']} MiB beside its "
            f"{result['predict_output_mib']} MiB output; step {result['train_step_s']} s, predict {result['predict_s']} s")


def recovery_command(prefix: str, module: str, config: str, name: str, *options: str):
    """bench_recovery's --quick protocol, run by ``module`` (it or a driver of it), with the knobs ``prefix``_*."""
    def command(k: dict, out: str, mode: str, scratch: str) -> list[str]:
        return [*python(), "-m", module, "--quick", "--config", config, "--intervals", k[f"{prefix}_TC"],
                "--intervals-per-run", "20", "--seeds", k[f"{prefix}_SEEDS"], "--methods", "trend",
                "--num-layers", k[f"{prefix}_LAYERS"], "--hidden-size", k[f"{prefix}_HIDDEN"],
                "--num-attention-heads", k[f"{prefix}_HEADS"], "--seq-length", k[f"{prefix}_SEQ"],
                "--micro-batch", k[f"{prefix}_MICRO"], "--valid-sequences", k[f"{prefix}_VALID"],
                "--eval-every", k[f"{prefix}_EVAL_EVERY"], "--out-dir", scratch,
                "--json", os.path.join(out, f"{name}.json"), *options,
                *(["--vitp-steps", "1"] if mode != "full" else [])]
    return command


def recovery_bench_summary(result: dict) -> str:
    def pct(v):
        return "-" if v is None else f"{v:.1%}"
    return "; ".join(f"{m}: reduction {pct(result['median_reduction'][m])} (mean {pct(result['mean_reduction'][m])}, "
                     f"95 % CI [{', '.join(map(pct, result['ci95_reduction'][m] or (None, None)))}]), worst loss "
                     f"excess {result['worst_final_loss_excess'][m]:+.3%}" for m in result["median_reduction"])


def device_summary(result: dict) -> str:
    return f"{result['name']}, torch {result['torch']}, CUDA {result['cuda']}, deepspeed {result['deepspeed']}"


DEVICE_PROBE = """
import json, os, shutil, subprocess, sys, tempfile
from importlib.metadata import version
import torch, psutil
smi = shutil.which("nvidia-smi")
out = {"name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
       "cuda_available": torch.cuda.is_available(), "torch": torch.__version__, "cuda": torch.version.cuda,
       "deepspeed": version("deepspeed"), "python": sys.version.split()[0], "cpus": os.cpu_count(),
       "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
       "disk_free_gib": round(shutil.disk_usage(".").free / 2**30, 1),
       "tmp_free_gib": round(shutil.disk_usage(tempfile.gettempdir()).free / 2**30, 1),
       "nvidia_smi": subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip() if smi else None}
print(json.dumps(out))
"""


def device_command(k: dict, out: str, mode: str, scratch: str) -> list[str]:
    return [*python(), "-c", DEVICE_PROBE]


MEASUREMENTS = (
    Measurement("device", PARTS, device_command, 120, device_summary, stdout_json=True),
    Measurement("checkpoint_gpt2_0.35b", ("1",), checkpoint_command("gpt2_0.35b", "GPT2"), 450, checkpoint_summary),
    Measurement("recovery_test", ("1",), pytest_command("tests/jobs/test_recovery.py", "-k", "single_process"), 300,
                pytest_summary, pytest=True),
    Measurement("checkpoint_gpt3_3.35b", ("2",), checkpoint_command("gpt3_3.35b", "GPT3"), 420, checkpoint_summary),
    Measurement("coordinator_test", ("2", "quick"), pytest_command("tests/jobs/test_coordinator_cuda.py"), 150,
                pytest_summary, pytest=True),

    Measurement("recovery_bench", ("3",), recovery_command("RECOVERY", "benchmarks.bench_recovery",
                                                      "configs/gpt_gpu_recovery.json", "recovery_bench"),
                420, recovery_bench_summary),
    Measurement("predictor_footprint", ("3",), footprint_command, 150, footprint_summary, stdout_json=True),
    Measurement("restart_gpt2_0.35b", ("3",), restart_command, 240, restart_summary),
    Measurement("recovery_gpt2_0.35b", ("quick",),
                recovery_command("GPT2_RECOVERY", "benchmarks.gpu.recovery", "benchmarks/gpu/gpt2_recovery.json",
                                 "recovery_gpt2_0.35b", "--no-cost-model"),
                420, recovery_bench_summary),
)


DISTRIBUTED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE")


def run_one(m: Measurement, k: dict, out: str, mode: str, scratch: str, timeout_s: float) -> tuple[str, str]:
    """(status, summary line) of one measurement, run for at most ``timeout_s`` unless its JSON exists."""
    json_path, txt_path = os.path.join(out, f"{m.name}.json"), os.path.join(out, f"{m.name}.txt")
    if os.path.exists(json_path):
        return "kept", summarize(m, json_path)
    if timeout_s <= 0:
        return "FAILED", "not run: the part's time is spent"
    command = m.command(k, out, mode, scratch)
    os.makedirs(scratch, exist_ok=True)
    print(f"== {m.name}: {' '.join(command).splitlines()[0][:300]}", flush=True)
    t0 = time.time()
    # A job of its own: the caller's rank and port (a test's process group, say) would make it join that job.
    env = {name: value for name, value in os.environ.items() if name not in DISTRIBUTED}
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        code = f"timed out after {timeout_s:.0f} s"
    seconds = time.time() - t0
    shutil.rmtree(scratch, ignore_errors=True)
    with open(txt_path, "w") as f:
        f.write(output)
    if m.pytest and code == 0:
        with open(json_path, "w") as f:
            json.dump({"passed": True, "collected_only": mode == "dry-run", "seconds": seconds, "command": command[1:],
                       "summary": output.strip().splitlines()[-1]}, f, indent=1)
    elif m.stdout_json and code == 0:
        with open(json_path, "w") as f:
            json.dump(json.loads(output.strip().splitlines()[-1]), f, indent=1)
    if code != 0 or not os.path.exists(json_path):
        if os.path.exists(json_path):
            os.unlink(json_path)
        tail = output.strip().splitlines()[-1:] or [""]
        return "FAILED", f"exit {code} after {seconds:.0f} s: {tail[0][:200]} (see {txt_path})"
    return f"{seconds:.0f} s", summarize(m, json_path)


def summarize(m: Measurement, json_path: str) -> str:
    with open(json_path) as f:
        return m.summary(json.load(f))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    sizes = p.add_mutually_exclusive_group()
    sizes.add_argument("--toy", action="store_true", help="every measurement at toy sizes, on the GPU")
    sizes.add_argument("--dry-run", action="store_true", help="every code path on the CPU at toy sizes")
    p.add_argument("--part", default="all", choices=[*PARTS, "all"])
    args = p.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    out = os.path.abspath(args.out_dir)
    mode = "dry-run" if args.dry_run else "toy" if args.toy else "full"
    k = knobs(mode != "full")
    chosen = [m for m in MEASUREMENTS if args.part == "all" or args.part in m.parts]
    deadline = time.time() + (float(k["QUICK_LIMIT_S"]) if args.part == "quick" else math.inf)
    scratch = tempfile.mkdtemp(prefix="cpsr-gpu-")
    try:
        results = [(m, *run_one(m, k, out, mode, scratch, min(m.timeout_s, deadline - time.time()))) for m in chosen]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\nGPU measurements in {out} (part {args.part}{'' if mode == 'full' else f', {mode}'}):")
    for m, status, line in results:
        print(f"  {m.name:24s} {status:>8s}  {line}")
    with open(os.path.join(out, "knobs.json"), "w") as f:
        json.dump(k, f, indent=1)
    failed = [m.name for m, status, _ in results if status == "FAILED"]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
