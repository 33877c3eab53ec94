"""What a loader returns: the model with its weights, its tokenizer and its description."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moeserve.config import ModelConfig
from moeserve.tokenizer.base import Tokenizer


@dataclass
class LoadedModel:
    model: nn.Module  # implements the model contract (see models/llama.py)
    tokenizer: Tokenizer
    config: ModelConfig
    kv_cache_dtype: torch.dtype  # what the runner allocates the paged cache in
    description: str  # one line for the start-up banner: format, quantization, dtype
    quant: Any = None  # the checkpoint's QuantConfig (None: unquantized or GGUF)
    load_seconds: float = 0.0  # building the model and reading (or generating) its weights
    cpu_native: bool = False  # the native CPU kernels serve (moeserve.kernels.cpu)
    cpu_kernels: str = ""  # CPU: one line saying which kernels serve (banner), "" elsewhere
