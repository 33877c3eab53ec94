"""NVFP4 x few rows on tensor cores with the decoded weights kept in registers (mma.sync).

The CUDA-core GEMV (nvfp4_gemv.py) spends one f16->f32 conversion and one FMA per weight
element and activation row on top of the E2M1 decode. Here the decoded bf16 pairs go straight
into the B operand of `mma.sync.m16n8k16` from the registers they were decoded in: the weight
rows are the MMA's 8 columns, up to 8 activation rows (tokens) are its rows, so 1..8 tokens cost
the same and the FMAs are gone.

This relies on the register layout Triton 3.6 gives the [R, BW] tile of packed words (BW = words
along K): `blocked{sizePerThread=[1,2], threadsPerWarp=[8,4], order=[1,0]}`, i.e. lane 4g+t
holds one weight row (g) and, per register slot, the same word position for every g, with
lanes t = 0..3 on 4 different words. One MMA then sums over the 16 K positions of those 4 words
that sit in the slot's registers (4 per lane: the (n_j, n_j+4) pairs j = 0, 1; then 2, 3):
  A (tokens x k)  lane (g, t): x of token g at its word's K positions, pairs (x_j, x_j+4)
  B (k x rows)    lane (g, t): its own decoded pairs (its row is column g)
  D (tokens x rows) lane (g, t): D[g][2t], D[g][2t+1]  (rows 8-15 of A are zero)
Which word a lane holds depends only on t, so A and B agree on the K order. The per-element
accumulators are summed afterwards with reshapes that follow that mapping. Triton picks that
layout when the launch is specialised on K % 16 == 0 and a 16-byte aligned weight (2-word
vectors; seen in the sm_90a TTGIR of every config used); without the specialisation it picks
single words and the result would be wrong, so the host wrappers check both, and
`probe_gemv_mma` (nvfp4_gemm.py) runs this kernel on a one-hot case at start-up and falls back
to the CUDA-core GEMV when it is not bit-exact.

The E2M1 -> bf16 decode and block-scale multiply are nvfp4_gemm.py's (value * scale * 2^-8);
the scale byte and the 16 bytes of activations per word are loaded inside the asm, so the
packed words are the only load Triton lays out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.gemm.e2m1_ptx import decode_pairs_ptx
from moeserve.kernels.gemm.splitk import (
    ACC_FIX_EXP,
    SplitKWorkspace,
    choose_split_k,
    splitk_buffers,
)

MMA_TOKENS = tl.constexpr(
    8
)  # rows of activations one program serves (the MMA's m16 minus its zero half)


def _decode_pairs(q: str) -> str:
    """Word q -> bf16x2 pairs w0..w3 times the scale pair ss (e2m1_ptx's decode)."""
    outs = ("w0", "w1", "w2", "w3")
    lines = decode_pairs_ptx(q, outs, "bf16", ("et", "ea", "eb"))
    return lines + "".join(f"mul.rn.bf16x2 {w}, {w}, ss;\n" for w in outs)


_X_PAIRS = """
prmt.b32 p0, {a}, {c}, 0x5410;
prmt.b32 p1, {a}, {c}, 0x7632;
prmt.b32 p2, {b}, {d}, 0x5410;
prmt.b32 p3, {b}, {d}, 0x7632;
"""
_MMA2 = """
mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
  {{{o0}, {o1}, d2, d3}}, {{p0, z, p1, z}}, {{{w0}, {w1}}}, {{{i0}, {i1}, zf, zf}};
mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
  {{{o0}, {o1}, d2, d3}}, {{p2, z, p3, z}}, {{{w2}, {w3}}}, {{{o0}, {o1}, zf, zf}};
"""
# One call handles the two consecutive words (w, w+1) a lane holds in one register slot; they
# share one block scale. Operands: $0,$1 c0 out, $2,$3 c1 out (per word); $4,$5 c0 in;
# $6,$7 c1 in; $8,$9 the packed words; $10,$11 address of the token's activation row;
# $12,$13 address of the weight row's scales; $14,$15 word index w (and w+1).
_MMA_ASM = tl.constexpr(
    """
{
.reg .b32 xa, xb, xc, xd, xe, xf, xg, xh, p0, p1, p2, p3, et, ea, eb, w0, w1, w2, w3, ss, z, s2, wi;
.reg .b64 ax, as;
.reg .b16 sb, sl, sh;
.reg .f32 sf, d2, d3, zf;
mov.b32 z, 0;
mov.f32 zf, 0f00000000;
mad.wide.u32 ax, $14, 16, $10;
ld.global.nc.v4.b32 {xa, xb, xc, xd}, [ax];
ld.global.nc.v4.b32 {xe, xf, xg, xh}, [ax+16];
shr.u32 wi, $14, 1;
cvt.u64.u32 as, wi;
add.s64 as, as, $12;
ld.global.nc.u8 sb, [as];
cvt.rn.f16x2.e4m3x2 s2, sb;
mov.b32 {sl, sh}, s2;
cvt.f32.f16 sf, sl;
mul.f32 sf, sf, 0f7A800000;
cvt.rn.bf16.f32 sl, sf;
mov.b32 ss, {sl, sl};
"""
    + _decode_pairs("$8")
    + _X_PAIRS.format(a="xa", b="xb", c="xc", d="xd")
    + _MMA2.format(o0="$0", o1="$2", i0="$4", i1="$6", w0="w0", w1="w1", w2="w2", w3="w3")
    + _decode_pairs("$9")
    + _X_PAIRS.format(a="xe", b="xf", c="xg", d="xh")
    + _MMA2.format(o0="$1", o1="$3", i0="$5", i1="$7", w0="w0", w1="w1", w2="w2", w3="w3")
    + "}"
)

TILE_WORDS = tl.constexpr(8)  # words per tile row: 4 lanes x 2 words (the layout above)


@triton.jit
def _mma_step(c0, c1, q, x_row, s_row, w):
    return tl.inline_asm_elementwise(
        _MMA_ASM,
        "=f,=f,=f,=f,f,f,f,f,r,r,l,l,l,l,r,r",
        [c0, c1, q, x_row, s_row, w[None, :]],
        dtype=(tl.float32, tl.float32),
        is_pure=True,
        pack=2,
    )


@triton.jit
def mma_accumulate(x_row, w_row, s_row, kw_begin, R: tl.constexpr, K_ITERS: tl.constexpr):
    """Per-lane MMA accumulators over K_ITERS steps of 4 tiles of 8 words (256 K) from word
    kw_begin; the next step's words are loaded before this step's are used.

    x_row [R, 1] int64: address of the activation row of the token that is MMA row r % 8 of
    tile row r; w_row [R, 1]: int32 pointer to weight row r's packed words; s_row [R, 1]
    int64: address of its block scales. No masks: the caller guarantees whole steps (rows
    past N and tokens past M point at valid rows and are dropped afterwards). Returns
    (c0, c1) [R, 8] (module docstring; x 2^-8 like nvfp4_gemm)."""
    c0 = tl.zeros((R, TILE_WORDS), dtype=tl.float32)
    c1 = tl.zeros((R, TILE_WORDS), dtype=tl.float32)
    w = kw_begin + tl.arange(0, TILE_WORDS)
    q0 = tl.load(w_row + w[None, :])
    q1 = tl.load(w_row + (w + 8)[None, :])
    q2 = tl.load(w_row + (w + 16)[None, :])
    q3 = tl.load(w_row + (w + 24)[None, :])
    for it in range(K_ITERS):
        wn = w + 32 * (it + 1 < K_ITERS)  # the last step reloads its own words
        n0 = tl.load(w_row + wn[None, :])
        n1 = tl.load(w_row + (wn + 8)[None, :])
        n2 = tl.load(w_row + (wn + 16)[None, :])
        n3 = tl.load(w_row + (wn + 24)[None, :])
        c0, c1 = _mma_step(c0, c1, q0, x_row, s_row, w)
        c0, c1 = _mma_step(c0, c1, q1, x_row, s_row, w + 8)
        c0, c1 = _mma_step(c0, c1, q2, x_row, s_row, w + 16)
        c0, c1 = _mma_step(c0, c1, q3, x_row, s_row, w + 24)
        q0, q1, q2, q3 = n0, n1, n2, n3
        w = wn
    return c0, c1


@triton.jit
def mma_rows(c0, c1, R: tl.constexpr):
    """Per-lane accumulators -> [8, R]: token (MMA row) x weight row of the tile."""
    RB: tl.constexpr = R // 8
    e0 = tl.sum(tl.reshape(c0, (RB, 8, 4, 2)), axis=3)  # [block, g, t]: D[g][2t]
    e1 = tl.sum(tl.reshape(c1, (RB, 8, 4, 2)), axis=3)  # D[g][2t + 1]
    v = tl.reshape(tl.join(e0, e1), (RB, 8, 8))  # [block, token, 2t + e]
    return tl.reshape(tl.permute(v, (1, 0, 2)), (8, R))


@triton.jit
def _nvfp4_gemv_mma_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    out_ptr,
    ws_ptr,
    lock_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_ITERS: tl.constexpr,
):
    """out [M, N] = x [M, K] @ W^T, 8 rows of x per program; K = SPLIT_K * K_ITERS * 256
    exactly (the host checks). Grid (cdiv(N, BLOCK_N), SPLIT_K,
    cdiv(M, 8)); split-K partials meet in the zeroed workspace like nvfp4_gemv's."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    row0 = tl.program_id(2) * MMA_TOKENS
    KW = K // 8
    r = tl.arange(0, BLOCK_N)
    offs_n = tl.minimum(pid_n * BLOCK_N + r, N - 1)  # rows past N recompute row N-1
    tok = tl.minimum(row0 + r % 8, M - 1)  # tokens past M recompute token M-1
    c0, c1 = mma_accumulate(
        (x_ptr + tok.to(tl.int64) * stride_xm).to(tl.int64)[:, None],
        w_ptr + offs_n[:, None].to(tl.int64) * KW,
        (s_ptr + offs_n.to(tl.int64) * (KW // 2)).to(tl.int64)[:, None],
        pid_k * K_ITERS * 4 * TILE_WORDS,
        BLOCK_N,
        K_ITERS,
    )
    offs_n = pid_n * BLOCK_N + r
    y = mma_rows(c0, c1, BLOCK_N) * (tl.load(gs_ptr) * (2.0**ACC_FIX_EXP))  # [8, BLOCK_N]
    t8 = row0 + tl.arange(0, 8)
    mask = (t8 < M)[:, None] & (offs_n < N)[None, :]
    o = out_ptr + t8[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(o, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ws = ws_ptr + t8[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.atomic_add(ws, y, mask=mask, sem="relaxed")
        tl.debug_barrier()
        lock = lock_ptr + tl.program_id(2) * tl.num_programs(0) + pid_n
        if tl.atomic_add(lock, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.load(ws, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(o, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(ws, tl.zeros_like(total), mask=mask)
            tl.atomic_xchg(lock, 0)


MMA_STEP_K = 256  # K per loop step (4 tiles of 8 words)


def mma_supported(n: int, k: int, block_n: int, weight: torch.Tensor | None = None) -> bool:
    """Whole steps and row tiles (the MMA kernels have no masks), and a 16-byte aligned weight
    (the layout the kernels rely on comes from Triton's alignment specialisation)."""
    aligned = weight is None or weight.data_ptr() % 16 == 0
    return k % MMA_STEP_K == 0 and n % block_n == 0 and aligned


def nvfp4_gemv_mma(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    out: torch.Tensor,
    workspace: SplitKWorkspace | None,
    config: dict[str, int],
) -> torch.Tensor:
    """out [M, N] = x [M, K] @ dequant(W)^T with register-fed mma.sync (GPU only; K % 64 == 0,
    N % BLOCK_N == 0)."""
    m, k = x.shape
    n = packed.shape[0]
    bn = config["BLOCK_N"]
    if not mma_supported(n, k, bn, packed):
        raise ValueError(f"NVFP4 MMA GEMV needs K % 256 == 0 and N % {bn} == 0, got {n}x{k}")
    grid_n, grid_m = n // bn, triton.cdiv(m, MMA_TOKENS.value)
    steps = k // MMA_STEP_K
    want = choose_split_k(config["SPLIT_K"], grid_n * grid_m, steps, x.device)
    split = max(d for d in range(1, steps + 1) if steps % d == 0 and d <= want)
    rows = grid_m * MMA_TOKENS.value
    ws, locks = splitk_buffers(split, workspace, rows * n, grid_n * grid_m, out)
    _nvfp4_gemv_mma_kernel[(grid_n, split, grid_m)](
        x,
        packed.view(torch.int32),
        scale.view(torch.uint8),
        global_scale,
        out,
        ws,
        locks,
        m,
        n,
        k,
        x.stride(0),
        out.stride(0),
        BLOCK_N=bn,
        SPLIT_K=split,
        K_ITERS=steps // split,
        num_warps=config["num_warps"],
        num_stages=1,
    )
    return out
