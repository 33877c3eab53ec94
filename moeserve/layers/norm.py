"""RMSNorm (optionally fused with the residual add)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.layers.quant.base import copy_loader, make_param


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = make_param(torch.ones(size, dtype=dtype), None, None)
        self.weight.weight_loader = copy_loader

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm(x), or with `residual`: (RMSNorm(x + residual), x + residual)."""
        if residual is not None:
            x = x + residual
            residual = x
        # one fused op (accumulates in fp32; exact against the fp32 formula in fp32)
        y = F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return y if residual is None else (y, residual)
