"""DeepSeek block-FP8 weights (``weight_scale_inv`` per 128x128 block) as a weight scheme
(`moeserve.layers.quant.scheme`)."""

from __future__ import annotations

import logging

import torch

from moeserve.kernels.gemm import fp8_block_gemm as fp8_gemm_kernels
from moeserve.kernels.gemm import invariant as invariant_kernels
from moeserve.kernels.gemm.fp8_block_gemm import FP8_BLOCK, dequantize_fp8_block
from moeserve.kernels.gemm.splitk import SplitKWorkspace
from moeserve.layers.quant.base import LinearMethod, QuantConfig, UnquantizedLinearMethod
from moeserve.layers.quant.scheme import SchemeLinearMethod, TensorSpec, WeightScheme

log = logging.getLogger(__name__)


# ---- block FP8 ---------------------------------------------------------------------------
class Fp8BlockScheme(WeightScheme):
    """e4m3 weight [N, K] + fp32 `weight_scale_inv` [ceil(N/b), ceil(K/b)]."""

    name = "fp8-block"

    def __init__(self, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)) -> None:
        if block[0] != block[1]:
            raise ValueError(f"only square FP8 weight blocks are supported, got {block}")
        self.block = block[0]

    def specs(self, out_features: int, in_features: int, dtype: torch.dtype) -> list[TensorSpec]:
        b = self.block
        return [
            TensorSpec("weight", (out_features, in_features), torch.float8_e4m3fn),
            TensorSpec(
                "weight_scale_inv",
                (-(-out_features // b), -(-in_features // b)),
                torch.float32,
                out_block=b,
                in_block=b,
            ),
        ]

    def dequantize(self, t: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8_block(t["weight"], t["weight_scale_inv"], dtype, self.block)

    def elementwise_view(
        self, t: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        if self.block != FP8_BLOCK or t["weight"].dtype != torch.float8_e4m3fn:
            return None
        return t["weight"], t["weight_scale_inv"]

    def has_gpu_matmul(self, t: dict[str, torch.Tensor]) -> bool:
        return self.block == FP8_BLOCK  # the Triton kernel is written for 128x128 blocks

    def gpu_matmul(
        self,
        t: dict[str, torch.Tensor],
        x: torch.Tensor,
        workspace: SplitKWorkspace | None = None,
        invariant: bool = False,
    ) -> torch.Tensor | None:
        if not self.has_gpu_matmul(t):
            return None
        gemm = fp8_gemm_kernels.fp8_block_gemm
        if invariant:
            return gemm(
                x,
                t["weight"],
                t["weight_scale_inv"],
                config=invariant_kernels.FP8_GEMM,
                kernel="mma",
            )
        return gemm(x, t["weight"], t["weight_scale_inv"], workspace=workspace)


class Fp8BlockConfig(QuantConfig):
    """`quant_method: fp8` with `weight_block_size` (DeepSeek-V3/R1, Kimi-K2 FP8)."""

    name = "fp8-block"

    def __init__(self, block: tuple[int, int], ignored: tuple[str, ...] = ()) -> None:
        self.scheme = Fp8BlockScheme(block)
        self.ignored = ignored

    def _skip(self, prefix: str) -> bool:
        return any(prefix == p or prefix.endswith("." + p) or p in prefix for p in self.ignored)

    def linear_method(self, prefix: str) -> LinearMethod:
        if self._skip(prefix):
            return UnquantizedLinearMethod()
        return SchemeLinearMethod(self.scheme)

    def moe_method(self, prefix: str) -> WeightScheme | None:
        return None if self._skip(prefix) else self.scheme
