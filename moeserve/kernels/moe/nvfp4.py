"""Fused NVFP4 mixture-of-experts (W4A16): align -> gate_up+SiLU*up -> down*weight -> combine.

Weight layout (stacked experts, ModelOpt NVFP4 per expert, see nvfp4_gemm.py):
  w13        uint8         [E, 2I, H/2]   gate rows 0..I-1, then up rows I..2I-1
  w13_scale  float8_e4m3fn [E, 2I, H/16]
  w13_gs     fp32          [E]            one global scale per expert shared by gate and up. A
                                          checkpoint with separate gate/up globals is loaded as
                                          gs = max(gs_gate, gs_up) and the other half's block
                                          scales rescaled by gs_own/gs (the loader's job).
  w2         uint8         [E, H, I/2]
  w2_scale   float8_e4m3fn [E, H, I/16]
  w2_gs      fp32          [E]
Routing: topk_ids int32 [M, k], topk_weights fp32 [M, k]. Output [M, H] in x.dtype:
  out[m] = sum_j topk_weights[m, j] * down_e(silu(gate_e(x_m)) * up_e(x_m)),  e = topk_ids[m, j]
over the slots with 0 <= e < E: with expert parallelism the ids are local to this rank's E
experts and other ranks' experts are out of range (their slots are skipped, not computed).

Kernels: one single-program Triton kernel sorts the M*k (token, expert) slots by expert into
blocks of BLOCK_M rows (padding slots = M*k); each expert's weights are then streamed once per
block of its tokens, so a decode step (few tokens x 8 experts) reads each touched expert once.
The intermediate (M*k x I, bf16) and the per-slot down output (M*k x H, fp32) are the only
round trips through memory; a last small kernel sums each token's k rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeserve.kernels.configs import max_rows, min_rows, tile_config
from moeserve.kernels.gemm.nvfp4_format import NVFP4_BLOCK, dequantize_nvfp4
from moeserve.kernels.gemm.nvfp4_gemm import (
    default_decode,
    dot_acc,
    gemv_mma_enabled,
    load_act_t,
    load_decode_tile,
)
from moeserve.kernels.gemm.nvfp4_gemv import GEMV_F16_EXP, gemv_accumulate
from moeserve.kernels.gemm.nvfp4_gemv_mma import (
    MMA_STEP_K,
    mma_accumulate,
    mma_rows,
    mma_supported,
)
from moeserve.kernels.gemm.splitk import ACC_FIX_EXP, slot_x_rows
from moeserve.kernels.pdl import pdl_launch, pdl_start
from moeserve.kernels.runtime import interpreting

ALIGN_CHUNK = 1024  # slots handled per vector step inside the single-program align kernel
ALIGN_BCHUNK = 32  # blocks per step when mapping blocks to experts ([32, E] compare)


# ----------------------------------------------------------------------------------------------
# Torch reference
# ----------------------------------------------------------------------------------------------


def fused_moe_nvfp4_ref(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_gs: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_gs: torch.Tensor,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Loop over the experts that received tokens; fp32 math, intermediate rounded to x.dtype
    (as the fused kernel stores it). Ids outside [0, E) (another rank's experts) add nothing;
    `accumulate` adds the result to `out`'s values."""
    m, _ = x.shape
    inter_size = w13.shape[1] // 2
    acc = torch.zeros(m, x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        if not 0 <= e < w13.shape[0]:
            continue
        rows, cols = (topk_ids == e).nonzero(as_tuple=True)
        w13_e = dequantize_nvfp4(w13[e], w13_scale[e], w13_gs[e], torch.float32)
        w2_e = dequantize_nvfp4(w2[e], w2_scale[e], w2_gs[e], torch.float32)
        h = x[rows].float() @ w13_e.t()
        g, u = h[:, :inter_size], h[:, inter_size:]
        a = (torch.nn.functional.silu(g) * u).to(x.dtype).float()
        y = a @ w2_e.t()
        acc.index_add_(0, rows, y * topk_weights[rows, cols].float()[:, None])
    if accumulate:
        acc += out.float()
    res = acc.to(x.dtype)
    if out is not None:
        out.copy_(res)
        return out
    return res


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _moe_align_kernel(
    ids_ptr,
    sorted_ptr,
    expert_ids_ptr,
    counts_ptr,
    ranks_ptr,
    Mk,
    E,
    max_blocks,
    sorted_len,
    BLOCK_M: tl.constexpr,
    E_P: tl.constexpr,
    CHUNK: tl.constexpr,
    BCHUNK: tl.constexpr,
    SORT_CHUNKS: tl.constexpr,
    SLOT_CHUNKS: tl.constexpr,
    BLK_CHUNKS: tl.constexpr,
):
    """One program. sorted[b*BLOCK_M + r] = slot (or Mk = padding) for block b whose expert is
    expert_ids[b] (-1 = unused block). Ranks within an expert come from atomics, so the order of
    slots inside an expert is arbitrary (the sum does not care). Loops run over constexpr chunk
    counts (the interpreter cannot loop over run-time bounds)."""
    offs = tl.arange(0, CHUNK)
    e_offs = tl.arange(0, E_P)
    e_mask = e_offs < E
    tl.store(counts_ptr + e_offs, tl.zeros((E_P,), tl.int32), mask=e_mask)
    for ci in range(SORT_CHUNKS):
        o = ci * CHUNK + offs
        tl.store(sorted_ptr + o, tl.full((CHUNK,), 0, tl.int32) + Mk, mask=o < sorted_len)
    tl.debug_barrier()
    for ci in range(SLOT_CHUNKS):
        o = ci * CHUNK + offs
        ids = tl.load(ids_ptr + o, mask=o < Mk, other=-1)
        msk = (o < Mk) & (ids >= 0) & (ids < E)  # other ranks' experts (EP) are skipped
        ids = tl.where(msk, ids, 0)
        rank = tl.atomic_add(counts_ptr + ids, tl.full((CHUNK,), 1, tl.int32), mask=msk)
        tl.store(ranks_ptr + o, rank, mask=msk)
    tl.debug_barrier()
    cnt = tl.load(counts_ptr + e_offs, mask=e_mask, other=0, volatile=True)
    blocks = (cnt + BLOCK_M - 1) // BLOCK_M
    cum_end = tl.cumsum(blocks, 0)
    total = tl.sum(blocks, 0)
    # expert of block b = number of experts whose blocks all end at or before b
    b_offs = tl.arange(0, BCHUNK)
    for ci in range(BLK_CHUNKS):
        b = ci * BCHUNK + b_offs
        ends_before = (cum_end[None, :] <= b[:, None]) & e_mask[None, :]
        eid = tl.sum(ends_before.to(tl.int32), 1)
        eid = tl.where(b < total, eid, -1)
        tl.store(expert_ids_ptr + b, eid, mask=b < max_blocks)
    tl.debug_barrier()
    # first block of each expert, kept in counts_ptr (already read above)
    tl.store(counts_ptr + e_offs, cum_end - blocks, mask=e_mask)
    tl.debug_barrier()
    for ci in range(SLOT_CHUNKS):
        o = ci * CHUNK + offs
        ids = tl.load(ids_ptr + o, mask=o < Mk, other=-1)
        msk = (o < Mk) & (ids >= 0) & (ids < E)
        ids = tl.where(msk, ids, 0)
        rank = tl.load(ranks_ptr + o, mask=msk, other=0, volatile=True)
        st = tl.load(counts_ptr + ids, mask=msk, other=0, volatile=True)
        tl.store(sorted_ptr + st * BLOCK_M + rank, o, mask=msk)


@triton.jit
def _moe_gate_up_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    inter_ptr,
    sorted_ptr,
    expert_ids_ptr,
    Mk,
    INTER,
    H,
    stride_xm,
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_ITERS: tl.constexpr,
    DECODE: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """inter[slot, n] = silu(gate) * up for the slots of block pid(1), columns of tile pid(0).
    Gate rows n and up rows INTER+n are decoded in the same loop so x is read once for both."""
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_b)
    if expert < 0:
        return
    slots = tl.load(sorted_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = slots[None, :] < Mk
    x_rows = x_ptr + (slots[None, :] // TOPK).to(tl.int64) * stride_xm
    KW = H // 8  # int32 words of 8 codes
    KG = H // 16
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n[:, None] < INTER
    w_e = w_ptr + expert.to(tl.int64) * (2 * INTER) * KW
    s_e = s_ptr + expert.to(tl.int64) * (2 * INTER) * KG
    g_rows = w_e + offs_n[:, None].to(tl.int64) * KW
    u_rows = w_e + (offs_n[:, None] + INTER).to(tl.int64) * KW
    gs_rows = s_e + offs_n[:, None].to(tl.int64) * KG
    us_rows = s_e + (offs_n[:, None] + INTER).to(tl.int64) * KG
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for it in range(K_ITERS):
        kw0 = it * (BLOCK_K // 8)
        xt = load_act_t(x_rows, m_mask, kw0, H, BLOCK_K)
        g = load_decode_tile(g_rows, gs_rows, n_mask, kw0, KW, KG, BLOCK_N, BLOCK_K, DECODE)
        acc_g = dot_acc(g, xt, acc_g, DOT_F32)
        u = load_decode_tile(u_rows, us_rows, n_mask, kw0, KW, KG, BLOCK_N, BLOCK_K, DECODE)
        acc_u = dot_acc(u, xt, acc_u, DOT_F32)
    gs = tl.load(gs_ptr + expert) * (2.0**ACC_FIX_EXP)
    g = acc_g * gs
    u = acc_u * gs
    h = g / (1.0 + tl.exp(-g)) * u
    ptrs = inter_ptr + slots[None, :].to(tl.int64) * INTER + offs_n[:, None]
    tl.store(ptrs, h.to(inter_ptr.dtype.element_ty), mask=n_mask & m_mask)


@triton.jit
def _moe_down_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    y_ptr,
    sorted_ptr,
    expert_ids_ptr,
    topk_w_ptr,
    Mk,
    H,
    INTER,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_ITERS: tl.constexpr,
    DECODE: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """y[slot, n] = topk_weight[slot] * (inter[slot] @ W2_e^T)[n], fp32."""
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_b)
    if expert < 0:
        return
    slots = tl.load(sorted_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < Mk
    m_mask = valid[None, :]
    a_rows = a_ptr + slots[None, :].to(tl.int64) * INTER
    KW = INTER // 8
    KG = INTER // 16
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n[:, None] < H
    w_rows = w_ptr + expert.to(tl.int64) * H * KW + offs_n[:, None].to(tl.int64) * KW
    s_rows = s_ptr + expert.to(tl.int64) * H * KG + offs_n[:, None].to(tl.int64) * KG
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for it in range(K_ITERS):
        kw0 = it * (BLOCK_K // 8)
        at = load_act_t(a_rows, m_mask, kw0, INTER, BLOCK_K)
        w = load_decode_tile(w_rows, s_rows, n_mask, kw0, KW, KG, BLOCK_N, BLOCK_K, DECODE)
        acc = dot_acc(w, at, acc, DOT_F32)
    wt = tl.load(topk_w_ptr + slots, mask=valid, other=0.0)
    acc = acc * (tl.load(gs_ptr + expert) * (2.0**ACC_FIX_EXP)) * wt[None, :]
    ptrs = y_ptr + slots[None, :].to(tl.int64) * H + offs_n[:, None]
    tl.store(ptrs, acc, mask=n_mask & m_mask)


@triton.jit
def block_expert(expert_ids_ptr, pid_b, num_experts, DIRECT: tl.constexpr):
    """Expert of block pid_b, or -1 (skip the block). Aligned blocks carry -1 themselves;
    direct blocks (see block_slots) read the routed id, which is out of [0, E) for another
    rank's expert."""
    expert = tl.load(expert_ids_ptr + pid_b)
    if DIRECT:
        expert = tl.where((expert >= 0) & (expert < num_experts), expert, -1)
    return expert


@triton.jit
def block_slots(sorted_ptr, pid_b, Mk, MP: tl.constexpr, DIRECT: tl.constexpr = 0):
    """The slots of aligned block pid_b (MP of them; the rest, and padding, are Mk). DIRECT:
    one token's slots, which name distinct experts, so block b is slot b alone and
    expert_ids is the routed ids themselves: no alignment launch."""
    if DIRECT:
        s0 = pid_b
    else:
        s0 = tl.load(sorted_ptr + pid_b * MP)
    base = sorted_ptr + pid_b * MP
    s1 = s0 * 0 + Mk
    s2 = s1
    s3 = s1
    if not DIRECT:
        if MP > 1:
            s1 = tl.load(base + 1)
        if MP > 2:
            s2 = tl.load(base + 2)
            s3 = tl.load(base + 3)
    return s0, s1, s2, s3


@triton.jit
def _store_gate_up(acc, slot, Mk, gs, inter_ptr, offs_n, INTER, BLOCK_N: tl.constexpr):
    """acc [2*BLOCK_N, BW/2] (gate rows, then up rows) -> inter[slot, offs_n] = silu(g) * u."""
    _store_gate_up_sum(tl.sum(acc, axis=1), slot, Mk, gs, inter_ptr, offs_n, INTER, BLOCK_N)


@triton.jit
def _store_gate_up_sum(v, slot, Mk, gs, inter_ptr, offs_n, INTER, BLOCK_N: tl.constexpr):
    """v [2*BLOCK_N] row sums (gate rows, then up rows) -> inter[slot, offs_n]."""
    v = v * gs
    g, u = tl.split(tl.permute(tl.reshape(v, (2, BLOCK_N)), (1, 0)))
    h = g / (1.0 + tl.exp(-g)) * u
    ptrs = inter_ptr + slot.to(tl.int64) * INTER + offs_n
    tl.store(ptrs, h.to(inter_ptr.dtype.element_ty), mask=(offs_n < INTER) & (slot < Mk))


@triton.jit
def split_k_total(acc, ws_ptr, cnt_ptr, W: tl.constexpr, SPLIT_K: tl.constexpr):
    """Split-K exchange of one tile's row sums (acc [W, *] -> [W]) in a grid (blocks, column
    tiles, SPLIT_K): each of the tile's SPLIT_K programs stores its partial in the workspace
    (no zeroing needed) and arrives at the tile's counter; the last to arrive gets (True, the
    partials summed in split order: the same total whatever the arrival order) and re-zeroes
    the counter; the others get (False, _)."""
    num_tiles = tl.num_programs(0) * tl.num_programs(1)
    tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    pid_k = tl.program_id(2)
    offs = tl.arange(0, W)
    tl.store(ws_ptr + (pid_k * num_tiles + tile).to(tl.int64) * W + offs, tl.sum(acc, axis=1))
    tl.debug_barrier()  # every thread's partial precedes the release below
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
    last = arrived == SPLIT_K - 1
    total = tl.zeros((W,), dtype=tl.float32)
    if last:
        for j in tl.static_range(SPLIT_K):
            # .cg: other SMs wrote these partials; read them from L2, never a stale L1 line
            part = ws_ptr + (j * num_tiles + tile).to(tl.int64) * W + offs
            total += tl.load(part, cache_modifier=".cg")
        tl.store(cnt_ptr + tile, 0)
    return last, total


@triton.jit
def _moe_gate_up_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    inter_ptr,
    sorted_ptr,
    expert_ids_ptr,
    num_experts,
    Mk,
    INTER,
    H,
    stride_xm,
    ws_ptr,
    cnt_ptr,
    TOPK: tl.constexpr,
    MP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_ITERS: tl.constexpr,
    DECODE: tl.constexpr,
    PREFETCH: tl.constexpr,
    STAGES: tl.constexpr = 0,
    F16: tl.constexpr = 0,
    DIRECT: tl.constexpr = 0,
    EVEN: tl.constexpr = 0,
    SPLIT_K: tl.constexpr = 1,
    PDL: tl.constexpr = 0,
):
    """CUDA-core decode path of _moe_gate_up_kernel: block pid(0) (MP slots of one expert),
    gate rows and up rows of column tile pid(1) decoded as one [2*BLOCK_N] row tile, so every
    x element loaded serves both. Blocks vary fastest: the blocks of one expert read the same
    weight tile at about the same time, from L2 after the first.
    SPLIT_K > 1 (MP == 1): pid(2) takes K_ITERS of the K tiles; the partial sums meet in the
    workspace `ws_ptr` [SPLIT_K, blocks x column tiles, 2*BLOCK_N] and the tile's last
    program applies SiLU (split_k_total). For few experts per rank (expert parallelism):
    more programs in flight, each with a shorter K loop.
    PDL: waits for the previous kernel (the router: the experts) first (kernels/pdl.py)."""
    z = pdl_start(PDL)
    x_ptr += z
    inter_ptr += z
    sorted_ptr += z
    expert_ids_ptr += z
    ws_ptr += z
    cnt_ptr += z
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    expert = block_expert(expert_ids_ptr, pid_b, num_experts, DIRECT)
    if expert < 0:
        return
    BW: tl.constexpr = BLOCK_K // 8
    KW = H // 8
    s0, s1, s2, s3 = block_slots(sorted_ptr, pid_b, Mk, MP, DIRECT)
    r = tl.arange(0, 2 * BLOCK_N)
    offs_n = pid_n * BLOCK_N + r % BLOCK_N
    w_row = offs_n + (r >= BLOCK_N).to(tl.int32) * INTER
    n_ok = (offs_n < INTER)[:, None]
    w_rows = w_ptr + (expert.to(tl.int64) * 2 * INTER + w_row[:, None]) * KW
    s_rows = s_ptr + (expert.to(tl.int64) * 2 * INTER + w_row[:, None]) * (KW // 2)
    x_rows, oks = slot_x_rows(x_ptr, (s0, s1, s2, s3), TOPK, stride_xm, Mk)
    acc0, acc1, acc2, acc3 = gemv_accumulate(
        x_rows,
        oks,
        w_rows,
        s_rows,
        n_ok,
        pid_k * K_ITERS * BW,
        KW,
        H,
        2 * BLOCK_N,
        BW,
        MP,
        K_ITERS,
        DECODE,
        PREFETCH,
        0,
        STAGES,
        F16,
        EVEN,
    )
    gs = tl.load(gs_ptr + expert) * (2.0**GEMV_F16_EXP)
    on = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if SPLIT_K > 1:
        last, total = split_k_total(acc0, ws_ptr, cnt_ptr, 2 * BLOCK_N, SPLIT_K)
        if last:
            _store_gate_up_sum(total, s0, Mk, gs, inter_ptr, on, INTER, BLOCK_N)
        return
    _store_gate_up(acc0, s0, Mk, gs, inter_ptr, on, INTER, BLOCK_N)
    if MP > 1:
        _store_gate_up(acc1, s1, Mk, gs, inter_ptr, on, INTER, BLOCK_N)
    if MP > 2:
        _store_gate_up(acc2, s2, Mk, gs, inter_ptr, on, INTER, BLOCK_N)
        _store_gate_up(acc3, s3, Mk, gs, inter_ptr, on, INTER, BLOCK_N)


@triton.jit
def combine_if_last(
    counter_ptr,
    y_ptr,
    ids_ptr,
    out_ptr,
    Mk,
    H,
    num_experts,
    pid_n,
    BLOCK_N: tl.constexpr,
    SLOTS_P2: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    """Down + combine in one launch for one token (direct blocks): each program of column
    tile pid_n arrives at the tile's counter once its y rows are stored; the last to arrive
    sums the tile over the token's slots (as moe_combine_kernel does) and resets the
    counter for the next launch (CUDA-graph replays included). The slots' rows are one
    load, so the tail costs one L2 round trip, not one per slot."""
    tl.debug_barrier()  # every thread's y stores precede the release below
    arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        msk = offs < H
        j = tl.arange(0, SLOTS_P2)
        e = tl.load(ids_ptr + j, mask=j < Mk, other=-1)
        ok = (j < Mk) & (e >= 0) & (e < num_experts)
        # one token's slots: j * H stays far below 2^31. .cg: other SMs wrote these rows;
        # read them from L2, never a stale L1 line
        rows = y_ptr + j[:, None] * H + offs[None, :]
        acc = tl.sum(
            tl.load(rows, mask=ok[:, None] & msk[None, :], other=0.0, cache_modifier=".cg"), 0
        )
        if ACCUMULATE:
            acc += tl.load(out_ptr + offs, mask=msk, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=msk)
        tl.store(counter_ptr + pid_n, 0)


@triton.jit
def _store_down(acc, slot, Mk, gs, topk_w_ptr, y_ptr, offs_n, H):
    _store_down_sum(tl.sum(acc, axis=1), slot, Mk, gs, topk_w_ptr, y_ptr, offs_n, H)


@triton.jit
def _store_down_sum(v, slot, Mk, gs, topk_w_ptr, y_ptr, offs_n, H):
    ok = slot < Mk
    wt = tl.load(topk_w_ptr + slot, mask=ok, other=0.0)
    v = v * (gs * wt)
    tl.store(y_ptr + slot.to(tl.int64) * H + offs_n, v, mask=(offs_n < H) & ok)


@triton.jit
def _moe_down_gemv_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    y_ptr,
    sorted_ptr,
    expert_ids_ptr,
    num_experts,
    topk_w_ptr,
    out_ptr,
    counter_ptr,
    Mk,
    H,
    INTER,
    ws_ptr,
    cnt_ptr,
    MP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_ITERS: tl.constexpr,
    DECODE: tl.constexpr,
    PREFETCH: tl.constexpr,
    STAGES: tl.constexpr = 0,
    F16: tl.constexpr = 0,
    DIRECT: tl.constexpr = 0,
    COMBINE: tl.constexpr = 0,  # 0, or the token's slots rounded up to a power of two
    ACCUMULATE: tl.constexpr = 0,
    EVEN: tl.constexpr = 0,
    SPLIT_K: tl.constexpr = 1,
    PDL: tl.constexpr = 0,
):
    """CUDA-core decode path of _moe_down_kernel (same outputs), grid like the gate_up GEMV.
    COMBINE (direct blocks only): the combine too, out = sum of the slots' rows (see
    combine_if_last). SPLIT_K > 1 (MP == 1): as in the gate_up GEMV; the last program of a
    tile stores its rows and arrives for the combine. PDL: as in the gate_up GEMV."""
    z = pdl_start(PDL)
    a_ptr += z
    y_ptr += z
    sorted_ptr += z
    expert_ids_ptr += z
    topk_w_ptr += z
    out_ptr += z
    counter_ptr += z
    ws_ptr += z
    cnt_ptr += z
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    expert = block_expert(expert_ids_ptr, pid_b, num_experts, DIRECT)
    if expert < 0:
        if COMBINE and pid_k == 0:
            combine_if_last(
                counter_ptr, y_ptr, expert_ids_ptr, out_ptr, Mk, H, num_experts, pid_n,
                BLOCK_N, COMBINE, ACCUMULATE,
            )  # fmt: skip
        return
    BW: tl.constexpr = BLOCK_K // 8
    KW = INTER // 8
    s0, s1, s2, s3 = block_slots(sorted_ptr, pid_b, Mk, MP, DIRECT)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = expert.to(tl.int64) * H + offs_n[:, None]
    x_rows, oks = slot_x_rows(a_ptr, (s0, s1, s2, s3), 1, INTER, Mk)
    acc0, acc1, acc2, acc3 = gemv_accumulate(
        x_rows,
        oks,
        w_ptr + rows * KW,
        s_ptr + rows * (KW // 2),
        (offs_n < H)[:, None],
        pid_k * K_ITERS * BW,
        KW,
        INTER,
        BLOCK_N,
        BW,
        MP,
        K_ITERS,
        DECODE,
        PREFETCH,
        0,
        STAGES,
        F16,
        EVEN,
    )
    gs = tl.load(gs_ptr + expert) * (2.0**GEMV_F16_EXP)
    if SPLIT_K > 1:
        last, total = split_k_total(acc0, ws_ptr, cnt_ptr, BLOCK_N, SPLIT_K)
        if last:
            _store_down_sum(total, s0, Mk, gs, topk_w_ptr, y_ptr, offs_n, H)
            if COMBINE:
                combine_if_last(
                    counter_ptr, y_ptr, expert_ids_ptr, out_ptr, Mk, H, num_experts, pid_n,
                    BLOCK_N, COMBINE, ACCUMULATE,
                )  # fmt: skip
        return
    _store_down(acc0, s0, Mk, gs, topk_w_ptr, y_ptr, offs_n, H)
    if MP > 1:
        _store_down(acc1, s1, Mk, gs, topk_w_ptr, y_ptr, offs_n, H)
    if MP > 2:
        _store_down(acc2, s2, Mk, gs, topk_w_ptr, y_ptr, offs_n, H)
        _store_down(acc3, s3, Mk, gs, topk_w_ptr, y_ptr, offs_n, H)
    if COMBINE:
        combine_if_last(
            counter_ptr, y_ptr, expert_ids_ptr, out_ptr, Mk, H, num_experts, pid_n,
            BLOCK_N, COMBINE, ACCUMULATE,
        )  # fmt: skip


@triton.jit
def _block_token_rows(sorted_ptr, pid_b, Mk, MP: tl.constexpr, R: tl.constexpr):
    """For tile row r: the slot that is MMA row r % 8 of block pid_b (padding and rows past MP
    give Mk), and the 8 slots themselves."""
    j = tl.arange(0, R) % 8
    slot_r = tl.load(sorted_ptr + pid_b * MP + j, mask=j < MP, other=Mk)
    j8 = tl.arange(0, 8)
    slots8 = tl.load(sorted_ptr + pid_b * MP + j8, mask=j8 < MP, other=Mk)
    return slot_r, slots8


@triton.jit
def _moe_gate_up_mma_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    inter_ptr,
    sorted_ptr,
    expert_ids_ptr,
    Mk,
    INTER,
    H,
    stride_xm,
    TOPK: tl.constexpr,
    MP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_ITERS: tl.constexpr,
):
    """Register-fed mma.sync path of the gate_up GEMM (nvfp4_gemv_mma.py): block pid(0) of up
    to MP <= 8 slots of one expert are the MMA's rows; BLOCK_N gate rows and the matching up
    rows of tile pid(1) are its columns, so 1..8 slots cost one pass over the weights."""
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_b)
    if expert < 0:
        return
    R: tl.constexpr = 2 * BLOCK_N
    KW = H // 8
    slot_r, slots8 = _block_token_rows(sorted_ptr, pid_b, Mk, MP, R)
    tok_r = tl.where(slot_r < Mk, slot_r, 0) // TOPK  # padding rows read token 0, dropped
    r = tl.arange(0, R)
    w_row = expert.to(tl.int64) * 2 * INTER + pid_n * BLOCK_N + r % BLOCK_N
    w_row += (r >= BLOCK_N).to(tl.int64) * INTER
    c0, c1 = mma_accumulate(
        (x_ptr + tok_r.to(tl.int64) * stride_xm).to(tl.int64)[:, None],
        w_ptr + w_row[:, None] * KW,
        (s_ptr + w_row * (KW // 2)).to(tl.int64)[:, None],
        0,
        R,
        K_ITERS,
    )
    y = mma_rows(c0, c1, R) * (tl.load(gs_ptr + expert) * (2.0**ACC_FIX_EXP))  # [8, 2*BN]
    g, u = tl.split(tl.permute(tl.reshape(y, (8, 2, BLOCK_N)), (0, 2, 1)))
    h = g / (1.0 + tl.exp(-g)) * u
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ptrs = inter_ptr + slots8[:, None].to(tl.int64) * INTER + offs_n[None, :]
    tl.store(ptrs, h.to(inter_ptr.dtype.element_ty), mask=(slots8 < Mk)[:, None])


@triton.jit
def _moe_down_mma_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    y_ptr,
    sorted_ptr,
    expert_ids_ptr,
    topk_w_ptr,
    Mk,
    H,
    INTER,
    MP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_ITERS: tl.constexpr,
):
    """Register-fed mma.sync path of the down GEMM (same outputs as _moe_down_kernel)."""
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_b)
    if expert < 0:
        return
    KW = INTER // 8
    slot_r, slots8 = _block_token_rows(sorted_ptr, pid_b, Mk, MP, BLOCK_N)
    src_r = tl.where(slot_r < Mk, slot_r, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_row = expert.to(tl.int64) * H + offs_n
    c0, c1 = mma_accumulate(
        (a_ptr + src_r.to(tl.int64) * INTER).to(tl.int64)[:, None],
        w_ptr + w_row[:, None] * KW,
        (s_ptr + w_row * (KW // 2)).to(tl.int64)[:, None],
        0,
        BLOCK_N,
        K_ITERS,
    )
    ok = slots8 < Mk
    wt = tl.load(topk_w_ptr + slots8, mask=ok, other=0.0)
    y = mma_rows(c0, c1, BLOCK_N) * (tl.load(gs_ptr + expert) * (2.0**ACC_FIX_EXP))
    ptrs = y_ptr + slots8[:, None].to(tl.int64) * H + offs_n[None, :]
    tl.store(ptrs, y * wt[:, None], mask=ok[:, None])


@triton.jit
def moe_combine_kernel(
    y_ptr,
    ids_ptr,
    out_ptr,
    H,
    E,
    stride_om,
    TOPK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    """out[m, :] (+)= sum_j y[m*TOPK + j, :] over the slots whose expert is in [0, E) (fp32
    sum, stored in out's dtype); other slots (experts of other ranks) were never computed.
    ACCUMULATE adds out's own values first (the shared expert's output: no separate add)."""
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    msk = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    if ACCUMULATE:
        acc += tl.load(out_ptr + m.to(tl.int64) * stride_om + offs, mask=msk, other=0.0).to(
            tl.float32
        )
    for j in range(TOPK):
        e = tl.load(ids_ptr + m * TOPK + j)
        ok = msk & (e >= 0) & (e < E)
        acc += tl.load(y_ptr + (m * TOPK + j).to(tl.int64) * H + offs, mask=ok, other=0.0)
    tl.store(
        out_ptr + m.to(tl.int64) * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=msk
    )


# ----------------------------------------------------------------------------------------------
# Host wrapper
# ----------------------------------------------------------------------------------------------

COMBINE_BLOCK_H = 1024


def max_aligned_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """Upper bound on sum_e ceil(count_e / block_m) over the experts that got slots."""
    return (num_slots + min(num_slots, num_experts) * (block_m - 1)) // block_m


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [M, k] -> (sorted slot ids int32 [max_blocks*block_m], expert per block int32
    [max_blocks], -1 for unused blocks). One kernel launch, no host synchronisation."""
    ids = topk_ids.reshape(-1).to(torch.int32)
    mk = ids.numel()
    nb = max_aligned_blocks(mk, num_experts, block_m)
    dev = ids.device
    sorted_ids = torch.empty(nb * block_m, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(nb, dtype=torch.int32, device=dev)
    scratch = torch.empty(num_experts + mk, dtype=torch.int32, device=dev)
    _moe_align_kernel[(1,)](
        ids,
        sorted_ids,
        expert_ids,
        scratch[:num_experts],
        scratch[num_experts:],
        mk,
        num_experts,
        nb,
        nb * block_m,
        BLOCK_M=block_m,
        E_P=triton.next_power_of_2(num_experts),
        CHUNK=ALIGN_CHUNK,
        BCHUNK=ALIGN_BCHUNK,
        # chunk counts rounded up to powers of two: extra chunks are fully masked, and serving
        # many batch sizes then compiles only a handful of variants of this kernel
        SORT_CHUNKS=triton.next_power_of_2(triton.cdiv(nb * block_m, ALIGN_CHUNK)),
        SLOT_CHUNKS=triton.next_power_of_2(triton.cdiv(mk, ALIGN_CHUNK)),
        BLK_CHUNKS=triton.next_power_of_2(triton.cdiv(nb, ALIGN_BCHUNK)),
        num_warps=4,
    )
    return sorted_ids, expert_ids


SPLIT_MIN_COLUMNS = 8  # the narrowest column tile a split-K GEMV launch may use


def combine_counters_needed(hidden: int, intermediate: int = 0, topk: int = 0) -> int:
    """Elements of the zeroed scratch that one-token GEMV calls use: one counter per column
    tile of the down launch for the combine, whatever its tile width (>= 1 column), then,
    given the expert shapes and slots per token, one per (slot, column tile) of each
    split-K launch (tiles >= SPLIT_MIN_COLUMNS wide)."""
    split = topk * (
        triton.cdiv(intermediate, SPLIT_MIN_COLUMNS) + triton.cdiv(hidden, SPLIT_MIN_COLUMNS)
    )
    return hidden + split


@dataclass(frozen=True)
class CombineInto:
    """Where the combine step writes: `out` [M, H], added to when `accumulate`, and the
    caller's zeroed counters for a combine inside the down launch (None: allocated)."""

    out: torch.Tensor
    accumulate: bool
    counters: torch.Tensor | None = None

    def counters_for(self, hidden: int, block_n: int, device: torch.device) -> torch.Tensor:
        return self.scratch(0, triton.cdiv(hidden, block_n), device)

    def scratch(self, offset: int, n: int, device: torch.device) -> torch.Tensor:
        """n zeroed int32 counters at `offset` of the caller's scratch (or fresh ones)."""
        if self.counters is None:
            return torch.zeros(n, dtype=torch.int32, device=device)
        if self.counters.numel() < offset + n or self.counters.dtype != torch.int32:
            raise ValueError(f"combine_counters must be int32 with >= {offset + n} elements")
        return self.counters[offset : offset + n]


def gemv_split(config_split: int, mp: int, k_tiles: int) -> tuple[int, int]:
    """(programs per output tile, K tiles each) of a GEMV launch: the config's split-K (one
    slot per block only), rounded so that no program gets an empty K range."""
    split = max(1, min(config_split, k_tiles)) if mp == 1 else 1
    k_iters = triton.cdiv(k_tiles, split)
    return triton.cdiv(k_tiles, k_iters), k_iters


def gemv_blocks(
    topk_ids: torch.Tensor, num_experts: int, slots_per_block: int
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(sorted slot ids, expert per block, direct) for the GEMV kernels. One token: each slot
    is a block of its own and the routed ids are the blocks' experts (direct, no alignment
    launch; correct even if two slots named one expert, which top-k never does). More tokens:
    ``moe_align``."""
    if topk_ids.shape[0] == 1:
        ids = topk_ids.reshape(-1)
        return ids, ids, True
    sorted_ids, expert_ids = moe_align(topk_ids, num_experts, slots_per_block)
    return sorted_ids, expert_ids, False


def _check_moe_args(x, topk_ids, topk_weights, w13, w13_scale, w13_gs, w2, w2_scale, w2_gs) -> None:
    m, h = x.shape
    e, two_i, h_half = w13.shape
    i = two_i // 2
    expect = {
        "topk_weights": (topk_weights, tuple(topk_ids.shape)),
        "w13": (w13, (e, 2 * i, h // 2)),
        "w13_scale": (w13_scale, (e, 2 * i, h // NVFP4_BLOCK)),
        "w13_gs": (w13_gs, (e,)),
        "w2": (w2, (e, h, i // 2)),
        "w2_scale": (w2_scale, (e, h, i // NVFP4_BLOCK)),
        "w2_gs": (w2_gs, (e,)),
    }
    for name, (t, shape) in expect.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != m or h % NVFP4_BLOCK or i % NVFP4_BLOCK:
        raise ValueError(
            f"bad MoE shapes: x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)}, I={i}"
        )
    if w13.dtype != torch.uint8 or w2.dtype != torch.uint8:
        raise TypeError("w13 and w2 must be packed uint8")


def fused_moe_nvfp4(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_gs: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_gs: torch.Tensor,
    out: torch.Tensor | None = None,
    gate_up_config: dict[str, int] | None = None,
    down_config: dict[str, int] | None = None,
    decode: int | None = None,
    kernel: str | None = None,
    accumulate: bool = False,
    combine_counters: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Fused NVFP4 MoE, see the module docstring for layouts. Graph-capturable (no host sync);
    temporaries come from the caching allocator (the graph's pool under capture).
    `accumulate`: add the result to `out`'s values (given) instead of overwriting them.
    `kernel`: "gemv" (CUDA-core decode path, blocks of a few slots), "gemv_mma" (register-fed
    mma.sync, blocks of up to 8 slots, GPU only), "mma" (tensor-core tl.dot) or None:
    gemv_mma between tiles.json's "moe_gemv_mma" min_m and max_m tokens (where the shapes
    allow and the start-up probe passed), else GEMV up to "moe_gemv"'s max_m, else mma.
    `combine_counters`: zeroed int32 scratch of at least `combine_counters_needed(H, I, k)`
    elements that one-token GEMV calls use to combine inside the down launch (left zeroed
    again); allocated per call when not given. `pdl`: the GEMV path's launches use
    programmatic dependent launch (kernels/pdl.py)."""
    _check_moe_args(x, topk_ids, topk_weights, w13, w13_scale, w13_gs, w2, w2_scale, w2_gs)
    topk_ids = topk_ids.to(torch.int32).contiguous()  # no-op for the router's output
    m, h = x.shape
    num_e, two_i, _ = w13.shape
    topk = topk_ids.shape[1]
    if out is None:
        if accumulate:
            raise ValueError("accumulate needs the tensor to add to (out)")
        out = torch.empty(m, h, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    dec = default_decode(x.device) if decode is None else decode
    tw = topk_weights.reshape(-1).to(torch.float32)
    key = f"{num_e}:{two_i}x{h}"
    if kernel is None:
        kernel = "gemv" if m <= max_rows("moe_gemv", key) else "mma"
        if (
            min_rows("moe_gemv_mma", key) <= m <= max_rows("moe_gemv_mma", key)
            and moe_gemv_mma_supported(w13, w2, tile_config("moe_gemv_mma", m, key))
            and gemv_mma_enabled(x.device)
        ):
            kernel = "gemv_mma"
    if kernel == "gemv":
        cfg = {**tile_config("moe_gemv", m, key), **(gate_up_config or {})}
        y = _moe_gemv(
            x,
            topk_ids,
            tw,
            (w13, w13_scale, w13_gs, w2, w2_scale, w2_gs),
            cfg,
            dec,
            CombineInto(out, accumulate, combine_counters),
            pdl,
        )
        if y is None:  # combined by the down launch
            return out
    elif kernel == "gemv_mma":
        cfg = {**tile_config("moe_gemv_mma", m, key), **(gate_up_config or {})}
        y = _moe_gemv_mma(x, topk_ids, tw, w13, w13_scale, w13_gs, w2, w2_scale, w2_gs, cfg)
    elif kernel == "mma":
        y = _moe_mma(
            x,
            topk_ids,
            tw,
            w13,
            w13_scale,
            w13_gs,
            w2,
            w2_scale,
            w2_gs,
            gate_up_config,
            down_config,
            dec,
        )
    else:
        raise ValueError(f"unknown MoE kernel {kernel!r}")
    moe_combine_kernel[(m, triton.cdiv(h, COMBINE_BLOCK_H))](
        y,
        topk_ids,
        out,
        h,
        num_e,
        out.stride(0),
        TOPK=topk,
        BLOCK_H=COMBINE_BLOCK_H,
        ACCUMULATE=accumulate,
        num_warps=4,
    )
    return out


def _moe_gemv(x, topk_ids, tw, weights, cfg, dec, into: CombineInto, pdl: bool = False):
    """Align into blocks of MP slots, then the two CUDA-core GEMV kernels -> y [M*k, H] fp32;
    None where the down launch also combined into `into.out` (one token)."""
    w13, w13_scale, w13_gs, w2, w2_scale, w2_gs = weights
    m, h = x.shape
    num_e, two_i, _ = w13.shape
    inter_size = two_i // 2
    topk = topk_ids.shape[1]
    mk = m * topk
    mp, bn, bk = cfg["MP"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    sorted_ids, expert_ids, direct = gemv_blocks(topk_ids, num_e, mp)
    nb = expert_ids.numel()
    inter = torch.empty(mk, inter_size, dtype=x.dtype, device=x.device)
    y = torch.empty(mk, h, dtype=torch.float32, device=x.device)
    bn2 = cfg.get("DOWN_BLOCK_N", bn)
    split13, kit13 = gemv_split(cfg.get("SPLIT_K", 1), mp, triton.cdiv(h, bk))
    split2, kit2 = gemv_split(
        cfg.get("DOWN_SPLIT_K", cfg.get("SPLIT_K", 1)), mp, triton.cdiv(inter_size, bk)
    )
    tiles13, tiles2 = nb * triton.cdiv(inter_size, bn), nb * triton.cdiv(h, bn2)
    pdl = pdl_launch(pdl)
    # split-K partials (written before they are read: no zeroing) and tile counters, the
    # latter after the combine's counters in the caller's zeroed scratch
    ws13 = ws2 = cnt13 = cnt2 = y
    if split13 > 1:
        ws13 = torch.empty(split13 * tiles13 * 2 * bn, dtype=torch.float32, device=x.device)
        cnt13 = into.scratch(h, tiles13, x.device)
    if split2 > 1:
        ws2 = torch.empty(split2 * tiles2 * bn2, dtype=torch.float32, device=x.device)
        cnt2 = into.scratch(h + (tiles13 if split13 > 1 else 0), tiles2, x.device)
    _moe_gate_up_gemv_kernel[(nb, triton.cdiv(inter_size, bn), split13)](
        x,
        w13.view(torch.int32),
        w13_scale.view(torch.uint8),
        w13_gs,
        inter,
        sorted_ids,
        expert_ids,
        num_e,
        mk,
        inter_size,
        h,
        x.stride(0),
        ws13,
        cnt13,
        TOPK=topk,
        MP=mp,
        BLOCK_N=bn,
        BLOCK_K=bk,
        K_ITERS=kit13,
        DECODE=dec,
        PREFETCH=cfg.get("PREFETCH", 1),
        STAGES=cfg.get("STAGES", 0),
        F16=cfg.get("F16", 0),
        DIRECT=direct,
        EVEN=int(split13 * kit13 * bk == h and inter_size % bn == 0),
        SPLIT_K=split13,
        PDL=int(pdl),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        launch_pdl=pdl,
    )
    counters = into.counters_for(h, bn2, x.device) if direct else None
    _moe_down_gemv_kernel[(nb, triton.cdiv(h, bn2), split2)](
        inter,
        w2.view(torch.int32),
        w2_scale.view(torch.uint8),
        w2_gs,
        y,
        sorted_ids,
        expert_ids,
        num_e,
        tw,
        into.out,
        counters if direct else y,
        mk,
        h,
        inter_size,
        ws2,
        cnt2,
        MP=mp,
        BLOCK_N=bn2,
        BLOCK_K=bk,
        K_ITERS=kit2,
        DECODE=dec,
        PREFETCH=cfg.get("PREFETCH", 1),
        STAGES=cfg.get("STAGES", 0),
        F16=cfg.get("F16", 0),
        DIRECT=direct,
        COMBINE=triton.next_power_of_2(mk) if direct else 0,
        ACCUMULATE=into.accumulate,
        EVEN=int(split2 * kit2 * bk == inter_size and h % bn2 == 0),
        SPLIT_K=split2,
        PDL=int(pdl),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        launch_pdl=pdl,
    )
    return None if direct else y


def moe_gemv_mma_supported(w13: torch.Tensor, w2: torch.Tensor, cfg: dict[str, int]) -> bool:
    inter_size, hidden = w13.shape[1] // 2, w2.shape[1]
    return mma_supported(inter_size, hidden, cfg["BLOCK_N"], w13) and mma_supported(
        hidden, inter_size, cfg["DOWN_BLOCK_N"], w2
    )


def _moe_gemv_mma(x, topk_ids, tw, w13, w13_scale, w13_gs, w2, w2_scale, w2_gs, cfg):
    """Align into blocks of MP <= 8 slots, then the two register-fed MMA kernels -> y."""
    m, h = x.shape
    num_e, two_i, _ = w13.shape
    inter_size = two_i // 2
    topk = topk_ids.shape[1]
    mk = m * topk
    mp, bn, bn2 = cfg["MP"], cfg["BLOCK_N"], cfg["DOWN_BLOCK_N"]
    if not moe_gemv_mma_supported(w13, w2, cfg) or not 1 <= mp <= 8:
        raise ValueError(f"MMA MoE needs H, I multiples of {MMA_STEP_K} and of the tiles, MP<=8")
    sorted_ids, expert_ids = moe_align(topk_ids, num_e, mp)
    nb = expert_ids.numel()
    inter = torch.empty(mk, inter_size, dtype=x.dtype, device=x.device)
    y = torch.empty(mk, h, dtype=torch.float32, device=x.device)
    _moe_gate_up_mma_kernel[(nb, inter_size // bn)](
        x,
        w13.view(torch.int32),
        w13_scale.view(torch.uint8),
        w13_gs,
        inter,
        sorted_ids,
        expert_ids,
        mk,
        inter_size,
        h,
        x.stride(0),
        TOPK=topk,
        MP=mp,
        BLOCK_N=bn,
        K_ITERS=h // MMA_STEP_K,
        num_warps=cfg["num_warps"],
        num_stages=1,
    )
    _moe_down_mma_kernel[(nb, h // bn2)](
        inter,
        w2.view(torch.int32),
        w2_scale.view(torch.uint8),
        w2_gs,
        y,
        sorted_ids,
        expert_ids,
        tw,
        mk,
        h,
        inter_size,
        MP=mp,
        BLOCK_N=bn2,
        K_ITERS=inter_size // MMA_STEP_K,
        num_warps=cfg["num_warps"],
        num_stages=1,
    )
    return y


def _moe_mma(
    x, topk_ids, tw, w13, w13_scale, w13_gs, w2, w2_scale, w2_gs, gate_up_config, down_config, dec
):
    """Tensor-core path -> y [M*k, H] fp32 (per-slot rows, routing weight applied)."""
    m, h = x.shape
    num_e, two_i, _ = w13.shape
    inter_size = two_i // 2
    topk = topk_ids.shape[1]
    mk = m * topk
    cfg1 = gate_up_config or tile_config("moe_gate_up", m, f"{num_e}:{two_i}x{h}")
    cfg2 = down_config or tile_config("moe_down", m, f"{num_e}:{h}x{inter_size}")
    bm = cfg1["BLOCK_M"]  # the alignment block size is shared by both GEMMs
    sorted_ids, expert_ids = moe_align(topk_ids, num_e, bm)
    nb = expert_ids.numel()
    inter = torch.empty(mk, inter_size, dtype=x.dtype, device=x.device)
    y = torch.empty(mk, h, dtype=torch.float32, device=x.device)
    bn1, bk1 = cfg1["BLOCK_N"], cfg1["BLOCK_K"]
    _moe_gate_up_kernel[(triton.cdiv(inter_size, bn1), nb)](
        x,
        w13.view(torch.int32),
        w13_scale.view(torch.uint8),
        w13_gs,
        inter,
        sorted_ids,
        expert_ids,
        mk,
        inter_size,
        h,
        x.stride(0),
        TOPK=topk,
        BLOCK_M=bm,
        BLOCK_N=bn1,
        BLOCK_K=bk1,
        K_ITERS=triton.cdiv(h, bk1),
        DECODE=dec,
        DOT_F32=interpreting(),
        num_warps=cfg1["num_warps"],
        num_stages=cfg1["num_stages"],
    )
    bn2, bk2 = cfg2["BLOCK_N"], cfg2["BLOCK_K"]
    _moe_down_kernel[(triton.cdiv(h, bn2), nb)](
        inter,
        w2.view(torch.int32),
        w2_scale.view(torch.uint8),
        w2_gs,
        y,
        sorted_ids,
        expert_ids,
        tw,
        mk,
        h,
        inter_size,
        BLOCK_M=bm,
        BLOCK_N=bn2,
        BLOCK_K=bk2,
        K_ITERS=triton.cdiv(inter_size, bk2),
        DECODE=dec,
        DOT_F32=interpreting(),
        num_warps=cfg2["num_warps"],
        num_stages=cfg2["num_stages"],
    )
    return y
