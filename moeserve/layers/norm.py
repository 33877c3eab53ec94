"""RMSNorm (optionally fused with the residual add).

On a GPU with the Triton kernels the norm (and the residual add with it) is one launch
(`moeserve.kernels.elementwise.norm`); elsewhere torch's `F.rms_norm`. Both normalise in
fp32 and agree to one rounding of the activation dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.kernels.elementwise import norm as norm_kernels
from moeserve.layers.quant.base import copy_loader, make_param

if TYPE_CHECKING:
    from moeserve.layers.kernel_plan import KernelPlan


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = make_param(torch.ones(size, dtype=dtype), None, None)
        self.weight.weight_loader = copy_loader
        self.kernels = False  # the Triton norm kernels serve (the kernel plan)
        self.pdl = False  # ... launched with programmatic dependent launch

    def use_kernel_plan(self, plan: KernelPlan) -> None:
        self.kernels = plan.triton
        self.pdl = plan.pdl

    def _kernel_ok(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        if not (self.kernels and x.is_cuda and x.dim() == 2):
            return False
        if x.stride(-1) != 1 or x.dtype != self.weight.dtype:
            return False
        return residual is None or (
            residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm(x), or with `residual`: (RMSNorm(x + residual), x + residual)."""
        if self._kernel_ok(x, residual):
            if residual is None:
                return norm_kernels.rms_norm(x, self.weight, self.eps, pdl=self.pdl)
            return norm_kernels.add_rmsnorm(x, residual, self.weight, self.eps, pdl=self.pdl)
        if residual is not None:
            x = x + residual
            residual = x
        # one fused op (accumulates in fp32; exact against the fp32 formula in fp32)
        y = F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return y if residual is None else (y, residual)
