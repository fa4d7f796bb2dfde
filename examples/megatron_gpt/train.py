"""A megatron-core GPT (``GPTModel``, one plain module) under DeepSpeed (ZeRO-3, ds_config.json) in a plain training
loop, with cpsr_ds; train_deepspeed.py is the same script without it (docs/how-to/megatron-gpt.md shows the diff).

    deepspeed --num_gpus 2 examples/megatron_gpt/train.py --deepspeed_config examples/megatron_gpt/ds_config.json
"""

import argparse

import cpsr_ds
import deepspeed

from model import gpt, micro_batch


def main() -> None:
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    parser.add_argument("--train-iters", type=int, default=20)
    args, _ = parser.parse_known_args()
    deepspeed.init_distributed()  # megatron-core builds its (size 1) model-parallel groups in it
    model = gpt()
    engine, *_ = cpsr_ds.initialize(args=args, model=model, model_parameters=model.parameters())
    while engine.global_steps < args.train_iters:
        i = engine.global_steps * engine.world_size + engine.global_rank
        loss = engine(**micro_batch(i, engine.train_micro_batch_size_per_gpu())).mean()
        engine.backward(loss)
        engine.step()
        if engine.global_rank == 0:
            print(f"iteration {engine.global_steps} loss {loss.item()!r}", flush=True)
    engine.destroy()


if __name__ == "__main__":
    main()
