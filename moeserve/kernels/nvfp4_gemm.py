"""NVFP4 (ModelOpt layout) helpers and the weight-only W4A16 GEMM.

Layout of one quantized linear with weight [N, K] (K a multiple of 16), see shared/SPECS.md:
  packed  uint8          [N, K/2]   two E2M1 codes per byte along K, element 2i in the LOW nibble
  scale   float8_e4m3fn  [N, K/16]  one block scale per 16 elements
  global  float32 scalar            amax(W) / (6*448); dequantization multiplies by it
E2M1 code = sign<<3 | idx, idx 0..7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6.

The torch functions here (``dequantize_nvfp4``, ``quantize_nvfp4``, ``nvfp4_gemm_ref``) are pure
torch and run on the CPU; they are the oracle for the Triton kernel below them.
"""

from __future__ import annotations

import torch

E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_BLOCK = 16
# Decision boundaries between neighbouring E2M1 magnitudes, and whether a tie goes UP
# (round-half-to-even: a tie goes to the neighbour whose index is even).
_E2M1_BOUNDS: tuple[float, ...] = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_UP: tuple[bool, ...] = (False, True, False, True, False, True, False)


def e2m1_table(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The 16 E2M1 values indexed by the 4-bit code (sign in bit 3)."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    return torch.cat([mags, -mags]).to(device=device, dtype=dtype)


def unpack_e2m1_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 codes [..., K] (low nibble first)."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def pack_e2m1_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (K even) -> uint8 [..., K/2], element 2i in the low nibble."""
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def dequantize_nvfp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor | float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """packed uint8 [..., N, K/2], scale e4m3 [..., N, K/16], global fp32 scalar -> [..., N, K].

    Leading batch dims (stacked experts) are allowed; a global scale with one value per
    leading index ([E]) is broadcast over its expert.
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    k = packed.shape[-1] * 2
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * NVFP4_BLOCK != k:
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not match packed {tuple(packed.shape)}"
        )
    codes = unpack_e2m1_codes(packed).long()
    vals = e2m1_table(packed.device)[codes]
    block = scale.float().repeat_interleave(NVFP4_BLOCK, dim=-1)
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=packed.device)
    gs = gs.reshape(gs.shape + (1,) * (packed.dim() - gs.dim()))  # [E] -> [E, 1, 1]
    return (vals * block * gs).to(dtype)


def _e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 values -> E2M1 magnitude index 0..7, round-half-to-even, saturating."""
    idx = torch.zeros_like(x, dtype=torch.uint8)
    for bound, tie_up in zip(_E2M1_BOUNDS, _E2M1_TIE_UP, strict=True):
        idx += (x >= bound if tie_up else x > bound).to(torch.uint8)
    return idx


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] (K a multiple of 16) -> (packed uint8 [N,K/2], scale e4m3 [N,K/16], global fp32 []).

    ModelOpt convention: global = amax / (6*448); block scale = block_amax / (6*global) cast to
    e4m3 (an all-zero block gets 1); code = round-half-to-even of w / (scale*global) on the E2M1
    grid. An all-zero tensor gets global 1/(6*448) so that dequantization stays finite.
    """
    if w.dim() != 2 or w.shape[1] % NVFP4_BLOCK:
        raise ValueError(f"quantize_nvfp4 wants [N, K] with K % 16 == 0, got {tuple(w.shape)}")
    wf = w.float()
    amax = wf.abs().amax()
    gs = torch.where(amax > 0, amax, torch.ones_like(amax)) / (E2M1_MAX * E4M3_MAX)
    blocks = wf.unflatten(1, (-1, NVFP4_BLOCK))  # [N, K/16, 16]
    bmax = blocks.abs().amax(dim=-1)
    scale = (bmax / (E2M1_MAX * gs)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    # All-zero blocks, and blocks so small that their scale underflowed e4m3, get scale 1:
    # their codes then round to (nearly) zero instead of dividing by zero.
    scale = torch.where(scale.float() > 0, scale.float(), torch.ones_like(bmax)).to(
        torch.float8_e4m3fn
    )
    q = blocks / (scale.float() * gs).unsqueeze(-1)
    idx = _e2m1_round(q.abs())
    codes = idx | (((q < 0) & (idx > 0)).to(torch.uint8) << 3)  # no negative zero codes
    return pack_e2m1_codes(codes.flatten(1)), scale, gs.to(torch.float32)


def nvfp4_gemm_ref(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor | float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference: x [M, K] @ dequant(W)^T -> [M, N] in x.dtype (fp32 accumulate)."""
    w = dequantize_nvfp4(packed, scale, global_scale, torch.float32)
    y = (x.float() @ w.t()).to(x.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y


# ----------------------------------------------------------------------------------------------
# Triton W4A16 kernel
#
# Decode on packed 32-bit words (Marlin-style): a word q holds 8 codes n0..n7 (n_j in bits
# 4j..4j+3; n0 = low nibble of byte 0 = the word's first K element). Shifting q left by
# 12 - 4j puts n_j at the top of the low 16-bit half and n_{j+4} at the top of the high half;
# then `(x & 0x80008000) | ((x & 0x70007000) >> 6)` moves each sign to bit 15 and (e1 e0 m) to
# bits 8..6, which read as bf16x2 equals the two E2M1 values * 2^-126 (e=0 lands on a bf16
# subnormal, still exact). Per 2 elements: 1 shift + 3 logic ops, then one `mul.rn.bf16x2` by
# the block scale pre-multiplied by 2^118, giving value*scale*2^-8 (exact: <= 5 significant
# bits, normal range); the remaining 2^8 and the global scale scale the fp32 accumulator.
# The decode works per word (inline PTX with pack=1, so no assumption about how Triton packs
# several tensor elements into one register) and yields 8 tensors [BLOCK_N, BLOCK_K/8], one per
# code position; a tree of tl.join lays them side by side so that each decoded bf16x2 register
# (n_j, n_{j+4}) stays one adjacent pair, and the activation columns are loaded in that same
# order (_kperm; a dot product does not care about a common permutation of K). Chosen over a
# natural-K-order tree from the sm_90a SASS: ~17% fewer instructions per weight element
# (fewer PRMT/MOV repacks), at the price of 2-byte activation gathers.
# DECODE_BITS is the same idea in plain Triton integer ops through fp16 (no subnormal bf16
# arithmetic, which a flush-to-zero multiply would lose), and DECODE_ARITH decodes per element
# arithmetically; both run in the CPU interpreter and are the tests' view of the bit layout.
# ----------------------------------------------------------------------------------------------

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# Jitted code may only read constexpr globals.
SCALE_BIAS_EXP = tl.constexpr(118)  # block scale * 2^118 fits bf16 (448 * 2^118 < 2^127)
ACC_FIX_EXP = tl.constexpr(8)  # 126 - 118: applied once to the accumulator
FP16_BIAS_EXP = tl.constexpr(14)  # DECODE_BITS: fp16 bits give value * 2^-14
SIGN_MASK2 = tl.constexpr(-2147450880)  # 0x80008000 as int32
IDX_MASK2 = tl.constexpr(0x70007000)

DECODE_ARITH = 0  # per-element arithmetic decode (interpreter; slow on a GPU)
DECODE_ASM = 1  # packed-word inline PTX, bf16x2 scale multiply (the GPU default)
DECODE_BITS = 2  # packed-word decode in Triton integer ops via fp16 (portable; interpreter too)

# $0..$7: bf16 bits of n0..n7 (int16 outputs), $8: the word, $9: bf16 bits of scale*2^118.
_E2M1_ASM = tl.constexpr(
    """
{
.reg .b32 x, t, r, ss;
mov.b32 ss, {$9, $9};
shl.b32 x, $8, 12;
and.b32 t, x, 0x70007000;
shr.b32 t, t, 6;
lop3.b32 r, x, 0x80008000, t, 0xEA;
mul.rn.bf16x2 r, r, ss;
mov.b32 {$0, $4}, r;
shl.b32 x, $8, 8;
and.b32 t, x, 0x70007000;
shr.b32 t, t, 6;
lop3.b32 r, x, 0x80008000, t, 0xEA;
mul.rn.bf16x2 r, r, ss;
mov.b32 {$1, $5}, r;
shl.b32 x, $8, 4;
and.b32 t, x, 0x70007000;
shr.b32 t, t, 6;
lop3.b32 r, x, 0x80008000, t, 0xEA;
mul.rn.bf16x2 r, r, ss;
mov.b32 {$2, $6}, r;
and.b32 t, $8, 0x70007000;
shr.b32 t, t, 6;
lop3.b32 r, $8, 0x80008000, t, 0xEA;
mul.rn.bf16x2 r, r, ss;
mov.b32 {$3, $7}, r;
}
"""
)


@triton.jit
def _kperm(p):
    """Tile column p -> K offset inside the tile, the order _join8 leaves the codes in: within
    each 8 columns, positions 2i and 2i+1 hold codes i and i+4 (0,4,1,5,2,6,3,7)."""
    b = p % 2
    i = (p % 8) // 2
    return (p - p % 8) + i + 4 * b


@triton.jit
def _join8(n0, n1, n2, n3, n4, n5, n6, n7, BLOCK_N: tl.constexpr, BW: tl.constexpr):
    """8 x [BLOCK_N, BW] (code j of every word) -> [BLOCK_N, 8*BW] in _kperm order.

    A join's new axis becomes the lowest bit of the merged index, so the last join pairs
    (n_j, n_{j+4}): the two halves of one decoded bf16x2 register stay neighbours."""
    la = tl.reshape(tl.join(n0, n2), (BLOCK_N, 2 * BW))
    lb = tl.reshape(tl.join(n1, n3), (BLOCK_N, 2 * BW))
    lc = tl.reshape(tl.join(n4, n6), (BLOCK_N, 2 * BW))
    ld = tl.reshape(tl.join(n5, n7), (BLOCK_N, 2 * BW))
    m0 = tl.reshape(tl.join(la, lb), (BLOCK_N, 4 * BW))
    m1 = tl.reshape(tl.join(lc, ld), (BLOCK_N, 4 * BW))
    return tl.reshape(tl.join(m0, m1), (BLOCK_N, 8 * BW))


@triton.jit
def _e2m1_arith(c):
    """4-bit codes (int32) -> fp32 E2M1 values."""
    idx = c & 7
    e = idx >> 1
    m = (idx & 1).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, tl.exp2((e - 1).to(tl.float32)) * (1.0 + 0.5 * m))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _arith_code(q, j: tl.constexpr, sf):
    return (_e2m1_arith((q >> (4 * j)) & 15) * sf).to(tl.bfloat16)


