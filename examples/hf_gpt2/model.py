"""The Hugging Face GPT-2 the examples train: a small ``GPT2Config`` with random weights (nothing downloaded),
and its data, micro-batch i a function of i alone, so that a restart at iteration c trains on the same batches."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

# Dropout off: a recomputed iteration then gives the failure-free run's loss.
CONFIG = GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
SEQUENCE = 32


def gpt2() -> GPT2LMHeadModel:
    """A fresh GPT-2 of :data:`CONFIG`, the same weights on every rank and every start."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(CONFIG)


def micro_batch(i: int, size: int) -> dict:
    """Micro-batch ``i``: ``size`` random token sequences, their own labels (the model shifts them)."""
    tokens = torch.randint(0, CONFIG.vocab_size, (size, SEQUENCE), generator=torch.Generator().manual_seed(i))
    return {"input_ids": tokens, "labels": tokens}


class TokenSequences(torch.utils.data.Dataset):
    """``length`` samples for the Hugging Face ``Trainer``: sample i as micro-batch i of one sequence."""

    def __init__(self, length: int):
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        return {name: tensor[0] for name, tensor in micro_batch(i, 1).items()}
