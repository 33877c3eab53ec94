"""Architecture name -> model class (imported lazily: the CPU default never imports MoE code)."""

from __future__ import annotations

import importlib

from torch import nn

from moeserve.config import ConfigError

_MODELS = {
    "llama": ("moeserve.models.llama", "LlamaForCausalLM"),
    "deepseek_v3": ("moeserve.models.deepseek_v3", "DeepseekV3ForCausalLM"),
}


def model_class(architecture: str) -> type[nn.Module]:
    try:
        module, name = _MODELS[architecture]
    except KeyError:
        raise ConfigError(f"no model implementation for architecture {architecture!r}") from None
    return getattr(importlib.import_module(module), name)
