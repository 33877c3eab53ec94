"""Write MLA latent rows into the paged cache (quantised on write for FP8).

Layouts:

- ``c``            ``[T, 512]`` normalised latent (after kv_a_layernorm), last dim contiguous.
- ``k_pe``         ``[T, 64]`` roped key, last dim contiguous.
- ``kv_cache``     ``[num_pages, page_size, 576]`` bf16 / fp16 / fp32 or float8_e4m3fn; last
                   dim contiguous. Row = ``[c | k_pe]``.
- ``slot_mapping`` ``[T]`` int64, ``page * page_size + offset``; negative -> token skipped
                   (padding of a CUDA-graph batch).
- ``kv_scale``     FP8 only: one-element fp32 tensor; stored = sat(value / scale) with
                   saturation to +-448 (e4m3 has no inf) and round-to-nearest-even.

One program per token writes its whole 576-wide row; the launch depends only on T, so it
can be captured in a CUDA graph with static input buffers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.mla_decode import FP8_E4M3_MAX, KV_LORA_RANK, LATENT_DIM, ROPE_DIM


@triton.jit
def _write_mla_cache_kernel(
    c_ptr,
    pe_ptr,
    kv_ptr,
    slot_ptr,
    scale_ptr,
    stride_c,
    stride_pe,
    stride_kv_page,
    stride_kv_tok,
    page_size,  # runtime: any page size >= 1 (value 1 gets its own specialisation)
    D_LAT: tl.constexpr,
    D_ROPE: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    valid = slot >= 0
    safe = tl.where(valid, slot, 0)
    row = kv_ptr + (safe // page_size) * stride_kv_page + (safe % page_size) * stride_kv_tok
    offs_d = tl.arange(0, D_LAT)
    offs_r = tl.arange(0, D_ROPE)
    c = tl.load(c_ptr + t.to(tl.int64) * stride_c + offs_d).to(tl.float32)
    pe = tl.load(pe_ptr + t.to(tl.int64) * stride_pe + offs_r).to(tl.float32)
    if QUANT:
        scale = tl.load(scale_ptr).to(tl.float32)
        # IEEE division so the result matches torch's x / scale bit for bit.
        c = tl.clamp(tl.div_rn(c, scale), -FP8_MAX, FP8_MAX)
        pe = tl.clamp(tl.div_rn(pe, scale), -FP8_MAX, FP8_MAX)
    dst = kv_ptr.dtype.element_ty
    tl.store(row + offs_d, c.to(dst), mask=valid & (offs_d < D_LAT))
    tl.store(row + D_LAT + offs_r, pe.to(dst), mask=valid & (offs_r < D_ROPE))


def _check(
    c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None,
) -> None:
    tokens = c.shape[0]
    if c.shape != (tokens, KV_LORA_RANK) or c.stride(-1) != 1:
        raise ValueError(f"c must be [T, {KV_LORA_RANK}] with a contiguous last dim")
    if k_pe.shape != (tokens, ROPE_DIM) or k_pe.stride(-1) != 1:
        raise ValueError(f"k_pe must be [T, {ROPE_DIM}] with a contiguous last dim")
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != LATENT_DIM or kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache must be [pages, page_size, {LATENT_DIM}]")
    if slot_mapping.shape != (tokens,) or slot_mapping.dtype != torch.int64:
        raise ValueError("slot_mapping must be [T] int64")
    if kv_cache.dtype == torch.float8_e4m3fn and (kv_scale is None or kv_scale.numel() != 1):
        raise ValueError("an FP8 cache needs kv_scale, a one-element fp32 tensor")


def write_mla_cache(
    c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Store row ``[c[t] | k_pe[t]]`` at ``slot_mapping[t]`` for every t with a slot >= 0."""
    _check(c, k_pe, kv_cache, slot_mapping, kv_scale)
    if c.shape[0] == 0:
        return
    quant = kv_cache.dtype == torch.float8_e4m3fn
    _write_mla_cache_kernel[(c.shape[0],)](
        c,
        k_pe,
        kv_cache,
        slot_mapping,
        kv_scale if quant else c,
        c.stride(0),
        k_pe.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.shape[1],
        D_LAT=KV_LORA_RANK,
        D_ROPE=ROPE_DIM,
        QUANT=quant,
        FP8_MAX=FP8_E4M3_MAX,
        num_warps=2,
    )


def write_mla_cache_ref(
    c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """torch reference of :func:`write_mla_cache` (also the CPU path)."""
    _check(c, k_pe, kv_cache, slot_mapping, kv_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    rows = torch.cat([c[keep], k_pe[keep]], dim=-1).float()
    if kv_cache.dtype == torch.float8_e4m3fn:
        rows = (rows / kv_scale.float().reshape(())).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    page_size = kv_cache.shape[1]
    kv_cache[slots // page_size, slots % page_size] = rows.to(kv_cache.dtype)
