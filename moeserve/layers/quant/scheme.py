"""The weight-scheme contract that every quantized checkpoint format implements.

A *weight scheme* describes the tensors one logical weight [out, in] is stored as
(`specs`) and how to turn them back into a dense matrix (`dequantize`). The same scheme
serves a linear layer (`SchemeLinearMethod`) and a bank of stacked experts
(`moeserve.layers.moe`), so a format is written once. The CPU path dequantizes one layer
(or one expert) at a time at run time: the model never holds a dense copy of itself. On GPUs
an NVFP4 scheme's tensors go to the Triton kernels as they are stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.kernels import cpu as cpu_kernels
from moeserve.kernels.gemm import invariant as invariant_kernels
from moeserve.kernels.gemm import nvfp4_gemm as nvfp4_gemm_kernels
from moeserve.kernels.gemm.splitk import SplitKWorkspace
from moeserve.layers.quant.base import LinearMethod, UnquantizedLinearMethod, make_param


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor of a weight: checkpoint suffix, local shape, dtype, TP axes.

    `out_dim` / `in_dim` name the axes that follow the weight's output / input features
    (None: the tensor is not split), `out_block` / `in_block` how many features one stored
    row / column covers (packed FP4: in_block 2; FP4 scales: 16; FP8 block scales: 128).
    """

    suffix: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    out_dim: int | None = 0
    in_dim: int | None = 1
    out_block: int = 1
    in_block: int = 1
    optional: bool = False  # may be absent from a checkpoint (e.g. input scales)


class WeightScheme:
    """How one logical weight [out, in] is stored and dequantized."""

    name = "bf16"

    def specs(self, out_features: int, in_features: int, dtype: torch.dtype) -> list[TensorSpec]:
        return [TensorSpec("weight", (out_features, in_features), dtype)]

    def dequantize(self, t: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return t["weight"].to(dtype)

    def nvfp4_view(
        self, t: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(packed codes, e4m3 block scales, multiplied global scale) in ModelOpt's
        convention, for the GPU NVFP4 kernels; None if this is not an NVFP4 scheme."""
        return None

    def elementwise_view(
        self, t: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(weight, 128x128 block scales or None) for the kernels that decode each element on
        its own (moe_fp8.py): 16-bit weights here, block FP8 in its scheme; else None."""
        w = t.get("weight")
        return (w, None) if w is not None and w.dtype in (torch.bfloat16, torch.float16) else None

    def has_gpu_matmul(self, t: dict[str, torch.Tensor]) -> bool:
        """Whether `gpu_matmul` has a kernel for these tensors (else it returns None)."""
        return self.nvfp4_view(t) is not None

    def gpu_matmul(
        self,
        t: dict[str, torch.Tensor],
        x: torch.Tensor,
        workspace: SplitKWorkspace | None = None,
        invariant: bool = False,
    ) -> torch.Tensor | None:
        """x [M, K] bf16 @ W^T by a GPU kernel reading the stored format, or None (no kernel:
        the caller dequantizes). `workspace`: a static split-K `SplitKWorkspace` that fits;
        `invariant`: the batch-invariant schedule (kernels/gemm/invariant.py)."""
        view = self.nvfp4_view(t)
        if view is None:
            return None
        nv = nvfp4_gemm_kernels  # W4A16, dequantized in registers
        if invariant:
            return nv.nvfp4_gemm(x, *view, config=invariant_kernels.NVFP4_GEMM, kernel="mma")
        return nv.nvfp4_gemm(x, *view, workspace=workspace)


class SchemeLinearMethod(LinearMethod):
    """A `LinearMethod` built from a `WeightScheme` (CPU path: dequantize, then matmul)."""

    def __init__(self, scheme: WeightScheme) -> None:
        self.scheme = scheme

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> None:
        layer.scheme_suffixes = []
        for s in self.scheme.specs(output_size, input_size, dtype):
            p = make_param(
                torch.zeros(s.shape, dtype=s.dtype), s.out_dim, s.in_dim, s.out_block, s.in_block
            )
            p.optional = s.optional
            setattr(layer, s.suffix, p)
            layer.scheme_suffixes.append(s.suffix)

    @staticmethod
    def tensors(layer: nn.Module) -> dict[str, torch.Tensor]:
        """The layer's stored tensors by checkpoint suffix (what the scheme's methods take)."""
        return {s: getattr(layer, s) for s in layer.scheme_suffixes}

    def dense_weight(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        return self.scheme.dequantize(self.tensors(layer), dtype)

    def prepare_cuda_graph(self, layer: nn.Module, max_tokens: int, shared: dict) -> None:
        """Bind the split-K workspace shared by all GPU GEMMs (they run one after another on
        one stream and leave it zeroed), so a captured GEMM allocates nothing per call."""
        tensors = self.tensors(layer)
        dev = tensors[layer.scheme_suffixes[0]].device
        if dev.type != "cuda" or not layer.gpu_kernels:
            return
        if self.scheme.has_gpu_matmul(tensors):
            layer.splitk_workspace = shared_splitk_workspace(
                shared, max_tokens, layer.local_output, dev
            )

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # native CPU kernels: each call dequantizes (the model holds no dense copy of itself)
        # and packs for them
        if layer.native_cpu and x.dtype == torch.bfloat16 and layer.local_input % 2 == 0:
            packed = cpu_kernels.pack_bf16(self.dense_weight(layer, torch.bfloat16))
            return cpu_kernels.linear(x, packed)
        invariant = layer.batch_invariant
        if x.is_cuda and layer.gpu_kernels:
            x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
            tensors = self.tensors(layer)
            ws = getattr(layer, "splitk_workspace", None)
            if ws is not None and not splitk_fits(ws, x2.shape[0], layer.local_output):
                ws = None  # a bigger (eager) batch: the kernel allocates its own
            y = self.scheme.gpu_matmul(tensors, x2, ws, invariant)
            if y is not None:  # the stored format straight into a Triton kernel
                return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])
            if invariant:
                y = invariant_kernels.gemm16(x2, self.dense_weight(layer, torch.bfloat16))
                return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])
        return F.linear(x, self.dense_weight(layer, x.dtype))


