"""FFT-based Data Denoising, FDD (Sec. III-A, Fig. 4).

Along the time axis of a window of checkpoints, the spectrum Y = FFT(y) is cut
into three bands of real-FFT bins: the low band (the slow baseline, kept as is),
the mid band (the stable evolutionary pattern, the only part fed to the VITP
network) and the high band (noise perturbations, dropped). The inverse FFT of
the kept bands assembles a window again. With a window of 5 checkpoints, one
low, one mid and one high bin, the mid band is 2 of the 5 real values per series:
the paper's 40 % of the volume.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Bands:
    """Real-FFT bins of a window of ``window`` samples: [0, low) low, [low, low+mid) mid, the rest high."""

    window: int
    low: int = 1
    mid: int = 1

    def __post_init__(self):
        if self.low < 0 or self.mid < 1 or self.low + self.mid > self.bins:
            raise ValueError(f"bands low={self.low} mid={self.mid} do not fit the {self.bins} bins of a window of {self.window}")

    @property
    def bins(self) -> int:
        return self.window // 2 + 1

    @property
    def mid_slice(self) -> slice:
        return slice(self.low, self.low + self.mid)

    @property
    def mid_volume(self) -> float:
        """Share of the window's real values carried by the mid band (a real bin counts 1, a complex bin 2)."""
        return sum(_real_values(k, self.window) for k in range(self.low, self.low + self.mid)) / self.window


def _real_values(k: int, window: int) -> int:
    return 1 if k == 0 or 2 * k == window else 2


def split(y: torch.Tensor, bands: Bands, dim: int = -2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Spectrum of ``y`` along ``dim`` as (low, mid, high) bins, the other bins zeroed in each."""
    spectrum = torch.fft.rfft(y, dim=dim)
    index = torch.arange(bands.bins, device=y.device)
    shape = [1] * spectrum.dim()
    shape[dim] = bands.bins
    index = index.view(shape)
    low = spectrum * (index < bands.low)
    mid = spectrum * ((index >= bands.low) & (index < bands.low + bands.mid))
    high = spectrum * (index >= bands.low + bands.mid)
    return low, mid, high


def assemble(*parts: torch.Tensor, window: int, dim: int = -2) -> torch.Tensor:
    """Inverse FFT of the sum of the given band spectra: the window they describe."""
    return torch.fft.irfft(sum(parts), n=window, dim=dim)


def denoise(y: torch.Tensor, bands: Bands, dim: int = -2) -> torch.Tensor:
    """``y`` with its high band dropped."""
    low, mid, _ = split(y, bands, dim)
    return assemble(low, mid, window=bands.window, dim=dim)
