"""Run under DeepSpeed's launcher by test_plain_engine_jobs.py: train tests/support/plain.py's Regression, a plain
module, with the user's loop of ``loss = engine(batch); engine.backward(loss); engine.step()`` until
``--train-iters``; each rank's micro-batches a function of the iteration, so a restart at c redoes the same."""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cpsr_ds  # noqa: E402
from support.plain import Regression, micro_batch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--train-iters", type=int, required=True)
    args, _ = parser.parse_known_args()
    torch.manual_seed(0)
    model = Regression()
    engine, *_ = cpsr_ds.initialize(args=args, model=model, model_parameters=model.parameters())
    accumulation, ranks = engine.gradient_accumulation_steps(), engine.world_size
    while engine.global_steps < args.train_iters:
        first = (engine.global_steps * ranks + engine.global_rank) * accumulation
        for micro in range(first, first + accumulation):
            loss = engine(*micro_batch(micro))
            engine.backward(loss)
            engine.step()
    engine.destroy()


if __name__ == "__main__":
    main()
