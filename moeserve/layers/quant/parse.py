"""A checkpoint's own description (hf_quant_config.json, config.json `quantization_config`)
-> the `QuantConfig` that builds its layers, and the KV-cache format it asks for."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from moeserve.layers.quant.base import NoQuant, QuantConfig
from moeserve.layers.quant.fp8_block import Fp8BlockConfig
from moeserve.layers.quant.nvfp4 import CompressedTensorsNvfp4Config, ModelOptNvfp4Config

MODELOPT_FILE = "hf_quant_config.json"
NVFP4_GROUP = 16
FP4_BITS = 4


class QuantConfigError(ValueError):
    """A quantization scheme this server does not load (one clear sentence)."""


@dataclass(frozen=True)
class CheckpointQuant:
    """What a checkpoint says about its weights and its KV cache."""

    method: str  # none | modelopt | fp8 | compressed-tensors
    description: dict[str, Any]
    kv_cache_quant_algo: str | None  # "FP8" or None


def _text_aliases(config: dict[str, Any]) -> tuple[str, ...]:
    return ("language_model.",) if "text_config" in config else ()


def read_checkpoint_quant(folder: str, config: dict[str, Any]) -> CheckpointQuant:
    path = os.path.join(folder, MODELOPT_FILE)
    if os.path.exists(path):
        with open(path) as f:
            q = json.load(f).get("quantization", {})
        return CheckpointQuant("modelopt", q, q.get("kv_cache_quant_algo"))
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get(
        "quantization_config"
    )
    if not qc:
        return CheckpointQuant("none", {}, None)
    method = qc.get("quant_method", "")
    kv = None
    if method == "modelopt":
        kv = qc.get("kv_cache_quant_algo")
        scheme = qc.get("kv_cache_scheme")
        if kv is None and isinstance(scheme, dict) and scheme.get("type") == "float":
            kv = "FP8"
    elif method == "compressed-tensors":
        scheme = qc.get("kv_cache_scheme")
        if (
            isinstance(scheme, dict)
            and scheme.get("type") == "float"
            and scheme.get("num_bits") == 8
        ):
            kv = "FP8"
    return CheckpointQuant(method, qc, kv.upper() if isinstance(kv, str) else None)


def quant_config_from_checkpoint(folder: str, config: dict[str, Any]) -> QuantConfig:
    """The QuantConfig for a checkpoint folder and its parsed config.json."""
    cq = read_checkpoint_quant(folder, config)
    aliases = _text_aliases(config)
    d = cq.description
    if cq.method == "none":
        return NoQuant()
    if cq.method == "modelopt":
        algo = str(d.get("quant_algo", "")).upper()
        if algo not in ("NVFP4", "W4A16_NVFP4"):
            raise QuantConfigError(
                f"ModelOpt quant_algo {algo!r} is not supported (NVFP4, W4A16_NVFP4)"
            )
        if int(d.get("group_size", NVFP4_GROUP)) != NVFP4_GROUP:
            raise QuantConfigError("ModelOpt NVFP4 needs group_size 16")
        exclude = d.get("exclude_modules") or d.get("ignore") or []
        return ModelOptNvfp4Config(algo, tuple(exclude), aliases)
    if cq.method == "fp8":
        block = d.get("weight_block_size")
        if not block:
            raise QuantConfigError(
                "FP8 checkpoints without weight_block_size (per-tensor FP8) are not supported"
            )
        ignored = tuple(d.get("modules_to_not_convert") or d.get("ignored_layers") or [])
        return Fp8BlockConfig((int(block[0]), int(block[1])), ignored)
    if cq.method == "compressed-tensors":
        return _compressed_tensors(d, aliases)
    raise QuantConfigError(f"quantization method {cq.method!r} is not supported")


def _compressed_tensors(d: dict[str, Any], aliases: tuple[str, ...]) -> QuantConfig:
    fmt = d.get("format", "")
    groups = d.get("config_groups") or {}
    if fmt != "nvfp4-pack-quantized" or not groups:
        raise QuantConfigError(
            f"compressed-tensors format {fmt!r} is not supported (nvfp4-pack-quantized only)"
        )
    activations = False
    for g in groups.values():
        w = g.get("weights") or {}
        if (
            w.get("num_bits") != FP4_BITS
            or w.get("type") != "float"
            or int(w.get("group_size") or 0) != NVFP4_GROUP
        ):
            raise QuantConfigError("compressed-tensors group is not NVFP4 (4-bit float, group 16)")
        activations = activations or bool(g.get("input_activations"))
    return CompressedTensorsNvfp4Config(activations, tuple(d.get("ignore") or []), aliases)
