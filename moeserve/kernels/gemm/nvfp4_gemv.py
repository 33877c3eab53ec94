"""NVFP4 weight-only products without the fused tensor-core kernel: a CUDA-core GEMV for a few
rows (decode), and dequantize-then-cuBLAS for many rows (prefill).

At M <= 8 a W4A16 GEMM is a stream of 4-bit weights with almost no arithmetic per byte, and what
limits it is instruction issue, not the MMA: the tensor-core path (nvfp4_gemm.py) must decode
E2M1 to bf16 and move the tile through shared memory into the MMA operand layout, ~5.6
instructions per weight element. Here nothing leaves the registers: each 32-bit word of 8 codes
is decoded by 11 integer instructions into 4 f16x2 pairs (e2m1_ptx.py) and 8 conversions into
fp32 values, each then costs one FMA per row of x.
The block scale multiplies a 16-element partial sum (1/16 of an FMA per element). With the F16
tile option the products are f16x2 instead (one fma.rn.f16x2 per two weights, no conversions,
x scaled per row by a power of two; see _E2M1_F16X2_DOT_ASM), and with STAGES
the K loop streams weight tiles through shared memory by cp.async instead of registers.

Decode (Marlin-style on words, e2m1_ptx.py): pair j of word q holds codes (n_j, n_{j+4}) as
f16x2 with the signs at bits 15/31 and (e1 e0 m) at bits 11..9 / 27..25, i.e. the two E2M1
values times 2^-14 (e=0 lands on an f16 subnormal, which f16 -> f32 conversion keeps exactly).
The 2^14 is folded into the global scale.

Layouts are nvfp4_format.py's (ModelOpt): packed uint8 [N, K/2] viewed as int32 [N, K/8], scales
e4m3 [N, K/16], one fp32 global scale; K a multiple of 16 (tiles past K load as zeros).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from moeserve.kernels.gemm.e2m1_ptx import decode_pairs_ptx
from moeserve.kernels.gemm.splitk import (
    SplitKWorkspace,
    dense_x_rows,
    split_k_plan,
    splitk_buffers,
)
from moeserve.kernels.pdl import pdl_launch, pdl_wait

GEMV_F16_EXP = tl.constexpr(14)  # decoded f16 values are E2M1 * 2^-14


# $0..$7: fp32 values of nibbles 0..7 of word $8 (times 2^-14).
def _e2m1_f32_asm() -> str:
    lines = [".reg .b32 et, ea, eb, r0, r1, r2, r3;", ".reg .b16 lo, hi;"]
    lines.append(decode_pairs_ptx("$8", ("r0", "r1", "r2", "r3"), "f16", ("et", "ea", "eb")))
    for j in range(4):
        lines += [f"mov.b32 {{lo, hi}}, r{j};", f"cvt.f32.f16 ${j}, lo;"]
        lines.append(f"cvt.f32.f16 ${j + 4}, hi;")
    return "{\n" + "\n".join(lines) + "\n}"


_E2M1_F32_ASM = tl.constexpr(_e2m1_f32_asm())


@triton.jit
def _nibble_f32(q, j: tl.constexpr):
    """Plain-Triton decode of nibble j of words q (the interpreter's path): fp32 value*2^-14."""
    c = (q >> (4 * j)) & 15
    h = ((c & 8) << 12) | ((c & 7) << 9)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble_arith(q, j: tl.constexpr):
    """Per-element arithmetic decode (no bit reinterpretation): fp32 value*2^-14."""
    c = (q >> (4 * j)) & 15
    idx = c & 7
    e = idx >> 1
    m = (idx & 1).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, tl.exp2((e - 1).to(tl.float32)) * (1.0 + 0.5 * m))
    return tl.where((c & 8) != 0, -mag, mag) * (2.0**-GEMV_F16_EXP)


