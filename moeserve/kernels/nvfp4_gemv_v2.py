"""NVFP4 decode GEMV, version 2: x [M, K] @ dequant(W [N, K])^T for a few rows on CUDA cores,
from a layout repacked once at load time (repack_for_gemv_v2).

Why a second GEMV (nvfp4_gemv.py is the first): that kernel is bound by instruction issue at
~5.2 instructions per weight element, of which only ~2 decode and multiply; the rest is
per-tile address and mask arithmetic and the x pairs it rebuilds through shared memory on
every tile. Here the work is turned around so that x costs nothing in the main loop:

* A program owns one K slice and a range of rows. Each thread owns KC "vectors" of that slice,
  16 bytes = 32 codes of one row each, and keeps the x values of those 32 K-positions in
  registers as f16x2 pairs for the whole program, built once in the prologue. The main loop
  walks the program's rows, RB rows at a time: one 16-byte load per vector, one inline-asm
  block per vector doing decode + HFMA2 + block scales, a warp-shuffle sum per row.
* The repack places the bits of each 8-code word so that a 9-instruction sequence (below)
  yields its 4 f16x2 pairs, and pairs one code of the vector's first 16-code block (low half)
  with one of its second block (high half): pair P = 4w + j of word w multiplies x pair
  (x[P], x[16 + P]), built once in the prologue.
* Block scales stay e4m3 (one byte per 16 weights, the bytes the HBM target counts); since a
  pair's halves belong to the two blocks, one f16x2 accumulator sums the whole vector, and one
  cvt.rn.f16x2.e4m3x2 + one HMUL2 apply both block scales; one f16x2 -> fp32 per vector/row.
* x is scaled per vector (32 K-positions) by a power of two so that its largest |x| lies in
  [2^12, 2^13): with codes decoded as value * 2^-14 a product is at most 3, a 16-term f16
  half-sum at most 48 and times the largest e4m3 scale 448 at most 21504 < 65504 (f16 max),
  so no activation range overflows; the scale is undone in fp32.
* Split-K: the K slices of one row range meet in a zeroed fp32 workspace by atomic adds; the
  last program of the range (an int32 counter) writes the output and re-zeroes workspace and
  counter, inside the one launch (CUDA-graph safe with a preallocated SplitKWorkspace).

Decode of a word q (9 instructions for its 4 f16x2 pairs; nvfp4_gemv.py's F16 path takes 12):
pair 0 = q & 0x8E008E00, pair 1 = rotl(q, 3) & 0x8E008E00, o = (q & 0x401F401F) |
(rotl(q, 2) & ~0x401F401F), pair 2 = rotl(o, 8) & 0x8E008E00, pair 3 = rotl(o, 11) & the
same; each is two E2M1 values * 2^-14 as f16x2 (sign at bits 15 / 31, e1 e0 m at 11..9 /
27..25; e = 0 lands on an f16 subnormal, exact). An exhaustive search over programs of
rotations and one- or two-merge steps (run offline for this module) found no 8-instruction
layout; the earlier conclusion that no repack beats 12 held only for one shift + one AND per
pair.

Layout after repack_for_gemv_v2: words int32 [Np, Kp/8], scales uint8 (e4m3 bits)
[Np, Kp/16], global scale fp32 [1]; N padded to ROW_PAD, K to K_PAD with zero codes and
zero scales. 4 words = one 32-code vector; which code bit sits where: _WORD_BIT_MAP.
"""

from __future__ import annotations

import torch
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from moeserve.kernels.nvfp4_format import (
    NVFP4_BLOCK,
    e2m1_table,
    unpack_e2m1_codes,
)
from moeserve.kernels.splitk import SplitKWorkspace, sm_count

CODES_PER_WORD = 8
VECTOR_CODES = 32  # codes per thread vector: 16 bytes, one LDG.128
VECTOR_WORDS = VECTOR_CODES // CODES_PER_WORD
K_PAD = 512  # K is padded to this (the narrowest K slice: 16 lanes x one vector)
ROW_PAD = 64  # N is padded to this (a multiple of every RB)
MAX_ROWS_PER_PASS = 4  # x rows served by one pass over the weights (MP)
# The word layout (found by exhaustive search over shift / merge programs; no 8-instruction
# one exists among them): pair j of a word is (source rotated left by rot) & _PAIR_MASK, with
# source q for pairs 0, 1 and o = (q & _MERGE_SELECT) | (rotl(q, _MERGE_ROT) & ~_MERGE_SELECT)
# for pairs 2, 3: 9 instructions per word of 8 codes (the F16 GEMV's decode takes 12).
_PAIR_MASK = 0x8E008E00  # f16x2 bits of two E2M1 codes: sign 15 / 31, e1 e0 m at 11..9 / 27..25
_PAIR_SOURCES = (("q", 0), ("q", 3), ("o", 8), ("o", 11))
_MERGE_ROT = 2
_MERGE_SELECT = 0x401F401F
# f16 bit of a decoded pair -> (half, code bit): code = sign << 3 | e1 << 2 | e0 << 1 | m
_PAIR_BITS = {
    9: (0, 0),
    10: (0, 1),
    11: (0, 2),
    15: (0, 3),
    25: (1, 0),
    26: (1, 1),
    27: (1, 2),
    31: (1, 3),
}
DECODE_EXP = tl.constexpr(14)  # decoded f16 code values are E2M1 * 2^-14
# x scaling: 2^(X_SCALE_BIAS - E) for a vector whose max |x| has biased fp32 exponent E puts
# that max in [2^12, 2^13); E is clamped from below so that all-zero vectors keep finite scales.
X_SCALE_BIAS = tl.constexpr(266)  # 127 + 12 + 127
X_MIN_EXP = tl.constexpr(20)
FP32_EXP_MASK = tl.constexpr(0xFF)
FP32_MANT_BITS = tl.constexpr(23)
PROGRAMS_PER_SM = 2  # default one-wave target: resident programs per SM


