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

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.config import ModelConfig
from moeserve.layers.attention.metadata import AttentionMetadata, ForwardContext
from moeserve.layers.kernel_plan import KernelPlan
from moeserve.layers.linear import (
    ColumnParallelLinear,
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
from moeserve.layers.quant.scheme import SchemeLinearMethod, dense_weight
from moeserve.layers.rotary import RotaryEmbedding, yarn_mscale
from moeserve.parallel.groups import SINGLE, TPGroup

if TYPE_CHECKING:
    from moeserve.kernels.attention.kv_cache import CacheWrite
    from moeserve.kernels.attention.mla_decode import MLADecodeWorkspace

log = logging.getLogger(__name__)

FP8_E4M3_MAX = 448.0


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


@dataclass
class MLADecodeScratch:
    """Split-KV partials of the decode kernels, shared by all MLA layers of a model (their
    calls are stream-ordered). One flat buffer, viewed per batch, so a captured graph uses
    fixed addresses; sized for every batch <= max_batch at the largest context. `gluon`:
    the Gluon kernel (kernels/attention/mla_decode_gluon.py) can serve the cache, decided once at
    allocation (--mla-decode-kernel); which kernel serves a batch then follows from static
    sizes only. The Triton kernel's fused-merge counters are zero between calls (each call
    resets the ones it used), so the layers share them too."""

    partial_out: torch.Tensor  # flat, [rows * heads * 512] in the partials' dtype
    partial_lse: torch.Tensor  # flat fp32 [rows * heads]
    counters: torch.Tensor  # flat int32, zeroed: merge_counters_needed(max_batch, heads)
    num_heads: int
    sm_count: int
    gluon: str | None = None  # "prefer", "always" or None (the kernel plan's MLA decode)

    @staticmethod
    def plan(
        batch: int, num_heads: int, max_context: int, sm_count: int, gluon: str | None
    ) -> tuple[Callable, int]:
        """(decode kernel, its default split count) for a launch of these static sizes: the
        Gluon kernel where it serves the cache and is asked for ("always") or measured
        faster ("prefer"), else the Triton one."""
        from moeserve.kernels.attention import mla_decode as md

        if gluon is not None:
            from moeserve.kernels.attention import mla_decode_gluon as mg

            if gluon == "always" or mg.prefer_gluon(batch, num_heads, max_context):
                splits = mg.gluon_default_num_splits(batch, num_heads, max_context, sm_count)
                return mg.mla_decode_gluon, splits
        splits = md.default_num_splits(batch, num_heads, max_context, sm_count=sm_count)
        return md.mla_decode, splits

    @classmethod
    def allocate(
        cls,
        max_batch: int,
        num_heads: int,
        max_context: int,
        dtype: torch.dtype,
        device: torch.device | str,
        sm_count: int,
        gluon: str | None = None,
    ) -> MLADecodeScratch:
        from moeserve.kernels.attention.mla_decode import KV_LORA_RANK, merge_counters_needed

        rows = max(
            b * cls.plan(b, num_heads, max_context, sm_count, gluon)[1]
            for b in range(1, max_batch + 1)
        )
        # the kernel's partials: fp32 for an fp32 output, else bf16 (see mla_decode)
        po_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
        po = torch.empty(rows * num_heads * KV_LORA_RANK, dtype=po_dtype, device=device)
        pl = torch.empty(rows * num_heads, dtype=torch.float32, device=device)
        counters = torch.zeros(
            merge_counters_needed(max_batch, num_heads), dtype=torch.int32, device=device
        )
        return cls(po, pl, counters, num_heads, sm_count, gluon)

    def workspace(
        self, batch: int, max_context: int
    ) -> tuple[Callable, MLADecodeWorkspace, int] | None:
        """(decode kernel, workspace view, num_splits) for this batch, or None if it does not
        fit."""
        from moeserve.kernels.attention.mla_decode import (
            KV_LORA_RANK,
            MLADecodeWorkspace,
            merge_counters_needed,
        )

        kernel, splits = self.plan(batch, self.num_heads, max_context, self.sm_count, self.gluon)
        n = batch * self.num_heads * splits
        if n > self.partial_lse.numel():
            return None
        if merge_counters_needed(batch, self.num_heads) > self.counters.numel():
            return None
        po = self.partial_out[: n * KV_LORA_RANK].view(batch, self.num_heads, splits, -1)
        pl = self.partial_lse[:n].view(batch, self.num_heads, splits)
        return kernel, MLADecodeWorkspace(po, pl, self.counters), splits


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
        heads, h = cfg.num_attention_heads, cfg.hidden_size
        h_in = input_size or h
        kw = dict(quant=quant, tp=tp, dtype=dtype)
        bias = cfg.attention_bias
        a_sizes = [self.q_lora, self.kv_lora + self.rope]
        a_prefixes = [f"{prefix}.q_a_proj", f"{prefix}.kv_a_proj_with_mqa"]
        self.fused_qkv_a_proj: MergedReplicatedLinear | None = None
        if self.q_lora and mergeable(quant, a_prefixes, a_sizes, h_in):
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
            h,
            bias=cfg.attention_bias,
            prefix=f"{prefix}.o_proj",
            reduce_results=False,
            **kw,
        )
        # FP8 cache scale (checkpoint k_scale / v_scale; absent -> 1.0)
        self.kv_scale = make_param(torch.ones(1), None, None)
        self.kv_scale.optional = True
        self.kv_scale.weight_loader = self._load_kv_scale
        self._kv_scale_loaded = False
        self.kv_cache = torch.empty(0)
        # set by prepare_cuda_graph (GPU kernels only); plain attributes, not state
        self._decode_scratch: MLADecodeScratch | None = None
        self._w_absorb: torch.Tensor | None = None
        # kv_b_proj's stored (weight, block scale or None) for the absorbed-product kernels;
        # chosen at the first kernel-path call (False: they cannot read this format)
        self._absorb_stored: tuple[torch.Tensor, torch.Tensor | None] | bool | None = None
        # the kernel plan's choices (use_kernel_plan, before loading): the Triton kernels
        # (tests also set this on a CPU, under the Triton interpreter), the Gluon decode
        # kernel's role, the native CPU kernels
        self.use_kernels = False
        self._gluon: str | None = None
        self._native_wanted = False
        # native CPU kernels: per-head W_UK / W_UV products, packed once after loading
        self._native_absorb: tuple[list, list] | None = None
        self._native_ok = False
        # --deterministic on GPUs: every row through the prefill kernel, absorbed products by
        # the batch-invariant GEMM (kernels/gemm/invariant.py)
        self.batch_invariant = False

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
        self._native_ok = self._native_absorb is not None and dtype == torch.bfloat16
        if self._native_absorb is not None and not self._native_ok:
            log.info("MLA: a %s cache: torch attention (the native CPU kernel reads bf16)", dtype)

    def use_kernel_plan(self, plan: KernelPlan) -> None:
        self.use_kernels = plan.mla == "triton"
        self._gluon = {"gluon": "always", "gluon-prefer": "prefer"}.get(plan.mla_decode)
        self._native_wanted = plan.mla == "native"
        self.batch_invariant = plan.invariant

    def process_weights_after_loading(self) -> None:
        """Native CPU kernels: W_UK [h, nope, L] as h linear weights [L, nope] and W_UV
        [h, v, L] as h [v, L], packed once (a dense copy of kv_b_proj only)."""
        from moeserve.kernels import cpu as cpu_kernels

        if not self._native_wanted or self.nope % 2 or self.kv_lora % 2 or self.latent_dim % 2:
            return
        w = dense_weight(self.kv_b_proj, torch.bfloat16)
        w = w.view(self.num_heads, self.nope + self.v_dim, self.kv_lora)
        uk = [cpu_kernels.pack_bf16(w[h, : self.nope].t()) for h in range(self.num_heads)]
        uv = [cpu_kernels.pack_bf16(w[h, self.nope :]) for h in range(self.num_heads)]
        self._native_absorb = (uk, uv)

    @property
    def supports_cuda_graph(self) -> bool:
        """Only the Triton kernels' decode is capturable: the torch path sizes its gather from
        host-side sequence lengths."""
        return self._kernels(self.kv_cache)

    def prepare_cuda_graph(self, max_batch: int, max_context: int, shared: dict) -> None:
        """Static decode state for graph capture: the split-KV scratch (one for all layers,
        kept in `shared`) and the absorbed kv_b_proj weight, dequantized once (dequantizing a
        quantized one per call would copy a host-side table inside the graph)."""
        if not self.supports_cuda_graph:
            return
        dtype = self.kv_a_layernorm.weight.dtype
        dev = self.kv_cache.device
        key = f"mla_decode_scratch/{self.num_heads}/{dtype}"
        scratch = shared.get(key)
        if scratch is None:
            sm = torch.cuda.get_device_properties(dev).multi_processor_count
            scratch = MLADecodeScratch.allocate(
                max_batch, self.num_heads, max_context, dtype, dev, sm, self._gluon
            )
            shared[key] = scratch
        self._decode_scratch = scratch
        self._w_absorb = dense_weight(self.kv_b_proj, dtype)

    def _load_kv_scale(self, param: nn.Parameter, w: torch.Tensor, shard_id: object = None) -> None:
        # k_scale and v_scale both describe the one latent row: keep the larger
        value = materialize(w).float().reshape(-1)[:1]
        if self._kv_scale_loaded:
            value = torch.maximum(value, param.data)
        param.data.copy_(value)
        self._kv_scale_loaded = True

    # ---- cache I/O ---------------------------------------------------------------------------
    def _kernels(self, t: torch.Tensor) -> bool:
        """The Triton MLA kernels serve CUDA tensors of the published 512 + 64 layout with
        DeepSeek's interleaved RoPE."""
        from moeserve.kernels.attention.mla_decode import KV_LORA_RANK, ROPE_DIM

        rot = self.rotary[0]
        fits = (
            self.kv_lora == KV_LORA_RANK
            and self.rope == ROPE_DIM
            and rot.interleaved
            and rot.rotary_dim == self.rope
            and rot.cos.dtype == torch.float32
        )
        return fits and self.use_kernels

    def _write(self, c: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor) -> None:
        """torch path: store [c | roped k_pe] rows (the kernel path writes in its rope launch)."""
        keep = slots >= 0  # negative slot: padding token, not stored
        rows = torch.cat([c, k_pe], dim=-1)[keep].float()
        if self.kv_cache.dtype == torch.float8_e4m3fn:
            rows = (rows / self.kv_scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        rows = rows.to(self.kv_cache.dtype)
        flat = self.kv_cache.view(-1, self.latent_dim)
        if flat.dtype == torch.float8_e4m3fn:  # no fp8 index_copy on the CPU: copy the bytes
            flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
        flat.index_copy_(0, slots[keep], rows)

    def _dequant(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if rows.dtype == torch.float8_e4m3fn:
            return (rows.float() * self.kv_scale).to(dtype)
        return rows.to(dtype)

    def _gather(
        self, table: torch.Tensor, n: int, page_size: int, dtype: torch.dtype
    ) -> torch.Tensor:
        pages = table[: -(-n // page_size)].long()
        return self._dequant(self.kv_cache[pages].flatten(0, 1)[:n], dtype)

    def _absorb_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [h, nope, L] and W_UV [h, v, L]: views of kv_b_proj's dense weight (kept on
        the kernel path: the same storage for a dense layer, one dequantized copy else)."""
        w = self._w_absorb
        if w is None or w.dtype != dtype:
            w = dense_weight(self.kv_b_proj, dtype)
            if self._kernels(w):
                self._w_absorb = w
        w = w.view(self.num_heads, self.nope + self.v_dim, -1)
        return w[:, : self.nope], w[:, self.nope :]

    def _stored_absorb_weight(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """kv_b_proj as stored, when the absorbed-product kernels
        (kernels/attention/mla_absorb.py) read that format: block-FP8 with 128x128 scales or
        16-bit. Decided once per layer."""
        if self._absorb_stored is None:
            from moeserve.kernels.attention.mla_absorb import check_absorb_weight

            self._absorb_stored = False
            layer = self.kv_b_proj
            method = layer.method
            stored: tuple[torch.Tensor, torch.Tensor | None] | None = None
            if isinstance(method, SchemeLinearMethod):
                stored = method.scheme.elementwise_view(method.tensors(layer))
            elif isinstance(method, UnquantizedLinearMethod):
                stored = (layer.weight, None)
            if stored is not None:
                try:
                    check_absorb_weight(*stored, self.num_heads, self.nope, self.v_dim)
                    self._absorb_stored = stored
                except ValueError as e:
                    log.info("MLA: absorbed products through bmm (%s)", e)
        return self._absorb_stored or None

    def _absorb(
        self, x: torch.Tensor, out: torch.Tensor, mode: str, cache_write: CacheWrite | None = None
    ) -> bool:
        """out = the absorbed product `mode` ("uk": q_nope @ W_UK, "uv": o_lat @ W_UV^T) of
        x [T, h, *]: the kernel on the stored weight for decode-sized T, else bmm on the
        dense weight. True where the kernel ran, and then it also did `cache_write`."""
        from moeserve.kernels.attention.mla_absorb import absorb_gemv, absorb_max_rows

        if self.batch_invariant:  # per head x [T, *] @ W^T by the batch-invariant GEMM
            from moeserve.kernels.gemm.invariant import gemm16

            w_uk, w_uv = self._absorb_weights(x.dtype)
            w = w_uk.transpose(1, 2) if mode == "uk" else w_uv  # [h, N, K] views
            gemm16(x.transpose(0, 1), w, out=out.transpose(0, 1))
            return False
        stored = self._stored_absorb_weight()
        if stored is not None and x.shape[0] <= absorb_max_rows(mode, stored[0], self.num_heads):
            absorb_gemv(x, *stored, out, mode, self.nope, cache_write=cache_write)
            return True
        w_uk, w_uv = self._absorb_weights(x.dtype)
        if mode == "uk":
            torch.bmm(x.transpose(0, 1), w_uk, out=out.transpose(0, 1))
        else:
            torch.bmm(x.transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))
        return False

    # ---- compute -------------------------------------------------------------------------------
    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        q, c, k_pe = self._project(x)
        if self._native_ok and q.dtype == torch.bfloat16:
            o = self._forward_native(positions, q, c, k_pe, ctx.attn)
        elif self._kernels(q):
            o = self._forward_kernels(positions, q, c, k_pe, ctx.attn)
        else:
            o = self._forward_torch(positions, q, c, k_pe, ctx.attn)
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
            norm_kernels = self.use_kernels or qn.kernels  # as RMSNorm decides
            if norm_kernels and qkv.dtype == qn.weight.dtype == kvn.weight.dtype:
                from moeserve.kernels.elementwise.norm import rms_norm_pair

                # both a-norms in one launch, in place; the rope columns stay as they are
                rms_norm_pair(qkv, qn.weight, kvn.weight, qn.eps, kvn.eps, out=qkv)
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
        fused = self.fused_qkv_a_proj
        if fused is None or not (x.is_cuda and fused.dense_gemv) or fused.bias is not None:
            return None
        if not isinstance(fused.method, UnquantizedLinearMethod):
            return None
        from moeserve.kernels.gemm.w16_gemv import NormSegment, w16_gemv, w16_gemv_supported

        if not w16_gemv_supported(x, fused.weight):
            return None
        qn, kvn = self.q_a_layernorm, self.kv_a_layernorm
        norms = (
            NormSegment(0, self.q_lora, qn.weight, qn.eps),
            NormSegment(self.q_lora, self.kv_lora, kvn.weight, kvn.eps),
        )
        ws = getattr(fused, "w16_workspace", None)
        return w16_gemv(x, fused.weight, norms=norms, workspace=ws)

    def _forward_kernels(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        c: torch.Tensor,
        k_pe: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        """Absorbed MLA for every token through the Triton kernels -> [T, h, v]."""
        from moeserve.kernels.attention.kv_cache import CacheRope, CacheWrite, write_mla_cache
        from moeserve.kernels.attention.mla_decode import mla_decode
        from moeserve.kernels.attention.mla_prefill import mla_prefill

        tokens, heads, lat = q.shape[0], self.num_heads, self.kv_lora
        # absorbed query [T, h, L + R]: q_nope @ W_UK straight into its first L columns, and
        # roped q_pe into the last R by the launch that ropes k_pe and writes the cache: the
        # W_UK kernel's own at decode sizes, else a launch of its own
        q_abs = q.new_empty(tokens, heads, lat + self.rope)
        rot = self.rotary[0]
        kv_scale = self.kv_scale if self.kv_cache.dtype == torch.float8_e4m3fn else None
        rope = CacheRope(positions, rot.cos, rot.sin, q[..., self.nope :], q_abs[..., lat:])
        write = CacheWrite(c, k_pe, self.kv_cache, md.slot_mapping, kv_scale, rope)
        if not self._absorb(q[..., : self.nope], q_abs[..., :lat], "uk", write):
            write_mla_cache(c, k_pe, self.kv_cache, md.slot_mapping, kv_scale, rope)
        o_lat = q.new_empty(tokens, heads, lat)
        if self.batch_invariant:  # every row through one kernel: key tiles from position 0
            mla_prefill(
                q_abs,
                self.kv_cache,
                md.query_start,
                md.seq_lens,
                md.block_tables,
                self.scale,
                o_lat,
                kv_scale=kv_scale,
                max_q_len=max(md.query_lens_host),
            )
            o = q.new_empty(tokens, heads, self.v_dim)
            self._absorb(o_lat, o, "uv")
            return o
        n_dec = md.num_decode_seqs  # the leading one-token sequences = the first n_dec tokens
        if n_dec:
            kernel, ws, splits = mla_decode, None, None
            if self._decode_scratch is not None:
                plan = self._decode_scratch.workspace(
                    n_dec, md.block_tables.shape[1] * md.page_size
                )
                if plan is not None:
                    kernel, ws, splits = plan
            kernel(
                q_abs[:n_dec],
                self.kv_cache,
                md.block_tables[:n_dec],
                md.seq_lens[:n_dec],
                self.scale,
                o_lat[:n_dec],
                kv_scale=kv_scale,
                num_splits=splits,
                workspace=ws,
            )
        if n_dec < md.num_seqs:  # prefill chunks: causal over their cached context + themselves
            mla_prefill(
                q_abs,
                self.kv_cache,
                md.query_start[n_dec:],
                md.seq_lens[n_dec:],
                md.block_tables[n_dec:],
                self.scale,
                o_lat,
                kv_scale=kv_scale,
                max_q_len=md.max_prefill_query_len,
            )
        o = q.new_empty(tokens, heads, self.v_dim)
        self._absorb(o_lat, o, "uv")
        return o

    def _forward_torch(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        c: torch.Tensor,
        k_pe: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        q_nope, q_pe = self._rope_and_write(positions, q, c, k_pe, md)
        if md.is_decode_only:
            return self._absorbed(q_nope, q_pe, md)
        return self._expanded(q_nope, q_pe, md)

    def _rope_and_write(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        c: torch.Tensor,
        k_pe: torch.Tensor,
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """torch and native paths: (q_nope, roped q_pe), the step's cache rows written."""
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        q_pe, k_pe = self.rotary[0](positions, q_pe, k_pe.unsqueeze(1))
        self._write(c, k_pe.squeeze(1), md.slot_mapping)
        return q_nope, q_pe

    def _forward_native(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        c: torch.Tensor,
        k_pe: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        """Every row in the absorbed form through the native CPU kernels."""
        from moeserve.kernels import cpu as cpu_kernels

        q_nope, q_pe = self._rope_and_write(positions, q, c, k_pe, md)
        tokens, heads, lat = q.shape[0], self.num_heads, self.kv_lora
        uk, uv = self._native_absorb
        q_abs = q.new_empty(tokens, heads, self.latent_dim)
        for h in range(heads):
            q_abs[:, h, :lat] = cpu_kernels.linear(q_nope[:, h], uk[h])
        q_abs[:, :, lat:] = q_pe
        rows = self.kv_cache.unsqueeze(2)  # [pages, page, 1 KV head, L + R]: keys and values
        o_lat = cpu_kernels.attention(
            q_abs,
            rows,
            rows,
            md.block_tables,
            md.query_lens_host,
            md.seq_lens_host,
            self.scale,
            lat,
        )
        o = q.new_empty(tokens, heads, self.v_dim)
        for h in range(heads):
            o[:, h] = cpu_kernels.linear(o_lat[:, h], uv[h])
        return o

    def _expanded(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """Per sequence: expand its cached latents to per-head keys/values, causal SDPA."""
        q = torch.cat([q_nope, q_pe], dim=-1)
        out = q.new_empty(q.shape[0], self.num_heads, self.v_dim)
        start = 0
        for b, (qlen, slen) in enumerate(zip(md.query_lens_host, md.seq_lens_host, strict=True)):
            rows = self._gather(md.block_tables[b], slen, md.page_size, q.dtype)
            kv = self.kv_b_proj(rows[:, : self.kv_lora]).view(slen, self.num_heads, -1)
            k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
            k_pe = rows[:, None, self.kv_lora :].expand(slen, self.num_heads, self.rope)
            k = torch.cat([k_nope, k_pe], dim=-1)
            # query i sits at absolute position slen - qlen + i and sees keys <= it
            mask = torch.ones(qlen, slen, dtype=torch.bool, device=q.device).tril(slen - qlen)
            o = F.scaled_dot_product_attention(
                q[start : start + qlen].transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=mask,
                scale=self.scale,
            )
            out[start : start + qlen] = o.transpose(0, 1)
            start += qlen
        return out

    def _absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """torch path: one query per sequence, attending the 576-wide latent rows directly."""
        dtype = q_nope.dtype
        w_uk, w_uv = self._absorb_weights(dtype)  # [h, nope, L], [h, v, L]
        q_lat = torch.einsum("bhd,hdl->bhl", q_nope, w_uk)
        q = torch.cat([q_lat, q_pe], dim=-1)  # [B, h, L + R]
        length, ps = md.max_seq_len, md.page_size
        pages = md.block_tables[:, : -(-length // ps)].long()
        rows = self._dequant(self.kv_cache[pages].flatten(1, 2)[:, :length], dtype)  # [B, n, L+R]
        scores = torch.einsum("bhd,bnd->bhn", q, rows).float() * self.scale
        valid = torch.arange(length, device=q.device)[None, :] < md.seq_lens[:, None]
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        p = scores.softmax(dim=-1).to(dtype)
        o_lat = torch.einsum("bhn,bnl->bhl", p, rows[..., : self.kv_lora])
        return torch.einsum("bhl,hvl->bhv", o_lat, w_uv)