@triton.jit
def _bits_pair(q, shift: tl.constexpr, sf):
    """Codes (n_j, n_{j+4}) of words q (shift = 12 - 4j) -> two bf16 tensors value*sf."""
    x = q << shift
    r = (x & SIGN_MASK2) | ((x & IDX_MASK2) >> 3)  # fp16 bits: value * 2^-14
    lo = (r & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (r >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return (lo * sf).to(tl.bfloat16), (hi * sf).to(tl.bfloat16)


@triton.jit
def _load_decode_tile(
    w_row_ptr,
    s_row_ptr,
    n_mask,
    kw0,
    KW,
    KG,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DECODE: tl.constexpr,
):
    """Load and decode one [BLOCK_N, BLOCK_K] NVFP4 weight tile starting at word column kw0.

    w_row_ptr [BLOCK_N, 1] int32 pointers to packed rows (8 codes per word), s_row_ptr
    [BLOCK_N, 1] uint8 pointers to scale rows. Returns bf16 value*scale*2^-8, column p holding
    K element kw0*8 + _kperm(p).
    """
    BW: tl.constexpr = BLOCK_K // 8
    BKG: tl.constexpr = BLOCK_K // 16
    offs_w = kw0 + tl.arange(0, BW)
    q = tl.load(w_row_ptr + offs_w[None, :], mask=n_mask & (offs_w[None, :] < KW), other=0)
    offs_g = kw0 // 2 + tl.arange(0, BKG)
    s = tl.load(s_row_ptr + offs_g[None, :], mask=n_mask & (offs_g[None, :] < KG), other=0)
    s = s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, BKG, 2)), (BLOCK_N, BW))  # per word
    if DECODE == 1:
        sb = (s * (2.0**SCALE_BIAS_EXP)).to(tl.bfloat16).to(tl.int16, bitcast=True)
        n0, n1, n2, n3, n4, n5, n6, n7 = tl.inline_asm_elementwise(
            _E2M1_ASM,
            "=h,=h,=h,=h,=h,=h,=h,=h,r,h",
            [q, sb],
            dtype=(tl.int16,) * 8,
            is_pure=True,
            pack=1,
        )
        n0 = n0.to(tl.bfloat16, bitcast=True)
        n1 = n1.to(tl.bfloat16, bitcast=True)
        n2 = n2.to(tl.bfloat16, bitcast=True)
        n3 = n3.to(tl.bfloat16, bitcast=True)
        n4 = n4.to(tl.bfloat16, bitcast=True)
        n5 = n5.to(tl.bfloat16, bitcast=True)
        n6 = n6.to(tl.bfloat16, bitcast=True)
        n7 = n7.to(tl.bfloat16, bitcast=True)
    elif DECODE == 2:
        sf = s * (2.0 ** (FP16_BIAS_EXP - ACC_FIX_EXP))
        n0, n4 = _bits_pair(q, 12, sf)
        n1, n5 = _bits_pair(q, 8, sf)
        n2, n6 = _bits_pair(q, 4, sf)
        n3, n7 = _bits_pair(q, 0, sf)
    else:
        sf = s * (2.0 ** (-ACC_FIX_EXP))
        n0 = _arith_code(q, 0, sf)
        n1 = _arith_code(q, 1, sf)
        n2 = _arith_code(q, 2, sf)
        n3 = _arith_code(q, 3, sf)
        n4 = _arith_code(q, 4, sf)
        n5 = _arith_code(q, 5, sf)
        n6 = _arith_code(q, 6, sf)
        n7 = _arith_code(q, 7, sf)
    return _join8(n0, n1, n2, n3, n4, n5, n6, n7, BLOCK_N, BW)


