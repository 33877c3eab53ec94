"""Architecture name -> model class (imported lazily: the CPU default never imports MoE code)."""

from __future__ import annotations

from torch import nn

from moeserve.config import ConfigError


def model_class(architecture: str) -> type[nn.Module]:
    if architecture == "llama":
        from moeserve.models.llama import LlamaForCausalLM

        return LlamaForCausalLM
    if architecture == "deepseek_v3":
        from moeserve.models.deepseek_v3 import DeepseekV3ForCausalLM

        return DeepseekV3ForCausalLM
    raise ConfigError(f"no model implementation for architecture {architecture!r}")
