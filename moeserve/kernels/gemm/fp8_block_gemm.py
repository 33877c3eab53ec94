"""DeepSeek block-FP8 weights (128x128 ``weight_scale_inv``) and their GEMM.

Layout: weight float8_e4m3fn [N, K]; weight_scale_inv fp32 [ceil(N/128), ceil(K/128)];
dequantization multiplies each 128x128 block by its value (see shared/SPECS.md).
"""

from __future__ import annotations

import torch

from moeserve.kernels.formats import E4M3_MAX

FP8_BLOCK = 128


def dequantize_fp8_block(
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    block: int = FP8_BLOCK,
) -> torch.Tensor:
    """w_fp8 e4m3 [N, K], scale_inv fp32 [ceil(N/128), ceil(K/128)] -> [N, K] in dtype."""
    n, k = w_fp8.shape
    nb, kb = -(-n // block), -(-k // block)
    if tuple(scale_inv.shape) != (nb, kb):
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} != {(nb, kb)} for weight {(n, k)}"
        )
    s = scale_inv.float().repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (w_fp8.float() * s).to(dtype)


def quantize_fp8_block(
    w: torch.Tensor, block: int = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], scale_inv fp32 [ceil(N/128), ceil(K/128)]); per-block amax/448
    (E4M3_MAX).

    Used to make test weights in DeepSeek's published layout.
    """
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    wp = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    wp[:n, :k] = w.float()
    blocks = wp.view(nb, block, kb, block)
    amax = blocks.abs().amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (blocks / s[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(nb * block, kb * block)[:n, :k].contiguous(), s


def fp8_block_gemm_ref(
    x: torch.Tensor, w_fp8: torch.Tensor, scale_inv: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch reference: x [M, K] @ dequant(W)^T -> [M, N] in x.dtype (fp32 accumulate)."""
    y = (x.float() @ dequantize_fp8_block(w_fp8, scale_inv, torch.float32).t()).to(x.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y


# ----------------------------------------------------------------------------------------------
# Triton kernels: W8A16, dequantized in registers. Decode rows (M <= 4) take the CUDA-core
# GEMV: a weight tile is converted once and feeds one FMA per element per row, the block scale
# folded into the activation chunk, and the K loop names its stages so that Triton streams the
# tiles through shared memory by cp.async (bytes in flight then cost no registers; without it
# the loop kept too few requests in flight to approach HBM speed). Otherwise the tensor-core
# kernel (Hopper has no FP8 x BF16 MMA; quantizing the
# activations to FP8 for native wgmma would change the numerics and only pays off in
# compute-bound prefill, while decode is bound by the 1-byte weight reads either way).
# The weight tile (e4m3 -> bf16 by the hardware converter) feeds tl.dot; the 128x128 block
# scale multiplies each K-block's partial product in fp32. Computed transposed (acc = W @ x^T)
# like the NVFP4 kernel, with the same split-K scheme for small M.
# ----------------------------------------------------------------------------------------------

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from moeserve.kernels.configs import max_rows, tile_config  # noqa: E402
from moeserve.kernels.gemm.splitk import (  # noqa: E402
    SplitKWorkspace,
    dense_x_rows,
    split_k_plan,
    splitk_buffers,
    splitk_finish,
)
from moeserve.kernels.runtime import interpreting  # noqa: E402


@triton.jit
def _load_w(rows, n_ok, kk, K, SCALED: tl.constexpr):
    """Weight tile [R, BK] (rows: pointers [R, 1]) as fp32; e4m3 bytes when SCALED."""
    w = tl.load(rows + kk[None, :], mask=n_ok & (kk[None, :] < K), other=0)
    if SCALED:
        w = w.to(tl.float8e4nv, bitcast=True)
    return w.to(tl.float32)


@triton.jit
def _scaled_tile(rows, n_ok, s_row, k0, K, BLOCK_K: tl.constexpr, SCALED: tl.constexpr,
                 SCALE_BLOCK: tl.constexpr):  # fmt: skip
    """(weight tile [R, BLOCK_K] from column k0 as fp32, its block scale or 1.0, columns)."""
    kk = k0 + tl.arange(0, BLOCK_K)
    w = _load_w(rows, n_ok, kk, K, SCALED)
    s = 1.0
    if SCALED:
        s = tl.load(s_row + k0 // SCALE_BLOCK)
    return w, s, kk


@triton.jit
def _slot_dot(acc, w, x_row, ok, kk, K, s):
    """acc [R] += (w [R, BK] . x[kk]) * s: the scale folded into the activation chunk."""
    xv = tl.load(x_row + kk, mask=ok & (kk < K), other=0.0).to(tl.float32) * s
    return acc + tl.sum(w * xv[None, :], axis=1)


@triton.jit
def fp8_gemv_rows(
    x_rows,
    oks,
    rows,
    n_ok,
    s_row,
    k_begin,
    K,
    R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MP: tl.constexpr,
    SCALED: tl.constexpr,
    K_ITERS: tl.constexpr,
    STAGES: tl.constexpr,
    SCALE_BLOCK: tl.constexpr = 128,
    LATE_SUM: tl.constexpr = 0,
):
    """Dot products of R weight rows (pointers [R, 1], one 128-row scale block whose scale row
    starts at s_row) with up to 4 activation rows (pointers x_rows, used where oks) over
    K_ITERS tiles of BLOCK_K columns from column k_begin -> four [R] fp32 accumulators (rows
    past MP stay 0). BLOCK_K divides
    128, so a tile has one scale; each weight tile is converted once and serves every row.
    STAGES > 0 lets Triton pipeline the weight tiles through that many shared-memory buffers
    (it pipelines loads that feed no tl.dot only when the loop names its stages).
    LATE_SUM (one row only; ignored for MP > 1, whose four [R, BLOCK_K] accumulators would
    not fit the registers): products accumulate elementwise in [R, BLOCK_K] and are reduced
    across the threads once after the loop instead of once per tile."""
    x0, x1, x2, x3 = x_rows
    ok0, ok1, ok2, ok3 = oks
    acc0 = tl.zeros((R,), dtype=tl.float32)
    acc1 = tl.zeros((R,), dtype=tl.float32)
    acc2 = tl.zeros((R,), dtype=tl.float32)
    acc3 = tl.zeros((R,), dtype=tl.float32)
    if LATE_SUM and MP == 1:
        wide = tl.zeros((R, BLOCK_K), dtype=tl.float32)
        for it in tl.range(0, K_ITERS, num_stages=STAGES if STAGES > 0 else None):
            w, s, kk = _scaled_tile(rows, n_ok, s_row, k_begin + it * BLOCK_K, K,
                                    BLOCK_K, SCALED, SCALE_BLOCK)  # fmt: skip
            xv = tl.load(x0 + kk, mask=ok0 & (kk < K), other=0.0).to(tl.float32) * s
            wide += w * xv[None, :]
        acc0 = tl.sum(wide, axis=1)
    else:
        for it in tl.range(0, K_ITERS, num_stages=STAGES if STAGES > 0 else None):
            w, s, kk = _scaled_tile(rows, n_ok, s_row, k_begin + it * BLOCK_K, K,
                                    BLOCK_K, SCALED, SCALE_BLOCK)  # fmt: skip
            acc0 = _slot_dot(acc0, w, x0, ok0, kk, K, s)
            if MP > 1:
                acc1 = _slot_dot(acc1, w, x1, ok1, kk, K, s)
            if MP > 2:
                acc2 = _slot_dot(acc2, w, x2, ok2, kk, K, s)
                acc3 = _slot_dot(acc3, w, x3, ok3, kk, K, s)
    return acc0, acc1, acc2, acc3


@triton.jit
def _fp8_block_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    ws_ptr,
    lock_ptr,
    M,
    N,
    K,
    KB,
    stride_xm,
    stride_om,
    MP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_ITERS: tl.constexpr,
    STAGES: tl.constexpr,
    LATE_SUM: tl.constexpr = 0,
):
    """out [M, N] = x @ dequant(W)^T for MP <= 4 rows of x per program, on CUDA cores: grid
    (cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, MP)); BLOCK_N divides 128, so the program's rows share
    one row of block scales."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    row0 = tl.program_id(2) * MP
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    s_row = s_ptr + (pid_n * BLOCK_N // SCALE_BLOCK).to(tl.int64) * KB
    x_rows, oks = dense_x_rows(x_ptr, row0, stride_xm, M)
    a0, a1, a2, a3 = fp8_gemv_rows(
        x_rows, oks, rows, n_ok[:, None], s_row, pid_k * K_ITERS * BLOCK_K, K,
        BLOCK_N, BLOCK_K, MP, True, K_ITERS, STAGES, SCALE_BLOCK, LATE_SUM,
    )  # fmt: skip
    # [BLOCK_N, MP] in row order (each join adds the new lowest index)
    if MP == 1:
        acc = tl.reshape(a0, (BLOCK_N, 1))
    elif MP == 2:
        acc = tl.join(a0, a1)
    else:
        acc = tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), (BLOCK_N, 4))
    offs_m = row0 + tl.arange(0, MP)
    mask = n_ok[:, None] & (offs_m[None, :] < M)
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    ws_ptrs = ws_ptr + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
    tile = tl.program_id(2) * tl.num_programs(0) + pid_n
    splitk_finish(acc, out_ptrs, ws_ptrs, lock_ptr + tile, mask, SPLIT_K)


@triton.jit
def _fp8_block_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    ws_ptr,
    lock_ptr,
    M,
    N,
    K,
    KB,
    stride_xm,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_ITERS: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n[:, None] < N
    m_mask = offs_m[None, :] < M
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    s_rows = s_ptr + (offs_n // SCALE_BLOCK).to(tl.int64) * KB
    x_rows = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for it in range(K_ITERS):
        k0 = (pid_k * K_ITERS + it) * BLOCK_K
        kk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + kk[None, :], mask=n_mask & (kk[None, :] < K), other=0)
        w = w.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
        xt = tl.load(x_rows + kk[:, None], mask=(kk[:, None] < K) & m_mask, other=0.0).to(
            tl.bfloat16
        )
        if DOT_F32:  # interpreter: numpy has no bf16 dot
            part = tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(w, xt)
        s = tl.load(s_rows + k0 // SCALE_BLOCK, mask=offs_n < N, other=0.0)
        acc += part * s[:, None]
    mask = n_mask & m_mask
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    ws_ptrs = ws_ptr + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
    tile = pid_m * tl.num_programs(0) + pid_n
    splitk_finish(acc, out_ptrs, ws_ptrs, lock_ptr + tile, mask, SPLIT_K)


def fp8_block_gemm(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    out: torch.Tensor | None = None,
    workspace: SplitKWorkspace | None = None,
    config: dict[str, int] | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """x [M, K] bf16 @ dequant(w_fp8 [N, K], scale_inv [ceil(N/128), ceil(K/128)])^T -> [M, N].

    `kernel`: "gemv" (CUDA cores, up to 4 rows per weight pass), "mma" (tensor cores) or None:
    gemv up to tiles.json's "fp8_block_gemv" max_m, else mma. BLOCK_K must divide 128 (one
    scale per K-step), and so must the GEMV's BLOCK_N; `workspace` as in nvfp4_gemm.
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [M, K] with unit stride along K, got {tuple(x.shape)}")
    m, k = x.shape
    n = w_fp8.shape[0]
    if tuple(w_fp8.shape) != (n, k) or not w_fp8.is_contiguous():
        raise ValueError(f"w_fp8 must be contiguous [N, {k}], got {tuple(w_fp8.shape)}")
    nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    if (
        tuple(scale_inv.shape) != (nb, kb)
        or scale_inv.dtype != torch.float32
        or not scale_inv.is_contiguous()
    ):
        raise ValueError(
            f"scale_inv must be contiguous fp32 {(nb, kb)}, "
            f"got {scale_inv.dtype} {tuple(scale_inv.shape)}"
        )
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (m, n) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{m}, {n}] with unit stride, got {tuple(out.shape)}")
    if m == 0:
        return out
    key = f"{n}x{k}"
    if kernel is None:
        kernel = "gemv" if m <= max_rows(GEMV_TABLE, key) else "mma"
    if kernel == "gemv":
        cfg = {**tile_config(GEMV_TABLE, m, key), **(config or {})}
        return _fp8_block_gemv(x, w_fp8, scale_inv, out, workspace, cfg)
    if kernel != "mma":
        raise ValueError(f"unknown block-FP8 GEMM kernel {kernel!r}")
    cfg = config or tile_config("fp8_block_gemm", m, key)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if FP8_BLOCK % bk:
        raise ValueError(f"BLOCK_K={bk} must divide {FP8_BLOCK}")
    grid_n, grid_m = triton.cdiv(n, bn), triton.cdiv(m, bm)
    k_tiles = triton.cdiv(k, bk)
    split, k_iters = split_k_plan(cfg["SPLIT_K"], grid_n * grid_m, k_tiles, x.device)
    ws, locks = splitk_buffers(split, workspace, m * n, grid_n * grid_m, out)
    _fp8_block_gemm_kernel[(grid_n, split, grid_m)](
        x,
        w_fp8.view(torch.uint8),
        scale_inv,
        out,
        ws,
        locks,
        m,
        n,
        k,
        kb,
        x.stride(0),
        out.stride(0),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        SCALE_BLOCK=FP8_BLOCK,
        SPLIT_K=split,
        K_ITERS=k_iters,
        DOT_F32=interpreting(),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out


GEMV_TABLE = "fp8_block_gemv"
GEMV_MAX_MP = 4  # x rows per program (one weight pass serves them all)


def _fp8_block_gemv(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    out: torch.Tensor,
    workspace: SplitKWorkspace | None,
    cfg: dict[str, int],
) -> torch.Tensor:
    """The CUDA-core path of fp8_block_gemm (arguments checked there)."""
    m, k = x.shape
    n = w_fp8.shape[0]
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    if FP8_BLOCK % bk or FP8_BLOCK % bn:
        raise ValueError(f"BLOCK_N={bn} and BLOCK_K={bk} must divide {FP8_BLOCK}")
    mp = 1 if m == 1 else 2 if m == 2 else GEMV_MAX_MP
    grid_n, grid_m = triton.cdiv(n, bn), triton.cdiv(m, mp)
    k_tiles = triton.cdiv(k, bk)
    split, k_iters = split_k_plan(cfg["SPLIT_K"], grid_n * grid_m, k_tiles, x.device)
    ws, locks = splitk_buffers(split, workspace, grid_m * mp * n, grid_n * grid_m, out)
    _fp8_block_gemv_kernel[(grid_n, split, grid_m)](
        x,
        w_fp8.view(torch.uint8),
        scale_inv,
        out,
        ws,
        locks,
        m,
        n,
        k,
        triton.cdiv(k, FP8_BLOCK),
        x.stride(0),
        out.stride(0),
        MP=mp,
        BLOCK_N=bn,
        BLOCK_K=bk,
        SCALE_BLOCK=FP8_BLOCK,
        SPLIT_K=split,
        K_ITERS=k_iters,
        STAGES=cfg.get("STAGES", 0),
        LATE_SUM=cfg.get("LATE_SUM", 0),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out
