"""SiLU(x @ gate^T) * (x @ up^T) for a few rows in one launch, gate and up NVFP4 weights with
global scales of their own (ModelOpt keeps one per tensor, so the two cannot be one merged
weight without rescaling block scales).

Why: a decode step's MLP with separate NVFP4 gate and up projections otherwise takes four
launches before the down projection (gate GEMV, up GEMV, SiLU, multiply), each ~1-3 us of
launch ramp and drain around ~1 MB of weights on a tensor-parallel rank. Here each program
decodes BLOCK_N gate rows and the same BLOCK_N up rows as one [2*BLOCK_N] row tile of the
CUDA-core GEMV (nvfp4_gemv.gemv_accumulate: every x element loaded serves both), scales each
half by its own global scale and stores SiLU(g) * u (fp32 math, one rounding to x's dtype).
With SPLIT_K > 1 the K range is split among programs (a rank's slice of the intermediate
dim is a few tiles wide: too few programs to keep HBM busy); the partial sums meet in the
zeroed fp32 split-K workspace and the tile's last program applies SiLU and re-zeroes it
(nvfp4_gemv's split-K contract: the workspace and counters stay zeroed between calls).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from moeserve.kernels.configs import max_rows, tile_config
from moeserve.kernels.gemm.nvfp4_gemm import default_decode
from moeserve.kernels.gemm.nvfp4_gemv import GEMV_F16_EXP, gemv_accumulate, gemv_rows_per_program
from moeserve.kernels.gemm.splitk import (
    SplitKWorkspace,
    dense_x_rows,
    split_k_plan,
    splitk_buffers,
)
from moeserve.kernels.pdl import pdl_launch

TABLE = "nvfp4_gate_up"


@triton.jit
def _silu_mul_store(v, out_ptrs, mask, BLOCK_N: tl.constexpr):
    """v [2*BLOCK_N] fp32 (gate sums, then up sums, scaled) -> out = silu(g) * u."""
    g, u = tl.split(tl.permute(tl.reshape(v, (2, BLOCK_N)), (1, 0)))
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptrs, h.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _ws_row(ws_ptr, row, M, N, pid_n, BLOCK_N: tl.constexpr):
    """The workspace entries [2*BLOCK_N] of tile pid_n of x row `row` (its gate columns, then
    its up columns, in a [M, 2N] fp32 block) and which of them exist."""
    r = tl.arange(0, 2 * BLOCK_N)
    n = pid_n * BLOCK_N + r % BLOCK_N
    col = n + (r >= BLOCK_N).to(tl.int32) * N
    return ws_ptr + row.to(tl.int64) * 2 * N + col, (n < N) & (row < M)


@triton.jit
def _finish_row(acc, scale, row, M, out_ptr, stride_om, ws_ptr, N, pid_n, BLOCK_N: tl.constexpr,
                SPLIT_K: tl.constexpr):  # fmt: skip
    """One x row's tile: stored (SPLIT_K == 1) or added into the workspace row [2N]."""
    offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    v = tl.sum(acc, axis=1) * scale
    if SPLIT_K == 1:
        _silu_mul_store(
            v, out_ptr + row.to(tl.int64) * stride_om + offs, (offs < N) & (row < M), BLOCK_N
        )
    else:
        ws, ok = _ws_row(ws_ptr, row, M, N, pid_n, BLOCK_N)
        tl.atomic_add(ws, v, mask=ok, sem="relaxed")


@triton.jit
def _copy_out_row(row, M, out_ptr, stride_om, ws_ptr, N, pid_n, BLOCK_N: tl.constexpr):
    """The last program of a split tile: total -> SiLU * up -> out, workspace re-zeroed."""
    ws, ok = _ws_row(ws_ptr, row, M, N, pid_n, BLOCK_N)
    total = tl.load(ws, mask=ok, other=0.0, cache_modifier=".cg")
    offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o = out_ptr + row.to(tl.int64) * stride_om + offs
    _silu_mul_store(total, o, (offs < N) & (row < M), BLOCK_N)
    tl.store(ws, tl.zeros_like(total), mask=ok)


