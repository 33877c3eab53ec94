"""MLA prefill with a cached prefix (chunked prefill), causal, over the paged latent cache.

Form chosen: the ABSORBED form, the same math as decode (see mla_decode.py). Each new
token's absorbed query ``[q_nope @ W_UK_T | q_pe]`` (576) attends the cached latent rows
(prefix + the new tokens themselves, which the caller writes with ``write_mla_cache``
first), values are the first 512 of each row, and the caller applies ``W_UV`` to the
512-wide output. Why: it reads the cache directly (no kv_b_proj expansion of the whole
prefix into per-head K/V, no extra buffers, works for FP8 caches the same way), and is
exactly what decode computes, so chunked prefill and decode agree. Cost: 576+512 MACs per
(query, key, head) instead of 192+128 in the expanded form, so very long fresh prompts
are compute-heavier than an expanded-form flash-attention would be (correctness first).

Layouts:

- ``q``            ``[T_total, H, 576]``: new tokens of all sequences, concatenated.
- ``kv_cache``     ``[num_pages, page_size, 576]`` bf16 / fp16 / fp32 / float8_e4m3fn
                   (``kv_scale`` for FP8), any page_size >= 1.
- ``cu_seqlens_q`` ``[B+1]`` int32: new tokens of sequence b are rows
                   ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of ``q``. It may start above 0:
                   the MLA layer passes the tail of a mixed batch's query_start (its
                   leading decode rows go to mla_decode) and rows outside are untouched.
- ``seq_lens``     ``[B]`` int32: prefix + new tokens in the cache; the new tokens are the
                   last ``q_len`` cached positions, so query i of b sits at position
                   ``seq_lens[b] - q_len_b + i`` and sees keys ``0..position`` (causal).
- ``block_tables`` ``[B, max_pages]`` int32.
- ``out``          ``[T_total, H, 512]``, preallocated, written and returned.

Programs: (sequence, tile of BLOCK_M new tokens, head group of BLOCK_H heads); the
BLOCK_M x BLOCK_H (token, head) pairs form the rows of one tensor-core tile, since all
heads share the single latent KV head. ``max_q_len`` (a host int) sizes the grid; pass it
to avoid a device sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeserve.kernels.attention.mla_decode import (
    KV_LORA_RANK,
    LATENT_DIM,
    LOG2E,
    ROPE_DIM,
    gather_latent_rows,
)


@dataclass(frozen=True)
class MLAPrefillConfig:
    block_m: int = 4  # new tokens per program
    block_h: int = 16  # heads per program; block_m * block_h >= 16 rows (tl.dot minimum)
    block_n: int = 32  # keys per tile
    num_warps: int = 8
    num_stages: int = 2


DEFAULT_PREFILL_CONFIG = MLAPrefillConfig()


@triton.jit
def _mla_prefill_kernel(
    q_ptr,
    kv_ptr,
    bt_ptr,
    cu_q_ptr,
    seq_lens_ptr,
    scale_ptr,
    out_ptr,
    qk_scale,  # sm_scale * log2(e)
    num_heads,
    stride_qt,
    stride_qh,
    stride_kv_page,
    stride_kv_tok,
    page_size,  # runtime: any page size >= 1 (value 1 gets its own specialisation)
    stride_btb,
    stride_ot,
    stride_oh,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_LAT: tl.constexpr,
    D_ROPE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    b = tl.program_id(0)
    mt = tl.program_id(1)
    hg = tl.program_id(2)
    ROWS: tl.constexpr = BLOCK_M * BLOCK_H

    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len

    r = tl.arange(0, ROWS)
    q_idx = mt * BLOCK_M + r // BLOCK_H
    head = hg * BLOCK_H + r % BLOCK_H
    row_ok = (q_idx < q_len) & (head < num_heads)
    pos = prefix + q_idx  # causal limit of each row (inclusive)

    offs_d = tl.arange(0, D_LAT)
    offs_r = tl.arange(0, D_ROPE)
    offs_n = tl.arange(0, BLOCK_N)
    q_rows = q_ptr + (q_start + q_idx).to(tl.int64) * stride_qt + head * stride_qh
    q_lat = tl.load(q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    q_pe = tl.load(q_rows[:, None] + D_LAT + offs_r[None, :], mask=row_ok[:, None], other=0.0)
    q_lat = q_lat.to(tl.bfloat16)
    q_pe = q_pe.to(tl.bfloat16)

    if HAS_SCALE:
        kv_scale = tl.load(scale_ptr).to(tl.float32)
    else:
        kv_scale = 1.0
    score_scale = qk_scale * kv_scale

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_LAT], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    # Keys beyond the last row's position are masked for every row of this program.
    kv_hi = tl.minimum(seq_len, prefix + (mt + 1) * BLOCK_M)
    n_tiles = tl.where(mt * BLOCK_M < q_len, tl.cdiv(kv_hi, BLOCK_N), 0)

    for tile in range(0, n_tiles):
        tok = tile * BLOCK_N + offs_n
        mask_n = tok < kv_hi
        page = tl.load(bt_row + tok // page_size, mask=mask_n, other=0)
        row = page.to(tl.int64) * stride_kv_page + (tok % page_size) * stride_kv_tok
        k_lat = tl.load(kv_ptr + row[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        k_pe = tl.load(
            kv_ptr + row[:, None] + D_LAT + offs_r[None, :], mask=mask_n[:, None], other=0.0
        )
        k_lat = k_lat.to(tl.bfloat16)
        k_pe = k_pe.to(tl.bfloat16)

        s = tl.dot(q_lat, tl.trans(k_lat))
        s = tl.dot(q_pe, tl.trans(k_pe), s)
        keep = mask_n[None, :] & (tok[None, :] <= pos[:, None])
        s = tl.where(keep, s * score_scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with no visible key yet keeps m = -inf; use 0 so exp2 gives 0, not NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(tl.bfloat16), k_lat, acc)
        m_i = m_new

    has = l_i > 0.0
    inv_l = tl.where(has, kv_scale / tl.where(has, l_i, 1.0), 0.0)
    o = acc * inv_l[:, None]
    o_rows = out_ptr + (q_start + q_idx).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(
        o_rows[:, None] + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def _check(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    out: torch.Tensor,
    kv_scale: torch.Tensor | None,
) -> None:
    if q.dim() != 3 or q.shape[-1] != LATENT_DIM or q.stride(-1) != 1:
        raise ValueError(f"q must be [T, H, {LATENT_DIM}] with a contiguous last dim")
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != LATENT_DIM or kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache must be [pages, page_size, {LATENT_DIM}]")
    page_size = kv_cache.shape[1]
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    batch = seq_lens.shape[0]
    if cu_seqlens_q.shape != (batch + 1,) or block_tables.shape[0] != batch:
        raise ValueError("cu_seqlens_q must be [B+1] and block_tables [B, max_pages]")
    for t in (cu_seqlens_q, seq_lens, block_tables):
        if t.dtype != torch.int32:
            raise ValueError("cu_seqlens_q, seq_lens and block_tables must be int32")
    if out.shape != (q.shape[0], q.shape[1], KV_LORA_RANK) or out.stride(-1) != 1:
        raise ValueError(f"out must be [T, H, {KV_LORA_RANK}] with a contiguous last dim")
    if kv_cache.dtype == torch.float8_e4m3fn and (kv_scale is None or kv_scale.numel() != 1):
        raise ValueError("an FP8 cache needs kv_scale, a one-element fp32 tensor")


def mla_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    max_q_len: int | None = None,
    config: MLAPrefillConfig = DEFAULT_PREFILL_CONFIG,
) -> torch.Tensor:
    """Causal absorbed-form MLA over prefix + new tokens; writes ``out [T, H, 512]``.

    The new tokens' rows must already be in the cache. ``max_q_len`` defaults to the
    largest ``cu_seqlens_q`` difference (one device->host sync).
    """
    _check(q, kv_cache, cu_seqlens_q, seq_lens, block_tables, out, kv_scale)
    batch, heads = seq_lens.shape[0], q.shape[1]
    if batch == 0 or q.shape[0] == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if config.block_m * config.block_h < 16:
        raise ValueError("block_m * block_h must be >= 16 (tensor-core tile rows)")
    has_scale = kv_cache.dtype == torch.float8_e4m3fn
    grid = (batch, triton.cdiv(max_q_len, config.block_m), triton.cdiv(heads, config.block_h))
    _mla_prefill_kernel[grid](
        q,
        kv_cache,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        kv_scale if has_scale else out,
        out,
        float(sm_scale) * LOG2E,
        heads,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.shape[1],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_M=config.block_m,
        BLOCK_H=config.block_h,
        BLOCK_N=config.block_n,
        D_LAT=KV_LORA_RANK,
        D_ROPE=ROPE_DIM,
        HAS_SCALE=has_scale,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def mla_prefill_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    max_q_len: int | None = None,
) -> torch.Tensor:
    """fp32 torch reference of :func:`mla_prefill` (``max_q_len`` is ignored)."""
    del max_q_len
    _check(q, kv_cache, cu_seqlens_q, seq_lens, block_tables, out, kv_scale)
    cu = cu_seqlens_q.tolist()
    for b, total in enumerate(seq_lens.tolist()):
        lo, hi = cu[b], cu[b + 1]
        if hi == lo:
            continue
        kv = gather_latent_rows(kv_cache, block_tables[b], total, kv_scale)
        qb = q[lo:hi].float().transpose(0, 1)  # [H, q_len, 576]
        scores = (qb @ kv.t()) * sm_scale  # [H, q_len, total]
        positions = torch.arange(total - (hi - lo), total, device=q.device)
        visible = torch.arange(total, device=q.device)[None, :] <= positions[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[lo:hi] = (probs @ kv[:, :KV_LORA_RANK]).transpose(0, 1).to(out.dtype)
    return out
