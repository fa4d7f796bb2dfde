"""Run under DeepSpeed's launcher by test_plain_engine_jobs.py and test_plain_engine_sources.py: train
tests/support/plain.py's Regression, a plain module, with the user's loop of ``loss = engine(batch); engine.backward(loss); engine.step()`` until
``--train-iters``; each rank's micro-batches a function of the iteration, so a restart at c redoes the same.
``--dump-own DIR``: each rank saves its own share of the state (ZeRO-3: its partition) where a restart resumes and
after each iteration of ``--dump-at``, for a test to compare."""

import argparse
import os
import sys

import torch
from deepspeed.accelerator import get_accelerator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cpsr_ds  # noqa: E402
from cpsr_ds.integration.deepspeed.engine_state import own_share  # noqa: E402
from support.plain import Regression, micro_batch  # noqa: E402


def dump_own(engine, directory: str | None, name: str) -> None:
    if directory:
        torch.save(own_share(engine), os.path.join(directory, f"rank{engine.global_rank}-{name}.pt"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--train-iters", type=int, required=True)
    parser.add_argument("--dump-own")
    parser.add_argument("--dump-at", type=int, nargs="*", default=[])
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="the inputs' type: the config's bf16 or fp16 block sets the model's")
    args, _ = parser.parse_known_args()
    if args.dtype == "float16" and not get_accelerator().is_fp16_supported():
        # DeepSpeed's CPU accelerator reports fp16 only where oneDNN has fp16 kernels; torch's own CPU half
        # kernels run this small model, and DeepSpeed's loss scaler and ZeRO optimizers are the real ones.
        get_accelerator().is_fp16_supported = lambda: True
    torch.manual_seed(0)
    model = Regression()
    engine, *_ = cpsr_ds.initialize(args=args, model=model, model_parameters=model.parameters())
    accumulation, ranks = engine.gradient_accumulation_steps(), engine.world_size
    if engine.global_steps:  # a restart (a fresh engine has no moments yet)
        dump_own(engine, args.dump_own, f"start{engine.global_steps}")
    while engine.global_steps < args.train_iters:
        first = (engine.global_steps * ranks + engine.global_rank) * accumulation
        for micro in range(first, first + accumulation):
            loss = engine(*micro_batch(micro, getattr(torch, args.dtype)))
            engine.backward(loss)
            engine.step()
        if engine.global_steps in args.dump_at:
            dump_own(engine, args.dump_own, f"at{engine.global_steps}")
    engine.destroy()
    # Gloo's threads left to the interpreter's teardown can abort a process that finished (train_gpt.py's finish).
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
