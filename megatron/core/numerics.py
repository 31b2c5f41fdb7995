"""Numeric rules shared by packages that may not import each other: the FP8 package's
quantizers and the optimizer's amax outputs both measure max|x| by `amax_ignoring_nan`."""

from __future__ import annotations

import torch


def amax_ignoring_nan(x: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """max|x| in fp32 where NaN elements count as 0 (so a NaN never raises the amax)."""
    magnitude = x.to(torch.float32).abs()
    magnitude = torch.where(torch.isnan(magnitude), torch.zeros_like(magnitude), magnitude)
    if dim is None:
        return magnitude.amax()
    return magnitude.amax(dim=dim)
