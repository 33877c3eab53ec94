"""Fused mixture-of-experts for 16-bit-activation weights that decode element by element:
DeepSeek block-FP8 (W8A16, 128x128 ``weight_scale_inv``) and plain bf16/fp16 (W16A16).

Weight layout (stacked experts, the ExpertBank layout of the checkpoint's tensors):
  w13        fp8 e4m3 or bf16 [E, 2I, H]   gate rows 0..I-1, then up rows I..2I-1
  w13_scale  fp32 [E, 2I/128, H/128]       block FP8 only (None for 16-bit weights)
  w2         fp8 e4m3 or bf16 [E, H, I]
  w2_scale   fp32 [E, H/128, I/128]
Routing, output and the skipping of other ranks' experts are those of moe.py's NVFP4 kernel,
whose slot alignment (`moe_align`) and combine step are shared:
  out[m] = sum_j topk_weights[m, j] * down_e(silu(gate_e(x_m)) * up_e(x_m)),  e = topk_ids[m, j]

Two schedules, one pass over each touched expert's weights per block of its slots:
  gemv  blocks of MP <= 4 slots on CUDA cores: each weight tile is converted once (e4m3 ->
        fp32) and fed to one FMA per element per slot; the 128x128 block scale is folded into
        the activation chunk (one multiply per column, not per weight), since a tile of at
        most 128 rows and 128 columns has one scale. At 1 B/weight an H200 SM has ~7.8
        instruction slots per weight element at full HBM rate, and this loop needs ~3-6.
  mma   blocks of BLOCK_M slots through tl.dot (bf16 tensor cores), the scale applied to each
        128-column partial product; for many tokens per expert (prefill).
Everything is graph-capturable: no host synchronisation, temporaries from the caching allocator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.configs import max_rows, tile_config
from moeserve.kernels.gemm.fp8_block_gemm import FP8_BLOCK, dequantize_fp8_block, fp8_gemv_rows
from moeserve.kernels.gemm.splitk import slot_x_rows
from moeserve.kernels.moe.nvfp4 import (
    COMBINE_BLOCK_H,
    CombineInto,
    block_expert,
    block_slots,
    combine_if_last,
    gemv_blocks,
    moe_align,
    moe_combine_kernel,
)
from moeserve.kernels.runtime import interpreting

# ----------------------------------------------------------------------------------------------
# Torch reference
# ----------------------------------------------------------------------------------------------


def _dense(w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if scale is None:
        return w.float()
    return dequantize_fp8_block(w, scale, torch.float32)


def fused_moe_fp8_ref(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
) -> torch.Tensor:
    """Loop over the experts that received tokens: fp32 math on dequantized weights, the
    intermediate rounded to x.dtype (as the kernels store it). Ids outside [0, E) add
    nothing."""
    inter_size = w13.shape[1] // 2
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        if not 0 <= e < w13.shape[0]:
            continue
        rows, cols = (topk_ids == e).nonzero(as_tuple=True)
        h = x[rows].float() @ _dense(w13[e], None if w13_scale is None else w13_scale[e]).t()
        a = (torch.nn.functional.silu(h[:, :inter_size]) * h[:, inter_size:]).to(x.dtype)
        y = a.float() @ _dense(w2[e], None if w2_scale is None else w2_scale[e]).t()
        acc.index_add_(0, rows, y * topk_weights[rows, cols].float()[:, None])
    return acc.to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _store_act(g, u, slot, Mk, inter_ptr, offs_n, INTER):
    h = g / (1.0 + tl.exp(-g)) * u
    ptrs = inter_ptr + slot.to(tl.int64) * INTER + offs_n
    tl.store(ptrs, h.to(inter_ptr.dtype.element_ty), mask=(offs_n < INTER) & (slot < Mk))


@triton.jit
def _moe_gate_up_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    inter_ptr,
    sorted_ptr,
    expert_ids_ptr,
    num_experts,
    Mk,
    INTER,
    H,
    stride_xm,
    TOPK: tl.constexpr,
    MP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALED: tl.constexpr,
    K_ITERS: tl.constexpr,
    STAGES: tl.constexpr = 0,
    DIRECT: tl.constexpr = 0,
    LATE_SUM: tl.constexpr = 0,
):
    """inter[slot, n] = silu(gate) * up for the MP slots of block pid(0), columns of tile
    pid(1). Blocks vary fastest, so the blocks of one expert read a tile about together."""
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = block_expert(expert_ids_ptr, pid_b, num_experts, DIRECT)
    if expert < 0:
        return
    s0, s1, s2, s3 = block_slots(sorted_ptr, pid_b, Mk, MP, DIRECT)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = (offs_n < INTER)[:, None]
    g_rows = w_ptr + (expert.to(tl.int64) * 2 * INTER + offs_n[:, None]) * H
    u_rows = w_ptr + (expert.to(tl.int64) * 2 * INTER + INTER + offs_n[:, None]) * H
    kb = tl.cdiv(H, 128)
    g_s = s_ptr + (expert.to(tl.int64) * tl.cdiv(2 * INTER, 128) + pid_n * BLOCK_N // 128) * kb
    u_s = g_s + (INTER // 128) * kb
    x_rows, oks = slot_x_rows(x_ptr, (s0, s1, s2, s3), TOPK, stride_xm, Mk)
    g0, g1, g2, g3 = fp8_gemv_rows(
        x_rows, oks, g_rows, n_ok, g_s, 0, H, BLOCK_N, BLOCK_K, MP, SCALED, K_ITERS, STAGES,
        128, LATE_SUM,
    )  # fmt: skip
    u0, u1, u2, u3 = fp8_gemv_rows(
        x_rows, oks, u_rows, n_ok, u_s, 0, H, BLOCK_N, BLOCK_K, MP, SCALED, K_ITERS, STAGES,
        128, LATE_SUM,
    )  # fmt: skip
    _store_act(g0, u0, s0, Mk, inter_ptr, offs_n, INTER)
    if MP > 1:
        _store_act(g1, u1, s1, Mk, inter_ptr, offs_n, INTER)
    if MP > 2:
        _store_act(g2, u2, s2, Mk, inter_ptr, offs_n, INTER)
        _store_act(g3, u3, s3, Mk, inter_ptr, offs_n, INTER)


@triton.jit
def _store_y(acc, slot, Mk, topk_w_ptr, y_ptr, offs_n, H):
    ok = slot < Mk
    wt = tl.load(topk_w_ptr + slot, mask=ok, other=0.0)
    tl.store(y_ptr + slot.to(tl.int64) * H + offs_n, acc * wt, mask=(offs_n < H) & ok)


@triton.jit
def _moe_down_gemv_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
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
    MP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALED: tl.constexpr,
    K_ITERS: tl.constexpr,
    STAGES: tl.constexpr = 0,
    DIRECT: tl.constexpr = 0,
    COMBINE: tl.constexpr = 0,  # 0, or the token's slots rounded up to a power of two
    ACCUMULATE: tl.constexpr = 0,
    LATE_SUM: tl.constexpr = 0,
):
    """y[slot, n] = topk_weight[slot] * (inter[slot] @ W2_e^T)[n] in fp32. COMBINE (direct
    blocks only): out = the sum of the slots' rows too (moe.py's combine_if_last)."""
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = block_expert(expert_ids_ptr, pid_b, num_experts, DIRECT)
    if expert < 0:
        if COMBINE:
            combine_if_last(
                counter_ptr, y_ptr, expert_ids_ptr, out_ptr, Mk, H, num_experts, pid_n,
                BLOCK_N, COMBINE, ACCUMULATE,
            )  # fmt: skip
        return
    s0, s1, s2, s3 = block_slots(sorted_ptr, pid_b, Mk, MP, DIRECT)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = w_ptr + (expert.to(tl.int64) * H + offs_n[:, None]) * INTER
    kb = tl.cdiv(INTER, 128)
    s_row = s_ptr + (expert.to(tl.int64) * tl.cdiv(H, 128) + pid_n * BLOCK_N // 128) * kb
    x_rows, oks = slot_x_rows(a_ptr, (s0, s1, s2, s3), 1, INTER, Mk)
    a0, a1, a2, a3 = fp8_gemv_rows(
        x_rows,
        oks,
        rows,
        (offs_n < H)[:, None],
        s_row,
        0,
        INTER,
        BLOCK_N,
        BLOCK_K,
        MP,
        SCALED,
        K_ITERS,
        STAGES,
        128,
        LATE_SUM,
    )
    _store_y(a0, s0, Mk, topk_w_ptr, y_ptr, offs_n, H)
    if MP > 1:
        _store_y(a1, s1, Mk, topk_w_ptr, y_ptr, offs_n, H)
    if MP > 2:
        _store_y(a2, s2, Mk, topk_w_ptr, y_ptr, offs_n, H)
        _store_y(a3, s3, Mk, topk_w_ptr, y_ptr, offs_n, H)
    if COMBINE:
        combine_if_last(
            counter_ptr, y_ptr, expert_ids_ptr, out_ptr, Mk, H, num_experts, pid_n,
            BLOCK_N, COMBINE, ACCUMULATE,
        )  # fmt: skip


@triton.jit
def _dot_tile(acc, rows, n_ok, kk, K, xt, s_row, k0, SCALED: tl.constexpr, DOT_F32: tl.constexpr):
    """acc [BN, BM] += (W tile [BN, BK] @ x^T tile [BK, BM]) * the tile's block scale."""
    w = tl.load(rows + kk[None, :], mask=n_ok & (kk[None, :] < K), other=0)
    if SCALED:
        w = w.to(tl.float8e4nv, bitcast=True)
    if DOT_F32:  # the interpreter: numpy has no bf16 dot
        part = tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
    else:
        part = tl.dot(w.to(tl.bfloat16), xt.to(tl.bfloat16))
    if SCALED:
        part = part * tl.load(s_row + k0 // 128)
    return acc + part


@triton.jit
def _moe_gate_up_mma_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
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
    SCALED: tl.constexpr,
    DOT_F32: tl.constexpr,
    K_ITERS: tl.constexpr,
):
    """inter for the BLOCK_M slots of block pid(1), columns of tile pid(0) (tensor cores)."""
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_b)
    if expert < 0:
        return
    slots = tl.load(sorted_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
    m_ok = slots[None, :] < Mk
    x_cols = x_ptr + (tl.where(slots < Mk, slots, 0) // TOPK).to(tl.int64)[None, :] * stride_xm
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n[:, None] < INTER
    g_rows = w_ptr + (expert.to(tl.int64) * 2 * INTER + offs_n[:, None]) * H
    u_rows = w_ptr + (expert.to(tl.int64) * 2 * INTER + INTER + offs_n[:, None]) * H
    kb = tl.cdiv(H, 128)
    g_s = s_ptr + (expert.to(tl.int64) * tl.cdiv(2 * INTER, 128) + pid_n * BLOCK_N // 128) * kb
    u_s = g_s + (INTER // 128) * kb
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for it in range(K_ITERS):
        k0 = it * BLOCK_K
        kk = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_cols + kk[:, None], mask=m_ok & (kk[:, None] < H), other=0.0)
        acc_g = _dot_tile(acc_g, g_rows, n_ok, kk, H, xt, g_s, k0, SCALED, DOT_F32)
        acc_u = _dot_tile(acc_u, u_rows, n_ok, kk, H, xt, u_s, k0, SCALED, DOT_F32)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    ptrs = inter_ptr + slots[None, :].to(tl.int64) * INTER + offs_n[:, None]
    tl.store(ptrs, h.to(inter_ptr.dtype.element_ty), mask=n_ok & m_ok)


@triton.jit
def _moe_down_mma_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
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
    SCALED: tl.constexpr,
    DOT_F32: tl.constexpr,
    K_ITERS: tl.constexpr,
):
    """y for the BLOCK_M slots of block pid(1), columns of tile pid(0) (tensor cores)."""
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_b)
    if expert < 0:
        return
    slots = tl.load(sorted_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < Mk
    m_ok = valid[None, :]
    a_cols = a_ptr + tl.where(valid, slots, 0).to(tl.int64)[None, :] * INTER
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n[:, None] < H
    rows = w_ptr + (expert.to(tl.int64) * H + offs_n[:, None]) * INTER
    kb = tl.cdiv(INTER, 128)
    s_row = s_ptr + (expert.to(tl.int64) * tl.cdiv(H, 128) + pid_n * BLOCK_N // 128) * kb
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for it in range(K_ITERS):
        k0 = it * BLOCK_K
        kk = k0 + tl.arange(0, BLOCK_K)
        at = tl.load(a_cols + kk[:, None], mask=m_ok & (kk[:, None] < INTER), other=0.0)
        acc = _dot_tile(acc, rows, n_ok, kk, INTER, at, s_row, k0, SCALED, DOT_F32)
    wt = tl.load(topk_w_ptr + slots, mask=valid, other=0.0)
    ptrs = y_ptr + slots[None, :].to(tl.int64) * H + offs_n[:, None]
    tl.store(ptrs, acc * wt[None, :], mask=n_ok & m_ok)


# ----------------------------------------------------------------------------------------------
# Host wrapper
# ----------------------------------------------------------------------------------------------


def check_fp8_moe_shapes(
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
) -> None:
    """Raise ValueError unless the banks fit the kernels' layout (see the module docstring)."""
    e, two_i, h = w13.shape
    i = two_i // 2
    if tuple(w2.shape) != (e, h, i) or two_i % 2:
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not pair up")
    scaled = w13.dtype == torch.float8_e4m3fn
    if scaled != (w2.dtype == torch.float8_e4m3fn) or scaled != (w13_scale is not None):
        raise ValueError("w13, w2 and the scales must be all block FP8 or all 16-bit")
    if scaled:
        nb = -(-h // FP8_BLOCK)
        ib = -(-i // FP8_BLOCK)
        if i % FP8_BLOCK:
            raise ValueError(f"intermediate size {i} is not a multiple of {FP8_BLOCK}")
        for name, t, shape in (
            ("w13_scale", w13_scale, (e, 2 * ib, nb)),
            ("w2_scale", w2_scale, (e, nb, ib)),
        ):
            if tuple(t.shape) != shape or t.dtype != torch.float32:
                raise ValueError(f"{name} must be fp32 {shape}, got {t.dtype} {tuple(t.shape)}")
    for t in (w13, w2, w13_scale, w2_scale):
        if t is not None and not t.is_contiguous():
            raise ValueError("MoE weights and scales must be contiguous")


def _aligned(x, ids, num_e, inter_size, block):
    """Slots sorted into blocks of `block` per expert, the intermediate [M*k, I] (x.dtype) and
    the per-slot down output [M*k, H] (fp32)."""
    mk = ids.numel()
    sorted_ids, expert_ids = moe_align(ids, num_e, block)
    inter = torch.empty(mk, inter_size, dtype=x.dtype, device=x.device)
    y = torch.empty(mk, x.shape[1], dtype=torch.float32, device=x.device)
    return sorted_ids, expert_ids, inter, y, mk


def _gemv(x, ids, tw, w13, s13, w2, s2, cfg, scaled, into: CombineInto):
    """The two GEMV launches -> y [M*k, H] fp32, or None where the down launch also combined
    into `into.out` (one token: direct blocks)."""
    h = x.shape[1]
    num_e, two_i, _ = w13.shape
    inter_size = two_i // 2
    topk = ids.shape[1]
    mp, bn, bn2, bk = cfg["MP"], cfg["BLOCK_N"], cfg["DOWN_BLOCK_N"], cfg["BLOCK_K"]
    # optional: the down launch's own K tile / warps / stages; products summed once per program
    bk2 = cfg.get("DOWN_BLOCK_K", bk)
    late_sum = cfg.get("LATE_SUM", 0)
    mk = ids.numel()
    sorted_ids, expert_ids, direct = gemv_blocks(ids, num_e, mp)
    nb = expert_ids.numel()
    inter = torch.empty(mk, inter_size, dtype=x.dtype, device=x.device)
    y = torch.empty(mk, h, dtype=torch.float32, device=x.device)
    _moe_gate_up_gemv_kernel[(nb, triton.cdiv(inter_size, bn))](
        x,
        w13,
        s13,
        inter,
        sorted_ids,
        expert_ids,
        num_e,
        mk,
        inter_size,
        h,
        x.stride(0),
        TOPK=topk,
        MP=mp,
        BLOCK_N=bn,
        BLOCK_K=bk,
        SCALED=scaled,
        K_ITERS=triton.cdiv(h, bk),
        STAGES=cfg.get("STAGES", 0),
        DIRECT=direct,
        LATE_SUM=late_sum,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    counters = into.counters_for(h, bn2, x.device) if direct else None
    _moe_down_gemv_kernel[(nb, triton.cdiv(h, bn2))](
        inter,
        w2,
        s2,
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
        MP=mp,
        BLOCK_N=bn2,
        BLOCK_K=bk2,
        SCALED=scaled,
        K_ITERS=triton.cdiv(inter_size, bk2),
        STAGES=cfg.get("DOWN_STAGES", cfg.get("STAGES", 0)),
        DIRECT=direct,
        COMBINE=triton.next_power_of_2(mk) if direct else 0,
        ACCUMULATE=into.accumulate,
        LATE_SUM=late_sum,
        num_warps=cfg.get("DOWN_WARPS", cfg["num_warps"]),
        num_stages=cfg["num_stages"],
    )
    return None if direct else y


def _mma(x, ids, tw, w13, s13, w2, s2, cfg, scaled):
    h = x.shape[1]
    num_e, two_i, _ = w13.shape
    inter_size = two_i // 2
    topk = ids.shape[1]
    bm, bn, bn2, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["DOWN_BLOCK_N"], cfg["BLOCK_K"]
    sorted_ids, expert_ids, inter, y, mk = _aligned(x, ids, num_e, inter_size, bm)
    nb = expert_ids.numel()
    dot_f32 = interpreting()
    _moe_gate_up_mma_kernel[(triton.cdiv(inter_size, bn), nb)](
        x,
        w13,
        s13,
        inter,
        sorted_ids,
        expert_ids,
        mk,
        inter_size,
        h,
        x.stride(0),
        TOPK=topk,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        SCALED=scaled,
        DOT_F32=dot_f32,
        K_ITERS=triton.cdiv(h, bk),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    _moe_down_mma_kernel[(triton.cdiv(h, bn2), nb)](
        inter,
        w2,
        s2,
        y,
        sorted_ids,
        expert_ids,
        tw,
        mk,
        h,
        inter_size,
        BLOCK_M=bm,
        BLOCK_N=bn2,
        BLOCK_K=bk,
        SCALED=scaled,
        DOT_F32=dot_f32,
        K_ITERS=triton.cdiv(inter_size, bk),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return y


def tile_table(scaled: bool, kernel: str) -> str:
    """tiles.json table of a schedule: 16-bit weight tiles are twice the bytes of FP8 ones,
    so their tensor-core configs differ (shared memory)."""
    return f"moe_{'fp8' if scaled else 'w16'}_{kernel}"


def fp8_moe_kernel_for(m: int, shape_key: str, scaled: bool = True) -> str:
    """The schedule used at m tokens: "gemv" up to the gemv table's last max_m, else "mma"."""
    return "gemv" if m <= max_rows(tile_table(scaled, "gemv"), shape_key) else "mma"


def fused_moe_fp8(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    kernel: str | None = None,
    config: dict[str, int] | None = None,
    combine_counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused MoE on block-FP8 (scales given) or 16-bit weights, layouts in the module
    docstring; shapes are checked once by the caller (`check_fp8_moe_shapes`). `accumulate`
    adds the result to `out`'s values. `kernel` "gemv" / "mma" / None (by row count).
    `combine_counters`: as for moe.fused_moe_nvfp4 (one-token GEMV calls combine inside
    the down launch)."""
    m, h = x.shape
    num_e, two_i, _ = w13.shape
    if out is None:
        if accumulate:
            raise ValueError("accumulate needs the tensor to add to (out)")
        out = torch.empty(m, h, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    ids = topk_ids.to(torch.int32).contiguous()
    tw = topk_weights.reshape(-1).to(torch.float32)
    scaled = w13_scale is not None
    key = f"{num_e}:{two_i}x{h}"
    kernel = kernel or fp8_moe_kernel_for(m, key, scaled)
    # 16-bit weights have no scale tensor; any pointer does (SCALED=False never reads it)
    s13 = w13_scale if scaled else tw
    s2 = w2_scale if scaled else tw
    if scaled:  # e4m3 bytes, reinterpreted in the kernel
        w13, w2 = w13.view(torch.uint8), w2.view(torch.uint8)
    into = CombineInto(out, accumulate, combine_counters)
    if kernel == "gemv":
        cfg = {**tile_config(tile_table(scaled, "gemv"), m, key), **(config or {})}
        y = _gemv(x, ids, tw, w13, s13, w2, s2, cfg, scaled, into)
        if y is None:  # combined by the down launch
            return out
    elif kernel == "mma":
        cfg = {**tile_config(tile_table(scaled, "mma"), m, key), **(config or {})}
        y = _mma(x, ids, tw, w13, s13, w2, s2, cfg, scaled)
    else:
        raise ValueError(f"unknown MoE kernel {kernel!r}")
    moe_combine_kernel[(m, triton.cdiv(h, COMBINE_BLOCK_H))](
        y,
        ids,
        out,
        h,
        num_e,
        out.stride(0),
        TOPK=ids.shape[1],
        BLOCK_H=COMBINE_BLOCK_H,
        ACCUMULATE=accumulate,
        num_warps=4,
    )
    return out