def _splitk_need(m: int, n: int) -> tuple[int, int]:
    """(fp32 partials, tile counters) a split-K GEMM or GEMV of [m, n] may use, bounded
    generously: rows rounded up to 16 (GEMV programs own up to 8 rows), tiles at least 16
    columns wide, and at least one row per tile."""
    rows = -(-m // 16) * 16
    return rows * n, rows * -(-n // 16)


def splitk_fits(ws: SplitKWorkspace, m: int, n: int) -> bool:
    elems, tiles = _splitk_need(m, n)
    return ws.partial.numel() >= elems and ws.locks.numel() >= tiles


def shared_splitk_workspace(shared: dict, m: int, n: int, device: torch.device) -> SplitKWorkspace:
    """The split-K workspace in `shared`, replaced by a larger one when [m, n] does not fit
    (layers bound earlier keep the smaller one, which fits them)."""
    ws = shared.get("splitk_workspace")
    if ws is None or not splitk_fits(ws, m, n):
        elems, tiles = _splitk_need(m, n)
        if ws is not None:
            elems, tiles = max(elems, ws.partial.numel()), max(tiles, ws.locks.numel())
        ws = shared["splitk_workspace"] = SplitKWorkspace.create(elems, tiles, device)
    return ws


def dense_weight(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A linear layer's weight as a dense [out, in] matrix, whatever its stored format."""
    method = layer.method
    if isinstance(method, SchemeLinearMethod):
        return method.dense_weight(layer, dtype)
    if isinstance(method, UnquantizedLinearMethod):
        return layer.weight.to(dtype)
    raise TypeError(f"{type(method).__name__} cannot give a dense weight")
