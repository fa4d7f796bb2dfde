"""Predictor samples from the checkpoint history (Sec. III-A, VI-C4).

A kind's flat vector is split along the tensor dimension into chunks of
``token_size`` values; the history then reads as chunks x checkpoints, in
chronological order, with the checkpoint iterations as time stamps (intervals may
vary). A sample is a window of W checkpoints of a batch of chunks plus a later
target checkpoint. Windows of every stride up to ``max_stride`` are used, so that
the target lies one to ``stride`` intervals of the input spacing past the window:
the failure point lies anywhere between two checkpoints, and the target offset
is an input of VITP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Window:
    """Indices into the history: ``inputs`` (W checkpoints, oldest first) and ``target``."""

    inputs: tuple[int, ...]
    target: int

    def times(self, iterations) -> tuple[torch.Tensor, int]:
        """Time stamps of the inputs and of the target."""
        return torch.tensor([float(iterations[i]) for i in self.inputs]), int(iterations[self.target])


def windows(n_checkpoints: int, window: int, max_stride: int = 1) -> list[Window]:
    """Every window of ``window`` equally strided checkpoints with a later target within one stride."""
    out = []
    for stride in range(1, max_stride + 1):
        for start in range(n_checkpoints):
            inputs = tuple(range(start, start + (window - 1) * stride + 1, stride))
            for target in range(inputs[-1] + 1, min(inputs[-1] + stride, n_checkpoints - 1) + 1):
                out.append(Window(inputs, target))
    return out


def chunks(flat: torch.Tensor, token_size: int) -> torch.Tensor:
    """A view of a kind's flat vector as (chunks, token_size); the layout pads it to whole chunks."""
    return flat.view(-1, token_size)


def gather(series: list[torch.Tensor], indices, rows: torch.Tensor, token_size: int) -> torch.Tensor:
    """Values of chunks ``rows`` at checkpoints ``indices``: (len(rows), len(indices), token_size)."""
    return torch.stack([chunks(series[i], token_size)[rows] for i in indices], dim=1)


def time_features(times: torch.Tensor, target: float) -> torch.Tensor:
    """Per token (W inputs, then the target query): the interval to the previous
    checkpoint and the offset from the last one, both in units of the window's
    mean interval, so that the embedding sees the irregular spacing."""
    mean = (times[-1] - times[0]) / max(len(times) - 1, 1)
    stamps = torch.cat([times, times.new_tensor([float(target)])])
    gaps = torch.diff(stamps, prepend=stamps[:1])
    gaps[0] = gaps[1]
    return torch.stack([gaps / mean, (stamps - times[-1]) / mean], dim=-1)