@triton.jit
def _load_act_t(x_rows_ptr, m_mask, kw0, K, BLOCK_K: tl.constexpr):
    """Activation columns matching _load_decode_tile: bf16 [BLOCK_K, BLOCK_M].

    x_rows_ptr [1, BLOCK_M] pointers to activation rows, m_mask [1, BLOCK_M].
    """
    kk = 8 * kw0 + _kperm(tl.arange(0, BLOCK_K))
    xt = tl.load(x_rows_ptr + kk[:, None], mask=(kk[:, None] < K) & m_mask, other=0.0)
    return xt.to(tl.bfloat16)


@triton.jit
def _dot_acc(a, b, acc, DOT_F32: tl.constexpr):
    """acc += a @ b. DOT_F32 (the CPU interpreter) multiplies in fp32: the interpreter's numpy
    dot has no bf16 and would multiply raw bit patterns."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _splitk_finish(acc, out_ptrs, ws_ptrs, lock_ptr, mask, SPLIT_K: tl.constexpr):
    """Store acc [BLOCK_N, BLOCK_M] fp32 (already scaled) as out's dtype; with SPLIT_K > 1, add
    into the fp32 workspace and let the last program of the tile write the output and re-zero
    workspace and lock (so they stay zero between calls and CUDA-graph replays)."""
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(ws_ptrs, acc, mask=mask, sem="relaxed")
        tl.debug_barrier()
        count = tl.atomic_add(lock_ptr, 1, sem="acq_rel")
        if count == SPLIT_K - 1:
            total = tl.load(ws_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=mask)
            tl.store(ws_ptrs, tl.zeros_like(total), mask=mask)
            tl.atomic_xchg(lock_ptr, 0)


@triton.jit
def _nvfp4_gemm_kernel(
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_ITERS: tl.constexpr,
    DECODE: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """out [M, N] = x [M, K] @ W^T. Grid (cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, BLOCK_M)).

    Computed transposed (acc [BLOCK_N, BLOCK_M] = W_tile @ x^T) so that the decoded weight is the
    register-resident A operand and a small M only pads the MMA's narrow side.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    KW = K // 8
    KG = K // 16
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n[:, None] < N
    m_mask = offs_m[None, :] < M
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * KW
    s_rows = s_ptr + offs_n[:, None].to(tl.int64) * KG
    x_rows = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for it in range(K_ITERS):
        kw0 = (pid_k * K_ITERS + it) * (BLOCK_K // 8)
        w = _load_decode_tile(w_rows, s_rows, n_mask, kw0, KW, KG, BLOCK_N, BLOCK_K, DECODE)
        xt = _load_act_t(x_rows, m_mask, kw0, K, BLOCK_K)
        acc = _dot_acc(w, xt, acc, DOT_F32)
    acc = acc * (tl.load(gs_ptr) * (2.0**ACC_FIX_EXP))
    mask = n_mask & m_mask
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    ws_ptrs = ws_ptr + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
    tile = pid_m * tl.num_programs(0) + pid_n
    _splitk_finish(acc, out_ptrs, ws_ptrs, lock_ptr + tile, mask, SPLIT_K)


# ----------------------------------------------------------------------------------------------
# Host wrappers
# ----------------------------------------------------------------------------------------------

import functools  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from moeserve.kernels.configs import max_rows, min_rows, tile_config  # noqa: E402

log = logging.getLogger(__name__)

CTAS_PER_SM_TARGET = 4  # split-K aims at this many programs per SM so HBM sees enough requests


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU interpreter: no inline PTX)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


