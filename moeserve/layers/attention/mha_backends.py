"""The implementations of GQA attention over the paged K/V cache (`PagedAttention`).

The kernel plan picks one class of `BACKENDS` (`KernelPlan.mha`); each attention layer builds
its own instance. All of them read and write the layer's caches after it has stored the
step's rows:

- `NativeMHA`: the native CPU kernel (`moeserve.kernels.cpu.attention`, bf16 cache): every
  query row computed by one fixed order over its keys, so a position's output depends
  neither on how its sequence was split into steps nor on the batch;
- `TorchMHA`: torch's SDPA and CPU flash kernels (fp32 cache for decode on CPUs);
- `InvariantTorchMHA` (--deterministic on a CPU): every sequence through one canonical
  computation (`attend`), the same alone, batched, chunked or after a prefix-cache hit.

None of them is capturable in a CUDA graph: decode slices the cache by host-side lengths.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F

from moeserve.kernels import cpu as cpu_kernels
from moeserve.layers.attention.metadata import AttentionMetadata

# torch's CPU flash attention splits keys into blocks of this many (from position 0)
INVARIANT_BLOCK = 512


class MHALayer(Protocol):
    """What a backend reads of its attention layer (`PagedAttention`'s public attributes)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    k_cache: torch.Tensor  # [pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor


class MHABackend(Protocol):
    name: ClassVar[str]
    label: ClassVar[str]
    capturable: ClassVar[bool]

    def for_cache(self, dtype: torch.dtype) -> MHABackend:
        """The backend that serves a cache of `dtype` (itself, where it reads that dtype)."""

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, H, D] and the step's k / v [T, KVH, D] (already in the cache) -> [T, H, D]."""


