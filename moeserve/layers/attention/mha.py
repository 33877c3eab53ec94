"""Multi-head (GQA) attention over a paged KV cache (CPU path).

Cache contract: `k_cache`, `v_cache` each [num_pages, page_size, num_kv_heads, head_dim];
token t of a sequence lives at page block_table[t // page_size], offset t % page_size.

Two implementations: the native CPU kernel (`moeserve.kernels.cpu.attention`, bf16 cache:
every query row computed by one fixed order over its keys, so a position's output does not
depend on how its sequence was split into steps, nor on the batch), and torch's SDPA / flash
kernels (fp32 cache for decode; `batch_invariant` makes it batch-invariant at a cost).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.kernels import cpu as cpu_kernels
from moeserve.layers.attention.metadata import AttentionMetadata, ForwardContext
from moeserve.layers.kernel_plan import KernelPlan

# torch's CPU flash attention splits keys into blocks of this many (from position 0)
INVARIANT_BLOCK = 512


class PagedAttention(nn.Module):
    # decode slices the cache by host-side sequence lengths: not capturable in a CUDA graph
    supports_cuda_graph = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # batch-invariant attention (deterministic mode): each query row gets the same
        # arithmetic alone or in any batch, chunk or prefix-cache split (see `_invariant`)
        self.batch_invariant = False
        self.native = False  # the native CPU kernel serves (the kernel plan; a bf16 cache)
        self._native_ok = False

    def use_kernel_plan(self, plan: KernelPlan) -> None:
        self.native = plan.cpu_native
        self.batch_invariant = plan.invariant

    # ---- cache contract used by the runner ------------------------------------------------
    def kv_cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_kv_heads * self.head_dim * dtype.itemsize

    def bind_kv_cache(
        self, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        shape = (num_pages, page_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self._native_ok = self.native and dtype == torch.bfloat16 and self.head_dim % 2 == 0

    # ---- compute ---------------------------------------------------------------------------
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] (new tokens) -> [T, H, D]. Sequences with one new
        token at the front of the batch decode together; each other sequence prefills."""
        md = ctx.attn
        kf = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
        vf = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
        kf.index_copy_(0, md.slot_mapping, k if k.dtype == kf.dtype else k.to(kf.dtype))
        vf.index_copy_(0, md.slot_mapping, v if v.dtype == vf.dtype else v.to(vf.dtype))
        if self._native_ok and q.dtype == torch.bfloat16:
            return cpu_kernels.attention(
                q,
                self.k_cache,
                self.v_cache,
                md.block_tables,
                md.query_lens_host,
                md.seq_lens_host,
                self.scale,
                self.head_dim,
            )
        if self.batch_invariant and q.device.type == "cpu":
            return self._invariant(q, md)
        nd = md.num_decode_seqs
        if nd == md.num_seqs:
            # decode attention runs in the cache dtype (fp32 on CPUs: torch's CPU SDPA is
            # faster there for one query row)
            return self._decode(q.to(kf.dtype), md, nd).to(q.dtype)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd].to(kf.dtype), md, nd).to(q.dtype)
        start = nd
        for b in range(nd, md.num_seqs):
            qlen, slen = md.query_lens_host[b], md.seq_lens_host[b]
            rows = slice(start, start + qlen)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], slen - qlen, md, b)
            start += qlen
        return out

    def _invariant(self, q: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Every sequence, decode or prefill chunk, through one canonical computation: its
        keys from the cache (fp32) zero-padded to whole blocks of INVARIANT_BLOCK, positions
        after each query masked, torch's CPU flash kernel. That kernel walks keys in blocks of
        512 from position 0 (for 512 keys or more), so a query row sees the same blocks with
        the same values whatever else is in the call: its arithmetic, hence its result, is
        the same alone, batched, chunked or after a prefix-cache hit. (Padded batched SDPA
        and flash calls of different lengths round differently, ~1e-7, enough to flip a
        greedy token now and then.)"""
        out = torch.empty_like(q)
        groups = self.num_heads // self.num_kv_heads
        start = 0
        for b in range(md.num_seqs):
            qlen, slen = md.query_lens_host[b], md.seq_lens_host[b]
            padded = -(-slen // INVARIANT_BLOCK) * INVARIANT_BLOCK
            k, v = self._gather(md.block_tables[b], slen, md.page_size)  # [KVH, slen, D]
            pad = (0, 0, 0, padded - slen)
            k = F.pad(k.float(), pad)[None]
            v = F.pad(v.float(), pad)[None]
            pos = torch.arange(slen - qlen, slen, device=q.device)[:, None]
            mask = torch.zeros(qlen, padded, device=q.device)
            mask.masked_fill_(torch.arange(padded, device=q.device)[None, :] > pos, float("-inf"))
            qb = q[start : start + qlen].float().transpose(0, 1)[None]
            o, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qb,
                _repeat(k, groups),
                _repeat(v, groups),
                0.0,
                False,
                attn_mask=mask,
                scale=self.scale,
            )
            out[start : start + qlen] = o[0].transpose(0, 1).to(q.dtype)
            start += qlen
        return out

    def _gather(
        self, table: torch.Tensor, n: int, page_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pages = table[: -(-n // page_size)].long()
        k = self.k_cache.index_select(0, pages).flatten(0, 1)[:n]  # [n, KVH, D]
        v = self.v_cache.index_select(0, pages).flatten(0, 1)[:n]
        return k.transpose(0, 1), v.transpose(0, 1)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        context: int,
        md: AttentionMetadata,
        b: int,
    ) -> torch.Tensor:
        """One sequence's chunk of `T` new tokens after `context` cached ones, in the
        activation dtype. On a CPU through the flash kernel: causal over the new tokens, and
        (when there is context) a second pass over the cached keys, merged by log-sum-exp,
        so time stays linear in the chunk and nothing of size T x (context + T) is built."""
        qh = q.transpose(0, 1)[None]  # [1, H, T, D]
        kn, vn = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, KVH, T, D]
        if q.device.type != "cpu":  # the portable path: one masked SDPA over everything
            kc, vc = self._gather(md.block_tables[b], context + q.shape[0], md.page_size)
            t, n = q.shape[0], context + q.shape[0]
            mask = torch.ones(t, n, dtype=torch.bool, device=q.device).tril(context)
            o = F.scaled_dot_product_attention(
                qh,
                kc[None].to(q.dtype),
                vc[None].to(q.dtype),
                attn_mask=mask,
                scale=self.scale,
                enable_gqa=True,
            )
            return o[0].transpose(0, 1)
        groups = self.num_heads // self.num_kv_heads
        o, lse = _flash_cpu(
            qh, _repeat(kn, groups), _repeat(vn, groups), is_causal=True, scale=self.scale
        )
        if context:
            kc, vc = self._gather(md.block_tables[b], context, md.page_size)
            o2, lse2 = _flash_cpu(
                qh,
                _repeat(kc[None].to(q.dtype), groups),
                _repeat(vc[None].to(q.dtype), groups),
                is_causal=False,
                scale=self.scale,
            )
            o = _merge(o, lse, o2, lse2).to(q.dtype)
        return o[0].transpose(0, 1)

    def _decode(self, q: torch.Tensor, md: AttentionMetadata, n: int) -> torch.Tensor:
        """One new token for each of the first n sequences: gather each one's keys, pad, one
        batched SDPA."""
        ps = md.page_size
        lens = md.seq_lens_host[:n]
        L = max(lens)
        if n == 1:  # nothing to pad: no mask
            k, v = self._gather(md.block_tables[0], L, ps)
            o = F.scaled_dot_product_attention(
                q.unsqueeze(2), k[None], v[None], scale=self.scale, enable_gqa=True
            )
            return o.squeeze(2)
        pages = md.block_tables[:n, : -(-L // ps)]
        k = self.k_cache[pages].flatten(1, 2)[:, :L].transpose(1, 2)  # [B, KVH, L, D]
        v = self.v_cache[pages].flatten(1, 2)[:, :L].transpose(1, 2)
        valid = torch.arange(L, device=q.device)[None, :] < md.seq_lens[:n, None]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            k,
            v,
            attn_mask=valid[:, None, None, :],
            scale=self.scale,
            enable_gqa=True,
        )
        return o.squeeze(2)


def _repeat(x: torch.Tensor, groups: int) -> torch.Tensor:
    """KV heads repeated for their query heads ([1, KVH, L, D] -> [1, H, L, D])."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _flash_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU flash attention: output [1, H, T, D] and log-sum-exp [1, H, T] (fp32)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, scale=scale
    )
    return out, lse


def _merge(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> torch.Tensor:
    """Attention over two disjoint key sets combined exactly from their outputs and
    log-sum-exps (fp32)."""
    m = torch.maximum(lse1, lse2)
    w1 = (lse1 - m).exp().unsqueeze(-1)
    w2 = (lse2 - m).exp().unsqueeze(-1)
    return (o1.float() * w1 + o2.float() * w2) / (w1 + w2)
