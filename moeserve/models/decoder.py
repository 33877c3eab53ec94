"""The pre-norm residual block shared by the Llama and DeepSeek decoders."""

from __future__ import annotations

import torch
from torch import nn

from moeserve.layers.attention.metadata import ForwardContext
from moeserve.parallel.groups import SINGLE, TPGroup


def reduce_add_norm(
    norm: nn.Module, x: torch.Tensor, residual: torch.Tensor, tp: TPGroup, partial: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), where `x` is this rank's partial sum when
    `partial` (the all-reduce, the add and the norm then run as one fused collective)."""
    if partial and tp.size > 1:
        return tp.all_reduce_add_rmsnorm(x, residual, norm.weight, norm.eps)
    return norm(x, residual)


class PreNormDecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)); the residual add is fused into each norm.

    Subclasses create `input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`. With
    `partial_outputs` (set by a subclass whose attention and MLP leave their row-parallel
    outputs unreduced) the tensor-parallel all-reduce happens here, fused with the residual
    add and the next norm; the caller reduces the last layer's MLP output the same way.
    """

    input_layernorm: nn.Module
    self_attn: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module
    tp: TPGroup = SINGLE
    partial_outputs = False
    # EAGLE-3: a preallocated [tokens, H] view that receives the residual stream entering this
    # layer (a draft head reads it); None: nothing captured, nothing copied
    aux_out: torch.Tensor | None = None

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
            x, residual = reduce_add_norm(
                self.input_layernorm, x, residual, self.tp, self.partial_outputs
            )
        if self.aux_out is not None:
            self.aux_out[: residual.shape[0]].copy_(residual)
        x = self.self_attn(positions, x, ctx)
        x, residual = reduce_add_norm(
            self.post_attention_layernorm, x, residual, self.tp, self.partial_outputs
        )
        return self.mlp(x), residual
