"""Write MLA latent rows into the paged cache (quantised on write for FP8).

Layouts:

- ``c``            ``[T, 512]`` normalised latent (after kv_a_layernorm), last dim contiguous.
- ``k_pe``         ``[T, 64]`` key rope part (already roped, or raw with ``rope``), last dim
                   contiguous (any row stride: c and k_pe may be column views of one buffer).
- ``kv_cache``     ``[num_pages, page_size, 576]`` bf16 / fp16 / fp32 or float8_e4m3fn; last
                   dim contiguous. Row = ``[c | k_pe]``.
- ``slot_mapping`` ``[T]`` int64, ``page * page_size + offset``; negative -> token skipped
                   (padding of a CUDA-graph batch).
- ``kv_scale``     FP8 only: one-element fp32 tensor; stored = sat(value / scale) with
                   saturation to +-448 (e4m3 has no inf) and round-to-nearest-even.

RoPE fused into the write (``rope=CacheRope(positions, cos, sin, q_pe, q_pe_out)``): ``k_pe``
is the RAW key rope part, rotated before it is stored, and ``q_pe`` (``[T, H, 64]``, any
token/head strides, e.g. the rope columns of the q_b_proj output viewed ``[T, H, 192]``) is
rotated too, in place or into ``q_pe_out`` (e.g. the rope columns of the absorbed decode
query ``[T, H, 576]``). DeepSeek's interleaved pairing: (x[2i], x[2i+1]) rotate by the angle
of frequency i, with ``cos``/``sin`` ``[max_position, 32]`` fp32 tables (``RotaryEmbedding``'s,
YaRN included). Rotated values are computed in fp32 and rounded to their tensor's dtype (as
the torch path does) before the FP8 quantisation. Padding tokens (slot < 0) still get their q
rotated.

Programs run over (token, block of q heads): each rotates its heads, the first of a token
also writes the token's 576-wide row. The launch depends only on T and H, so it can be
captured in a CUDA graph with static input buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeserve.kernels.attention.mla_decode import KV_LORA_RANK, LATENT_DIM, ROPE_DIM
from moeserve.kernels.formats import E4M3_MAX

# Query heads each program rotates. One program per token rotating all 128 heads took
# 18 us on an H200 (64 heads: 11 us), a third of an attention block at batch 1; programs
# over head blocks spread that over the SMs.
_ROPE_HEADS_PER_PROGRAM = 16


@triton.jit
def _rotate_pairs(x1, x2, cos, sin):
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _pairs(ptrs, mask, ROWS: tl.constexpr, HALF: tl.constexpr):
    """(even, odd) fp32 halves of ``ROWS`` contiguous rows of ``2 * HALF`` values: one
    contiguous (vectorised) load, split into the rotation pairs in registers."""
    if mask is None:
        x = tl.load(ptrs).to(tl.float32)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return tl.split(tl.reshape(x, [ROWS, HALF, 2]))


@triton.jit
def _interleave(y1, y2, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    return tl.reshape(tl.join(y1, y2), [ROWS, WIDTH])


@triton.jit
def rope_write_program(
    t,
    hb,
    c_ptr,
    pe_ptr,
    kv_ptr,
    slot_ptr,
    scale_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    qo_ptr,
    stride_c,
    stride_pe,
    stride_kv_page,
    stride_kv_tok,
    page_size,  # runtime: any page size >= 1 (value 1 gets its own specialisation)
    stride_cs,
    num_heads,
    stride_qt,
    stride_qh,
    stride_qot,
    stride_qoh,
    D_LAT: tl.constexpr,
    D_ROPE: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    ROPE: tl.constexpr,
    HAS_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Token t's share of a rope + cache write (module docstring): rotate its query heads
    hb * BLOCK_H .. + BLOCK_H; for hb == 0 also write its cache row. The arguments after
    (t, hb) are `CacheWrite.kernel_args`' in order, so another launch can carry the write
    (mla_absorb's W_UK kernel at decode rows)."""
    t64 = t.to(tl.int64)
    HALF: tl.constexpr = D_ROPE // 2
    offs_r = tl.arange(0, D_ROPE)
    if ROPE:
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cos = tl.load(cos_ptr + pos * stride_cs + tl.arange(0, HALF))[None, :]
        sin = tl.load(sin_ptr + pos * stride_cs + tl.arange(0, HALF))[None, :]
        if HAS_Q:
            offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
            mask_q = (offs_h < num_heads)[:, None] & (offs_r < D_ROPE)[None, :]
            q = q_ptr + t64 * stride_qt + offs_h[:, None] * stride_qh + offs_r[None, :]
            q1, q2 = _pairs(q, mask_q, BLOCK_H, HALF)
            r1, r2 = _rotate_pairs(q1, q2, cos, sin)
            qo = qo_ptr + t64 * stride_qot + offs_h[:, None] * stride_qoh + offs_r[None, :]
            r = _interleave(r1, r2, BLOCK_H, D_ROPE)
            tl.store(qo, r.to(qo_ptr.dtype.element_ty), mask=mask_q)
    if hb == 0:
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            row = kv_ptr + (slot // page_size) * stride_kv_page + (slot % page_size) * stride_kv_tok
            offs_d = tl.arange(0, D_LAT)
            c = tl.load(c_ptr + t64 * stride_c + offs_d).to(tl.float32)
            pe_row = pe_ptr + t64 * stride_pe + offs_r[None, :]
            if ROPE:
                x1, x2 = _pairs(pe_row, None, 1, HALF)
                y1, y2 = _rotate_pairs(x1, x2, cos, sin)
                # the torch path stores the rotated key in the activation dtype first
                y = _interleave(y1, y2, 1, D_ROPE).to(pe_ptr.dtype.element_ty)
                pe = y.to(tl.float32)
            else:
                pe = tl.load(pe_row).to(tl.float32)
            if QUANT:
                scale = tl.load(scale_ptr).to(tl.float32)
                # IEEE division so the result matches torch's x / scale bit for bit.
                c = tl.clamp(tl.div_rn(c, scale), -FP8_MAX, FP8_MAX)
                pe = tl.clamp(tl.div_rn(pe, scale), -FP8_MAX, FP8_MAX)
            dst = kv_ptr.dtype.element_ty
            tl.store(row + offs_d, c.to(dst))
            tl.store(row + D_LAT + offs_r[None, :], pe.to(dst))


@triton.jit
def _write_mla_cache_kernel(
    c_ptr,
    pe_ptr,
    kv_ptr,
    slot_ptr,
    scale_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    qo_ptr,
    stride_c,
    stride_pe,
    stride_kv_page,
    stride_kv_tok,
    page_size,
    stride_cs,
    num_heads,
    stride_qt,
    stride_qh,
    stride_qot,
    stride_qoh,
    D_LAT: tl.constexpr,
    D_ROPE: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    ROPE: tl.constexpr,
    HAS_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # Grid (tokens, head blocks): every program rotates BLOCK_H query heads of its token,
    # the first one also writes the token's cache row.
    rope_write_program(
        tl.program_id(0), tl.program_id(1), c_ptr, pe_ptr, kv_ptr, slot_ptr, scale_ptr,
        pos_ptr, cos_ptr, sin_ptr, q_ptr, qo_ptr, stride_c, stride_pe, stride_kv_page,
        stride_kv_tok, page_size, stride_cs, num_heads, stride_qt, stride_qh, stride_qot,
        stride_qoh, D_LAT, D_ROPE, QUANT, FP8_MAX, ROPE, HAS_Q, BLOCK_H,
    )  # fmt: skip


@dataclass(frozen=True)
class CacheRope:
    """The RoPE stage of a cache write (see the module docstring)."""

    positions: torch.Tensor  # [T] int64 (or int32) token positions
    cos: torch.Tensor  # [max_position, 32] fp32
    sin: torch.Tensor  # [max_position, 32] fp32
    q_pe: torch.Tensor | None = None  # [T, H, 64], last dim contiguous
    q_pe_out: torch.Tensor | None = None  # like q_pe; None: rotate q_pe in place


def _check(
    c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None,
    rope: CacheRope | None = None,
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
    if rope is None:
        return
    if rope.positions.shape != (tokens,) or rope.positions.dtype not in (torch.int64, torch.int32):
        raise ValueError("positions must be [T] int64 or int32")
    half = ROPE_DIM // 2
    for name, tab in (("cos", rope.cos), ("sin", rope.sin)):
        if tab.dim() != 2 or tab.shape[1] != half or tab.dtype != torch.float32:
            raise ValueError(f"{name} must be an fp32 [max_position, {half}] table")
    if rope.cos.stride() != rope.sin.stride() or rope.cos.stride(1) != 1:
        raise ValueError("cos and sin must share one row-major layout")
    for name, q in (("q_pe", rope.q_pe), ("q_pe_out", rope.q_pe_out)):
        if q is not None and (
            q.dim() != 3 or q.shape[::2] != (tokens, ROPE_DIM) or q.stride(-1) != 1
        ):
            raise ValueError(f"{name} must be [T, H, {ROPE_DIM}] with a contiguous last dim")
    if rope.q_pe_out is not None and (rope.q_pe is None or rope.q_pe_out.shape != rope.q_pe.shape):
        raise ValueError("q_pe_out needs q_pe, and the same shape")


@dataclass(frozen=True)
class CacheWrite:
    """One rope + cache write (arguments of :func:`write_mla_cache`), checked on creation,
    as the launch arguments of `rope_write_program`, so that it can run in its own launch
    or inside another one."""

    c: torch.Tensor
    k_pe: torch.Tensor
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    kv_scale: torch.Tensor | None = None
    rope: CacheRope | None = None

    def __post_init__(self) -> None:
        _check(self.c, self.k_pe, self.kv_cache, self.slot_mapping, self.kv_scale, self.rope)

    @property
    def heads(self) -> int:
        """Query heads rotated (1 without a query)."""
        q = self.rope.q_pe if self.rope is not None else None
        return q.shape[1] if q is not None else 1

    def kernel_args(self) -> tuple[tuple, dict]:
        """(runtime arguments, constexprs except BLOCK_H) of `rope_write_program` after
        (t, hb). Tensors that a stage does not use are replaced by `c` (never read)."""
        c, k_pe, kv_cache, rope = self.c, self.k_pe, self.kv_cache, self.rope
        quant = kv_cache.dtype == torch.float8_e4m3fn
        q = rope.q_pe if rope is not None else None
        qo = (rope.q_pe_out if rope.q_pe_out is not None else q) if rope is not None else None
        args = (
            c,
            k_pe,
            kv_cache,
            self.slot_mapping,
            self.kv_scale if quant else c,
            rope.positions if rope is not None else self.slot_mapping,
            rope.cos if rope is not None else c,
            rope.sin if rope is not None else c,
            q if q is not None else c,
            qo if qo is not None else c,
            c.stride(0),
            k_pe.stride(0),
            kv_cache.stride(0),
            kv_cache.stride(1),
            kv_cache.shape[1],
            rope.cos.stride(0) if rope is not None else 0,
            self.heads,
            q.stride(0) if q is not None else 0,
            q.stride(1) if q is not None else 0,
            qo.stride(0) if qo is not None else 0,
            qo.stride(1) if qo is not None else 0,
        )
        constexprs = dict(
            D_LAT=KV_LORA_RANK,
            D_ROPE=ROPE_DIM,
            QUANT=quant,
            FP8_MAX=E4M3_MAX,
            ROPE=rope is not None,
            HAS_Q=q is not None,
        )
        return args, constexprs

    def launch(self) -> None:
        """Run the write in a launch of its own."""
        if self.c.shape[0] == 0:
            return
        args, constexprs = self.kernel_args()
        block_h = min(triton.next_power_of_2(self.heads), _ROPE_HEADS_PER_PROGRAM)
        grid = (self.c.shape[0], triton.cdiv(self.heads, block_h))
        _write_mla_cache_kernel[grid](*args, **constexprs, BLOCK_H=block_h, num_warps=2)


def write_mla_cache(
    c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    rope: CacheRope | None = None,
) -> None:
    """Store row ``[c[t] | k_pe[t]]`` at ``slot_mapping[t]`` for every t with a slot >= 0;
    with ``rope``, k_pe is rotated before it is stored and q_pe rotated too (one launch)."""
    CacheWrite(c, k_pe, kv_cache, slot_mapping, kv_scale, rope).launch()


def rope_interleaved_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved RoPE of ``x [..., 64]`` with per-token ``cos``/``sin`` rows
    broadcast against it ([..., 32] fp32); computed in fp32, returned in x's dtype."""
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    y = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return y.to(x.dtype)


def write_mla_cache_ref(
    c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    rope: CacheRope | None = None,
) -> None:
    """torch reference of :func:`write_mla_cache`."""
    _check(c, k_pe, kv_cache, slot_mapping, kv_scale, rope)
    if rope is not None:
        pos = rope.positions.long()
        cos, sin = rope.cos[pos], rope.sin[pos]  # [T, 32]
        k_pe = rope_interleaved_ref(k_pe, cos, sin)
        if rope.q_pe is not None:
            q = rope_interleaved_ref(rope.q_pe, cos[:, None], sin[:, None])
            (rope.q_pe_out if rope.q_pe_out is not None else rope.q_pe).copy_(q)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    rows = torch.cat([c[keep], k_pe[keep]], dim=-1).float()
    if kv_cache.dtype == torch.float8_e4m3fn:
        rows = (rows / kv_scale.float().reshape(())).clamp(-E4M3_MAX, E4M3_MAX)
    page_size = kv_cache.shape[1]
    kv_cache[slots // page_size, slots % page_size] = rows.to(kv_cache.dtype)
