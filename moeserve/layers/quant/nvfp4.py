"""NVFP4 weights as ModelOpt and compressed-tensors (llm-compressor) store them.

ModelOpt, per quantized linear X [N, K]: `X.weight` uint8 [N, K/2] (two E2M1 codes per byte,
element 2i in the low nibble), `X.weight_scale` e4m3 [N, K/16], `X.weight_scale_2` fp32
scalar (global, multiplied on dequantization), `X.input_scale` fp32 scalar (W4A4 only).
compressed-tensors: `weight_packed`, `weight_scale`, `weight_global_scale` [1] (the
RECIPROCAL: dequantization divides by it) and `input_global_scale` (W4A4 only).

The CPU has no FP4 math: W4A4 checkpoints run weight-only here (activation scales are
loaded and kept for the GPU kernels, not applied).
"""

from __future__ import annotations

import fnmatch
import logging
import re

import torch
from torch import nn

from moeserve.kernels.gemm import nvfp4_gemm as nvfp4_gemm_kernels
from moeserve.kernels.gemm.nvfp4_format import NVFP4_BLOCK, dequantize_nvfp4
from moeserve.layers.quant.base import LinearMethod, QuantConfig, UnquantizedLinearMethod
from moeserve.layers.quant.scheme import (
    SchemeLinearMethod,
    TensorSpec,
    WeightScheme,
    splitk_fits,
)

log = logging.getLogger(__name__)

# two E2M1 codes per stored byte
_CODES_PER_BYTE = 2


def _check_k(in_features: int) -> None:
    if in_features % NVFP4_BLOCK:
        raise ValueError(
            f"NVFP4 needs input features divisible by {NVFP4_BLOCK}, got {in_features}"
        )


