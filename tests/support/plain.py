"""A plain module (no pipeline) and its data for the plain-engine tests: batch i is a function of i alone."""

import torch

MICRO_BATCH, FEATURES = 4, 16


class Regression(torch.nn.Module):
    """A plain module whose forward returns its loss, as a Hugging Face model does."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.layers(x).squeeze(-1).float(), y.float())


def micro_batch(i: int, dtype=torch.float32):
    """Micro-batch ``i``: inputs and their targets."""
    gen = torch.Generator().manual_seed(i)
    x = torch.randn(MICRO_BATCH, FEATURES, generator=gen)
    return x.to(dtype), x.sum(-1).sin().to(dtype)


def plain_config(run_dir, zero_stage=0, accumulation=1, cpsr: dict | None = None, **extra) -> dict:
    """A DeepSpeed config for :class:`Regression` (``extra`` DeepSpeed keys) with a "cpsr" block checkpointing
    every 3 iterations (``cpsr``: its other sections)."""
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": accumulation,
            "steps_per_print": 10 ** 9,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
            "zero_optimization": {"stage": zero_stage},
            "cpsr": {"checkpoint": {"dir": str(run_dir), "interval": 3}, **(cpsr or {})}, **extra}