@triton.jit
def _decode_nibbles(q, DECODE: tl.constexpr):
    """int32 words -> 8 fp32 tensors of q's shape: nibble j of each word (value * 2^-14)."""
    if DECODE == 1:
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _E2M1_F32_ASM,
            "=f,=f,=f,=f,=f,=f,=f,=f,r",
            [q],
            dtype=(tl.float32,) * 8,
            is_pure=True,
            pack=1,
        )
    elif DECODE == 2:
        v0 = _nibble_f32(q, 0)
        v1 = _nibble_f32(q, 1)
        v2 = _nibble_f32(q, 2)
        v3 = _nibble_f32(q, 3)
        v4 = _nibble_f32(q, 4)
        v5 = _nibble_f32(q, 5)
        v6 = _nibble_f32(q, 6)
        v7 = _nibble_f32(q, 7)
    else:
        v0 = _nibble_arith(q, 0)
        v1 = _nibble_arith(q, 1)
        v2 = _nibble_arith(q, 2)
        v3 = _nibble_arith(q, 3)
        v4 = _nibble_arith(q, 4)
        v5 = _nibble_arith(q, 5)
        v6 = _nibble_arith(q, 6)
        v7 = _nibble_arith(q, 7)
    return v0, v1, v2, v3, v4, v5, v6, v7


# f16x2 products (F16 option): $0 = fp32 sum over one 16-element block of the products of the
# codes of words $1, $2 (value * 2^-14) with x pairs $3..$10, f16x2 words (x[8w + j],
# x[8w + j + 4]) for word w, j = 0..3, of x pre-scaled by a power of two. One fma.rn.f16x2 per
# two weights replaces two f16 -> f32 conversions and two fp32 FMAs; the decode is
# e2m1_ptx's (11 instructions per word).


def _f16x2_dot_asm() -> str:
    lines = [".reg .b32 et, ea, eb, r0, r1, r2, r3, a;", ".reg .b16 lo, hi;", ".reg .f32 flo, fhi;"]
    first = True
    for w, q in ((0, "$1"), (1, "$2")):
        lines.append(decode_pairs_ptx(q, ("r0", "r1", "r2", "r3"), "f16", ("et", "ea", "eb")))
        for j in range(4):
            x = f"${3 + 4 * w + j}"
            op = f"mul.rn.f16x2 a, r{j}, {x};" if first else f"fma.rn.f16x2 a, r{j}, {x}, a;"
            lines.append(op)
            first = False
    lines += ["mov.b32 {lo, hi}, a;", "cvt.f32.f16 flo, lo;", "cvt.f32.f16 fhi, hi;"]
    lines.append("add.f32 $0, flo, fhi;")
    return "{\n" + "\n".join(lines) + "\n}"


_E2M1_F16X2_DOT_ASM = tl.constexpr(_f16x2_dot_asm())
# x scaling for the f16 products: the row's max |x| over the program's K slice is brought to
# [2^14, 2^15), so that x fits f16 and products (<= 6 * 2^-14 * 2^15) and their 16-term sums
# stay far below its 65504, while none but negligible terms fall into f16 subnormals.
F16_X_EXP = tl.constexpr(141)  # 2^(F16_X_EXP - E) for max|x| with biased fp32 exponent E
F16_X_MIN_EXP = tl.constexpr(32)  # rows with max|x| < 2^-95 (zero) keep a finite scale
X_SCALE_TILES = tl.constexpr(4)  # K tiles of x one load of the x-scale prologue covers