def _vector_dot_asm(rows: int) -> str:
    """PTX: $0..$(rows-1) = fp32 sum over one 32-code vector of w * x_m (x_m scaled by its
    power of two), w = codes of words $rows..$rows+3 times 2^-14 times their e4m3 block scales
    (low / high byte of $rows+4 for the vector's first / second 16 codes); x pairs of row m:
    $(rows+5+16m) .. $(rows+20+16m), f16x2 (x[P], x[16 + P]) for pair P = 4w + j of word w.
    A decoded pair holds one code of each block (low half: first block), so one f16x2
    accumulator sums both blocks and one HMUL2 by the converted scale pair applies them."""
    q0 = rows
    sc = rows + VECTOR_WORDS
    x0 = sc + 1
    lines = [
        ".reg .b32 t, o, r, s2;",
        ".reg .b16 lo, hi;",
        ".reg .f32 flo, fhi;",
        f".reg .b32 a<{rows}>;",
    ]
    for w in range(VECTOR_WORDS):
        q = f"${q0 + w}"
        for j, (src, rot) in enumerate(_PAIR_SOURCES):
            if j == 2:  # o: the bits of pairs 2 and 3, merged from q and q rotated
                lines += [
                    f"shf.l.wrap.b32 t, {q}, {q}, {_MERGE_ROT};",
                    f"lop3.b32 o, {q}, t, {_MERGE_SELECT:#010x}, 0xE4;",  # (a & c) | (b & ~c)
                ]
            reg = q if src == "q" else "o"
            if rot:
                lines += [
                    f"shf.l.wrap.b32 t, {reg}, {reg}, {rot};",
                    f"and.b32 r, t, {_PAIR_MASK:#010x};",
                ]
            else:
                lines.append(f"and.b32 r, {reg}, {_PAIR_MASK:#010x};")
            for m in range(rows):
                x = f"${x0 + 16 * m + 4 * w + j}"
                if w == 0 and j == 0:
                    lines.append(f"mul.rn.f16x2 a{m}, r, {x};")
                else:
                    lines.append(f"fma.rn.f16x2 a{m}, r, {x}, a{m};")
    lines.append(f"cvt.rn.f16x2.e4m3x2 s2, ${sc};")
    for m in range(rows):
        lines += [
            f"mul.rn.f16x2 t, a{m}, s2;",
            "mov.b32 {lo, hi}, t;",
            "cvt.f32.f16 flo, lo;",
            "cvt.f32.f16 fhi, hi;",
            f"add.f32 ${m}, flo, fhi;",
        ]
    return "{\n" + "\n".join(lines) + "\n}"


_DOT_ASM_1 = tl.constexpr(_vector_dot_asm(1))
_DOT_ASM_2 = tl.constexpr(_vector_dot_asm(2))
_DOT_ASM_4 = tl.constexpr(_vector_dot_asm(4))
_CONSTRAINTS_1 = tl.constexpr(",".join(["=f"] * 1 + ["r"] * 4 + ["h"] + ["r"] * 16 * 1))
_CONSTRAINTS_2 = tl.constexpr(",".join(["=f"] * 2 + ["r"] * 4 + ["h"] + ["r"] * 16 * 2))
_CONSTRAINTS_4 = tl.constexpr(",".join(["=f"] * 4 + ["r"] * 4 + ["h"] + ["r"] * 16 * 4))


@gluon.jit
def _quad(t):
    """[..., 2, 2] (b, a) -> the 4 tensors at a = 0, b = 0 / b = 1 / a = 1, b = 0 / a = b = 1,
    i.e. pairs P, P + 4, P + 8, P + 12 when the index is P + 8a + 4b."""
    b0, b1 = gl.split(t)
    p0, p8 = gl.split(b0)
    p4, p12 = gl.split(b1)
    return p0, p4, p8, p12


