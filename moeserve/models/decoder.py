"""The pre-norm residual block shared by the Llama and DeepSeek decoders, and its fused form:
the whole layer as one call where the kernel plan chose a fused backend (`fused_decode`,
moeserve/layers/fused_layer.py) and the layer's parts qualify."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from moeserve.layers.attention.metadata import ForwardContext
from moeserve.layers.fused_layer import FusedLayerParts
from moeserve.parallel.groups import SINGLE, TPGroup

if TYPE_CHECKING:
    from moeserve.layers.kernel_plan import KernelPlan


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
    # the kernel plan's whole-layer backend (moeserve.layers.fused_layer), None: layer by layer
    fused_decode: Any = None

    def use_kernel_plan(self, plan: KernelPlan) -> None:
        self.fused_decode = plan.fused_layer

    def fused_parts(self) -> FusedLayerParts | None:
        """The parts a fused backend reads (None: this kind of layer is never fused)."""
        return None

    def fused(self) -> Any:
        """This layer as one call of the plan's fused backend, or None where there is none or
        the parts do not qualify; asked once the weights are packed and the cache bound."""
        parts = self.fused_parts() if self.fused_decode is not None else None
        return None if parts is None else self.fused_decode.build(parts)

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


def fused_stack(layers: Sequence[PreNormDecoderLayer]) -> list | None:
    """Every layer as one fused call (`PreNormDecoderLayer.fused`), or None unless all are."""
    fused = [layer.fused() for layer in layers]
    return fused if fused and all(f is not None for f in fused) else None
