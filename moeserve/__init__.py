"""moeserve: an inference server for DeepSeek-V3-architecture MoE models (and Llama)."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from moeserve.engine.offline import LLM
    from moeserve.sampling import SamplingParams


def __getattr__(name: str):
    # lazy: `import moeserve` stays cheap for the bench client and the CLI's help
    if name == "LLM":
        from moeserve.engine.offline import LLM

        return LLM
    if name == "SamplingParams":
        from moeserve.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "__version__"]
