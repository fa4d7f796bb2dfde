"""A Hugging Face GPT-2 under DeepSpeed (ZeRO-3, ds_config.json) in a plain training loop, without cpsr_ds;
train.py is the same script with cpsr_ds (docs/how-to/hf-gpt2.md shows the diff).

    deepspeed --num_gpus 2 examples/hf_gpt2/train_deepspeed.py --deepspeed_config examples/hf_gpt2/ds_config.json
"""

import argparse

import deepspeed

from model import gpt2, micro_batch


def main() -> None:
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    parser.add_argument("--train-iters", type=int, default=20)
    args, _ = parser.parse_known_args()
    model = gpt2()
    engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    while engine.global_steps < args.train_iters:
        i = engine.global_steps * engine.world_size + engine.global_rank
        loss = engine(**micro_batch(i, engine.train_micro_batch_size_per_gpu())).loss
        engine.backward(loss)
        engine.step()
        if engine.global_rank == 0:
            print(f"iteration {engine.global_steps} loss {loss.item()!r}", flush=True)
    engine.destroy()


if __name__ == "__main__":
    main()
