"""What a model path holds, read once from its description files, no weights: an HF folder's
config.json with its quantization description, or a GGUF file's metadata. The engine (the
hidden size and context it needs before any rank loads), `moeserve plan`, `moeserve check`
and the loaders all start from `describe_source`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from moeserve.config import DEFAULT_MAX_POSITIONS, ConfigError, ModelConfig
from moeserve.errors import LoadError
from moeserve.layers.quant.base import QuantConfig
from moeserve.loader.base import SourceKind
from moeserve.models.registry import config_from_hf


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str  # llama.cpp's quant type name (Q4_K, F16, ...)
    n_bytes: int


@dataclass(frozen=True)
class ModelSource:
    path: str
    kind: SourceKind
    raw: dict[str, Any]  # config.json, or the GGUF file's scalar metadata (key -> value)
    config: ModelConfig | None = None  # HF: parsed; GGUF: built by its loader (needs the vocab)
    quant: QuantConfig | None = None  # HF: the checkpoint's; GGUF: chosen at load
    quant_source: str = ""  # where the quantization description came from
    kv_cache_quant_algo: str | None = None  # what the checkpoint asks of the KV cache
    gguf_tensors: tuple[GGUFTensor, ...] = ()  # GGUF: the file's tensor directory

    @property
    def hidden_size(self) -> int:
        if self.config is not None:
            return self.config.hidden_size
        return int(self.raw[f"{self.gguf_arch}.embedding_length"])

    @property
    def max_positions(self) -> int:
        if self.config is not None:
            return self.config.max_position_embeddings
        ctx = self.raw.get(f"{self.gguf_arch}.context_length")
        return int(ctx) if ctx is not None else DEFAULT_MAX_POSITIONS

    @property
    def gguf_arch(self) -> str:
        return str(self.raw.get("general.architecture"))


def read_config_json(path: str) -> dict[str, Any]:
    """A checkpoint folder's config.json as a dict (one sentence on any problem)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise LoadError(f"{path} has no config.json")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError(f"{cfg_path} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise LoadError(f"{cfg_path} does not hold a JSON object")
    return raw


GGUF_SUFFIX = ".gguf"


def source_kind(path: str) -> SourceKind:
    """What a resolved model path is, decided here and nowhere else: a .gguf file, or a
    checkpoint folder with config.json."""
    if path.endswith(GGUF_SUFFIX):
        return "gguf"
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf"
    raise LoadError(f"{path} is neither a .gguf file nor a folder with config.json")


def describe_source(path: str, kind: SourceKind | None = None) -> ModelSource:
    """The description of a resolved model path (a .gguf file or a checkpoint folder)."""
    return _DESCRIBE[kind or source_kind(path)](path)


def _describe_folder(path: str) -> ModelSource:
    from moeserve.layers.quant.parse import (
        MODELOPT_FILE,
        QuantConfigError,
        quant_config_from_checkpoint,
        read_checkpoint_quant,
    )

    raw = read_config_json(path)
    try:
        cfg = config_from_hf(raw)
        quant = quant_config_from_checkpoint(path, raw)
        ckq = read_checkpoint_quant(path, raw)
    except QuantConfigError as e:
        raise ConfigError(str(e)) from None
    except (KeyError, TypeError) as e:
        raise ConfigError(f"config.json lacks or mistypes a field the model needs: {e}") from None
    if ckq.method == "none":
        source = "none (unquantized)"
    elif os.path.exists(os.path.join(path, MODELOPT_FILE)):
        source = MODELOPT_FILE
    else:
        source = "config.json quantization_config"
    return ModelSource(path, "hf", raw, cfg, quant, source, ckq.kv_cache_quant_algo)


def _describe_gguf(path: str) -> ModelSource:
    """The file's scalar metadata and tensor directory; the tokenizer's arrays (the bulk of
    the metadata) are left to the loader, which needs them."""
    from gguf import GGUFReader, GGUFValueType

    try:
        reader = GGUFReader(path)
        meta = {
            key: f.contents()
            for key, f in reader.fields.items()
            if not key.startswith("GGUF.") and f.types and f.types[0] != GGUFValueType.ARRAY
        }
        tensors = tuple(
            GGUFTensor(t.name, t.tensor_type.name, int(t.n_bytes)) for t in reader.tensors
        )
    except Exception as e:  # noqa: BLE001 - a parser of an untrusted file: any failure is "corrupt"
        raise LoadError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    return ModelSource(path, "gguf", meta, quant_source="GGUF tensor types", gguf_tensors=tensors)


_DESCRIBE = {"gguf": _describe_gguf, "hf": _describe_folder}