class ModelOptNvfp4Scheme(WeightScheme):
    name = "nvfp4"

    def __init__(self, activations: bool) -> None:
        self.activations = activations  # W4A4: the checkpoint carries input_scale

    def specs(self, out_features: int, in_features: int, dtype: torch.dtype) -> list[TensorSpec]:
        _check_k(in_features)
        specs = [
            TensorSpec(
                "weight",
                (out_features, in_features // _CODES_PER_BYTE),
                torch.uint8,
                in_block=_CODES_PER_BYTE,
            ),
            TensorSpec(
                "weight_scale",
                (out_features, in_features // NVFP4_BLOCK),
                torch.float8_e4m3fn,
                in_block=NVFP4_BLOCK,
            ),
            TensorSpec("weight_scale_2", (), torch.float32, None, None),
        ]
        if self.activations:
            specs.append(TensorSpec("input_scale", (), torch.float32, None, None, optional=True))
        return specs

    def dequantize(self, t: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return dequantize_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"], dtype)

    def nvfp4_view(self, t: dict[str, torch.Tensor]):
        return t["weight"], t["weight_scale"], t["weight_scale_2"]


class CompressedTensorsNvfp4Scheme(WeightScheme):
    name = "nvfp4-ct"

    def __init__(self, activations: bool) -> None:
        self.activations = activations

    def specs(self, out_features: int, in_features: int, dtype: torch.dtype) -> list[TensorSpec]:
        _check_k(in_features)
        specs = [
            TensorSpec(
                "weight_packed",
                (out_features, in_features // _CODES_PER_BYTE),
                torch.uint8,
                in_block=_CODES_PER_BYTE,
            ),
            TensorSpec(
                "weight_scale",
                (out_features, in_features // NVFP4_BLOCK),
                torch.float8_e4m3fn,
                in_block=NVFP4_BLOCK,
            ),
            TensorSpec("weight_global_scale", (1,), torch.float32, None, None),
        ]
        if self.activations:
            specs.append(
                TensorSpec("input_global_scale", (1,), torch.float32, None, None, optional=True)
            )
        return specs

    def dequantize(self, t: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        # published rule: divide by the (reciprocal) global scale
        w = dequantize_nvfp4(t["weight_packed"], t["weight_scale"], 1.0, torch.float32)
        return (w / t["weight_global_scale"].float().reshape(())).to(dtype)

    def nvfp4_view(self, t: dict[str, torch.Tensor]):
        g = t["weight_global_scale"].float()
        return t["weight_packed"], t["weight_scale"], (1.0 / g).reshape(g.shape[:-1])


class Nvfp4LinearMethod(SchemeLinearMethod):
    """SchemeLinearMethod whose GPU kernel choices are made once per layer, after loading:
    the decode mode, the MMA-GEMV probe and the tile configs of the layer's (N, K) go into a
    plan (plan_nvfp4_gemm), and the global scale into the fp32 [1] device tensor the kernels
    read, so that a call only picks its kernel by row count."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.nvfp4_kernel_args = None  # (packed, scale, global [1], plan) on a GPU
        tensors = self.tensors(layer)
        packed, scale, gs = self.scheme.nvfp4_view(tensors)
        dev = packed.device
        if dev.type != "cuda" or not layer.gpu_kernels:
            return
        with torch.cuda.device(dev):  # the probes launch on the current device
            plan = nvfp4_gemm_kernels.plan_nvfp4_gemm(packed)
        gs = torch.as_tensor(gs, dtype=torch.float32, device=dev).reshape(1)
        layer.nvfp4_kernel_args = (packed, scale, gs, plan)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        args = getattr(layer, "nvfp4_kernel_args", None)
        if args is None or not x.is_cuda:
            return super().apply(layer, x)
        nv = nvfp4_gemm_kernels  # looked up per call: tests count calls
        packed, scale, gs, plan = args
        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
        ws = getattr(layer, "splitk_workspace", None)
        if ws is not None and not splitk_fits(ws, x2.shape[0], layer.local_output):
            ws = None  # a bigger (eager) batch: the kernel allocates its own
        y = nv.nvfp4_gemm(x2, packed, scale, gs, workspace=ws, plan=plan, pdl=layer.pdl)
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


# ---- exclusion rules ----------------------------------------------------------------------
def modelopt_excluded(name: str, patterns: tuple[str, ...]) -> bool:
    """ModelOpt `exclude_modules` matching: exact, then substring, then shell wildcard
    (`foo*` covers `foo` and everything under `foo.`)."""
    for p in patterns:
        if name == p or ("*" not in p and "?" not in p and p in name):
            return True
        if fnmatch.fnmatchcase(name, p):
            return True
    return False


def ct_ignored(name: str, patterns: tuple[str, ...]) -> bool:
    """compressed-tensors `ignore`: `re:REGEX` (re.match on the module name) or a module name
    (exact, or as the last dotted components, e.g. `lm_head`)."""
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif name == p or name.endswith("." + p):
            return True
    return False


class _Nvfp4Config(QuantConfig):
    """Shared logic: the names a layer may carry in an exclude list, and one log line."""

    def __init__(self, scheme: WeightScheme, patterns: tuple[str, ...], aliases: tuple[str, ...]):
        self.scheme = scheme
        self.patterns = patterns
        # alternative checkpoint prefixes of the text model (Kimi-K2.5: "language_model.",
        # with or without ".model."): a pattern may be written against any of them
        self.aliases = aliases

    def _names(self, prefix: str) -> list[str]:
        names = [prefix]
        for a in self.aliases:
            names.append(a + prefix)
            if prefix.startswith("model."):
                names.append(a + prefix[len("model.") :])
        return names

    def _match(self, name: str) -> bool:
        raise NotImplementedError

    def excluded(self, prefix: str) -> bool:
        return any(self._match(n) for n in self._names(prefix))

    def linear_method(self, prefix: str) -> LinearMethod:
        if self.excluded(prefix):
            return UnquantizedLinearMethod()
        return Nvfp4LinearMethod(self.scheme)

    def moe_method(self, prefix: str) -> WeightScheme | None:
        # experts are excluded as a group ("...mlp.experts*") or by their first projection
        if self.excluded(prefix) or self.excluded(f"{prefix}.0.gate_proj"):
            return None
        return self.scheme


class ModelOptNvfp4Config(_Nvfp4Config):
    name = "nvfp4-modelopt"

    def __init__(
        self, quant_algo: str, exclude: tuple[str, ...], aliases: tuple[str, ...] = ()
    ) -> None:
        w4a4 = quant_algo.upper() == "NVFP4"
        super().__init__(ModelOptNvfp4Scheme(activations=w4a4), exclude, aliases)
        self.quant_algo = quant_algo
        if w4a4:
            log.info("NVFP4 W4A4 checkpoint: running weight-only (no FP4 activation math here)")

    def _match(self, name: str) -> bool:
        return modelopt_excluded(name, self.patterns)


class CompressedTensorsNvfp4Config(_Nvfp4Config):
    name = "nvfp4-ct"

    def __init__(
        self, activations: bool, ignore: tuple[str, ...], aliases: tuple[str, ...] = ()
    ) -> None:
        super().__init__(CompressedTensorsNvfp4Scheme(activations), ignore, aliases)
        if activations:
            log.info("NVFP4 W4A4 checkpoint: running weight-only (no FP4 activation math here)")

    def _match(self, name: str) -> bool:
        return ct_ignored(name, self.patterns)
