"""Checkpoint cost: training stall per checkpoint and persist throughput of every strategy.

Measured in one run on the same directory, beside the physical floors: a raw host copy
of the same bytes (the floor of the stall) and the disk's sequential write speed with
fsync (the ceiling of persist throughput). The stall is the time from ``create`` to
the return of ``commit`` (what the training loop waits for); each checkpoint is
persisted completely before the next one, so stalls do not include persist backlog.

    python benchmarks/bench_checkpoint.py [--quick] [--json PATH] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

from cpsr_ds.checkpoint.factory import create_engine
from cpsr_ds.config import CheckpointConfig

STRATEGIES = ("torch", "checkfreq", "pccheck", "cpsr")
GB = 1e9


def synthetic_state(total_bytes: int) -> dict:
    """Model weights, fp32 master weights and two Adam moments in the proportions of mixed precision."""
    n = total_bytes // 14  # bf16 weights (2 B) + fp32 master, exp_avg, exp_avg_sq (12 B) per parameter
    return {"model": {"module": {"w": torch.randn(n // 2, dtype=torch.bfloat16), "v": torch.randn(n - n // 2,
                                                                                                  dtype=torch.bfloat16)}},
            "optim": {"fp32": torch.randn(n), "state": {"exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n)},
                      "step": 1}}


def state_bytes(state: dict) -> int:
    from cpsr_ds.checkpoint.fileformat import flatten
    return sum(t.numel() * t.element_size() for t in flatten(state)[1])


def measure_engine(strategy: str, state: dict, root: str, repeats: int) -> tuple[list[float], list[float]]:
    """(stall seconds, persist seconds) per checkpoint."""
    d = os.path.join(root, strategy)
    cfg = CheckpointConfig(dir=d, strategy=strategy, keep_last=2, max_in_flight=2)
    eng = create_engine(cfg, 0, 1)
    stalls, persists = [], []
    try:
        for i in range(repeats):
            tag = f"global_step{i}"
            os.makedirs(os.path.join(d, tag), exist_ok=True)
            t0 = time.perf_counter()
            info = CheckpointCommitInfo(tag=tag, save_dir=d, save_latest=True)
            eng.create(info)
            eng.save(state["model"], os.path.join(d, tag, "mp_rank_00_model_states.pt"))
            eng.save(state["optim"], os.path.join(d, tag, "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"))
            eng.commit(info)
            stalls.append(time.perf_counter() - t0)
            if strategy == "torch":
                _sync_dir_files(os.path.join(d, tag))
            else:
                eng.flush()
            persists.append(time.perf_counter() - t0)
            if strategy == "torch" and i >= 2:
                shutil.rmtree(os.path.join(d, f"global_step{i - 2}"), ignore_errors=True)
    finally:
        if strategy != "torch":
            eng.cleanup()
        shutil.rmtree(d, ignore_errors=True)
    return stalls, persists


def _sync_dir_files(path: str) -> None:
    # DeepSpeed's engine does not fsync; durability costs the same for everyone, so add it.
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


# DeepSpeed 0.19.8 cannot build DecoupledCheckpointEngine without a model-parallel unit:
# create_data_parallel_writer_config reads UniversalParallelInfo.dp_rank, which does not exist.
DS_DECOUPLED_UNAVAILABLE = "DecoupledCheckpointEngine does not build in DeepSpeed 0.19.8 without an mpu " \
                           "(AttributeError: 'UniversalParallelInfo' object has no attribute 'dp_rank')"


def raw_copy(state: dict, repeats: int) -> list[float]:
    from cpsr_ds.checkpoint.fileformat import flatten
    tensors = flatten(state)[1]
    dst = [torch.empty_like(t, pin_memory=torch.cuda.is_available(), device="cpu") for t in tensors]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for a, b in zip(dst, tensors):
            a.copy_(b)
        times.append(time.perf_counter() - t0)
    return times


def disk_write_gbps(root: str, nbytes: int) -> float:
    buf = memoryview(bytearray(os.urandom(1 << 20)) * 64)
    path = os.path.join(root, "disk-probe")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t0 = time.perf_counter()
    written = 0
    while written < nbytes:
        written += os.write(fd, buf[:min(len(buf), nbytes - written)])
    os.fsync(fd)
    elapsed = time.perf_counter() - t0
    os.close(fd)
    os.unlink(path)
    return written / elapsed / GB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10 repeats, finishes within minutes on 2 cores")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--dir", help="directory on the storage to measure (default: a temporary one)")
    args = ap.parse_args()
    repeats = 10 if args.quick else 20
    root = tempfile.mkdtemp(prefix="cpsr-bench-", dir=args.dir)
    results = {"sizes": {}}
    try:
        for label, size in (("small", 10 * 2**20), ("large", 2**30)):
            state = synthetic_state(size)
            nbytes = state_bytes(state)
            row = {"bytes": nbytes, "stall_s": {}, "persist_gbps": {}}
            for strategy in STRATEGIES:
                stalls, persists = measure_engine(strategy, state, root, repeats)
                row["stall_s"][strategy] = statistics.median(stalls)
                row["persist_gbps"][strategy] = nbytes / statistics.median(persists) / GB
            row["stall_s"]["ds_decoupled"] = None
            row["raw_copy_s"] = statistics.median(raw_copy(state, repeats))
            row["disk_gbps"] = disk_write_gbps(root, max(nbytes, 256 * 2**20))
            results["sizes"][label] = row
            del state
    finally:
        shutil.rmtree(root, ignore_errors=True)
    large = results["sizes"]["large"]
    results.update(stall_s=large["stall_s"], raw_copy_s=large["raw_copy_s"], persist_gbps=large["persist_gbps"],
                   disk_gbps=large["disk_gbps"], repeats=repeats, notes={"ds_decoupled": DS_DECOUPLED_UNAVAILABLE},
                   device="cuda" if torch.cuda.is_available() else "cpu")
    for label, row in results["sizes"].items():
        print(f"\n{label}: {row['bytes'] / 2**20:.0f} MiB   raw host copy {row['raw_copy_s'] * 1e3:.1f} ms   "
              f"disk {row['disk_gbps']:.2f} GB/s")
        print(f"{'strategy':<14} {'stall ms':>10} {'x raw copy':>11} {'persist GB/s':>13} {'x disk':>7}")
        for strategy, stall in row["stall_s"].items():
            if stall is None:
                print(f"{strategy:<14} {'n/a':>10}   ({DS_DECOUPLED_UNAVAILABLE})")
                continue
            gbps = row["persist_gbps"].get(strategy)
            tail = f"{gbps:>13.2f} {gbps / row['disk_gbps']:>7.2f}" if gbps is not None else f"{'-':>13} {'-':>7}"
            print(f"{strategy:<14} {stall * 1e3:>10.1f} {stall / row['raw_copy_s']:>11.2f} {tail}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
