"""Weight-only quantization applied at load for the CPU path (`--quantization`).

Checkpoint weights arrive as floats (GGUF tensors are dequantized by `gguf`) into an fp32
staging parameter; after loading, these methods repack them, for the native CPU kernels
(`moeserve.kernels.cpu`: one arithmetic order per output element, whatever the row count)
where those serve, else for torch's CPU weight-only matmul ops:
- int4: groups of 32 along K, asymmetric (scale and zero per group). This is exactly GGUF's
  Q4_1 (w = d*q + m; llama.cpp puts each group's min and max on codes 0 and 15), so a Q4_1
  file is served with its own 4-bit weights.
- int8: per output channel, symmetric.

On torch's kernels with bf16 activations each layer also keeps a bf16 copy of its
(dequantized) weights for prefill: from PREFILL_ROWS rows on a bf16 GEMM beats torch's
weight-only kernels, at 2 bytes per weight of memory. Batch-invariant (deterministic) layers
always take the weight-only kernel there. The native kernels need neither: one kernel serves
every row count at once.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from moeserve.config import ConfigError
from moeserve.kernels import cpu as cpu_kernels
from moeserve.layers.quant.base import LinearMethod, NoQuant, QuantConfig, make_param

log = logging.getLogger(__name__)

INT4_GROUP = 32
INT4_MAX = 15
INT4_MID = 8  # torch's int4 kernels dequantize (q - 8) * scale + zero
INT8_MAX = 127.0
PREFILL_ROWS = 64  # rows from which the bf16 copy's GEMM is used (see above)
# the bf16 GEMM runs on row counts rounded up to a multiple of this: oneDNN keeps JIT code
# for every row count it meets, and a server meets most of them (its RSS grew ~150 MB per
# 200 requests of varied lengths; flat with whole blocks)
DENSE_ROW_BLOCK = 64


def _dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T with the rows padded to whole DENSE_ROW_BLOCKs (zeros, sliced off)."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if n % DENSE_ROW_BLOCK:
        rows = torch.nn.functional.pad(rows, (0, 0, 0, -n % DENSE_ROW_BLOCK))
    return torch.nn.functional.linear(rows, weight)[:n].reshape(*x.shape[:-1], weight.shape[0])


class _StagedMethod(LinearMethod):
    """Loads into an fp32 weight (no rounding before repacking), applies in `act_dtype`; where
    the kernel plan hands the layer to the native CPU kernels (`layer.native_cpu`), repacks for
    them (`layer.native_weight`) instead of torch's."""

    def __init__(self, prefill_copy: bool = True) -> None:
        self.prefill_copy = prefill_copy

    @staticmethod
    def _use_native(layer: nn.Module) -> bool:
        return getattr(layer, "native_cpu", False) and layer.act_dtype == torch.bfloat16

    def apply(
        self, layer: nn.Module, x: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """x @ W^T in the activation dtype, or `out_dtype` (the LM head's fp32 logits)."""
        packed = getattr(layer, "native_weight", None)
        if packed is not None:
            return cpu_kernels.linear(x, packed, out_dtype or torch.bfloat16)
        y = self._apply_torch(layer, x)
        return y if out_dtype is None else y.to(out_dtype)

    def _apply_torch(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _keep_copy(self, layer: nn.Module, dequantized: torch.Tensor) -> None:
        if self.prefill_copy and layer.act_dtype == torch.bfloat16:
            layer.register_buffer("dense", dequantized.to(torch.bfloat16).contiguous())

    @staticmethod
    def _dense_rows(layer: nn.Module, x: torch.Tensor) -> bool:
        return (
            hasattr(layer, "dense")
            and not getattr(layer, "batch_invariant", False)
            and x.numel() >= PREFILL_ROWS * x.shape[-1]
        )

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> None:
        layer.weight = make_param(torch.empty(output_size, input_size, dtype=torch.float32))
        layer.act_dtype = dtype


class Int8WeightOnlyMethod(_StagedMethod):
    """Per-output-channel symmetric int8 weights."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.data.float()
        scale = (w.abs().amax(dim=1) / INT8_MAX).clamp(min=1e-12)
        q = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        dtype = getattr(layer, "act_dtype", layer.weight.dtype)
        del layer.weight  # a tied embedding keeps its own reference for lookups
        layer.act_dtype = dtype
        if self._use_native(layer):
            layer.native_weight = cpu_kernels.pack_i8(q, scale)
            return
        layer.register_buffer("qweight", q)
        layer.register_buffer("scales", scale.to(dtype))
        self._keep_copy(layer, q.float() * scale.to(dtype).float()[:, None])

    def _apply_torch(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self._dense_rows(layer, x):
            return _dense_linear(x, layer.dense)
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(
            x.reshape(-1, shape[-1]), layer.qweight, layer.scales
        )
        return y.reshape(*shape[:-1], -1)


class Int4WeightOnlyMethod(_StagedMethod):
    """Asymmetric int4 in groups of 32 along K (GGUF Q4_1's own format)."""

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> None:
        if input_size % INT4_GROUP:
            raise ConfigError(
                f"int4 needs input sizes divisible by {INT4_GROUP} (got {input_size}); "
                "use --quantization int8"
            )
        super().create_weights(layer, input_size, output_size, dtype)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.data.float()
        n, k = w.shape
        g = w.view(n, k // INT4_GROUP, INT4_GROUP)
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        scale = ((hi - lo) / INT4_MAX).clamp(min=1e-12)
        q = torch.round((g - lo) / scale).clamp(0, INT4_MAX).to(torch.int32).view(n, k)
        del layer.weight
        if self._use_native(layer):
            if cpu_kernels.fp16_exact(scale, lo):  # GGUF Q4_1's own fp16 scale and minimum
                layer.native_weight = cpu_kernels.pack_q4h(q, scale.squeeze(-1), lo.squeeze(-1))
                return
            # w = scale * q + lo = d * (128 + q) + c
            c = lo - cpu_kernels.Q4_BIAS * scale
            layer.native_weight = cpu_kernels.pack_q4(q, scale.squeeze(-1), c.squeeze(-1))
            return
        zero = lo + INT4_MID * scale
        sz = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1).transpose(0, 1)
        layer.register_buffer(
            "qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INT4_MID)
        )
        layer.register_buffer("scales_zeros", sz.contiguous().to(layer.act_dtype))
        # what the kernel computes: (q - 8) * scale + zero, with bf16 scale and zero
        s16, z16 = (t.to(layer.act_dtype).float() for t in (scale, zero))
        deq = (q.view(n, k // INT4_GROUP, INT4_GROUP).float() - INT4_MID) * s16 + z16
        self._keep_copy(layer, deq.view(n, k))

    def _apply_torch(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self._dense_rows(layer, x):
            return _dense_linear(x, layer.dense)
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]), layer.qweight, INT4_GROUP, layer.scales_zeros
        )
        return y.reshape(*shape[:-1], -1)


class CpuWeightOnlyConfig(QuantConfig):
    """Linear layers in `bits` (4 or 8); the LM head in int8 (tied embeddings are Q8 in GGUF
    files, and int4 would lose more there)."""

    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.name = f"int{bits}-weight-only"

    def linear_method(self, prefix: str) -> LinearMethod:
        return Int4WeightOnlyMethod() if self.bits == 4 else Int8WeightOnlyMethod()

    def lm_head_method(self) -> LinearMethod | None:
        # the LM head sees a step's logit rows only (few): no prefill copy
        return Int8WeightOnlyMethod(prefill_copy=False)


def cpu_quant_config(name: str) -> QuantConfig:
    if name in ("none", "", None):
        return NoQuant()
    if name in ("int4", "int8"):
        return CpuWeightOnlyConfig(int(name[3:]))
    raise ConfigError(f"unknown CPU quantization {name!r}; use auto, none, int4 or int8")
