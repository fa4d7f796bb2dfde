"""Run by test_recovery.py: build the job as train_gpt.py does (so recovery runs), then
save, per rank, what recovery put into the engine and the states of the checkpoints the
predictor learned from. With PROBE_RESUME=1 the job trains on to --train-iters first
(the checkpoints the predictor learned from must outlive that: checkpoint.keep_last)."""

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "launch"))

import train_gpt  # noqa: E402
from cpsr_ds.checkpoint.store import list_checkpoints  # noqa: E402
from cpsr_ds.recovery import engine_state  # noqa: E402


def main() -> None:
    job = train_gpt.setup()
    engine = job.engine
    report = engine.cpsr.recovery
    probe = {
        "report": report,
        "global_steps": engine.global_steps,
        "recovered": engine_state(engine),
        # The weights the forward pass uses, as distinct from the optimizer's fp32 masters.
        "module": {name: p.detach().float().cpu().clone() for name, p in engine.module.named_parameters()},
        "module_dtypes": {str(p.dtype) for p in engine.module.parameters()},
        "scheduler": engine.lr_scheduler.state_dict(),
        "optimizer_steps": sorted({int(st["step"]) for st in engine.optimizer.optimizer.state.values()}),
        "history": {},
    }
    if os.environ.get("PROBE_RESUME") == "1":
        train_gpt.train(job)
    for ck in list_checkpoints(job.cpsr_cfg.checkpoint.dir):
        if ck.valid and ck.iteration <= report.checkpoint:
            engine.load_checkpoint(job.cpsr_cfg.checkpoint.dir, tag=ck.tag)
            probe["history"][ck.iteration] = engine_state(engine)
    torch.save(probe, os.path.join(os.environ["PROBE_OUT"], f"rank{engine.global_rank}.pt"))


if __name__ == "__main__":
    main()
