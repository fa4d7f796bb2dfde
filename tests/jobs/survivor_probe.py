"""Run under DeepSpeed's launcher by test_survivor.py: train as train_gpt.py does, and after every iteration save
rank 0's engine_state; the killed rank waits for rank 0's state of its last iteration before its fault fires, so
that the state the survivor dumps is always on record. With PROBE_RECOVERED, save instead each rank's state as
recovery left it and as its checkpoint c holds it, and stop."""

import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))

import train_gpt  # noqa: E402
from cpsr_ds.recovery import engine_state  # noqa: E402


def probe_path(iteration: int) -> str:
    return os.path.join(os.environ["PROBE_OUT"], f"rank0-iteration{iteration}.pt")


def main() -> None:
    job = train_gpt.setup()
    engine = job.engine
    recovered = os.environ.get("PROBE_RECOVERED")
    if recovered:
        rank = engine.global_rank
        torch.save(engine_state(engine), os.path.join(recovered, f"rank{rank}.pt"))
        engine.load_checkpoint(job.cpsr_cfg.checkpoint.dir, tag=f"global_step{engine.cpsr.recovery.checkpoint}")
        torch.save(engine_state(engine), os.path.join(recovered, f"rank{rank}-checkpoint.pt"))
        return
    check = engine.cpsr.faults.check

    def after_rank0_recorded(iteration: int) -> None:
        deadline = time.monotonic() + 60
        while not os.path.exists(probe_path(iteration)) and time.monotonic() < deadline:
            time.sleep(0.01)
        check(iteration)

    if engine.global_rank != 0:
        engine.cpsr.faults.check = after_rank0_recorded
    for iteration in range(engine.global_steps, job.args.train_iters):
        engine.train_batch(iter(job.batches.micro_batches(iteration)))
        if engine.global_rank == 0:
            tmp = probe_path(engine.global_steps) + ".tmp"
            torch.save(engine_state(engine), tmp)
            os.replace(tmp, probe_path(engine.global_steps))
    train_gpt.finish(job)


if __name__ == "__main__":
    main()