PROBE_SHAPE = (16, 96, 512)  # (M, N, K) of the one-time decode self-check


def _probe_case(device: torch.device) -> tuple[torch.Tensor, ...]:
    """Random codes (all 16 values occur) and scales; x = one-hot rows picking K columns at every
    position of a 32-bit word, so the exact answer is a set of dequantized weights (a flushed
    subnormal or a swapped nibble cannot hide inside a tolerance)."""
    m, n, k = PROBE_SHAPE
    g = torch.Generator(device="cpu").manual_seed(0)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, k // NVFP4_BLOCK, generator=g) * 4 + 0.25).to(torch.float8_e4m3fn)
    x = torch.zeros(m, k)
    x[torch.arange(m), torch.arange(m) * 37 % k] = 1.0  # 37 is odd: covers all 8 positions
    gs = torch.tensor(1.0 / 64)
    return tuple(t.to(device) for t in (x.to(torch.bfloat16), packed, scale, gs))


@functools.lru_cache(maxsize=8)
def probe_decode(device: torch.device) -> int:
    """The fastest E2M1 decode that reproduces the torch reference exactly on this device.

    Runs once per device (one tiny GEMM per candidate, no tuning): the inline-PTX decode
    first, then the plain-Triton bit decode, then per-element arithmetic. Call it before
    CUDA-graph capture (it synchronises); a fallback logs one line.
    """
    if device.type != "cuda":
        return DECODE_ARITH
    x, packed, scale, gs = _probe_case(device)
    ref = nvfp4_gemm_ref(x, packed, scale, gs)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1}
    cfg |= {"num_warps": 4, "num_stages": 2}
    for mode in (DECODE_ASM, DECODE_BITS):
        try:
            mma = nvfp4_gemm(x, packed, scale, gs, config=cfg, decode=mode, kernel="mma")
            gemv = nvfp4_gemm(x, packed, scale, gs, decode=mode, kernel="gemv")
            if torch.equal(mma, ref) and torch.equal(gemv, ref):
                return mode
            log.warning("NVFP4 decode mode %d is wrong on %s; trying the next one", mode, device)
        except Exception as e:  # noqa: BLE001 - any compile/launch failure means "not this one"
            log.warning("NVFP4 decode mode %d unavailable on %s (%s)", mode, device, e)
    return DECODE_ARITH


