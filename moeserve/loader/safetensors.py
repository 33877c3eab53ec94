"""HF checkpoint folder (config.json + safetensors, single or sharded) -> `LoadedModel`.

Formats: BF16/FP16/FP32, DeepSeek block-FP8, ModelOpt NVFP4 (W4A4 / W4A16) and
compressed-tensors NVFP4; the checkpoint's own description picks the quant config
(`layers/quant/parse.py`). Weights stay in their stored format; tensors stream from the
memory-mapped files one at a time. `load_format="dummy"` builds the same model in its
serving format from config.json alone, with random weights.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

from moeserve.config import ConfigError, ModelConfig
from moeserve.dist.parallel import SINGLE, TPGroup
from moeserve.layers.quant.base import QuantConfig
from moeserve.layers.quant.parse import (
    QuantConfigError,
    quant_config_from_checkpoint,
    read_checkpoint_quant,
)
from moeserve.loader.base import LoadedModel, LoadError
from moeserve.models.registry import model_class
from moeserve.models.weights import finish_loading

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
KV_CACHE_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp16": torch.float16}
# dummy weights: std of random floats, and the amplitude they dequantize to
_DUMMY_STD = 0.02


def checkpoint_files(folder: str) -> list[str]:
    """The safetensors files of a checkpoint, from the index when there is one."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not files:
        raise LoadError(f"{folder} holds no .safetensors files")
    missing = [n for n in files if not os.path.exists(os.path.join(folder, n))]
    if missing:
        raise LoadError(f"{folder} lacks {missing[0]} (listed in {INDEX_FILE})")
    return [os.path.join(folder, n) for n in files]


def iterate_tensors(files: list[str], progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file, one at a time (memory-mapped)."""
    counts = []
    for path in files:
        with safe_open(path, framework="pt") as f:
            counts.append(len(list(f.keys())))
    bar = tqdm(total=sum(counts), desc="Loading weights", unit="tensor", disable=not progress)
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
                bar.update(1)
    bar.close()


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


def _dummy_fill(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights that dequantize to ~N(0, 0.02) whatever the stored format."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if p.dtype == torch.uint8:
                p.copy_(torch.randint(0, 256, p.shape, generator=gen, dtype=torch.uint8))
            elif p.dtype == torch.float8_e4m3fn:
                if leaf == "weight":  # block-FP8 codes, scaled by weight_scale_inv below
                    p.copy_(torch.randn(p.shape, generator=gen).clamp(-4, 4).to(p.dtype))
                else:  # FP4 block scales
                    p.copy_(torch.ones(p.shape).to(p.dtype))
            elif leaf in ("weight_scale_2", "input_scale"):
                p.fill_(_DUMMY_STD / 2)
            elif leaf in ("weight_global_scale", "input_global_scale"):
                p.fill_(2 / _DUMMY_STD)
            elif leaf == "weight_scale_inv":
                p.fill_(_DUMMY_STD)
            elif leaf == "kv_scale":
                p.fill_(1.0)
            elif "norm" in name:
                p.fill_(1.0)
            elif leaf == "e_score_correction_bias":
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * _DUMMY_STD)


def _read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise LoadError(f"{path} has no config.json")
    with open(cfg_path) as f:
        return json.load(f)


def _describe(cfg: ModelConfig, quant: QuantConfig, dtype: torch.dtype, kv: torch.dtype) -> str:
    kind = "MoE" if cfg.n_routed_experts else "dense"
    return (
        f"{cfg.architecture} ({kind}, {cfg.num_hidden_layers} layers), weights {quant.name}, "
        f"compute {str(dtype).replace('torch.', '')}, kv cache {str(kv).replace('torch.', '')}"
    )


def load_safetensors_model(
    path: str,
    dtype: torch.dtype,
    device: str = "cpu",
    tp: TPGroup = SINGLE,
    kv_cache_dtype: str = "auto",
    num_layers: int | None = None,
    load_format: str = "auto",
) -> LoadedModel:
    """Build the model of an HF checkpoint folder and load its weights in their stored format."""
    from moeserve.tokenizer.hf import load_hf_tokenizer

    raw = _read_config(path)
    try:
        cfg = ModelConfig.from_hf(raw)
        quant = quant_config_from_checkpoint(path, raw)
    except (ConfigError, QuantConfigError) as e:
        raise LoadError(str(e)) from None
    if num_layers is not None:
        cfg = cfg.with_layers(num_layers)
    kv_dtype = resolve_kv_cache_dtype(
        kv_cache_dtype, read_checkpoint_quant(path, raw).kv_cache_quant_algo, dtype
    )
    model = model_class(cfg.architecture)(cfg, quant, tp, dtype)
    if load_format == "dummy":
        _dummy_fill(model)
        finish_loading(model)
    elif load_format in ("auto", "safetensors"):
        loaded = model.load_weights(iterate_tensors(checkpoint_files(path)))
        missing = [
            n
            for n, p in model.named_parameters()
            if n not in loaded and not getattr(p, "optional", False)
        ]
        if missing:
            raise LoadError(f"checkpoint {path} lacks {len(missing)} weights, e.g. {missing[0]!r}")
    else:
        raise LoadError(f"unknown load format {load_format!r}; use auto or dummy")
    model = model.to(device).eval()
    tokenizer = load_hf_tokenizer(path)
    return LoadedModel(model, tokenizer, cfg, kv_dtype, _describe(cfg, quant, dtype, kv_dtype))
