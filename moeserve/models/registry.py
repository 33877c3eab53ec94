"""The architecture table: every model family moeserve serves, one entry each.

An entry names the HF architectures it serves (config.json `architectures[0]`, or `model_type`
where a config has no architectures), the parser that turns that config.json into a
`ModelConfig`, the model class (imported on first use: the CPU default never imports MoE
code), llama.cpp's GGUF architecture where the GGUF loader reads one, the `make-checkpoint
--like` layouts that write it, and the line `plan` and `check` print. Adding an architecture
is one model module, one entry (`register`, or a `moeserve.architectures` entry point of an
installed package) and its layers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from torch import nn

from moeserve.config import (
    ConfigError,
    ModelConfig,
    deepseek_config,
    kimi_k25_config,
    llama_config,
)

log = logging.getLogger(__name__)

# packages that ship an architecture name an `Architecture` under this entry-point group
ENTRY_POINT_GROUP = "moeserve.architectures"


@dataclass(frozen=True)
class Architecture:
    name: str  # ModelConfig.architecture of the configs it parses
    hf_names: tuple[str, ...]  # config.json architectures[0] / model_type values it serves
    parse_hf: Callable[[dict[str, Any], str], ModelConfig]  # (config.json, name) -> config
    model: Callable[[], type[nn.Module]]  # imports the class, built as cls(cfg, quant, tp, dtype)
    description: str  # what `plan` and `check` say it is
    gguf_arch: str | None = None  # llama.cpp's general.architecture (None: no GGUF loader)
    checkpoint_likes: tuple[str, ...] = ()  # `make-checkpoint --like` layouts written as it

    def model_class(self) -> type[nn.Module]:
        return self.model()

    def parse(self, raw: dict[str, Any]) -> ModelConfig:
        return self.parse_hf(raw, self.name)


def _llama() -> type[nn.Module]:
    from moeserve.models.llama import LlamaForCausalLM

    return LlamaForCausalLM


def _deepseek_v3() -> type[nn.Module]:
    from moeserve.models.deepseek_v3 import DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM


BUILTIN: tuple[Architecture, ...] = (
    Architecture(
        name="llama",
        hf_names=("LlamaForCausalLM", "llama", "MistralForCausalLM", "mistral"),
        parse_hf=llama_config,
        model=_llama,
        description="Llama family (GQA attention, dense SwiGLU MLP)",
        gguf_arch="llama",
    ),
    Architecture(
        name="deepseek_v3",
        hf_names=(
            "DeepseekV3ForCausalLM",
            "DeepseekV2ForCausalLM",
            "deepseek_v3",
            "deepseek_v2",
            "kimi_k2",
        ),
        parse_hf=deepseek_config,
        model=_deepseek_v3,
        description="DeepSeek-V3 family (MLA attention, routed + shared experts)",
        gguf_arch="deepseek2",
        checkpoint_likes=("deepseek-v3", "moonlight"),
    ),
    Architecture(
        name="kimi_k25",
        hf_names=("KimiK25ForConditionalGeneration", "kimi_k25"),
        parse_hf=kimi_k25_config,
        model=_deepseek_v3,
        description="Kimi-K2.5 (a DeepSeek-V3 text model with the MoonViT vision encoder)",
        checkpoint_likes=("kimi-k2.5",),
    ),
)


class ArchitectureTable:
    """Name -> entry, with lookups by HF and GGUF name; installed packages' entry points are
    read on the first lookup."""

    def __init__(self, entries: tuple[Architecture, ...]) -> None:
        self._entries = {a.name: a for a in entries}
        self._plugins_read = False

    def register(self, arch: Architecture) -> None:
        """Add (or replace) an entry; its HF names then resolve to it."""
        self._read_plugins()
        self._entries[arch.name] = arch

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    def entries(self) -> tuple[Architecture, ...]:
        self._read_plugins()
        return tuple(self._entries.values())

    def by_name(self, name: str) -> Architecture:
        for a in self.entries():
            if a.name == name:
                return a
        raise ConfigError(f"no model implementation for architecture {name!r}")

    def lookup_hf(self, raw: dict[str, Any]) -> Architecture:
        """The entry serving a config.json (its first architecture, else its model_type)."""
        archs = raw.get("architectures") or []
        names = [archs[0]] if archs else []
        if raw.get("model_type"):
            names.append(raw["model_type"])
        for name in names:
            for a in self.entries():
                if name in a.hf_names:
                    return a
        shown = names[0] if names else ""
        known = ", ".join(n for a in self.entries() for n in a.hf_names if n[:1].isupper())
        raise ConfigError(f"unsupported model architecture {shown!r}; served: {known}")

    def lookup_gguf(self, gguf_arch: str) -> Architecture:
        for a in self.entries():
            if a.gguf_arch is not None and a.gguf_arch == gguf_arch:
                return a
        known = ", ".join(a.gguf_arch for a in self.entries() if a.gguf_arch)
        raise ConfigError(f"GGUF architecture {gguf_arch!r} is not supported ({known} are)")

    def _read_plugins(self) -> None:
        if self._plugins_read:
            return
        self._plugins_read = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            arch = ep.load()
            if not isinstance(arch, Architecture):
                raise ConfigError(f"entry point {ep.value} is not a moeserve Architecture")
            log.info("architecture %s from %s", arch.name, ep.value)
            self._entries[arch.name] = arch


# the process's table: the built-in entries and whatever `register` or entry points add
ARCHITECTURES = ArchitectureTable(BUILTIN)


def register(arch: Architecture) -> None:
    """Serve another architecture (vLLM's `ModelRegistry.register_model`)."""
    ARCHITECTURES.register(arch)


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    """The `ModelConfig` of a checkpoint's config.json, by the entry that serves it."""
    return ARCHITECTURES.lookup_hf(raw).parse(raw)


def model_class(architecture: str) -> type[nn.Module]:
    """The model class of a `ModelConfig.architecture`."""
    return ARCHITECTURES.by_name(architecture).model_class()