@functools.lru_cache(maxsize=8)
def probe_gemv_mma(device: torch.device) -> bool:
    """Whether the register-fed MMA GEMV (nvfp4_gemv_mma.py) reproduces the reference exactly
    on this device (it relies on Triton's register layout; a mismatch shows here). Runs once
    per device; call it before CUDA-graph capture."""
    if device.type != "cuda":
        return False
    from moeserve.kernels.nvfp4_gemv_mma import nvfp4_gemv_mma

    x, packed, scale, gs = _probe_case(device)
    ref = nvfp4_gemm_ref(x, packed, scale, gs)
    try:
        cfg = {"BLOCK_N": 32, "SPLIT_K": 0, "num_warps": 4}
        y = nvfp4_gemv_mma(x, packed, scale, gs.reshape(1), torch.empty_like(ref), None, cfg)
        if torch.equal(y, ref):
            return True
        log.warning("NVFP4 MMA GEMV is not exact on %s; using the CUDA-core GEMV", device)
    except Exception as e:  # noqa: BLE001 - any compile/launch failure means "not this one"
        log.warning("NVFP4 MMA GEMV unavailable on %s (%s)", device, e)
    return False


def gemv_mma_enabled(device: torch.device) -> bool:
    """probe_gemv_mma's answer; False (no probe) under graph capture before any probe."""
    if interpreting() or device.type != "cuda":
        return False
    if torch.cuda.is_current_stream_capturing() and probe_gemv_mma.cache_info().currsize == 0:
        log.warning("NVFP4 MMA GEMV not probed before graph capture; not using it")
        return False
    return probe_gemv_mma(device)


