"""Run under DeepSpeed's launcher by bench_overhead.py (``--module benchmarks.common.overhead_job``, from the
repository root): examples/gpt/train_gpt.py with the host memory of recovery measured.

Every rank appends one line to ``RUN_DIR/recovery_memory/rankNNNNN.jsonl`` per start:
its resident memory before recovery and the peak (Linux VmHWM, reset just before)
while ``recover`` ran, in KiB, with its stage, data-parallel rank and degree, the
recovery's method, the size of the rank's own share of its stage's fp32 parameters and
Adam moments (``own_share``) and the predictor's history.
"""

import json
import os

from cpsr_ds.runtime import runtime  # noqa: E402
from cpsr_ds.predictor.footprint import _reset_peak, _status_kib  # noqa: E402
from cpsr_ds.integration.deepspeed.engine_state import own_share  # noqa: E402
from examples.gpt import train_gpt

RECORD_DIR = "recovery_memory"


def share_kib(engine) -> float | None:
    """The size of the rank's own share of its stage's state; None before the optimizer's first step (a fresh start)."""
    try:
        return sum(t.numel() * t.element_size() for t in own_share(engine).values()) / 1024
    except KeyError:
        return None


def measured(recover):
    def recover_measured(engine, cfg, predictor, **options):
        baseline_kib = _reset_peak()
        report = recover(engine, cfg, predictor, **options)
        row = {"rank": engine.global_rank, "stage": engine.stage_id, "dp_rank": engine.grid.get_data_parallel_rank(),
               "dp": engine.grid.get_data_parallel_world_size(), "method": report.method,
               "baseline_kib": baseline_kib, "peak_kib": _status_kib("VmHWM"),
               "share_kib": share_kib(engine), "history": cfg.predictor.history}
        folder = os.path.join(cfg.checkpoint.dir, RECORD_DIR)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank{engine.global_rank:05d}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        return report
    return recover_measured


if __name__ == "__main__":
    runtime.recover = measured(runtime.recover)
    train_gpt.main()
