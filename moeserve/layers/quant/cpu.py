"""Weight-only quantization applied at load for the CPU path (`--quantization`).

Checkpoint weights arrive as floats (GGUF tensors are dequantized by `gguf`); these methods
repack them after loading into the formats of torch's CPU weight-only matmul ops.
"""

from __future__ import annotations

import torch
from torch import nn

from moeserve.config import ConfigError
from moeserve.layers.quant.base import LinearMethod, NoQuant, QuantConfig, UnquantizedLinearMethod


class Int8WeightOnlyMethod(UnquantizedLinearMethod):
    """Per-output-channel symmetric int8 weights, activations in the model dtype."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.data.float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        dtype = layer.weight.dtype
        del layer.weight  # a tied embedding keeps its own reference for lookups
        layer.register_buffer("qweight", q)
        layer.register_buffer("scales", scale.to(dtype))

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(
            x.reshape(-1, shape[-1]), layer.qweight, layer.scales
        )
        return y.reshape(*shape[:-1], -1)


class CpuInt8Config(QuantConfig):
    name = "int8-weight-only"

    def linear_method(self, prefix: str) -> LinearMethod:
        return Int8WeightOnlyMethod()

    def lm_head_method(self) -> LinearMethod | None:
        return Int8WeightOnlyMethod()


def cpu_quant_config(name: str) -> QuantConfig:
    if name in ("none", "", None):
        return NoQuant()
    if name == "int8":
        return CpuInt8Config()
    raise ConfigError(f"unknown CPU quantization {name!r}; use none or int8")