def default_decode(device: torch.device | None = None) -> int:
    """Decode mode for kernels launched on `device`: probed once per device (see probe_decode).
    Under CUDA-graph capture before any probe, the plain-Triton decode is used (one log line)."""
    if interpreting() or device is None or device.type != "cuda":
        return DECODE_ARITH
    if torch.cuda.is_current_stream_capturing() and probe_decode.cache_info().currsize == 0:
        log.warning("NVFP4 decode not probed before graph capture; using the plain Triton decode")
        return DECODE_BITS
    return probe_decode(device)


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # interpreter: pretend an H200 so split-K paths get exercised
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass(frozen=True)
class SplitKWorkspace:
    """Zeroed fp32 partial sums and int32 tile counters for split-K; kernels leave them zeroed,
    so one workspace serves any number of sequential calls (and CUDA-graph replays)."""

    partial: torch.Tensor  # fp32 [capacity] >= M*N
    locks: torch.Tensor  # int32 [tiles] >= number of output tiles

    @staticmethod
    def create(max_elems: int, max_tiles: int, device: torch.device | str) -> SplitKWorkspace:
        return SplitKWorkspace(
            torch.zeros(max_elems, dtype=torch.float32, device=device),
            torch.zeros(max_tiles, dtype=torch.int32, device=device),
        )


