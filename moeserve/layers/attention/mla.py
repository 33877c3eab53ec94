"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi) over a paged latent cache.

Cache contract: `kv_cache` [num_pages, page_size, kv_lora_rank + qk_rope_head_dim]; row =
[normalised latent c | roped k_pe]; token t of a sequence at page block_table[t // page_size],
offset t % page_size. FP8-E4M3 caches store row / kv_scale (one fp32 scale for the whole row,
saturating at +-448) and dequantize as fp8 * kv_scale.

Two mathematically equal forms:
- expanded (prefill): keys/values per head from kv_b_proj(c): k = [k_nope | k_pe], v;
- absorbed (decode): q_latent = q_nope @ W_UK (per head [nope, kv_lora]); scores against the
  576-wide cached rows directly; out = (p @ c) @ W_UV^T. One KV head for all query heads.
RoPE is DeepSeek's interleaved pairing on the rope dims (HF de-interleaves q and k the same
way; dot products are identical).

q_a_proj and kv_a_proj_with_mqa read the same input: when their checkpoint formats allow it
they are one GEMM (`fused_qkv_a_proj`, shard 0 = q_a, 1 = kv_a; checkpoint names unchanged).

Two execution paths:
- kernels (CUDA, published 512 + 64 layout; `_forward_kernels`): fused a-GEMM -> both
  a-norms in one launch (in place) -> q_b_proj -> W_UK product into the absorbed query
  [T, H, 576] and one launch that ropes q_pe (into that query) and k_pe and writes the cache
  (where the W_UK kernel serves, decode-sized batches on block-FP8, that launch is its own) ->
  the leading single-token sequences through the split-KV decode kernel, the rest (prefill
  chunks over their cached context) through the prefill kernel -> W_UV product. The two
  products read kv_b_proj as stored (block-FP8 or 16-bit, kernels/attention/mla_absorb.py) for
  decode-sized batches, else run as bmm on its dense weight. Strided views instead of
  copies throughout; no host syncs (CUDA-graph capturable).
- native CPU kernels (bf16 cache; the kernel plan): the absorbed form for every row, decode
  or prefill (W_UK and W_UV products per head and the attention over the latent rows through
  `moeserve.kernels.cpu`), so a row's result does not depend on how its sequence was split
  into steps.
- torch (CPU, other shapes): expanded form per sequence for prefill, absorbed for decode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from moeserve.config import ModelConfig
from moeserve.kernels.elementwise import norm as norm_kernels
from moeserve.kernels.gemm import w16_gemv as w16_kernels
from moeserve.layers.attention.metadata import ForwardContext
from moeserve.layers.attention.mla_backends import MLABackend, MLADecodeScratch, TorchMLA
from moeserve.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedReplicatedLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from moeserve.layers.norm import RMSNorm
from moeserve.layers.quant.base import (
    NoQuant,
    QuantConfig,
    UnquantizedLinearMethod,
    make_param,
    materialize,
)
from moeserve.layers.rotary import RotaryEmbedding, yarn_mscale
from moeserve.parallel.groups import SINGLE, TPGroup

if TYPE_CHECKING:
    from moeserve.layers.kernel_plan import KernelPlan