@gluon.jit
def _x_vector_pairs(
    x_row, vec0, K, ok, KC: gl.constexpr, L: gl.constexpr, NW: gl.constexpr, L3: gl.constexpr
):
    """The 16 f16x2 pair words (x[P], x[16 + P]) of each thread's vectors (vector (c, l) covers
    K positions (vec0 + c * L + l) * 32 ..), x scaled per vector by a power of two, as [KC, 1,
    L] int32 tensors in layout L3, and the inverse scales (fp32). A thread loads its 32 x
    values with 16-byte loads and builds the pairs in registers (once per program)."""
    XL: gl.constexpr = gl.BlockedLayout(
        [1, 1, 1, 32], [1, 32 // L, L, 1], [1, NW, 1, 1], [3, 2, 1, 0]
    )
    XS: gl.constexpr = gl.SliceLayout(3, XL)
    c = gl.arange(0, KC, layout=gl.SliceLayout(1, gl.SliceLayout(2, XS)))[:, None, None, None]
    ln = gl.arange(0, L, layout=gl.SliceLayout(0, gl.SliceLayout(1, XS)))[None, None, :, None]
    e = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, XL))))
    pos = (vec0 + c * L + ln) * 32 + e[None, None, None, :]  # [KC, 1, L, 32]
    xv = gl.load(x_row + pos, mask=ok & (pos < K), other=0.0).to(gl.float32)
    m = gl.max(gl.abs(xv), axis=3)
    ex = (m.to(gl.int32, bitcast=True) >> FP32_MANT_BITS) & FP32_EXP_MASK
    ex = gl.maximum(ex, X_MIN_EXP)
    s = ((X_SCALE_BIAS - ex) << FP32_MANT_BITS).to(gl.float32, bitcast=True)
    inv = ((ex - (X_SCALE_BIAS - 2 * 127)) << FP32_MANT_BITS).to(gl.float32, bitcast=True)
    xh = (xv * s[:, :, :, None]).to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32)
    t = gl.permute(gl.reshape(xh & 0xFFFF, [KC, 1, L, 2, 16]), [0, 1, 2, 4, 3])
    lo, hi = gl.split(t)  # x[P], x[16 + P]
    w = gl.reshape(lo | (hi << 16), [KC, 1, L, 2, 2, 2, 2])  # P = 8a + 4b + 2c + d
    d0, d1 = gl.split(w)
    d0c0, d0c1 = gl.split(d0)
    d1c0, d1c1 = gl.split(d1)
    p0, p4, p8, p12 = _quad(d0c0)
    p1, p5, p9, p13 = _quad(d1c0)
    p2, p6, p10, p14 = _quad(d0c1)
    p3, p7, p11, p15 = _quad(d1c1)
    pairs = (
        gl.convert_layout(p0, L3),
        gl.convert_layout(p1, L3),
        gl.convert_layout(p2, L3),
        gl.convert_layout(p3, L3),
        gl.convert_layout(p4, L3),
        gl.convert_layout(p5, L3),
        gl.convert_layout(p6, L3),
        gl.convert_layout(p7, L3),
        gl.convert_layout(p8, L3),
        gl.convert_layout(p9, L3),
        gl.convert_layout(p10, L3),
        gl.convert_layout(p11, L3),
        gl.convert_layout(p12, L3),
        gl.convert_layout(p13, L3),
        gl.convert_layout(p14, L3),
        gl.convert_layout(p15, L3),
    )
    return pairs, gl.convert_layout(inv, L3)


@gluon.jit
def _bc(t, shape: gl.constexpr):
    return gl.broadcast(t, gl.full(shape, 0, gl.int32, layout=t.type.layout))[0]


@gluon.jit
def _vector_dots_1(q0, q1, q2, q3, sc, p):
    shape: gl.constexpr = q0.shape
    return gl.inline_asm_elementwise(
        _DOT_ASM_1,
        _CONSTRAINTS_1,
        [
            q0, q1, q2, q3, sc,
            _bc(p[0], shape), _bc(p[1], shape), _bc(p[2], shape), _bc(p[3], shape),
            _bc(p[4], shape), _bc(p[5], shape), _bc(p[6], shape), _bc(p[7], shape),
            _bc(p[8], shape), _bc(p[9], shape), _bc(p[10], shape), _bc(p[11], shape),
            _bc(p[12], shape), _bc(p[13], shape), _bc(p[14], shape), _bc(p[15], shape),
        ],
        dtype=gl.float32,
        is_pure=True,
        pack=1,
    )  # fmt: skip


@gluon.jit
def _vector_dots_2(q0, q1, q2, q3, sc, p, u):
    shape: gl.constexpr = q0.shape
    return gl.inline_asm_elementwise(
        _DOT_ASM_2,
        _CONSTRAINTS_2,
        [
            q0, q1, q2, q3, sc,
            _bc(p[0], shape), _bc(p[1], shape), _bc(p[2], shape), _bc(p[3], shape),
            _bc(p[4], shape), _bc(p[5], shape), _bc(p[6], shape), _bc(p[7], shape),
            _bc(p[8], shape), _bc(p[9], shape), _bc(p[10], shape), _bc(p[11], shape),
            _bc(p[12], shape), _bc(p[13], shape), _bc(p[14], shape), _bc(p[15], shape),
            _bc(u[0], shape), _bc(u[1], shape), _bc(u[2], shape), _bc(u[3], shape),
            _bc(u[4], shape), _bc(u[5], shape), _bc(u[6], shape), _bc(u[7], shape),
            _bc(u[8], shape), _bc(u[9], shape), _bc(u[10], shape), _bc(u[11], shape),
            _bc(u[12], shape), _bc(u[13], shape), _bc(u[14], shape), _bc(u[15], shape),
        ],
        dtype=(gl.float32, gl.float32),
        is_pure=True,
        pack=1,
    )  # fmt: skip


