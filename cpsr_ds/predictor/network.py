"""The Variable-Interval Temporal Predictor network, VITP (Sec. III-A, Fig. 4).

A small transformer over a window of W checkpoints of a batch of chunks. Each
input token is the FDD mid band of one checkpoint of the chunk (``token_size``
values), normalised by the chunk's recent movement, plus the chunk's mid-band
autocorrelation row (scale- and order-free summary of its dynamics). A learned
embedding of the time intervals is added to the tokens before the position
embedding; a last query token carries the target offset and the kind of state.

The network outputs a complex gain per mid-band bin: the target window's mid band
is the input window's mid band times (1 + gain) (a shift in time is a phase
rotation per bin), the low band is kept as is, the high band is dropped, and the
inverse FFT assembles the window ending at the target. Its change from the last
checkpoint's band-limited value is added to the exact last checkpoint, so a zero
gain reproduces the checkpoint (the head starts at zero) and dropped noise is
never extrapolated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cpsr_ds.predictor import fdd
from cpsr_ds.predictor.state import KINDS


@dataclass
class Prepared:
    """A window of chunks in the form the network reads and :func:`advance` extends."""

    last: torch.Tensor  # (B, T) the last checkpoint
    low: torch.Tensor  # (B, F, T) low-band bins of the window centred on its last checkpoint
    mid: torch.Tensor  # (B, F, T) mid-band bins
    inputs: torch.Tensor  # (B, W, T) mid band in time, / scale
    gram: torch.Tensor  # (B, W, W) autocorrelation of ``inputs`` over the chunk's values
    scale: torch.Tensor  # (B, 1) RMS movement of the chunk over the window


def prepare(y: torch.Tensor, bands: fdd.Bands) -> Prepared:
    """FDD of a window ``y`` (B, W, T) of chunks."""
    last = y[:, -1]
    centred = y - last[:, None]
    scale = centred.square().mean(dim=(1, 2)).sqrt()[:, None]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    low, mid, _ = fdd.split(centred, bands, dim=1)
    inputs = fdd.assemble(mid, window=bands.window, dim=1) / scale[:, :, None]
    gram = inputs @ inputs.transpose(1, 2) / y.shape[-1]
    return Prepared(last, low, mid, inputs, gram, scale)


def advance(p: Prepared, gains: torch.Tensor, bands: fdd.Bands) -> torch.Tensor:
    """Prediction (B, T) at the target from per-bin complex ``gains`` (B, mid bins)."""
    g = torch.zeros(gains.shape[0], bands.bins, 1, dtype=p.mid.dtype, device=gains.device)
    g[:, bands.mid_slice, 0] = gains
    target_window = fdd.assemble(p.low, p.mid * (1 + g), window=bands.window, dim=1)
    window = fdd.assemble(p.low, p.mid, window=bands.window, dim=1)
    return p.last + target_window[:, -1] - window[:, -1]


class VITP(nn.Module):
    def __init__(self, token_size: int, bands: fdd.Bands, d_model: int = 64, heads: int = 4, layers: int = 2, d_ff: int = 128):
        super().__init__()
        w = bands.window
        self.bands = bands
        self.value_proj = nn.Linear(token_size, d_model)
        self.gram_proj = nn.Linear(w, d_model)
        self.time_embed = nn.Sequential(nn.Linear(2, d_model), nn.GELU(), nn.Linear(d_model, d_model))
        self.query = nn.Parameter(torch.zeros(d_model))
        self.kind_embed = nn.Embedding(len(KINDS), d_model)
        self.pos_embed = nn.Parameter(torch.randn(w + 1, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, d_ff, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 2 * bands.mid)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, p: Prepared, times: torch.Tensor, kind: torch.Tensor) -> torch.Tensor:
        """Complex gains (B, mid bins) for a window; ``times`` (W+1, 2) from :func:`samples.time_features`."""
        tokens = self.value_proj(p.inputs) + self.gram_proj(p.gram)
        query = (self.query + self.kind_embed(kind))[:, None]
        h = torch.cat([tokens, query], dim=1) + self.time_embed(times)
        h = self.encoder(h + self.pos_embed)
        out = self.head(h[:, -1])
        return torch.complex(out[:, : self.bands.mid], out[:, self.bands.mid :])