__all__ = ["MLAAttention", "MLADecodeScratch", "mergeable", "mla_softmax_scale"]


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """(qk_nope + qk_rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = cfg.mla.qk_head_dim**-0.5
    rs = cfg.rope_scaling
    if rs is not None and rs.type == "yarn" and rs.mscale_all_dim:
        scale *= yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2
    return scale


def mergeable(
    quant: QuantConfig | None, prefixes: list[str], sizes: list[int], input_size: int
) -> bool:
    """Whether linear layers over one input can run as one GEMM: the same quant method and
    scheme, and for block-quantized formats shard boundaries on block rows (block-FP8: q_lora
    1536 is 12 blocks of 128)."""
    methods = [(quant or NoQuant()).linear_method(p) for p in prefixes]
    if any(type(m) is not type(methods[0]) for m in methods):
        return False
    scheme = getattr(methods[0], "scheme", None)
    if scheme is None:  # dense, or the CPU's row-wise weight-only formats
        return True
    if any(type(m.scheme) is not type(scheme) or vars(m.scheme) != vars(scheme) for m in methods):
        return False
    specs = scheme.specs(sum(sizes), input_size, torch.float32)
    blocks = [s.out_block for s in specs if s.out_dim is not None]
    return all(n % b == 0 for n in sizes[:-1] for b in blocks)


class MLAAttention(nn.Module):
    """Projections, RoPE and paged attention of one MLA layer (`self_attn`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        prefix: str,
        rotary: RotaryEmbedding,
        quant: QuantConfig | None = None,
        tp: TPGroup = SINGLE,
        dtype: torch.dtype = torch.float32,
        input_size: int | None = None,
    ) -> None:
        """`input_size`: the width of the projections' input (default: the hidden size; an
        EAGLE-3 draft layer reads [embedding | hidden], twice as wide)."""
        super().__init__()
        self.num_heads = tp.shard(cfg.num_attention_heads)
        mla = cfg.mla
        self.nope = mla.qk_nope_head_dim
        self.rope = mla.qk_rope_head_dim
        self.v_dim = mla.v_head_dim
        self.kv_lora = mla.kv_lora_rank
        self.q_lora = mla.q_lora_rank
        self.scale = mla_softmax_scale(cfg)
        self.rotary = [rotary]  # shared by all layers; a list keeps it out of state_dict
        kw = dict(quant=quant, tp=tp, dtype=dtype)
        self._build_projections(cfg, prefix, input_size or cfg.hidden_size, kw)
        # FP8 cache scale (checkpoint k_scale / v_scale; absent -> 1.0)
        self.kv_scale = make_param(torch.ones(1), None, None)
        self.kv_scale.optional = True
        self.kv_scale.weight_loader = self._load_kv_scale
        self._kv_scale_loaded = False
        self.kv_cache = torch.empty(0)
        # the plan's backend (use_kernel_plan, before loading), and the one serving the
        # bound cache (`MLABackend.for_cache`); torch until a plan says otherwise
        self.planned: MLABackend = TorchMLA(self)
        self.backend: MLABackend = self.planned

    def _build_projections(self, cfg: ModelConfig, prefix: str, h_in: int, kw: dict) -> None:
        mla, heads, bias = cfg.mla, cfg.num_attention_heads, cfg.attention_bias
        a_sizes = [self.q_lora, self.kv_lora + self.rope]
        a_prefixes = [f"{prefix}.q_a_proj", f"{prefix}.kv_a_proj_with_mqa"]
        self.fused_qkv_a_proj: MergedReplicatedLinear | None = None
        if self.q_lora and mergeable(kw["quant"], a_prefixes, a_sizes, h_in):
            # method chosen by q_a's name (mergeable checked that kv_a's is the same)
            self.fused_qkv_a_proj = MergedReplicatedLinear(
                h_in, a_sizes, bias=bias, prefix=a_prefixes[0], **kw
            )
        else:
            if self.q_lora:
                self.q_a_proj = ReplicatedLinear(
                    h_in, self.q_lora, bias=bias, prefix=a_prefixes[0], **kw
                )
            else:
                self.q_proj = ColumnParallelLinear(
                    h_in, heads * mla.qk_head_dim, prefix=f"{prefix}.q_proj", **kw
                )
            self.kv_a_proj_with_mqa = ReplicatedLinear(
                h_in, a_sizes[1], bias=bias, prefix=a_prefixes[1], **kw
            )
        dtype = kw["dtype"]
        if self.q_lora:
            self.q_a_layernorm = RMSNorm(self.q_lora, cfg.rms_norm_eps, dtype)
            self.q_b_proj = ColumnParallelLinear(
                self.q_lora, heads * mla.qk_head_dim, prefix=f"{prefix}.q_b_proj", **kw
            )
        self.kv_a_layernorm = RMSNorm(self.kv_lora, cfg.rms_norm_eps, dtype)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora, heads * (self.nope + self.v_dim), prefix=f"{prefix}.kv_b_proj", **kw
        )
        # partial sums: the decoder all-reduces them with the residual add and the next norm
        self.o_proj = RowParallelLinear(
            heads * self.v_dim,
            cfg.hidden_size,
            bias=bias,
            prefix=f"{prefix}.o_proj",
            reduce_results=False,
            **kw,
        )

    @property
    def rotary_emb(self) -> RotaryEmbedding:
        """The model's RoPE tables (shared by its layers)."""
        return self.rotary[0]

    # ---- the kernel plan ---------------------------------------------------------------------
    def use_kernel_plan(self, plan: KernelPlan) -> None:
        self.planned = plan.mla(self)
        self._serve_cache()

    def use_backend(self, cls: type[MLABackend]) -> None:
        """Serve through `cls` from now on, its weights prepared at once (tests and
        benchmarks switch a loaded layer between backends)."""
        self.planned = cls(self)
        self.planned.process_weights()
        self._serve_cache()

    def _serve_cache(self) -> None:
        """The planned backend, or the one it hands the bound cache to."""
        bound = self.kv_cache.numel() > 0
        self.backend = self.planned.for_cache(self.kv_cache.dtype) if bound else self.planned

    def process_weights_after_loading(self) -> None:
        self.planned.process_weights()

    @property
    def supports_cuda_graph(self) -> bool:
        """Only the GPU kernels' decode is capturable: the torch paths size their gathers from
        host-side sequence lengths."""
        return self.backend.capturable

    def prepare_cuda_graph(self, max_batch: int, max_context: int, shared: dict) -> None:
        self.backend.prepare_cuda_graph(max_batch, max_context, shared)

    # ---- cache contract used by the runner ------------------------------------------------
    @property
    def latent_dim(self) -> int:
        return self.kv_lora + self.rope

    def kv_cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.latent_dim * dtype.itemsize

    def bind_kv_cache(
        self, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        self.kv_cache = torch.zeros(
            (num_pages, page_size, self.latent_dim), dtype=dtype, device=device
        )
        self._serve_cache()

    def cache_tensors(self) -> list[torch.Tensor]:
        return [self.kv_cache] if self.kv_cache.numel() else []

    def _load_kv_scale(self, param: nn.Parameter, w: torch.Tensor, shard_id: object = None) -> None:
        # k_scale and v_scale both describe the one latent row: keep the larger
        value = materialize(w).float().reshape(-1)[:1]
        if self._kv_scale_loaded:
            value = torch.maximum(value, param.data)
        param.data.copy_(value)
        self._kv_scale_loaded = True

    # ---- compute -------------------------------------------------------------------------------
    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        q, c, k_pe = self._project(x)
        o = self.backend.attend(positions, q, c, k_pe, ctx.attn)
        return self.o_proj(o.flatten(1))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, h, nope + rope], the normalised latent c [T, L] and the raw k_pe [T, R]
        (c and k_pe may be column views of one buffer)."""
        tokens = x.shape[0]
        fused = self.fused_qkv_a_proj
        normed = self._qkv_a_normed(x)
        if normed is not None:
            q_a, c, k_pe = normed.split([self.q_lora, self.kv_lora, self.rope], dim=-1)
            q = self.q_b_proj(q_a)
        elif fused is not None:
            qkv = fused(x)
            qn, kvn = self.q_a_layernorm, self.kv_a_layernorm
            norm_kernels_serve = self.backend.fused_a_norms or qn.kernels  # as RMSNorm decides
            if norm_kernels_serve and qkv.dtype == qn.weight.dtype == kvn.weight.dtype:
                # both a-norms in one launch, in place; the rope columns stay as they are
                norm_kernels.rms_norm_pair(qkv, qn.weight, kvn.weight, qn.eps, kvn.eps, out=qkv)
                q_a, c, k_pe = qkv.split([self.q_lora, self.kv_lora, self.rope], dim=-1)
            else:
                q_a, c, k_pe = qkv.split([self.q_lora, self.kv_lora, self.rope], dim=-1)
                q_a, c = qn(q_a), kvn(c)
            q = self.q_b_proj(q_a)
        else:
            if self.q_lora:
                q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
            else:
                q = self.q_proj(x)
            c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope], dim=-1)
            c = self.kv_a_layernorm(c)
        return q.view(tokens, self.num_heads, self.nope + self.rope), c, k_pe

    def _qkv_a_normed(self, x: torch.Tensor) -> torch.Tensor | None:
        """[q_a normed | c normed | k_pe] of decode rows in one launch, both a-norms in the
        split-K GEMV's epilogue, where it serves (a merged 16-bit q_a / kv_a weight without
        bias on the GPU); None elsewhere."""
        fused: LinearBase | None = self.fused_qkv_a_proj
        if fused is None or not (x.is_cuda and fused.dense_gemv) or fused.bias is not None:
            return None
        if not isinstance(fused.method, UnquantizedLinearMethod):
            return None
        if not w16_kernels.w16_gemv_supported(x, fused.weight):
            return None
        qn, kvn = self.q_a_layernorm, self.kv_a_layernorm
        norms = (
            w16_kernels.NormSegment(0, self.q_lora, qn.weight, qn.eps),
            w16_kernels.NormSegment(self.q_lora, self.kv_lora, kvn.weight, kvn.eps),
        )
        return w16_kernels.w16_gemv(x, fused.weight, norms=norms, workspace=fused.w16_workspace)