@gluon.jit
def _vector_dots_4(q0, q1, q2, q3, sc, p, u, v, w):
    shape: gl.constexpr = q0.shape
    return gl.inline_asm_elementwise(
        _DOT_ASM_4,
        _CONSTRAINTS_4,
        [
            q0, q1, q2, q3, sc,
            _bc(p[0], shape), _bc(p[1], shape), _bc(p[2], shape), _bc(p[3], shape),
            _bc(p[4], shape), _bc(p[5], shape), _bc(p[6], shape), _bc(p[7], shape),
            _bc(p[8], shape), _bc(p[9], shape), _bc(p[10], shape), _bc(p[11], shape),
            _bc(p[12], shape), _bc(p[13], shape), _bc(p[14], shape), _bc(p[15], shape),
            _bc(u[0], shape), _bc(u[1], shape), _bc(u[2], shape), _bc(u[3], shape),
            _bc(u[4], shape), _bc(u[5], shape), _bc(u[6], shape), _bc(u[7], shape),
            _bc(u[8], shape), _bc(u[9], shape), _bc(u[10], shape), _bc(u[11], shape),
            _bc(u[12], shape), _bc(u[13], shape), _bc(u[14], shape), _bc(u[15], shape),
            _bc(v[0], shape), _bc(v[1], shape), _bc(v[2], shape), _bc(v[3], shape),
            _bc(v[4], shape), _bc(v[5], shape), _bc(v[6], shape), _bc(v[7], shape),
            _bc(v[8], shape), _bc(v[9], shape), _bc(v[10], shape), _bc(v[11], shape),
            _bc(v[12], shape), _bc(v[13], shape), _bc(v[14], shape), _bc(v[15], shape),
            _bc(w[0], shape), _bc(w[1], shape), _bc(w[2], shape), _bc(w[3], shape),
            _bc(w[4], shape), _bc(w[5], shape), _bc(w[6], shape), _bc(w[7], shape),
            _bc(w[8], shape), _bc(w[9], shape), _bc(w[10], shape), _bc(w[11], shape),
            _bc(w[12], shape), _bc(w[13], shape), _bc(w[14], shape), _bc(w[15], shape),
        ],
        dtype=(gl.float32, gl.float32, gl.float32, gl.float32),
        is_pure=True,
        pack=1,
    )  # fmt: skip


@gluon.jit
def _row_sum(part, inv):
    """[KC, RB, L] per-vector sums times their x inverse scales -> [RB] row partials."""
    return gl.sum(gl.sum(part * inv, axis=0), axis=1)


@gluon.jit
def _emit(v, rows, row_ok, m_ok, out_row, ws_row, SPLIT: gl.constexpr):
    if not SPLIT:
        gl.store(out_row + rows, v.to(out_row.dtype.element_ty), mask=row_ok & m_ok)
    else:
        gl.atomic_add(ws_row + rows, v, mask=row_ok & m_ok, sem="relaxed")


@gluon.jit
def _finish(out_row, ws_row, row_begin, row_end, N, m_ok, FIN: gl.constexpr, NW: gl.constexpr):
    """Last program of a row range: workspace rows -> out, workspace re-zeroed."""
    fin_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    for r0 in range(row_begin, row_end, FIN):
        rows = r0 + gl.arange(0, FIN, layout=fin_layout)
        ok = (rows < row_end) & m_ok  # row_end <= N; the next range is another program's
        total = gl.load(ws_row + rows, mask=ok, other=0.0, cache_modifier=".cg")
        gl.store(out_row + rows, total.to(out_row.dtype.element_ty), mask=ok)
        gl.store(ws_row + rows, gl.zeros_like(total), mask=ok)


