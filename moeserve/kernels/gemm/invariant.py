"""Batch-invariant GPU kernels (`--deterministic` on GPUs): one tile shape per weight and one
K order per output element, whatever the step's row count.

The default GPU kernels pick by row count (CUDA-core GEMVs for a few rows, tensor-core tiles
above, cuBLAS for many) and split K over programs whose partial sums meet through atomic adds
in arrival order: a row's result then depends on how many rows share its step and even on
the run. Under --deterministic every GEMM runs the tensor-core kernel with the fixed configs
below (SPLIT_K 1: each output element is one program's K loop in order), the MoE its
tensor-core schedule with the routed experts' slots combined in top-k order, MLA attention
the prefill kernel for every row (key tiles from position 0, the same for a row decoded alone
or inside a chunk), and 16-bit GEMMs (the LM head, the router's gate, absorbed MLA products,
unquantized linears) `gemm16` below. A tensor-core tile computes each of its elements the
same way wherever the element's row sits in the tile, so rows are independent of each other.
What it costs is in benchmarks/results (decode_layer: deterministic vs default).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.runtime import interpreting

# tiles.json-style configs used for every row count (the smallest-M entries, split-K off)
NVFP4_GEMM = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=4)
FP8_GEMM = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=3)
MOE_NVFP4_GATE_UP = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=4)
MOE_NVFP4_DOWN = dict(BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4)
GEMM16 = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)


@triton.jit
def _gemm16_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xb,
    stride_xm,
    stride_wb,
    stride_wn,
    stride_wk,
    stride_ob,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + b * stride_xb + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + b * stride_wb + offs_n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(
            w_cols + kk[:, None].to(tl.int64) * stride_wk,
            mask=k_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        if DOT_F32:  # interpreter: numpy has no bf16 dot
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    out = out_ptr + b * stride_ob + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemm16(
    x: torch.Tensor,
    w: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ w^T with fp32 accumulation, rows independent of each other.

    x [M, K] or [B, M, K] (16-bit, unit stride along K); w [N, K] or [B, N, K] (16-bit, any
    strides: a transposed view serves without a copy); returns [M, N] / [B, M, N] in
    `out_dtype` (default x's) or writes `out` (unit stride along N)."""
    batched = x.dim() == 3
    xb = x if batched else x[None]
    wb = w if batched else w[None]
    if xb.dim() != 3 or wb.dim() != 3 or xb.shape[0] != wb.shape[0] or xb.shape[2] != wb.shape[2]:
        raise ValueError(f"gemm16: x {tuple(x.shape)} and w {tuple(w.shape)} do not match")
    if xb.stride(-1) != 1:
        xb = xb.contiguous()
    b, m, k = xb.shape
    n = wb.shape[1]
    if out is None:
        out = torch.empty(b, m, n, dtype=out_dtype or x.dtype, device=x.device)
        ob = out
    else:
        ob = out if batched else out[None]
    if tuple(ob.shape) != (b, m, n) or ob.stride(-1) != 1:
        raise ValueError(f"gemm16: out must be [{b}, {m}, {n}] with unit stride along N")
    cfg = GEMM16
    if m and n:
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), b)
        _gemm16_kernel[grid](
            xb,
            wb,
            ob,
            m,
            n,
            k,
            xb.stride(0),
            xb.stride(1),
            wb.stride(0),
            wb.stride(1),
            wb.stride(2),
            ob.stride(0),
            ob.stride(1),
            BLOCK_M=cfg["BLOCK_M"],
            BLOCK_N=cfg["BLOCK_N"],
            BLOCK_K=cfg["BLOCK_K"],
            DOT_F32=interpreting(),
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )
    return ob if batched else ob[0]