@triton.jit
def _x_scale(x_row, ok, kw_begin, K, BW: tl.constexpr, K_ITERS: tl.constexpr):
    """(scale, 1/scale), powers of two, for x's values in this program's K slice (F16).

    Unrolled in steps of X_SCALE_TILES tiles so that the loads are in flight together: as a
    loop of K_ITERS dependent loads this prologue held back a program's first weight requests
    by K_ITERS L2 round trips (measured: expert_down 7.7 -> 6.9 us, q_b_proj 7.7 -> 7.1 us at
    one row, where one program covers all of K)."""
    CH: tl.constexpr = X_SCALE_TILES * 8 * BW
    end = tl.minimum(K, (kw_begin + K_ITERS * BW) * 8)
    m = tl.zeros((CH,), dtype=tl.float32)
    for c in tl.static_range(0, K_ITERS, X_SCALE_TILES):
        offs = (kw_begin + c * BW) * 8 + tl.arange(0, CH)
        xv = tl.load(x_row + offs, mask=ok & (offs < end), other=0.0)
        m = tl.maximum(m, tl.abs(xv.to(tl.float32)))
    e = (tl.max(m, axis=0).to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.maximum(e, F16_X_MIN_EXP)
    scale = ((-e + (F16_X_EXP + 127)) << 23).to(tl.float32, bitcast=True)
    inv = ((e + (127 - F16_X_EXP)) << 23).to(tl.float32, bitcast=True)
    return scale, inv


@triton.jit
def _split4(t):
    """[G, 4] -> its four columns, each [G]."""
    a, b = tl.split(tl.reshape(t, (t.shape[0], 2, 2)))  # column 2*i + 0 / 2*i + 1
    c0, c2 = tl.split(a)
    c1, c3 = tl.split(b)
    return c0, c1, c2, c3


@triton.jit
def _nibble(q, j: tl.constexpr, DECODE: tl.constexpr):
    if DECODE == 2:
        return _nibble_f32(q, j)
    return _nibble_arith(q, j)


@triton.jit
def _pair_dot(q, p, j: tl.constexpr, DECODE: tl.constexpr):
    """Plain-Triton model of one fma.rn.f16x2 of the asm (fp32 math): nibbles j and j + 4 of
    words q times the f16 halves of pair words p."""
    lo = (p & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = ((p >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return _nibble(q, j, DECODE) * lo + _nibble(q, j + 4, DECODE) * hi


@triton.jit
def _tile_dot_f16(q0, q1, s, x_row, ok, kw, K, xs, BW: tl.constexpr, DECODE: tl.constexpr):
    """F16 path of one tile: words q0 / q1 [R, BW/2] (first / second word of each 16-element
    block), block scales s [R, BW/2] -> sum(w * x) * s per block, [R, BW/2] fp32 (x 2^-14,
    x times its power-of-two scale xs, which the caller undoes once)."""
    xf = _load_x(x_row, ok, kw, K, BW) * xs
    # element 16b + 8w + 4h + j of the tile -> pair word (j, j + 4) of word w of block b
    xf = tl.permute(tl.reshape(xf, (BW // 2, 2, 2, 4)), (0, 1, 3, 2))
    lo, hi = tl.split(xf)
    if DECODE == 1:  # one conversion per pair (cvt puts its first source in the high half)
        pairs = tl.inline_asm_elementwise(
            "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        lo = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        pairs = lo | (hi << 16)
    w0, w1 = tl.split(tl.permute(pairs, (0, 2, 1)))
    a0, a1, a2, a3 = _split4(w0)
    b0, b1, b2, b3 = _split4(w1)
    if DECODE == 1:
        g = tl.inline_asm_elementwise(
            _E2M1_F16X2_DOT_ASM,
            "=f,r,r,r,r,r,r,r,r,r,r",
            [
                q0,
                q1,
                a0[None, :],
                a1[None, :],
                a2[None, :],
                a3[None, :],
                b0[None, :],
                b1[None, :],
                b2[None, :],
                b3[None, :],
            ],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    else:
        g = _pair_dot(q0, a0[None, :], 0, DECODE) + _pair_dot(q0, a1[None, :], 1, DECODE)
        g += _pair_dot(q0, a2[None, :], 2, DECODE) + _pair_dot(q0, a3[None, :], 3, DECODE)
        g += _pair_dot(q1, b0[None, :], 0, DECODE) + _pair_dot(q1, b1[None, :], 1, DECODE)
        g += _pair_dot(q1, b2[None, :], 2, DECODE) + _pair_dot(q1, b3[None, :], 3, DECODE)
    return g * s


@triton.jit
def _decode_words(q, R: tl.constexpr, BW: tl.constexpr, DECODE: tl.constexpr):
    """int32 words [R, BW] -> fp32 [R, 8*BW] (value * 2^-14), column 8*w + j = nibble j of word w.

    Each join adds a new lowest index bit, so joining on nibble bit 2 first, then bit 1, then
    bit 0 leaves the natural K order; joins of values held by one thread stay in registers."""
    v0, v1, v2, v3, v4, v5, v6, v7 = _decode_nibbles(q, DECODE)
    a0 = tl.reshape(tl.join(v0, v4), (R, 2 * BW))
    a1 = tl.reshape(tl.join(v2, v6), (R, 2 * BW))
    a2 = tl.reshape(tl.join(v1, v5), (R, 2 * BW))
    a3 = tl.reshape(tl.join(v3, v7), (R, 2 * BW))
    c0 = tl.reshape(tl.join(a0, a1), (R, 4 * BW))
    c1 = tl.reshape(tl.join(a2, a3), (R, 4 * BW))
    return tl.reshape(tl.join(c0, c1), (R, 8 * BW))


@triton.jit
def _load_q(w_rows, n_mask, kw0, KW, BW: tl.constexpr, EVEN: tl.constexpr = 0):
    """Words [R, BW] from word column kw0 (masked ones load as 0). EVEN: the caller guarantees
    every row and column is inside the weight, so no masks (their compares, selects and zero
    fills were ~6% of the MoE GEMV's loop)."""
    offs_w = kw0 + tl.arange(0, BW)
    if EVEN:
        return tl.load(w_rows + offs_w[None, :])
    return tl.load(w_rows + offs_w[None, :], mask=n_mask & (offs_w[None, :] < KW), other=0)


@triton.jit
def _load_scales(s_rows, n_mask, kw0, KW, BW: tl.constexpr, EVEN: tl.constexpr = 0):
    """The raw e4m3 block scales [R, BW/2] of the words _load_q loads."""
    offs_g = kw0 // 2 + tl.arange(0, BW // 2)
    if EVEN:
        return tl.load(s_rows + offs_g[None, :])
    return tl.load(s_rows + offs_g[None, :], mask=n_mask & (offs_g[None, :] < KW // 2), other=0)


@triton.jit
def _load_words(w_rows, s_rows, n_mask, kw0, KW, BW: tl.constexpr, EVEN: tl.constexpr = 0):
    """Words [R, BW] from word column kw0 and the raw e4m3 block scales [R, BW/2]; masked
    words and scales load as 0."""
    return (
        _load_q(w_rows, n_mask, kw0, KW, BW, EVEN),
        _load_scales(s_rows, n_mask, kw0, KW, BW, EVEN),
    )


@triton.jit
def _group_dot(w, s, x_row, R: tl.constexpr, BW: tl.constexpr):
    """Per 16-element block: sum(w * x) * scale -> [R, BW/2] fp32."""
    p = tl.reshape(w * x_row[None, :], (R, BW // 2, 16))
    return tl.sum(p, axis=2) * s


@triton.jit
def _load_x(x_row, row_ok, kw0, K, BW: tl.constexpr):
    offs = kw0 * 8 + tl.arange(0, 8 * BW)
    return tl.load(x_row + offs, mask=row_ok & (offs < K), other=0.0).to(tl.float32)


@triton.jit
def _tile_update(
    accs, q, s8, x_rows, oks, xss, kw, K,
    R: tl.constexpr, BW: tl.constexpr, MP: tl.constexpr, DECODE: tl.constexpr,
    F16: tl.constexpr,
):  # fmt: skip
    """Add one tile's block partials to the MP accumulators (fp32 or f16x2 products)."""
    acc0, acc1, acc2, acc3 = accs
    x_row0, x_row1, x_row2, x_row3 = x_rows
    ok0, ok1, ok2, ok3 = oks
    s = s8.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if F16:
        xs0, xs1, xs2, xs3 = xss
        q0, q1 = tl.split(tl.reshape(q, (R, BW // 2, 2)))
        acc0 += _tile_dot_f16(q0, q1, s, x_row0, ok0, kw, K, xs0, BW, DECODE)
        if MP > 1:
            acc1 += _tile_dot_f16(q0, q1, s, x_row1, ok1, kw, K, xs1, BW, DECODE)
        if MP > 2:
            acc2 += _tile_dot_f16(q0, q1, s, x_row2, ok2, kw, K, xs2, BW, DECODE)
            acc3 += _tile_dot_f16(q0, q1, s, x_row3, ok3, kw, K, xs3, BW, DECODE)
    else:
        w = _decode_words(q, R, BW, DECODE)
        acc0 += _group_dot(w, s, _load_x(x_row0, ok0, kw, K, BW), R, BW)
        if MP > 1:
            acc1 += _group_dot(w, s, _load_x(x_row1, ok1, kw, K, BW), R, BW)
        if MP > 2:
            acc2 += _group_dot(w, s, _load_x(x_row2, ok2, kw, K, BW), R, BW)
            acc3 += _group_dot(w, s, _load_x(x_row3, ok3, kw, K, BW), R, BW)
    return acc0, acc1, acc2, acc3


@triton.jit
def _unscale_x(accs, xinvs):
    """The accumulators times their x rows' inverse scales (1.0 without F16): the scale is one
    power of two per row and K slice, so it is undone once instead of once per block."""
    acc0, acc1, acc2, acc3 = accs
    xi0, xi1, xi2, xi3 = xinvs
    return acc0 * xi0, acc1 * xi1, acc2 * xi2, acc3 * xi3


@triton.jit
def _x_scales(x_rows, oks, kw_begin, K, BW: tl.constexpr, MP: tl.constexpr, K_ITERS):
    """Per-row (scale, 1/scale) tuples for the F16 path (1.0 for rows past MP)."""
    x_row0, x_row1, x_row2, x_row3 = x_rows
    ok0, ok1, ok2, ok3 = oks
    xs0, xi0 = _x_scale(x_row0, ok0, kw_begin, K, BW, K_ITERS)
    xs1, xi1, xs2, xi2, xs3, xi3 = 1.0, 1.0, 1.0, 1.0, 1.0, 1.0
    if MP > 1:
        xs1, xi1 = _x_scale(x_row1, ok1, kw_begin, K, BW, K_ITERS)
    if MP > 2:
        xs2, xi2 = _x_scale(x_row2, ok2, kw_begin, K, BW, K_ITERS)
        xs3, xi3 = _x_scale(x_row3, ok3, kw_begin, K, BW, K_ITERS)
    return (xs0, xs1, xs2, xs3), (xi0, xi1, xi2, xi3)


@triton.jit
def gemv_accumulate(
    x_rows,
    oks,
    w_rows,
    s_rows,
    n_mask,
    kw_begin,
    KW,
    K,
    R: tl.constexpr,
    BW: tl.constexpr,
    MP: tl.constexpr,
    K_ITERS: tl.constexpr,
    DECODE: tl.constexpr,
    PREFETCH: tl.constexpr = 1,
    PDL: tl.constexpr = 0,
    STAGES: tl.constexpr = 0,
    F16: tl.constexpr = 0,
    EVEN: tl.constexpr = 0,
):
    """Partial dot products of R weight rows (pointers w_rows / s_rows [R, 1]) with up to 4 x
    rows (row pointers x_rows, used where oks) over K_ITERS tiles of BW words from word column
    kw_begin. Returns four [R, BW/2] fp32 accumulators (x 2^-14; rows past MP stay 0).
    Tiles are loaded PREFETCH tiles ahead of the one being decoded (into registers: no trip
    through shared memory), so that many bytes per SM are in flight while it computes; with
    STAGES > 0 the compiler pipelines them through shared memory instead (PREFETCH unused).
    PDL: the first tiles are requested before waiting for the previous kernel in the stream
    (programmatic dependent launch): weights are constants, x is that kernel's output.
    F16: products in f16x2 (one fma.rn.f16x2 per two weights) on x scaled per row by a power
    of two, 16-term block sums converted to fp32; the accumulators are the same.
    EVEN: every row of the tile is below N and the K_ITERS tiles from kw_begin lie inside K,
    so the weight loads are not masked (tiles requested ahead of the slice's end re-read its
    last tile instead)."""
    zero = tl.zeros((R, BW // 2), dtype=tl.float32)
    accs = (zero, zero, zero, zero)
    xss = (1.0, 1.0, 1.0, 1.0)
    xinvs = (1.0, 1.0, 1.0, 1.0)
    if STAGES > 0:
        # Triton's software pipeline (an explicit num_stages lets it pipeline loads that feed
        # no tl.dot): tiles stream through STAGES shared-memory buffers by cp.async, so the
        # bytes in flight per SM no longer cost registers (register prefetch capped them)
        if PDL:
            x_rows = _after_wait(x_rows)
        if F16:
            xss, xinvs = _x_scales(x_rows, oks, kw_begin, K, BW, MP, K_ITERS)
        # The one-byte scale loads cannot go through cp.async (4 bytes at least), so they are
        # requested a tile ahead in registers; the last request re-reads the last tile.
        kw_last = kw_begin + (K_ITERS - 1) * BW
        s_next = _load_scales(s_rows, n_mask, kw_begin, KW, BW, EVEN)
        for it in tl.range(0, K_ITERS, num_stages=STAGES):
            kw = kw_begin + it * BW
            q = _load_q(w_rows, n_mask, kw, KW, BW, EVEN)
            s8 = s_next
            s_next = _load_scales(s_rows, n_mask, tl.minimum(kw + BW, kw_last), KW, BW, EVEN)
            accs = _tile_update(accs, q, s8, x_rows, oks, xss, kw, K, R, BW, MP, DECODE, F16)
        return _unscale_x(accs, xinvs)
    # with EVEN the tiles requested ahead past the slice re-read its last one instead
    kw_last = kw_begin + (K_ITERS - 1) * BW if EVEN else kw_begin + (K_ITERS + 1) * BW
    kw0 = kw_begin
    q, s8 = _load_words(w_rows, s_rows, n_mask, kw0, KW, BW, EVEN)
    q1, s81 = _load_words(w_rows, s_rows, n_mask, tl.minimum(kw0 + BW, kw_last), KW, BW, EVEN)
    if PDL:
        x_rows = _after_wait(x_rows)  # the previous kernel's writes are visible from here
    if F16:
        xss, xinvs = _x_scales(x_rows, oks, kw_begin, K, BW, MP, K_ITERS)
    for _ in range(K_ITERS):
        kw2 = tl.minimum(kw0 + 2 * BW, kw_last)
        if PREFETCH == 2:
            q2, s82 = _load_words(w_rows, s_rows, n_mask, kw2, KW, BW, EVEN)
        accs = _tile_update(accs, q, s8, x_rows, oks, xss, kw0, K, R, BW, MP, DECODE, F16)
        if PREFETCH == 2:
            q, s8, q1, s81 = q1, s81, q2, s82
        else:
            q, s8 = q1, s81
            q1, s81 = _load_words(w_rows, s_rows, n_mask, kw2, KW, BW, EVEN)
        kw0 += BW
    return _unscale_x(accs, xinvs)


@triton.jit
def _after_wait(x_rows):
    """Wait for the previous kernel (PDL); x_rows tied to the wait (kernels/pdl.py)."""
    z = pdl_wait()
    x0, x1, x2, x3 = x_rows
    return (x0 + z, x1 + z, x2 + z, x3 + z)


@triton.jit
def _finish_row(acc, scale, out_ptrs, ws_ptrs, mask, SPLIT_K: tl.constexpr):
    """Row total acc [R, BW/2] * scale -> out (SPLIT_K == 1) or added into the fp32 workspace."""
    v = tl.sum(acc, axis=1) * scale
    if SPLIT_K == 1:
        tl.store(out_ptrs, v.to(out_ptrs.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(ws_ptrs, v, mask=mask, sem="relaxed")


@triton.jit
def _copy_out_row(out_ptrs, ws_ptrs, mask):
    total = tl.load(ws_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=mask)
    tl.store(ws_ptrs, tl.zeros_like(total), mask=mask)


@triton.jit
def _nvfp4_gemv_kernel(
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
    MP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_ITERS: tl.constexpr,
    DECODE: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr = 0,
    STAGES: tl.constexpr = 0,
    F16: tl.constexpr = 0,
    EVEN: tl.constexpr = 0,
):
    """out [M, N] = x [M, K] @ W^T for MP rows of x per program.
    Grid (cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, MP)). With SPLIT_K > 1 the partial sums meet in
    the zeroed fp32 workspace; the last program of a tile writes out and re-zeroes it.
    PDL (launched with programmatic stream serialization): the next kernel may launch once
    every program has started, and this one reads only weights before it waits (kernels/pdl.py)."""
    if PDL:
        gdc_launch_dependents()
    BW: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    row0 = tl.program_id(2) * MP
    KW = K // 8
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * KW
    s_rows = s_ptr + offs_n[:, None].to(tl.int64) * (KW // 2)
    x_rows, oks = dense_x_rows(x_ptr, row0, stride_xm, M)
    acc0, acc1, acc2, acc3 = gemv_accumulate(
        x_rows,
        oks,
        w_rows,
        s_rows,
        n_ok[:, None],
        pid_k * K_ITERS * BW,
        KW,
        K,
        BLOCK_N,
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
    scale = tl.load(gs_ptr) * (2.0**GEMV_F16_EXP)
    o = out_ptr + row0.to(tl.int64) * stride_om + offs_n
    ws = ws_ptr + row0.to(tl.int64) * N + offs_n
    _finish_row(acc0, scale, o, ws, n_ok & (row0 < M), SPLIT_K)
    if MP > 1:
        _finish_row(acc1, scale, o + stride_om, ws + N, n_ok & (row0 + 1 < M), SPLIT_K)
    if MP > 2:
        _finish_row(acc2, scale, o + 2 * stride_om, ws + 2 * N, n_ok & (row0 + 2 < M), SPLIT_K)
        _finish_row(acc3, scale, o + 3 * stride_om, ws + 3 * N, n_ok & (row0 + 3 < M), SPLIT_K)
    if SPLIT_K > 1:
        tl.debug_barrier()
        lock = lock_ptr + tl.program_id(2) * tl.num_programs(0) + pid_n
        if tl.atomic_add(lock, 1, sem="acq_rel") == SPLIT_K - 1:
            _copy_out_row(o, ws, n_ok & (row0 < M))
            if MP > 1:
                _copy_out_row(o + stride_om, ws + N, n_ok & (row0 + 1 < M))
            if MP > 2:
                _copy_out_row(o + 2 * stride_om, ws + 2 * N, n_ok & (row0 + 2 < M))
                _copy_out_row(o + 3 * stride_om, ws + 3 * N, n_ok & (row0 + 3 < M))
            tl.atomic_xchg(lock, 0)


@triton.jit
def _nvfp4_dequant_kernel(
    w_ptr,
    s_ptr,
    gs_ptr,
    out_ptr,
    N,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DECODE: tl.constexpr,
):
    """out [N, K] bf16 = dequantized weight rows of tile pid(0), K tile pid(1)."""
    BW: tl.constexpr = BLOCK_K // 8
    KW = K // 8
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n[:, None] < N
    kw0 = tl.program_id(1) * BW
    q, s8 = _load_words(
        w_ptr + offs_n[:, None].to(tl.int64) * KW,
        s_ptr + offs_n[:, None].to(tl.int64) * (KW // 2),
        n_ok,
        kw0,
        KW,
        BW,
    )
    scale = s8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * (
        tl.load(gs_ptr) * (2.0**GEMV_F16_EXP)
    )
    w = tl.reshape(_decode_words(q, BLOCK_N, BW, DECODE), (BLOCK_N, BW // 2, 16))
    w = tl.reshape(w * scale[:, :, None], (BLOCK_N, 8 * BW))
    offs_k = kw0 * 8 + tl.arange(0, 8 * BW)
    ptrs = out_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    tl.store(ptrs, w.to(out_ptr.dtype.element_ty), mask=n_ok & (offs_k[None, :] < K))


DEQUANT_CHUNK_ELEMS = 1 << 25  # bf16 weight rows materialised per matmul (64 MiB)


def nvfp4_dequant_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    out: torch.Tensor,
    config: dict[str, int],
    decode: int,
) -> torch.Tensor:
    """Many rows (prefill): dequantize W to bf16 in chunks of rows and let cuBLAS multiply.
    At large M the product is compute-bound and cuBLAS's tensor-core GEMM beats a fused
    dequantizing kernel; the dequantization itself costs one read of W and one bf16 write."""
    m, k = x.shape
    n = packed.shape[0]
    bn, bk = config["BLOCK_N"], config["BLOCK_K"]
    rows = max(bn, min(n, DEQUANT_CHUNK_ELEMS // k) // bn * bn)
    buf = torch.empty(min(rows, n), k, dtype=x.dtype, device=x.device)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        w = buf[: r1 - r0]
        _nvfp4_dequant_kernel[(triton.cdiv(r1 - r0, bn), triton.cdiv(k, bk))](
            packed[r0:r1].view(torch.int32),
            scale[r0:r1].view(torch.uint8),
            global_scale,
            w,
            r1 - r0,
            k,
            BLOCK_N=bn,
            BLOCK_K=bk,
            DECODE=decode,
            num_warps=config["num_warps"],
        )
        torch.matmul(x, w.t(), out=out[:, r0:r1])
    return out


GEMV_MAX_M = 4  # rows per program at most (one weight pass serves up to 4 rows)


def gemv_rows_per_program(m: int) -> int:
    return 1 if m == 1 else 2 if m == 2 else GEMV_MAX_M


def nvfp4_gemv(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    out: torch.Tensor,
    workspace: SplitKWorkspace | None,
    config: dict[str, int],
    decode: int,
) -> torch.Tensor:
    """out [M, N] = x [M, K] @ dequant(W)^T on CUDA cores; arguments checked by nvfp4_gemm."""
    m, k = x.shape
    n = packed.shape[0]
    bn, bk = config["BLOCK_N"], config["BLOCK_K"]
    mp = gemv_rows_per_program(m)
    grid_n, grid_m = triton.cdiv(n, bn), triton.cdiv(m, mp)
    k_tiles = triton.cdiv(k, bk)
    split, k_iters = split_k_plan(config["SPLIT_K"], grid_n * grid_m, k_tiles, x.device)
    ws, locks = splitk_buffers(split, workspace, grid_m * mp * n, grid_n * grid_m, out)
    # programmatic dependent launch: a tile-table option until measured (the interpreter
    # has no grid dependency control)
    pdl = pdl_launch(config.get("PDL", 0))
    _nvfp4_gemv_kernel[(grid_n, split, grid_m)](
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
        MP=mp,
        BLOCK_N=bn,
        BLOCK_K=bk,
        SPLIT_K=split,
        K_ITERS=k_iters,
        DECODE=decode,
        PREFETCH=config.get("PREFETCH", 1),
        PDL=int(pdl),
        STAGES=config.get("STAGES", 0),
        F16=config.get("F16", 0),
        EVEN=int(n % bn == 0 and split * k_iters * bk == k),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
        launch_pdl=pdl,
    )
    return out