@gluon.jit
def _tile(
    q, sc, rows, N, M, row0, p0, p1, p2, p3, i0, i1, i2, i3, gscale, out_row, ws_row, stride_om,
    L3: gl.constexpr, KC: gl.constexpr, RB: gl.constexpr, L: gl.constexpr, MP: gl.constexpr,
    SPLIT: gl.constexpr,
):  # fmt: skip
    """One step of RB rows: words q [KC, RB, L, 4] and scale pairs sc [KC, RB, L] -> the MP
    x rows' partial sums of those rows, stored, or with SPLIT added into the workspace."""
    qa, qb = gl.split(gl.reshape(q, [KC, RB, L, 2, 2]))  # words (0, 2) and (1, 3)
    q0, q2 = gl.split(qa)
    q1, q3 = gl.split(qb)
    q0 = gl.convert_layout(q0, L3, assert_trivial=True)
    q1 = gl.convert_layout(q1, L3, assert_trivial=True)
    q2 = gl.convert_layout(q2, L3, assert_trivial=True)
    q3 = gl.convert_layout(q3, L3, assert_trivial=True)
    row_ok = rows < N
    if MP == 1:
        d0 = _vector_dots_1(q0, q1, q2, q3, sc, p0)
        _emit(_row_sum(d0, i0) * gscale, rows, row_ok, row0 < M, out_row, ws_row, SPLIT)
    elif MP == 2:
        d0, d1 = _vector_dots_2(q0, q1, q2, q3, sc, p0, p1)
        _emit(_row_sum(d0, i0) * gscale, rows, row_ok, row0 < M, out_row, ws_row, SPLIT)
        o1 = out_row + stride_om
        _emit(_row_sum(d1, i1) * gscale, rows, row_ok, row0 + 1 < M, o1, ws_row + N, SPLIT)
    else:
        d0, d1, d2, d3 = _vector_dots_4(q0, q1, q2, q3, sc, p0, p1, p2, p3)
        _emit(_row_sum(d0, i0) * gscale, rows, row_ok, row0 < M, out_row, ws_row, SPLIT)
        o1 = out_row + stride_om
        _emit(_row_sum(d1, i1) * gscale, rows, row_ok, row0 + 1 < M, o1, ws_row + N, SPLIT)
        o2 = out_row + 2 * stride_om
        _emit(_row_sum(d2, i2) * gscale, rows, row_ok, row0 + 2 < M, o2, ws_row + 2 * N, SPLIT)
        o3 = out_row + 3 * stride_om
        _emit(_row_sum(d3, i3) * gscale, rows, row_ok, row0 + 3 < M, o3, ws_row + 3 * N, SPLIT)


@gluon.jit
def _nvfp4_gemv_v2_kernel(
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
    row_words,
    row_scales,
    rows_pad,
    rows_per_prog,
    split_k,
    MP: gl.constexpr,
    KC: gl.constexpr,
    L: gl.constexpr,
    RB: gl.constexpr,
    SPLIT: gl.constexpr,
    FIN: gl.constexpr,
    NW: gl.constexpr,
):
    """Grid (row ranges, split_k, cdiv(M, MP)). Program (n, k, g): rows
    [n * rows_per_prog, +rows_per_prog) of W, K slice k of KC * L vectors, x rows g*MP.. .

    Layouts: a thread owns KC vectors x RB / (32 / L * NW) rows; the L lanes of a row group
    run along K (16-byte loads, coalesced), warps along rows; the 4 words of a vector are the
    thread's last two dimensions (2, 2), so tl.split peels them off in registers."""
    L4: gl.constexpr = gl.BlockedLayout(
        [1, 1, 1, 4], [1, 32 // L, L, 1], [1, NW, 1, 1], [3, 2, 1, 0]
    )
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 32 // L, L], [1, NW, 1], [2, 1, 0])
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    row0 = gl.program_id(2) * MP
    row_begin = pid_n * rows_per_prog
    row_end = gl.minimum(row_begin + rows_per_prog, rows_pad)
    # [KC, RB, L] indices; vector (c, l) covers K positions (pid_k * KC * L + c * L + l) * 32 ..
    c3 = gl.arange(0, KC, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))[:, None, None]
    r3 = gl.arange(0, RB, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))[None, :, None]
    l3 = gl.arange(0, L, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))[None, None, :]
    vec0 = pid_k * (KC * L)
    vec = vec0 + c3 * L + l3  # [KC, 1, L]
    s_ptrs = s_ptr + row_begin.to(gl.int64) * row_scales + (r3.to(gl.int64) * row_scales + vec)
    # the same in 4D for the words: [KC, RB, L, 4], word w of vector (c, l) of row r
    S3: gl.constexpr = gl.SliceLayout(3, L4)
    S32: gl.constexpr = gl.SliceLayout(2, S3)
    c4 = gl.arange(0, KC, layout=gl.SliceLayout(1, S32))[:, None, None, None]
    r4 = gl.arange(0, RB, layout=gl.SliceLayout(0, S32))[None, :, None, None]
    l4 = gl.arange(0, L, layout=gl.SliceLayout(0, gl.SliceLayout(1, S3)))[None, None, :, None]
    w4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
    word = (pid_k * (KC * L) + c4 * L + l4) * 4 + w4[None, None, None, :]
    q_ptrs = w_ptr + row_begin.to(gl.int64) * row_words + (r4.to(gl.int64) * row_words + word)
    # the first rows' weights are requested before the x prologue (they do not depend on it)
    q = gl.load(q_ptrs)
    sc = gl.load(s_ptrs)
    x_row = x_ptr + row0.to(gl.int64) * stride_xm
    p0, i0 = _x_vector_pairs(x_row, vec0, K, row0 < M, KC, L, NW, L3)
    p1, i1, p2, i2, p3, i3 = p0, i0, p0, i0, p0, i0  # rows past MP: never read
    if MP > 1:
        p1, i1 = _x_vector_pairs(x_row + stride_xm, vec0, K, row0 + 1 < M, KC, L, NW, L3)
    if MP > 2:
        p2, i2 = _x_vector_pairs(x_row + 2 * stride_xm, vec0, K, row0 + 2 < M, KC, L, NW, L3)
        p3, i3 = _x_vector_pairs(x_row + 3 * stride_xm, vec0, K, row0 + 3 < M, KC, L, NW, L3)
    gscale = gl.load(gs_ptr) * (2.0**DECODE_EXP)
    out_row = out_ptr + row0.to(gl.int64) * stride_om
    ws_row = ws_ptr + row0.to(gl.int64) * N
    r1 = gl.arange(0, RB, layout=gl.SliceLayout(1, gl.SliceLayout(0, L3)))
    # Unrolled by two (every range is a multiple of 2 * RB rows) so that the two register
    # buffers alternate without copies: tile B is requested before tile A is computed, the
    # next tile A before tile B is.
    for r0 in range(row_begin, row_end, 2 * RB):
        q_b = gl.load(q_ptrs + RB * row_words)
        sc_b = gl.load(s_ptrs + RB * row_scales)
        _tile(q, sc, r0 + r1, N, M, row0, p0, p1, p2, p3, i0, i1, i2, i3, gscale, out_row,
              ws_row, stride_om, L3, KC, RB, L, MP, SPLIT)  # fmt: skip
        more = r0 + 2 * RB < row_end
        q_ptrs += 2 * RB * row_words
        s_ptrs += 2 * RB * row_scales
        q = gl.load(q_ptrs, mask=more)
        sc = gl.load(s_ptrs, mask=more)
        _tile(q_b, sc_b, r0 + RB + r1, N, M, row0, p0, p1, p2, p3, i0, i1, i2, i3, gscale,
              out_row, ws_row, stride_om, L3, KC, RB, L, MP, SPLIT)  # fmt: skip
    if SPLIT:
        gl.thread_barrier()
        lock = lock_ptr + gl.program_id(2) * gl.num_programs(0) + pid_n
        if gl.atomic_add(lock, 1, sem="acq_rel") == split_k - 1:
            end = gl.minimum(row_end, N)
            _finish(out_row, ws_row, row_begin, end, N, row0 < M, FIN, NW)
            if MP > 1:
                _finish(out_row + stride_om, ws_row + N, row_begin, end, N, row0 + 1 < M, FIN, NW)
            if MP > 2:
                _finish(
                    out_row + 2 * stride_om,
                    ws_row + 2 * N,
                    row_begin,
                    end,
                    N,
                    row0 + 2 < M,
                    FIN,
                    NW,
                )
                _finish(
                    out_row + 3 * stride_om,
                    ws_row + 3 * N,
                    row_begin,
                    end,
                    N,
                    row0 + 3 < M,
                    FIN,
                    NW,
                )
            gl.atomic_xchg(lock, 0)