@triton.jit
def _gate_up_silu_gemv_kernel(
    x_ptr,
    wg_ptr,
    sg_ptr,
    gsg_ptr,
    wu_ptr,
    su_ptr,
    gsu_ptr,
    out_ptr,
    ws_ptr,
    lock_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    MP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_ITERS: tl.constexpr,
    DECODE: tl.constexpr,
    PREFETCH: tl.constexpr,
    STAGES: tl.constexpr = 0,
    F16: tl.constexpr = 0,
    EVEN: tl.constexpr = 0,
    PDL: tl.constexpr = 0,
):
    """out [M, N] = silu(x @ Wg^T) * (x @ Wu^T) for MP rows of x per program.
    Grid (cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, MP)). PDL: the first weight tiles are requested
    before waiting for the previous kernel (kernels/pdl.py)."""
    if PDL:
        gdc_launch_dependents()
    BW: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    row0 = tl.program_id(2) * MP
    KW = K // 8
    r = tl.arange(0, 2 * BLOCK_N)
    offs = pid_n * BLOCK_N + r % BLOCK_N
    up = (r >= BLOCK_N)[:, None]
    rows = offs[:, None].to(tl.int64)
    w_rows = tl.where(up, wu_ptr + rows * KW, wg_ptr + rows * KW)
    s_rows = tl.where(up, su_ptr + rows * (KW // 2), sg_ptr + rows * (KW // 2))
    x_rows, oks = dense_x_rows(x_ptr, row0, stride_xm, M)
    acc0, acc1, acc2, acc3 = gemv_accumulate(
        x_rows,
        oks,
        w_rows,
        s_rows,
        (offs < N)[:, None],
        pid_k * K_ITERS * BW,
        KW,
        K,
        2 * BLOCK_N,
        BW,
        MP,
        K_ITERS,
        DECODE,
        PREFETCH,
        PDL,
        STAGES,
        F16,
        EVEN,
    )
    scale = tl.where(r >= BLOCK_N, tl.load(gsu_ptr), tl.load(gsg_ptr)) * (2.0**GEMV_F16_EXP)
    _finish_row(acc0, scale, row0, M, out_ptr, stride_om, ws_ptr, N, pid_n, BLOCK_N, SPLIT_K)
    if MP > 1:
        _finish_row(
            acc1, scale, row0 + 1, M, out_ptr, stride_om, ws_ptr, N, pid_n, BLOCK_N, SPLIT_K
        )
    if MP > 2:
        _finish_row(
            acc2, scale, row0 + 2, M, out_ptr, stride_om, ws_ptr, N, pid_n, BLOCK_N, SPLIT_K
        )
        _finish_row(
            acc3, scale, row0 + 3, M, out_ptr, stride_om, ws_ptr, N, pid_n, BLOCK_N, SPLIT_K
        )
    if SPLIT_K > 1:
        tl.debug_barrier()  # every thread's partials precede the release below
        lock = lock_ptr + tl.program_id(2) * tl.num_programs(0) + pid_n
        if tl.atomic_add(lock, 1, sem="acq_rel") == SPLIT_K - 1:
            _copy_out_row(row0, M, out_ptr, stride_om, ws_ptr, N, pid_n, BLOCK_N)
            if MP > 1:
                _copy_out_row(row0 + 1, M, out_ptr, stride_om, ws_ptr, N, pid_n, BLOCK_N)
            if MP > 2:
                _copy_out_row(row0 + 2, M, out_ptr, stride_om, ws_ptr, N, pid_n, BLOCK_N)
                _copy_out_row(row0 + 3, M, out_ptr, stride_om, ws_ptr, N, pid_n, BLOCK_N)
            tl.atomic_xchg(lock, 0)


NVFP4Weight = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # packed, block scales, global [1]


def gate_up_max_rows(n: int, k: int) -> int:
    """The most rows of x the fused launch serves for one half of [n, k] (tiles.json)."""
    return max_rows(TABLE, f"{n}x{k}")


def nvfp4_gate_up_silu(
    x: torch.Tensor,
    gate: NVFP4Weight,
    up: NVFP4Weight,
    workspace: SplitKWorkspace | None = None,
    config: dict[str, int] | None = None,
    decode: int | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """silu(x @ dequant(gate)^T) * (x @ dequant(up)^T): x [M, K] bf16, gate and up
    (packed uint8 [N, K/2], e4m3 scales [N, K/16], fp32 global scale [1] on the device) ->
    [M, N] in x's dtype. `workspace`: the zeroed split-K workspace (needed for graph capture
    when the config splits K; allocated per call otherwise). `pdl`: programmatic dependent
    launch (kernels/pdl.py)."""
    m, k = x.shape
    n = gate[0].shape[0]
    for name, (packed, scale, gs) in (("gate", gate), ("up", up)):
        if tuple(packed.shape) != (n, k // 2) or tuple(scale.shape) != (n, k // 16):
            raise ValueError(f"{name} must be [{n}, {k}] NVFP4, got {tuple(packed.shape)}")
        if not (packed.is_contiguous() and scale.is_contiguous()) or gs.numel() != 1:
            raise ValueError(f"{name}: contiguous packed weight and scales, one global scale")
    if x.stride(-1) != 1:
        raise ValueError("x must have unit stride along K")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or tile_config(TABLE, m, f"{n}x{k}")
    dec = default_decode(x.device) if decode is None else decode
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    mp = gemv_rows_per_program(m)
    grid_n, grid_m = triton.cdiv(n, bn), triton.cdiv(m, mp)
    split, k_iters = split_k_plan(cfg["SPLIT_K"], grid_n * grid_m, triton.cdiv(k, bk), x.device)
    ws, locks = splitk_buffers(split, workspace, grid_m * mp * 2 * n, grid_n * grid_m, out)
    pdl = pdl_launch(pdl)
    _gate_up_silu_gemv_kernel[(grid_n, split, grid_m)](
        x,
        gate[0].view(torch.int32),
        gate[1].view(torch.uint8),
        gate[2],
        up[0].view(torch.int32),
        up[1].view(torch.uint8),
        up[2],
        out,
        ws,
        locks,
        m,
        n,
        k,
        x.stride(0),
        out.stride(0),
        MP=mp,
        BLOCK_N=bn,
        BLOCK_K=bk,
        SPLIT_K=split,
        K_ITERS=k_iters,
        DECODE=dec,
        PREFETCH=cfg.get("PREFETCH", 1),
        STAGES=cfg.get("STAGES", 0),
        F16=cfg.get("F16", 0),
        EVEN=int(n % bn == 0 and split * k_iters * bk == k),
        PDL=int(pdl),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        launch_pdl=pdl,
    )
    return out