class TorchMHA:
    """Sequences with one new token at the front of the batch decode together (one padded
    SDPA); each other sequence prefills on its own."""

    name: ClassVar[str] = "torch"
    label: ClassVar[str] = "torch SDPA"
    capturable: ClassVar[bool] = False

    def __init__(self, layer: MHALayer) -> None:
        self.layer = layer

    def for_cache(self, dtype: torch.dtype) -> MHABackend:
        return self

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        kv_dtype = self.layer.k_cache.dtype
        nd = md.num_decode_seqs
        if nd == md.num_seqs:
            # decode attention runs in the cache dtype (fp32 on CPUs: torch's CPU SDPA is
            # faster there for one query row)
            return self.decode(q.to(kv_dtype), md, nd).to(q.dtype)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self.decode(q[:nd].to(kv_dtype), md, nd).to(q.dtype)
        start = nd
        for b in range(nd, md.num_seqs):
            qlen, slen = md.query_lens_host[b], md.seq_lens_host[b]
            rows = slice(start, start + qlen)
            out[rows] = self.prefill(q[rows], k[rows], v[rows], slen - qlen, md, b)
            start += qlen
        return out

    def gather(
        self, table: torch.Tensor, n: int, page_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n keys and values of a sequence's pages: [KVH, n, D] each."""
        a = self.layer
        pages = table[: -(-n // page_size)].long()
        k = a.k_cache.index_select(0, pages).flatten(0, 1)[:n]  # [n, KVH, D]
        v = a.v_cache.index_select(0, pages).flatten(0, 1)[:n]
        return k.transpose(0, 1), v.transpose(0, 1)

    def prefill(
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
        a = self.layer
        qh = q.transpose(0, 1)[None]  # [1, H, T, D]
        kn, vn = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, KVH, T, D]
        if q.device.type != "cpu":  # the portable path: one masked SDPA over everything
            kc, vc = self.gather(md.block_tables[b], context + q.shape[0], md.page_size)
            t, n = q.shape[0], context + q.shape[0]
            mask = torch.ones(t, n, dtype=torch.bool, device=q.device).tril(context)
            o = F.scaled_dot_product_attention(
                qh,
                kc[None].to(q.dtype),
                vc[None].to(q.dtype),
                attn_mask=mask,
                scale=a.scale,
                enable_gqa=True,
            )
            return o[0].transpose(0, 1)
        groups = a.num_heads // a.num_kv_heads
        o, lse = _flash_cpu(
            qh, _repeat(kn, groups), _repeat(vn, groups), is_causal=True, scale=a.scale
        )
        if context:
            kc, vc = self.gather(md.block_tables[b], context, md.page_size)
            o2, lse2 = _flash_cpu(
                qh,
                _repeat(kc[None].to(q.dtype), groups),
                _repeat(vc[None].to(q.dtype), groups),
                is_causal=False,
                scale=a.scale,
            )
            o = _merge(o, lse, o2, lse2).to(q.dtype)
        return o[0].transpose(0, 1)

    def decode(self, q: torch.Tensor, md: AttentionMetadata, n: int) -> torch.Tensor:
        """One new token for each of the first n sequences: gather each one's keys, pad, one
        batched SDPA."""
        a = self.layer
        ps = md.page_size
        lens = md.seq_lens_host[:n]
        L = max(lens)
        if n == 1:  # nothing to pad: no mask
            k, v = self.gather(md.block_tables[0], L, ps)
            o = F.scaled_dot_product_attention(
                q.unsqueeze(2), k[None], v[None], scale=a.scale, enable_gqa=True
            )
            return o.squeeze(2)
        pages = md.block_tables[:n, : -(-L // ps)]
        k = a.k_cache[pages].flatten(1, 2)[:, :L].transpose(1, 2)  # [B, KVH, L, D]
        v = a.v_cache[pages].flatten(1, 2)[:, :L].transpose(1, 2)
        valid = torch.arange(L, device=q.device)[None, :] < md.seq_lens[:n, None]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            k,
            v,
            attn_mask=valid[:, None, None, :],
            scale=a.scale,
            enable_gqa=True,
        )
        return o.squeeze(2)


class InvariantTorchMHA(TorchMHA):
    name = "torch-invariant"
    label = "torch SDPA, batch-invariant"

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """Every sequence, decode or prefill chunk, through one canonical computation: its
        keys from the cache (fp32) zero-padded to whole blocks of INVARIANT_BLOCK, positions
        after each query masked, torch's CPU flash kernel. That kernel walks keys in blocks of
        512 from position 0 (for 512 keys or more), so a query row sees the same blocks with
        the same values whatever else is in the call: its arithmetic, hence its result, is
        the same alone, batched, chunked or after a prefix-cache hit. (Padded batched SDPA
        and flash calls of different lengths round differently, ~1e-7, enough to flip a
        greedy token now and then.) Other devices: the torch path."""
        if q.device.type != "cpu":
            return super().attend(q, k, v, md)
        a = self.layer
        out = torch.empty_like(q)
        groups = a.num_heads // a.num_kv_heads
        start = 0
        for b in range(md.num_seqs):
            qlen, slen = md.query_lens_host[b], md.seq_lens_host[b]
            padded = -(-slen // INVARIANT_BLOCK) * INVARIANT_BLOCK
            kc, vc = self.gather(md.block_tables[b], slen, md.page_size)  # [KVH, slen, D]
            pad = (0, 0, 0, padded - slen)
            kc = F.pad(kc.float(), pad)[None]
            vc = F.pad(vc.float(), pad)[None]
            pos = torch.arange(slen - qlen, slen, device=q.device)[:, None]
            mask = torch.zeros(qlen, padded, device=q.device)
            mask.masked_fill_(torch.arange(padded, device=q.device)[None, :] > pos, float("-inf"))
            qb = q[start : start + qlen].float().transpose(0, 1)[None]
            o, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qb,
                _repeat(kc, groups),
                _repeat(vc, groups),
                0.0,
                False,
                attn_mask=mask,
                scale=a.scale,
            )
            out[start : start + qlen] = o[0].transpose(0, 1).to(q.dtype)
            start += qlen
        return out


class NativeMHA(TorchMHA):
    """The native CPU kernel over a bf16 cache (the kernel plan chooses it for bf16
    activations and even head widths)."""

    name = "native"
    label = "native CPU paged attention"

    def for_cache(self, dtype: torch.dtype) -> MHABackend:
        return self if dtype == torch.bfloat16 else TorchMHA(self.layer)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        a = self.layer
        return cpu_kernels.attention(
            q,
            a.k_cache,
            a.v_cache,
            md.block_tables,
            md.query_lens_host,
            md.seq_lens_host,
            a.scale,
            a.head_dim,
        )


BACKENDS: dict[str, type[TorchMHA]] = {
    cls.name: cls for cls in (TorchMHA, InvariantTorchMHA, NativeMHA)
}


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