def _round_up(v: int, to: int) -> int:
    return -(-v // to) * to


_WORD_BITS = 32
_WORD_MASK = (1 << _WORD_BITS) - 1


def _rotl(v: int, k: int) -> int:
    return ((v << k) | (v >> (_WORD_BITS - k))) & _WORD_MASK if k else v


def decode_word_model(q: int) -> tuple[int, int, int, int]:
    """Python model of the asm decode of one word: its 4 f16x2 pairs as 32-bit patterns."""
    o = (q & _MERGE_SELECT) | (_rotl(q, _MERGE_ROT) & ~_MERGE_SELECT & _WORD_MASK)
    regs = {"q": q, "o": o}
    return tuple(_rotl(regs[src], rot) & _PAIR_MASK for src, rot in _PAIR_SOURCES)


def _word_bit_map() -> list[tuple[int, int, int]]:
    """For each bit of a word: (pair j, half h, code bit b) the decode moves it to."""
    out = []
    for x in range(_WORD_BITS):
        pairs = decode_word_model(1 << x)
        (j, pat), *rest = [(j, v) for j, v in enumerate(pairs) if v]
        if rest or pat & (pat - 1):
            raise AssertionError(f"decode layout: word bit {x} lands in more than one place")
        out.append((j, *_PAIR_BITS[pat.bit_length() - 1]))
    return out


_WORD_BIT_MAP = _word_bit_map()


def _code_index(w: int, j: int, h: int) -> int:
    """Position within its 32-code vector of the code in half h of pair j of word w."""
    return h * NVFP4_BLOCK + VECTOR_WORDS * w + j


def repack_for_gemv_v2(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checkpoint layout (packed uint8 [N, K/2] low nibble first, scale e4m3 [N, K/16], fp32
    global scale) -> (words int32 [Np, Kp/8], scales uint8 [Np, Kp/16], global fp32 [1]) of
    the GEMV v2 layout (module docstring). Done once at load time; pure torch, any device."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise TypeError(f"packed must be uint8 [N, K/2], got {packed.dtype} {tuple(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * 2
    if k % NVFP4_BLOCK or tuple(scale.shape) != (n, k // NVFP4_BLOCK):
        raise ValueError(f"scale {tuple(scale.shape)} does not fit packed {tuple(packed.shape)}")
    np_, kp = _round_up(n, ROW_PAD), _round_up(k, K_PAD)
    codes = torch.zeros(np_, kp, dtype=torch.uint8, device=packed.device)
    codes[:n, :k] = unpack_e2m1_codes(packed)
    vecs = codes.view(np_, kp // VECTOR_CODES, VECTOR_CODES).to(torch.int64)
    words = torch.zeros(
        np_, kp // VECTOR_CODES, VECTOR_WORDS, dtype=torch.int64, device=codes.device
    )
    for w in range(VECTOR_WORDS):
        for x, (j, h, b) in enumerate(_WORD_BIT_MAP):
            words[:, :, w] |= ((vecs[:, :, _code_index(w, j, h)] >> b) & 1) << x
    words = torch.where(words >= 1 << (_WORD_BITS - 1), words - (1 << _WORD_BITS), words)
    scales = torch.zeros(np_, kp // NVFP4_BLOCK, dtype=torch.uint8, device=packed.device)
    scales[:n, : k // NVFP4_BLOCK] = scale.view(torch.uint8)
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=packed.device)
    return words.to(torch.int32).view(np_, -1), scales, gs.reshape(1).clone()


def unpack_gemv_v2_codes(words: torch.Tensor) -> torch.Tensor:
    """Repacked words int32 [Np, Kp/8] -> E2M1 codes uint8 [Np, Kp] in K order."""
    np_ = words.shape[0]
    w64 = words.view(np_, -1, VECTOR_WORDS).to(torch.int64) & _WORD_MASK
    vecs = torch.zeros(np_, w64.shape[1], VECTOR_CODES, dtype=torch.int64, device=words.device)
    for w in range(VECTOR_WORDS):
        for x, (j, h, b) in enumerate(_WORD_BIT_MAP):
            vecs[:, :, _code_index(w, j, h)] |= ((w64[:, :, w] >> x) & 1) << b
    return vecs.view(np_, -1).to(torch.uint8)


def dequantize_gemv_v2(
    words: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    n: int,
    k: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The repacked weight -> dense [n, k] (what dequantize_nvfp4 gives for the original)."""
    codes = unpack_gemv_v2_codes(words).long()
    vals = e2m1_table(codes.device)[codes]
    block = scales.view(torch.float8_e4m3fn).float().repeat_interleave(NVFP4_BLOCK, dim=1)
    dense = vals * block * global_scale.float().reshape(())
    return dense[:n, :k].to(dtype)


def nvfp4_gemv_v2_ref(
    x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, n: int
) -> torch.Tensor:
    """Torch reference of nvfp4_gemv_v2: fp32 x @ dequantized W^T [.., n], in x's dtype."""
    w = dequantize_gemv_v2(words, scales, global_scale, n, x.shape[1])
    return (x.float() @ w.t()).to(x.dtype)


def rows_per_pass(m: int) -> int:
    """x rows that share one pass over the weights (the kernel's MP)."""
    return 1 if m == 1 else 2 if m == 2 else MAX_ROWS_PER_PASS


# Measured best (benchmarks/kernels_nvfp4_gemv_v2.py --sweep, H200, 2026-12-01; results in
# benchmarks/results/kernels_nvfp4_gemv_v2.*): (MP, N, K) -> (KC, L, RB, num_warps, programs
# per SM). MP 2 and 4 use one config for every shape (_MP2_CONFIG, _MP4_CONFIG).
_TUNED: dict[tuple[int, int, int], tuple[int, int, int, int, int]] = {
    (1, 4096, 7168): (1, 32, 32, 8, 2),
    (1, 7168, 2048): (2, 32, 16, 4, 4),
    (1, 7168, 8192): (1, 32, 16, 8, 3),
    (1, 12288, 1536): (1, 16, 32, 8, 3),
}
_MP2_CONFIG = (1, 16, 16, 4, 4)  # ~110 registers: 4 programs of 4 warps per SM
_MP4_CONFIG = (1, 16, 16, 4, 3)  # ~150 registers: 3 programs of 4 warps per SM
WIDE_K_MAX = 2048  # up to here one 2048-wide slice covers K: no split-K at all


def _as_config(point: tuple[int, int, int, int, int], device: torch.device) -> dict[str, int]:
    kc, lanes, rb, warps, per_sm = point
    return {
        "KC": kc,
        "L": lanes,
        "RB": rb,
        "num_warps": warps,
        "PROGRAMS": per_sm * sm_count(device),
    }


def default_config(m: int, n: int, k: int, device: torch.device) -> dict[str, int]:
    """Launch config: KC vectors per thread, L lanes along K (K slice = KC * L * 32), RB rows
    per loop step, num_warps, PROGRAMS (programs in the one wave the launch aims at). The
    measured table first; otherwise one slice per program when K <= WIDE_K_MAX, else 1024-wide
    slices where K allows and 512-wide ones elsewhere, 3 programs per SM (69 registers)."""
    mp = rows_per_pass(m)
    if mp == 2:
        return _as_config(_MP2_CONFIG, device)
    if mp == MAX_ROWS_PER_PASS:
        return _as_config(_MP4_CONFIG, device)
    kp = _round_up(k, K_PAD)
    if (mp, n, k) in _TUNED:
        return _as_config(_TUNED[(mp, n, k)], device)
    if kp == WIDE_K_MAX:
        return _as_config((2, 32, 16, 4, 4), device)
    if kp % (32 * VECTOR_CODES) == 0:
        return _as_config((1, 32, 16, 8, 3), device)
    return _as_config((1, 16, 32, 8, 3), device)


def launch_geometry(
    m: int, rows_pad: int, k_pad: int, config: dict[str, int]
) -> tuple[int, int, int, int]:
    """(row-range programs, split-K, x row groups, rows per program) of one call."""
    slice_k = config["KC"] * config["L"] * VECTOR_CODES
    if k_pad % slice_k:
        raise ValueError(f"K slice {slice_k} does not divide the padded K {k_pad}")
    split = k_pad // slice_k
    groups = -(-m // rows_per_pass(m))
    ranges = max(1, config["PROGRAMS"] // (split * groups))
    covered = 32 // config["L"] * config["num_warps"]  # rows one layout pass covers
    if config["RB"] % covered:
        raise ValueError(f"RB = {config['RB']} must be a multiple of the {covered} rows covered")
    step = 2 * config["RB"]  # the kernel's loop is unrolled by two steps of RB rows
    if ROW_PAD % step:
        raise ValueError(f"2 * RB = {step} must divide ROW_PAD = {ROW_PAD}")
    rows = _round_up(-(-rows_pad // ranges), step)
    return -(-rows_pad // rows), split, groups, rows


def workspace_size(
    m: int, n: int, k: int, config: dict[str, int] | None = None, device: torch.device | None = None
) -> tuple[int, int]:
    """(fp32 partials, int32 counters) for SplitKWorkspace.create, enough for a call of m rows
    on an [n, k] weight with this config (default_config when None)."""
    cfg = config or default_config(m, n, k, device or torch.device("cuda"))
    ranges, _, groups, _ = launch_geometry(m, _round_up(n, ROW_PAD), _round_up(k, K_PAD), cfg)
    return groups * rows_per_pass(m) * n, groups * ranges


FINISH_BLOCK = 256  # rows the finishing program copies per step


def nvfp4_gemv_v2(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    out: torch.Tensor,
    workspace: SplitKWorkspace | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """out [M, N] = x [M, K] @ dequant(W)^T with fp32 accumulation; packed / scale /
    global_scale as repack_for_gemv_v2 returns them (N and K are out's and x's).

    x: bf16 / f16 / fp32 [M, K], unit stride along K; any M (MAX_ROWS_PER_PASS rows share one
    pass over the weights, more rows take more passes). `workspace` (a zeroed SplitKWorkspace
    of at least workspace_size) is needed under CUDA-graph capture when the config splits K;
    the kernel leaves it zeroed. The launch depends only on shapes (graph safe)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with unit stride along K, got {tuple(x.shape)}")
    m, k = x.shape
    n = out.shape[1]
    rows_pad, k_pad = packed.shape[0], packed.shape[1] * CODES_PER_WORD
    if packed.dtype != torch.int32 or rows_pad < n or k_pad < k or rows_pad % ROW_PAD:
        raise ValueError(
            f"packed {packed.dtype} {tuple(packed.shape)} is not a repacked [{n}, {k}]"
        )
    if scale.dtype != torch.uint8 or tuple(scale.shape) != (rows_pad, k_pad // NVFP4_BLOCK):
        raise ValueError(f"scale {scale.dtype} {tuple(scale.shape)} does not fit packed")
    if tuple(out.shape) != (m, n) or out.stride(1) != 1:
        raise ValueError(f"out must be [{m}, {n}] with unit stride, got {tuple(out.shape)}")
    if m == 0:
        return out
    cfg = config or default_config(m, n, k, x.device)
    ranges, split, groups, rows = launch_geometry(m, rows_pad, k_pad, cfg)
    if split > 1:
        elems, tiles = groups * rows_per_pass(m) * n, groups * ranges
        if workspace is None:
            workspace = SplitKWorkspace.create(elems, tiles, x.device)
        if workspace.partial.numel() < elems or workspace.locks.numel() < tiles:
            raise ValueError("split-K workspace too small for this GEMV")
        ws, locks = workspace.partial, workspace.locks
    else:
        ws, locks = out, out
    _nvfp4_gemv_v2_kernel[(ranges, split, groups)](
        x,
        packed,
        scale.view(torch.int16),
        global_scale,
        out,
        ws,
        locks,
        m,
        n,
        k,
        x.stride(0),
        out.stride(0),
        packed.shape[1],
        scale.shape[1] // 2,
        rows_pad,
        rows,
        split,
        MP=rows_per_pass(m),
        KC=cfg["KC"],
        L=cfg["L"],
        RB=cfg["RB"],
        SPLIT=split > 1,
        FIN=FINISH_BLOCK,
        NW=cfg["num_warps"],
        num_warps=cfg["num_warps"],
        num_stages=1,
    )
    return out
