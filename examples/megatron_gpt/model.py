"""The megatron-core GPT the example trains: ``megatron.core.models.gpt.GPTModel`` as one plain module (tensor and
pipeline parallel size 1; DeepSpeed does the data parallelism and ZeRO), and its data, micro-batch i a function of
i alone. Its layers are examples/gpt's: megatron-core's local spec, with core attention on PyTorch's SDPA on the
CPU (examples/gpt/model.py says why)."""

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # examples.gpt

with warnings.catch_warnings():
    # megatron-core warns at import that Apex / Transformer Engine are absent.
    warnings.simplefilter("ignore")
    from megatron.core.models.gpt import GPTModel

from examples.gpt.model import GPTConfig, ensure_model_parallel_state, layer_spec, transformer_config  # noqa: E402

SHAPE = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256)


def gpt() -> GPTModel:
    """A fresh GPTModel of :data:`SHAPE`, the same weights on every rank and every start."""
    ensure_model_parallel_state()
    torch.manual_seed(0)
    return GPTModel(config=transformer_config(SHAPE, torch.float32), transformer_layer_spec=layer_spec(),
                    vocab_size=SHAPE.vocab_size, max_sequence_length=SHAPE.seq_length,
                    share_embeddings_and_output_weights=True)


def micro_batch(i: int, size: int) -> dict:
    """Micro-batch ``i``: ``size`` random token sequences, each position's label the next token."""
    tokens = torch.randint(0, SHAPE.vocab_size, (size, SHAPE.seq_length + 1),
                           generator=torch.Generator().manual_seed(i))
    positions = torch.arange(SHAPE.seq_length).expand(size, -1)
    return {"input_ids": tokens[:, :-1], "position_ids": positions, "attention_mask": None, "labels": tokens[:, 1:]}
