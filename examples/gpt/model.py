"""GPT built from megatron-core layers, as a DeepSpeed ``PipelineModule`` (:func:`gpt_pipeline`) or as one plain
module for DeepSpeed's plain engine and ZeRO 0-3 (:func:`gpt_plain`).

Layout, top to bottom: token + position embedding -> ``num_layers`` megatron-core
``TransformerLayer`` blocks (the local spec) -> final LayerNorm -> vocabulary head.
Activations travel between pipeline stages as ``[sequence, batch, hidden]``, the
layout megatron-core's layers use.

megatron-core's fused attention paths need CUDA; on the CPU the spec's core
attention is replaced by :class:`SDPAttention`, which calls
``torch.nn.functional.scaled_dot_product_attention``. On CUDA the stock spec runs.
megatron-core's own DDP, optimizer and pipeline p2p are CUDA-only, so DeepSpeed does
those; megatron-core only needs its (trivial, TP = PP = 1) model-parallel state.
"""

from __future__ import annotations

import copy
import itertools
import warnings

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import nn

with warnings.catch_warnings():
    # megatron-core warns at import that Apex / Transformer Engine are absent.
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

from deepspeed.pipe import LayerSpec, PipelineModule

from examples.gpt.corpus import VOCAB_SIZE


class GPTConfig(BaseModel):
    """Model shape; read from the ``"gpt"`` block of the DeepSpeed config."""

    model_config = ConfigDict(extra="forbid")

    num_layers: int = Field(4, gt=0)
    hidden_size: int = Field(128, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    seq_length: int = Field(128, gt=0)
    vocab_size: int = Field(VOCAB_SIZE, gt=0)
    init_method_std: float = Field(0.02, gt=0)
    hidden_dropout: float = Field(0.0, ge=0, lt=1, description="megatron-core's dropout after attention and MLP.")
    attention_dropout: float = Field(0.0, ge=0, lt=1, description="megatron-core's dropout of attention weights.")
    partition_method: str = Field(
        "type:Block",
        description="How the layers are split across pipeline stages: DeepSpeed's partition_method (uniform, "
        "parameters, type:REGEX; type:Block balances the transformer blocks), or blocks:N,N,... for N blocks on "
        "each stage in order (fewer on the stages of smaller GPUs; the embedding goes with the first, the head "
        "with the last).",
    )

    @field_validator("partition_method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        if value.startswith(BLOCKS):
            block_counts(value)
        elif value.lower() not in ("uniform", "parameters") and not value.lower().startswith("type:"):
            raise ValueError(f"expected uniform, parameters, type:REGEX or {BLOCKS}N,N,... (got {value!r})")
        return value

    @model_validator(mode="after")
    def _blocks_add_up(self) -> "GPTConfig":
        if self.partition_method.startswith(BLOCKS) and sum(block_counts(self.partition_method)) != self.num_layers:
            raise ValueError(f"partition_method {self.partition_method} places {sum(block_counts(self.partition_method))} "
                             f"blocks, the model has num_layers {self.num_layers}")
        return self


BLOCKS = "blocks:"


def block_counts(method: str) -> list[int]:
    """The blocks per stage of a ``blocks:N,N,...`` partition method; ValueError naming what is wrong."""
    try:
        counts = [int(n) for n in method[len(BLOCKS):].split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ValueError(f"{method!r}: expected {BLOCKS} and a whole number >= 1 of blocks per stage, comma-separated")
    return counts


def stage_bounds(counts: list[int]) -> list[int]:
    """Where each stage's layers begin in [embedding, blocks..., head], and where the last ends."""
    ends = list(itertools.accumulate(counts))
    return [0] + [1 + end for end in ends[:-1]] + [ends[-1] + 2]


class SDPAttention(DotProductAttention):
    """Causal core attention on PyTorch's SDPA, so megatron-core layers run on the CPU."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        seq, batch = query.shape[0], query.shape[1]
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout = self.config.attention_dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)


def transformer_config(cfg: GPTConfig, params_dtype: torch.dtype) -> TransformerConfig:
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=4 * cfg.hidden_size,
        init_method_std=cfg.init_method_std,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
    )


def layer_spec():
    spec = get_gpt_layer_local_spec()
    if not torch.cuda.is_available():
        spec = copy.deepcopy(spec)
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.positions = nn.Embedding(cfg.seq_length, cfg.hidden_size)
        for table in (self.tokens, self.positions):
            nn.init.normal_(table.weight, std=cfg.init_method_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        hidden = self.tokens(tokens) + self.positions(positions)[None]
        return hidden.transpose(0, 1).contiguous()


class Block(nn.Module):
    """One megatron-core ``TransformerLayer``; ``layer_number`` counts from 1."""

    def __init__(self, cfg: GPTConfig, layer_number: int, params_dtype: torch.dtype):
        super().__init__()
        self.layer = build_module(layer_spec(), config=transformer_config(cfg, params_dtype), layer_number=layer_number)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        output, _context = self.layer(hidden, attention_mask=None)
        return output


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        nn.init.normal_(self.proj.weight, std=cfg.init_method_std)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(hidden)).transpose(0, 1)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def ensure_model_parallel_state() -> None:
    """megatron-core layers query their (TP = 1) group; DeepSpeed owns all real parallelism."""
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)


class GPTPipeline(PipelineModule):
    """DeepSpeed's PipelineModule, also split by ``blocks:N,N,...`` (GPTConfig.partition_method)."""

    def _partition_layers(self, method="uniform"):
        if not method.startswith(BLOCKS):
            return super()._partition_layers(method)
        counts = block_counts(method)
        if len(counts) != self.num_stages:
            raise ValueError(f"partition_method {method} names {len(counts)} stages, the pipeline has {self.num_stages}")
        self.parts = stage_bounds(counts)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


def _seed_layer(layer_seed) -> None:
    """Seed a layer's initialisation; on CUDA also megatron-core's model-parallel RNG state, which its
    layers fork when they initialise weights on the GPU and in attention dropout.

    DeepSpeed calls it before every layer's forward pass too. Without CUDA only the CPU generator is
    seeded: ``torch.manual_seed`` would also queue a seed for CUDA's lazy initialisation, recording a
    stack trace each time: bench_ftcost's tiny GPT trained 10 % faster without it (median iteration 26.8
    against 29.8 ms over five runs each), with the same losses."""
    if torch.cuda.is_available():
        torch.manual_seed(int(layer_seed))
        tensor_parallel.model_parallel_cuda_manual_seed(int(layer_seed))
    else:
        torch.default_generator.manual_seed(int(layer_seed))


def gpt_pipeline(cfg: GPTConfig, num_stages: int, seed: int, params_dtype: torch.dtype = torch.float32) -> PipelineModule:
    """The GPT as ``num_stages`` pipeline stages, split by ``cfg.partition_method`` (by default the transformer
    blocks balanced across them).

    Each layer is seeded from ``seed`` and its index, so the initial weights do not
    depend on the number of stages.
    """
    ensure_model_parallel_state()
    layers = [LayerSpec(Embedding, cfg)]
    layers += [LayerSpec(Block, cfg, n + 1, params_dtype) for n in range(cfg.num_layers)]
    layers += [LayerSpec(Head, cfg)]
    return GPTPipeline(
        layers=layers,
        loss_fn=lm_loss,
        num_stages=num_stages,
        partition_method=cfg.partition_method,
        seed_layers=True,
        # DeepSpeed's default seeder hands numpy ints to random.seed, which rejects them.
        seed_fn=_seed_layer,
        base_seed=seed,
    )


class GPTPlain(nn.Module):
    """The same layers as one plain module: ``model(tokens, labels)`` returns the loss, as DeepSpeed's plain engine
    and a Hugging Face model take it."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.Sequential(*layers)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.layers(tokens), labels)


def gpt_plain(cfg: GPTConfig, seed: int, params_dtype: torch.dtype = torch.float32) -> GPTPlain:
    """The GPT as one plain module, each layer seeded from ``seed`` and its index as :func:`gpt_pipeline` seeds it."""
    ensure_model_parallel_state()
    builders = [lambda: Embedding(cfg)]
    builders += [lambda n=n: Block(cfg, n + 1, params_dtype) for n in range(cfg.num_layers)]
    builders += [lambda: Head(cfg)]
    layers = []
    for index, build in enumerate(builders):
        _seed_layer(seed + index)
        layers.append(build())
    return GPTPlain(layers)
