"""DeepSeek block-FP8 weights (128x128 ``weight_scale_inv``) and their GEMM.

Layout: weight float8_e4m3fn [N, K]; weight_scale_inv fp32 [ceil(N/128), ceil(K/128)];
dequantization multiplies each 128x128 block by its value (see shared/SPECS.md).
"""

from __future__ import annotations

import torch

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
    """w [N, K] -> (e4m3 [N, K], scale_inv fp32 [ceil(N/128), ceil(K/128)]); per-block amax/448.

    Used to make test weights in DeepSeek's published layout.
    """
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    wp = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    wp[:n, :k] = w.float()
    blocks = wp.view(nb, block, kb, block)
    amax = blocks.abs().amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (blocks / s[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
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
# Triton kernel: W8A16, dequantized in registers (Hopper has no FP8 x BF16 MMA; quantizing the
# activations to FP8 for native wgmma would change the numerics and only pays off in
# compute-bound prefill, while decode is bound by the 1-byte weight reads either way).
# The weight tile (e4m3 -> bf16 by the hardware converter) feeds tl.dot; the 128x128 block
# scale multiplies each K-block's partial product in fp32. Computed transposed (acc = W @ x^T)
# like the NVFP4 kernel, with the same split-K scheme for small M.
# ----------------------------------------------------------------------------------------------

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from moeserve.kernels.configs import tile_config  # noqa: E402
from moeserve.kernels.splitk import (  # noqa: E402
    SplitKWorkspace,
    _splitk_finish,
    choose_split_k,
    interpreting,
    splitk_buffers,
)


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
    _splitk_finish(acc, out_ptrs, ws_ptrs, lock_ptr + tile, mask, SPLIT_K)


def fp8_block_gemm(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    out: torch.Tensor | None = None,
    workspace: SplitKWorkspace | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """x [M, K] bf16 @ dequant(w_fp8 [N, K], scale_inv [ceil(N/128), ceil(K/128)])^T -> [M, N].

    BLOCK_K must divide 128 (one scale per K-step); `workspace` as in nvfp4_gemm.
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
    cfg = config or tile_config("fp8_block_gemm", m, f"{n}x{k}")
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if FP8_BLOCK % bk:
        raise ValueError(f"BLOCK_K={bk} must divide {FP8_BLOCK}")
    grid_n, grid_m = triton.cdiv(n, bn), triton.cdiv(m, bm)
    k_tiles = triton.cdiv(k, bk)
    split = choose_split_k(cfg["SPLIT_K"], grid_n * grid_m, k_tiles, x.device)
    k_iters = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, k_iters)
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
