"""The pre-norm residual block shared by the Llama and DeepSeek decoders."""

from __future__ import annotations

import torch
from torch import nn

from moeserve.layers.attention.metadata import ForwardContext


class PreNormDecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)); the residual add is fused into each norm.

    Subclasses create `input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`.
    """

    input_layernorm: nn.Module
    self_attn: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual
