"""Memory footprint and step time of the VITP predictor (Sec. III-B, VI-C4: < 200 MB).

``python -m cpsr_ds.predictor.footprint --chunks 8192`` fills a history with a
synthetic shard of ``chunks`` x ``token_size`` parameters, then measures the peak
resident memory above that baseline (Linux VmHWM, reset through
/proc/self/clear_refs) of training steps (from the first, optimizer state included) and of a full prediction, and the mean
time of a training step. The history is the checkpoints themselves and is not
counted; the predicted state that ``predict`` returns is reported apart. ``--memory-mb``
caps the predictor (``predictor.memory_mb``); the footprint it accounts under the cap
(:mod:`cpsr_ds.predictor.memory`) is reported with the batch it chose.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import time

import torch

from cpsr_ds.predictor.vitp import VITPPredictor


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> int:
    gc.collect()
    # Hand freed heap back to the OS, so memory cached by an earlier phase does not hide the next one's.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS")


def _peak_mib_since(baseline_kib: int) -> float:
    return (_status_kib("VmHWM") - baseline_kib) / 1024


def _filled(chunks: int, token_size: int, checkpoints: int, batch_chunks: int, memory_mb: float) -> VITPPredictor:
    n = chunks * token_size
    gen = torch.Generator().manual_seed(0)
    start, drift = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    predictor = VITPPredictor(token_size=token_size, batch_chunks=batch_chunks, history=checkpoints, min_train_steps=1,
                              memory_mb=memory_mb)
    for i in range(checkpoints):
        t = 50 * i + 7 * (i % 3)
        predictor.observe(t, {"param/w": start + drift * (1 - torch.exp(torch.tensor(-t / 400.0)))})
    return predictor


def measure(chunks: int, token_size: int, checkpoints: int, steps: int, batch_chunks: int,
            memory_mb: float = 200.0) -> dict:
    # Run every code path once on a tiny shard first: the pages of torch's kernels
    # that the first call faults in are shared library code, not predictor memory.
    warm = _filled(4, token_size, checkpoints, batch_chunks, memory_mb)
    warm.step(n_steps=1)
    warm.predict(warm.history.iterations[-1] + 25)
    del warm
    predictor = _filled(chunks, token_size, checkpoints, batch_chunks, memory_mb)
    accounted = predictor.trainer.footprint

    baseline = _reset_peak()
    predictor.step(n_steps=1)
    t0 = time.perf_counter()
    predictor.step(n_steps=steps)
    step_s = (time.perf_counter() - t0) / steps
    train_peak = _peak_mib_since(baseline)

    baseline = _reset_peak()
    t0 = time.perf_counter()
    state = predictor.predict(predictor.history.iterations[-1] + 25)
    predict_s = time.perf_counter() - t0
    output_mib = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    predict_peak = _peak_mib_since(baseline)
    return {
        "chunks": chunks,
        "token_size": token_size,
        "batch_chunks": batch_chunks,
        "threads": torch.get_num_threads(),
        "train_peak_mib": round(train_peak, 1),
        "train_step_s": round(step_s, 4),
        "predict_peak_mib": round(predict_peak, 1),
        "predict_output_mib": round(output_mib, 1),
        "predict_working_peak_mib": round(predict_peak - output_mib, 1),
        "predict_s": round(predict_s, 3),
        "model_params": sum(p.numel() for p in predictor.trainer.model.parameters()),
        "memory_mb": memory_mb,
        "accounted_mib": round(accounted.total / 2**20, 1),
        "batch": accounted.batch,
        "streamed": accounted.streamed,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=8192)
    ap.add_argument("--token-size", type=int, default=1024)
    ap.add_argument("--checkpoints", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-chunks", type=int, default=256)
    ap.add_argument("--memory-mb", type=float, default=200.0, help="predictor.memory_mb: the cap, MiB")
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0 leaves torch's default")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(measure(args.chunks, args.token_size, args.checkpoints, args.steps, args.batch_chunks,
                             args.memory_mb)))


if __name__ == "__main__":
    main()
