"""Multi-head (GQA) attention over a paged KV cache; torch implementation (CPU path).

Cache contract: `k_cache`, `v_cache` each [num_pages, page_size, num_kv_heads, head_dim];
token t of a sequence lives at page block_table[t // page_size], offset t % page_size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.layers.attention.metadata import ForwardContext


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

    # ---- cache contract used by the runner ------------------------------------------------
    def kv_cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_kv_heads * self.head_dim * dtype.itemsize

    def bind_kv_cache(
        self, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        shape = (num_pages, page_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    # ---- compute ---------------------------------------------------------------------------
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] (new tokens) -> [T, H, D]."""
        md = ctx.attn
        kf = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
        vf = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
        kf.index_copy_(0, md.slot_mapping, k if k.dtype == kf.dtype else k.to(kf.dtype))
        vf.index_copy_(0, md.slot_mapping, v if v.dtype == vf.dtype else v.to(vf.dtype))
        # attention runs in the cache dtype (fp32 on CPUs: torch's CPU SDPA is faster there)
        act, q = q.dtype, q.to(kf.dtype)
        if md.is_decode_only:
            return self._decode(q, md).to(act)
        out = torch.empty_like(q)
        start = 0
        for b, (qlen, slen) in enumerate(zip(md.query_lens_host, md.seq_lens_host, strict=True)):
            keys, vals = self._gather(md.block_tables[b], slen, md.page_size)
            qb = q[start : start + qlen].transpose(0, 1)  # [H, q, D]
            # causal with an offset: query i (absolute position slen-qlen+i) sees keys <= it
            mask = torch.ones(qlen, slen, dtype=torch.bool, device=q.device).tril(slen - qlen)
            o = F.scaled_dot_product_attention(
                qb, keys, vals, attn_mask=mask, scale=self.scale, enable_gqa=True
            )
            out[start : start + qlen] = o.transpose(0, 1)
            start += qlen
        return out.to(act)

    def _gather(
        self, table: torch.Tensor, n: int, page_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pages = table[: -(-n // page_size)].long()
        k = self.k_cache.index_select(0, pages).flatten(0, 1)[:n]  # [n, KVH, D]
        v = self.v_cache.index_select(0, pages).flatten(0, 1)[:n]
        return k.transpose(0, 1), v.transpose(0, 1)

    def _decode(self, q: torch.Tensor, md) -> torch.Tensor:
        """One new token per sequence: gather each sequence's keys, pad, one batched SDPA."""
        L, ps = md.max_seq_len, md.page_size
        if md.num_seqs == 1:  # nothing to pad: no mask
            k, v = self._gather(md.block_tables[0], L, ps)
            o = F.scaled_dot_product_attention(
                q.unsqueeze(2), k[None], v[None], scale=self.scale, enable_gqa=True
            )
            return o.squeeze(2)
        pages = md.block_tables[:, : -(-L // ps)]
        k = self.k_cache[pages].flatten(1, 2)[:, :L].transpose(1, 2)  # [B, KVH, L, D]
        v = self.v_cache[pages].flatten(1, 2)[:, :L].transpose(1, 2)
        valid = torch.arange(L, device=q.device)[None, :] < md.seq_lens[:, None]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            k,
            v,
            attn_mask=valid[:, None, None, :],
            scale=self.scale,
            enable_gqa=True,
        )
        return o.squeeze(2)
