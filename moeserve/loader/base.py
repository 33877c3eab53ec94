"""What a loader returns (the model with its weights, its tokenizer, its kernel plan and its
description), and how every loader builds a model: the kernel plan resolved and handed to its
layers before any weight is read."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import nn

from moeserve.config import ModelConfig
from moeserve.errors import LoadError
from moeserve.layers.kernel_plan import (
    Hardware,
    KernelPlan,
    PlanSettings,
    apply_kernel_plan,
    resolve_kernel_plan,
)
from moeserve.layers.quant.base import QuantConfig
from moeserve.parallel.groups import SINGLE, TPGroup
from moeserve.tokenizer.base import Tokenizer

KV_CACHE_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp16": torch.float16}


def resolve_kv_cache_dtype(
    name: str, checkpoint_algo: str | None, dtype: torch.dtype
) -> torch.dtype:
    """--kv-cache-dtype auto|bf16|fp8|fp16: auto follows the checkpoint (FP8 if it asks for it,
    else the model dtype)."""
    if name == "auto":
        return torch.float8_e4m3fn if checkpoint_algo == "FP8" else dtype
    try:
        return KV_CACHE_DTYPES[name]
    except KeyError:
        raise LoadError(f"unknown kv cache dtype {name!r}; use auto, bf16 or fp8") from None


@dataclass(frozen=True)
class Planning:
    """What the kernel plan is resolved for: the hardware (None: the load device's own) and
    the settings (the loader fills in the activation and cache dtypes)."""

    hardware: Hardware | None = None
    settings: PlanSettings = field(default_factory=PlanSettings)


DEFAULT_PLANNING = Planning()  # the load device's hardware, default settings

# what a model path is (moeserve.loader.source.source_kind): a llama.cpp GGUF file, or an HF
# checkpoint folder (config.json + safetensors)
SourceKind = Literal["gguf", "hf"]


@dataclass(frozen=True)
class LoadRequest:
    """One load, as `load_model` resolved it: the path and its kind, decided once, and every
    setting the kind's loader reads."""

    path: str
    kind: SourceKind
    dtype: torch.dtype
    device: str = "cpu"
    quantize: str = "auto"  # GGUF on the CPU: the weight-only method (auto, none, int8, int4)
    kv_cache_dtype: str = "auto"
    num_layers: int | None = None  # keep the first N layers (benchmarks on real shapes)
    load_format: str = "auto"  # auto | dummy (random weights of the real shapes) | the format
    tp: TPGroup = SINGLE  # this rank's tensor-parallel group
    seed: int = 0  # of the dummy weights
    planning: Planning = DEFAULT_PLANNING
    mtp: bool = False  # also build the checkpoint's first MTP layer as a draft model


def build_model(
    cls: type[nn.Module],
    cfg: ModelConfig,
    quant: QuantConfig | None,
    dtype: torch.dtype,
    device: str,
    kv_cache_dtype: torch.dtype,
    planning: Planning,
    tp: TPGroup = SINGLE,
) -> tuple[nn.Module, KernelPlan]:
    """The model of `cfg` on `device`, its layers handed the kernel plan (which they use when
    processing the weights loaded next)."""
    hardware = planning.hardware or Hardware.of(device)
    settings = replace(planning.settings, act_dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    plan = resolve_kernel_plan(cfg, quant, hardware, settings)
    with torch.device(device):
        model = cls(cfg, quant, tp, dtype)
    apply_kernel_plan(model, plan)
    return model, plan


@dataclass
class LoadedModel:
    model: nn.Module  # implements the model contract (see models/llama.py)
    tokenizer: Tokenizer
    config: ModelConfig
    kv_cache_dtype: torch.dtype  # what the runner allocates the paged cache in
    description: str  # one line for the start-up banner: format, quantization, dtype
    kernel_plan: KernelPlan  # what serves each part of the model (the banner prints it)
    quant: Any = None  # the checkpoint's QuantConfig (None: unquantized or GGUF)
    load_seconds: float = 0.0  # building the model and reading (or generating) its weights
    # an EAGLE-3 draft head loaded for this model (moeserve.models.eagle3), or None
    draft: Any = None
