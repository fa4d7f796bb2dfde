"""Run by test_recovery.py: build the job as train_gpt.py does (so recovery runs), then
save, per rank, what recovery put into the engine and the states of the checkpoints the
predictor learned from. With PROBE_RESUME=1 the job trains on to --train-iters first
(the checkpoints the predictor learned from must outlive that: checkpoint.keep_last).
Also counted: the full tensors gathered from ZeRO partitions during recovery and training,
and the size of each share of a checkpoint recovery kept for the predictor."""

import os
import sys
from collections import Counter

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))

import train_gpt  # noqa: E402
from cpsr_ds.checkpoint.storage.catalog import list_checkpoints  # noqa: E402
from cpsr_ds.integration.deepspeed import engine_state as engine_io
from cpsr_ds.recovery import engine_state# noqa: E402
from cpsr_ds.recovery.sources import checkpoint as checkpoint_source  # noqa: E402

GATHERS = Counter()
SHARES = []  # values in each share recovery kept


def counted(gather):
    def wrapped(*args, **kwargs):
        GATHERS["calls"] += 1
        return gather(*args, **kwargs)
    return wrapped


def recorded(own_share):
    def wrapped(engine, **options):
        share = own_share(engine, **options)
        SHARES.append(sum(t.numel() for t in share.values()))
        return share
    return wrapped


engine_io.safe_get_full_fp32_param = counted(engine_io.safe_get_full_fp32_param)
engine_io.safe_get_full_optimizer_state = counted(engine_io.safe_get_full_optimizer_state)
checkpoint_source.own_share = recorded(checkpoint_source.own_share)


def main() -> None:
    job = train_gpt.setup()
    engine = job.engine
    report = engine.cpsr.recovery
    gathered_in_recovery = GATHERS["calls"]
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
    probe.update(gathered_in_recovery=gathered_in_recovery, kept_shares=list(SHARES),
                 partition=sum(t.numel() for t in engine_io.local_state(engine)[0].values()),
                 stage_values=3 * sum(p.numel() for p in engine.module.parameters()))
    if os.environ.get("PROBE_RESUME") == "1":
        before = GATHERS["calls"]
        train_gpt.train(job)
        probe["gathered_in_training"] = GATHERS["calls"] - before
    for ck in list_checkpoints(job.cpsr_cfg.checkpoint.dir):
        if ck.valid and ck.iteration <= report.checkpoint:
            engine.load_checkpoint(job.cpsr_cfg.checkpoint.dir, tag=ck.tag)
            probe["history"][ck.iteration] = engine_state(engine)
    torch.save(probe, os.path.join(os.environ["PROBE_OUT"], f"rank{engine.global_rank}.pt"))
    train_gpt.finish(job)


if __name__ == "__main__":
    main()