def splitk_buffers(
    split: int, workspace: SplitKWorkspace | None, elems: int, tiles: int, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials, tile counters) for a launch that splits K `split` ways: the caller's
    workspace (checked to fit) or a fresh zeroed one; unused placeholders when split == 1."""
    if split == 1:
        return out, out
    if workspace is None:
        workspace = SplitKWorkspace.create(elems, tiles, out.device)
    if workspace.partial.numel() < elems or workspace.locks.numel() < tiles:
        raise ValueError("split-K workspace too small for this GEMM")
    return workspace.partial, workspace.locks


def choose_split_k(cfg_split: int, tiles: int, k_tiles: int, device: torch.device) -> int:
    """Config value if > 0, else enough K-splits to reach CTAS_PER_SM_TARGET programs per SM
    (each split keeping >= 2 K-iterations)."""
    if cfg_split > 0:
        return max(1, min(cfg_split, k_tiles))
    want = -(-CTAS_PER_SM_TARGET * sm_count(device) // max(tiles, 1))
    return max(1, min(want, k_tiles // 2))


def _default_kernel(m: int, key: str, packed: torch.Tensor, device: torch.device) -> str:
    """By row count, from tiles.json: the register-fed MMA GEMV between "nvfp4_gemv_mma"'s
    min_m and max_m (where the shape allows it and the start-up probe passed), else the
    CUDA-core GEMV up to "nvfp4_gemv"'s rows; dequantize+cuBLAS from "nvfp4_dequant"'s min_m;
    the tensor-core GEMM between."""
    if min_rows("nvfp4_gemv_mma", key) <= m <= max_rows("nvfp4_gemv_mma", key):
        from moeserve.kernels.nvfp4_gemv_mma import mma_supported

        n, k = packed.shape[0], packed.shape[1] * 2
        bn = tile_config("nvfp4_gemv_mma", m, key)["BLOCK_N"]
        if mma_supported(n, k, bn, packed) and gemv_mma_enabled(device):
            return "gemv_mma"
    if m <= max_rows("nvfp4_gemv", key):
        return "gemv"
    if m >= min_rows("nvfp4_dequant", key):
        return "dequant"
    return "mma"


def _as_scalar_tensor(v: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(v, dtype=torch.float32, device=device).reshape(1)
    return t


def nvfp4_gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor | float,
    out: torch.Tensor | None = None,
    workspace: SplitKWorkspace | None = None,
    config: dict[str, int] | None = None,
    decode: int | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """W4A16 GEMM: x [M, K] bf16 @ dequant(W [N, K])^T -> out [M, N] bf16 (fp32 accumulate).

    packed uint8 [N, K/2], scale float8_e4m3fn [N, K/16], global_scale fp32 scalar (a device
    tensor keeps it CUDA-graph safe). `workspace` (SplitKWorkspace) is needed for graph capture
    when the chosen config splits K; without it a zeroed one is allocated per call.
    `kernel`: "gemv" (CUDA cores, nvfp4_gemv.py), "gemv_mma" (register-fed mma.sync,
    nvfp4_gemv_mma.py, GPU only), "mma" (tensor cores, below), "dequant" (bf16 weight chunks +
    cuBLAS) or None: see _default_kernel.
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [M, K] with unit stride along K, got {tuple(x.shape)}")
    m, k = x.shape
    n = packed.shape[0]
    if (
        packed.dtype != torch.uint8
        or tuple(packed.shape) != (n, k // 2)
        or not packed.is_contiguous()
    ):
        raise ValueError(
            f"packed must be contiguous uint8 [N, {k // 2}], "
            f"got {packed.dtype} {tuple(packed.shape)}"
        )
    if k % NVFP4_BLOCK or tuple(scale.shape) != (n, k // NVFP4_BLOCK) or not scale.is_contiguous():
        raise ValueError(
            f"scale must be contiguous [N, K/16] = {(n, k // 16)}, got {tuple(scale.shape)}"
        )
    if scale.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"scale must be float8_e4m3fn, got {scale.dtype}")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (m, n) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{m}, {n}] with unit stride, got {tuple(out.shape)}")
    if m == 0:
        return out
    dec = default_decode(x.device) if decode is None else decode
    gs = _as_scalar_tensor(global_scale, x.device)
    key = f"{n}x{k}"
    if kernel is None:
        kernel = _default_kernel(m, key, packed, x.device)
    if kernel == "gemv_mma":
        from moeserve.kernels.nvfp4_gemv_mma import nvfp4_gemv_mma

        cfg = config or tile_config("nvfp4_gemv_mma", m, key)
        return nvfp4_gemv_mma(x, packed, scale, gs, out, workspace, cfg)
    if kernel in ("gemv", "dequant"):
        from moeserve.kernels.nvfp4_gemv import nvfp4_dequant_matmul, nvfp4_gemv

        if kernel == "gemv":
            cfg = config or tile_config("nvfp4_gemv", m, key)
            return nvfp4_gemv(x, packed, scale, gs, out, workspace, cfg, dec)
        cfg = config or tile_config("nvfp4_dequant", m, key)
        return nvfp4_dequant_matmul(x, packed, scale, gs, out, cfg, dec)
    if kernel != "mma":
        raise ValueError(f"unknown NVFP4 kernel {kernel!r}")
    cfg = config or tile_config("nvfp4_gemm", m, f"{n}x{k}")
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    grid_n, grid_m = triton.cdiv(n, bn), triton.cdiv(m, bm)
    k_tiles = triton.cdiv(k, bk)
    split = choose_split_k(cfg["SPLIT_K"], grid_n * grid_m, k_tiles, x.device)
    k_iters = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, k_iters)
    ws, locks = splitk_buffers(split, workspace, m * n, grid_n * grid_m, out)
    _nvfp4_gemm_kernel[(grid_n, split, grid_m)](
        x,
        packed.view(torch.int32),
        scale.view(torch.uint8),
        gs,
        out,
        ws,
        locks,
        m,
        n,
        k,
        x.stride(0),
        out.stride(0),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        SPLIT_K=split,
        K_ITERS=k_iters,
        DECODE=dec,
        DOT_F32=interpreting(),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out
