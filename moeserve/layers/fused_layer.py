"""Whole decoder layers as one call each (the kernel plan's `fused_layer`).

A decode step of a small model is dozens of tiny operations per layer; `NativeDecoderLayers`
runs a pre-norm Llama layer (GQA attention with RoPE over the paged cache, SwiGLU MLP) as one
native CPU call (kernels/cpu/decoder.py), for every row of a step. A decoder layer offers
itself through `FusedLayerParts` (its linears, norms, attention and RoPE, by their public
accessors); `build` says whether those parts qualify, once the weights are packed and the
cache bound; `run` serves a whole stack of built layers, the final norm included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from moeserve.kernels.cpu import decoder as cpu_decoder
from moeserve.layers.attention.metadata import AttentionMetadata
from moeserve.layers.attention.mha import PagedAttention
from moeserve.layers.linear import LinearBase
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class FusedLayerParts:
    """What a pre-norm decoder layer hands a fused backend."""

    qkv: LinearBase  # q, then k, then v rows
    o: LinearBase
    gate_up: LinearBase  # gate rows, then up rows
    down: LinearBase
    input_norm: RMSNorm
    post_norm: RMSNorm
    attention: PagedAttention  # its heads, scale and bound caches
    rotary: RotaryEmbedding

    @property
    def linears(self) -> tuple[LinearBase, LinearBase, LinearBase, LinearBase]:
        return (self.qkv, self.o, self.gate_up, self.down)


class NativeDecoderLayers:
    """One layer as one native call: where every part runs on the native CPU kernels (bf16
    activations and cache, packed weights, no biases, one rank, RoPE over the whole head)."""

    name: ClassVar[str] = "native"
    label: ClassVar[str] = "native CPU decoder layer, one call per layer"

    def __init__(self, layer: cpu_decoder.DecoderLayer, attention: PagedAttention) -> None:
        self.layer = layer
        self.attention = attention

    @classmethod
    def build(cls, parts: FusedLayerParts) -> NativeDecoderLayers | None:
        linears, rotary, attn = parts.linears, parts.rotary, parts.attention
        weights = [lin.native_weight for lin in linears]
        norms = (parts.input_norm.weight, parts.post_norm.weight)
        if (
            any(w is None for w in weights)
            or any(lin.bias is not None or lin.tp.size != 1 for lin in linears)
            or rotary.interleaved
            or rotary.rotary_dim != attn.head_dim
            or any(t.dtype != torch.bfloat16 for t in (*norms, attn.k_cache))
        ):
            return None
        layer = cpu_decoder.DecoderLayer(
            *weights,
            norms[0].data,
            norms[1].data,
            parts.input_norm.eps,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            attn.scale,
            rotary.cos,
            rotary.sin,
        )
        return cls(layer, attn)

    def __call__(
        self, step: cpu_decoder.DecoderStep, x: torch.Tensor, residual: torch.Tensor, first: bool
    ) -> None:
        """x and residual updated in place (`cpu_decoder.DecoderLayer`); the layer follows
        its attention's caches if they were bound again."""
        a = self.attention
        if not self.layer.cache_is(a.k_cache, a.v_cache):
            self.layer.bind_cache(a.k_cache, a.v_cache)
        self.layer(step, x, residual, first)

    @staticmethod
    def run(
        layers: Sequence[NativeDecoderLayers],
        x: torch.Tensor,
        positions: torch.Tensor,
        md: AttentionMetadata,
        norm: RMSNorm,
    ) -> torch.Tensor:
        """The stack over the embeddings x (contiguous bf16), then the final norm."""
        residual = torch.empty_like(x)
        step = cpu_decoder.DecoderStep(
            layers[0].layer, positions, md.slot_mapping, md.block_tables, md.query_lens_host,
            md.seq_lens_host,
        )  # fmt: skip
        for i, fused in enumerate(layers):
            fused(step, x, residual, first=i == 0)
        return cpu_decoder.add_rmsnorm(x, residual, norm.weight.data, norm.eps)


BACKENDS: dict[str, type[NativeDecoderLayers]] = {NativeDecoderLayers.name: NativeDecoderLayers}
