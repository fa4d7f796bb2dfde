"""Run under DeepSpeed's launcher by test_data_iterator.py: DeepSpeedExamples' pipeline pattern
(training/pipeline_parallelism/train.py): a PipelineModule, ``training_data=dataset`` given to initialize, and
``engine.train_batch()`` with no argument, the engine feeding its own batches; nothing in the script makes batch i
a function of i."""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cpsr_ds  # noqa: E402
import deepspeed  # noqa: E402
from deepspeed.pipe import PipelineModule  # noqa: E402

SAMPLES, FEATURES = 96, 8  # 96 samples: the loader wraps around within the run


def dataset() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=gen)
    return torch.utils.data.TensorDataset(x, x.sum(-1, keepdim=True).sin())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--train-iters", type=int, required=True)
    args, _ = parser.parse_known_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    net = PipelineModule(layers=[torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)],
                         loss_fn=torch.nn.MSELoss(), num_stages=2)
    engine, *_ = cpsr_ds.initialize(args=args, model=net, model_parameters=net.parameters(), training_data=dataset())
    while engine.global_steps < args.train_iters:
        engine.train_batch()
    engine.destroy()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
