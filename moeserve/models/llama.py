"""Llama-family decoder (GQA attention, RoPE, RMSNorm, SwiGLU) over the paged KV cache."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.config import ModelConfig
from moeserve.kernels import cpu as cpu_kernels
from moeserve.layers.attention.metadata import ForwardContext
from moeserve.layers.attention.mha import PagedAttention
from moeserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from moeserve.layers.fused_layer import FusedLayerParts
from moeserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from moeserve.layers.norm import RMSNorm
from moeserve.layers.quant.base import QuantConfig
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.models.decoder import PreNormDecoderLayer, fused_stack
from moeserve.models.weights import finish_loading, load_weights_by_rules
from moeserve.parallel.groups import SINGLE, TPGroup

if TYPE_CHECKING:
    from moeserve.layers.kernel_plan import KernelPlan


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        prefix: str,
        quant: QuantConfig | None,
        tp: TPGroup,
        dtype: torch.dtype,
        rotary: RotaryEmbedding,
    ) -> None:
        super().__init__()
        d = cfg.head_dim
        self.num_heads = tp.shard(cfg.num_attention_heads)
        self.num_kv_heads = max(1, cfg.num_key_value_heads // tp.size)
        self.head_dim = d
        kw = dict(quant=quant, tp=tp, dtype=dtype)
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            d,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            bias=cfg.attention_bias,
            prefix=f"{prefix}.qkv_proj",
            **kw,
        )
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * d, cfg.hidden_size, prefix=f"{prefix}.o_proj", **kw
        )
        self.rotary = [rotary]  # shared by all layers (a list: not a submodule of each)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, d**-0.5)

    @property
    def rotary_emb(self) -> RotaryEmbedding:
        """The model's RoPE tables (shared by its layers)."""
        return self.rotary[0]

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary[0](positions, q, k)
        o = self.attn(q, k, v, ctx)
        return self.o_proj(o.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        prefix: str,
        quant: QuantConfig | None,
        tp: TPGroup,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        kw = dict(quant=quant, tp=tp, dtype=dtype)
        i = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [i, i], prefix=f"{prefix}.gate_up_proj", **kw
        )
        self.down_proj = RowParallelLinear(i, cfg.hidden_size, prefix=f"{prefix}.down_proj", **kw)
        self.native = False  # SiLU * up by the native CPU kernel (the kernel plan)

    def use_kernel_plan(self, plan: KernelPlan) -> None:
        self.native = plan.cpu_native

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        if self.native and gu.dtype == torch.bfloat16:
            return self.down_proj(cpu_kernels.silu_mul(gu))
        gate, up = gu.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(
        self,
        cfg: ModelConfig,
        prefix: str,
        quant: QuantConfig | None,
        tp: TPGroup,
        dtype: torch.dtype,
        rotary: RotaryEmbedding,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, f"{prefix}.self_attn", quant, tp, dtype, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(cfg, f"{prefix}.mlp", quant, tp, dtype)

    def fused_parts(self) -> FusedLayerParts:
        a, mlp = self.self_attn, self.mlp
        return FusedLayerParts(
            a.qkv_proj,
            a.o_proj,
            mlp.gate_up_proj,
            mlp.down_proj,
            self.input_layernorm,
            self.post_attention_layernorm,
            a.attn,
            a.rotary_emb,
        )


class LlamaModel(nn.Module):
    def __init__(
        self, cfg: ModelConfig, quant: QuantConfig | None, tp: TPGroup, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, f"model.layers.{i}", quant, tp, dtype, self.rotary)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # the layers as fused calls (`fused_stack`), decided at the first forward, once the
        # weights are packed and the cache bound; False where they do not all qualify
        self._fused: list | bool | None = None

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        if self._fused is None:
            stack = fused_stack(self.layers)
            ok = stack is not None and all(
                w.dtype == torch.bfloat16 for w in (self.norm.weight, self.embed_tokens.weight)
            )
            self._fused = stack if ok else False
        # a layer that hands its residual stream to a draft head (aux_out) runs layer by layer
        if self._fused and all(layer.aux_out is None for layer in self.layers):
            x = self.embed_tokens(ids).contiguous()
            run = self.layers[0].fused_decode.run
            return run(self._fused, x, positions, ctx.attn, self.norm)
        x, residual = self.embed_tokens(ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, ctx)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """Model contract (used by the runner; every model class implements it):

    - `forward(input_ids [T], positions [T], ctx) -> hidden [T, H]`
    - `compute_logits(hidden [N, H], out=None) -> [N, vocab] fp32` (into `out` when given)
    - `load_weights(iterable of (HF checkpoint name, tensor)) -> set of loaded param names`
    - `attention_layers() -> list` of modules with `kv_cache_bytes_per_token(dtype)`,
      `bind_kv_cache(num_pages, page_size, dtype, device)` and `cache_tensors()`.

    (`moeserve.layers.contract.CausalLM` and `KVCacheLayer` state it as protocols.)
    """

    STACKED = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(
        self,
        cfg: ModelConfig,
        quant: QuantConfig | None = None,
        tp: TPGroup = SINGLE,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, quant, tp, dtype)
        head_method = quant.lm_head_method() if quant is not None else None
        self.lm_head = ParallelLMHead(
            cfg.vocab_size, cfg.hidden_size, tp, dtype, method=head_method
        )
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        return self.model(ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden, out)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name:
                return None
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                return None
            return name

        loaded = load_weights_by_rules(self, weights, self.STACKED, rename)
        finish_loading(self)
        return loaded
