"""Run under DeepSpeed's launcher by test_data_iterator.py: DeepSpeed owns the data, as in DeepSpeedExamples'
pipeline script. ``training_data=`` goes to ``cpsr_ds.initialize``; with ``--pipeline`` a PipelineModule of two
stages trains by ``engine.train_batch()`` with no argument, else a plain module by the user's loop over the loader
``initialize`` returns. Nothing here makes batch i a function of i: the engine's loader must resume."""

import argparse

import deepspeed
import torch
from deepspeed.pipe import PipelineModule

import cpsr_ds

SAMPLES, FEATURES = 72, 16


def dataset() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=gen)
    return torch.utils.data.TensorDataset(x, x.sum(-1, keepdim=True).sin())


def layers() -> list:
    return [torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--train-iters", type=int, required=True)
    parser.add_argument("--pipeline", action="store_true")
    args, _ = parser.parse_known_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    if args.pipeline:
        model = PipelineModule(layers=layers(), loss_fn=torch.nn.functional.mse_loss, num_stages=2)
    else:
        model = torch.nn.Sequential(*layers())
    engine, _, loader, _ = cpsr_ds.initialize(args=args, model=model, model_parameters=model.parameters(),
                                              training_data=dataset())
    while engine.global_steps < args.train_iters:
        if args.pipeline:
            engine.train_batch()
            continue
        for x, y in loader:
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
            if engine.global_steps == args.train_iters:
                break
    engine.destroy()


if __name__ == "__main__":
    main()
