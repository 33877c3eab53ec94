"""The weight-only W4A16 NVFP4 GEMM on tensor cores, and `nvfp4_gemm`, the dispatcher that
picks it or one of the GEMVs (nvfp4_gemv.py, nvfp4_gemv_mma.py) by row count.

The format (layout, E2M1 codes, quantize/dequantize) is nvfp4_format.py's; split-K and the
other plumbing the kernels share is splitk.py's. ``nvfp4_gemm_ref`` is the pure-torch oracle
for the kernels here.
"""

from __future__ import annotations

import torch

from moeserve.kernels.gemm.nvfp4_format import NVFP4_BLOCK, dequantize_nvfp4


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

from moeserve.kernels.gemm.e2m1_ptx import decode_pairs_ptx  # noqa: E402
from moeserve.kernels.gemm.splitk import (  # noqa: E402
    ACC_FIX_EXP,
    SCALE_BIAS_EXP,
    SplitKWorkspace,
    split_k_plan,
    splitk_buffers,
    splitk_finish,
)
from moeserve.kernels.runtime import interpreting  # noqa: E402

# Jitted code may only read constexpr globals.
FP16_BIAS_EXP = tl.constexpr(14)  # DECODE_BITS: fp16 bits give value * 2^-14
SIGN_MASK2 = tl.constexpr(-2147450880)  # 0x80008000 as int32
IDX_MASK2 = tl.constexpr(0x70007000)

DECODE_ARITH = 0  # per-element arithmetic decode (interpreter; slow on a GPU)
DECODE_ASM = 1  # packed-word inline PTX, bf16x2 scale multiply (the GPU default)
DECODE_BITS = 2  # packed-word decode in Triton integer ops via fp16 (portable; interpreter too)


# $0..$7: bf16 bits of n0..n7 (int16 outputs), $8: the word, $9: bf16 bits of scale*2^118.
def _e2m1_bf16_asm() -> str:
    lines = [".reg .b32 et, ea, eb, ss, r0, r1, r2, r3;", "mov.b32 ss, {$9, $9};"]
    lines.append(decode_pairs_ptx("$8", ("r0", "r1", "r2", "r3"), "bf16", ("et", "ea", "eb")))
    for j in range(4):
        lines += [f"mul.rn.bf16x2 r{j}, r{j}, ss;", f"mov.b32 {{${j}, ${j + 4}}}, r{j};"]
    return "{\n" + "\n".join(lines) + "\n}"


_E2M1_ASM = tl.constexpr(_e2m1_bf16_asm())


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
def load_decode_tile(
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
def load_act_t(x_rows_ptr, m_mask, kw0, K, BLOCK_K: tl.constexpr):
    """Activation columns matching load_decode_tile: bf16 [BLOCK_K, BLOCK_M].

    x_rows_ptr [1, BLOCK_M] pointers to activation rows, m_mask [1, BLOCK_M].
    """
    kk = 8 * kw0 + _kperm(tl.arange(0, BLOCK_K))
    xt = tl.load(x_rows_ptr + kk[:, None], mask=(kk[:, None] < K) & m_mask, other=0.0)
    return xt.to(tl.bfloat16)


@triton.jit
def dot_acc(a, b, acc, DOT_F32: tl.constexpr):
    """acc += a @ b. DOT_F32 (the CPU interpreter) multiplies in fp32: the interpreter's numpy
    dot has no bf16 and would multiply raw bit patterns."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


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
        w = load_decode_tile(w_rows, s_rows, n_mask, kw0, KW, KG, BLOCK_N, BLOCK_K, DECODE)
        xt = load_act_t(x_rows, m_mask, kw0, K, BLOCK_K)
        acc = dot_acc(w, xt, acc, DOT_F32)
    acc = acc * (tl.load(gs_ptr) * (2.0**ACC_FIX_EXP))
    mask = n_mask & m_mask
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    ws_ptrs = ws_ptr + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
    tile = pid_m * tl.num_programs(0) + pid_n
    splitk_finish(acc, out_ptrs, ws_ptrs, lock_ptr + tile, mask, SPLIT_K)


# ----------------------------------------------------------------------------------------------
# Host wrappers
# ----------------------------------------------------------------------------------------------

import bisect  # noqa: E402
import functools  # noqa: E402
import logging  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from moeserve.kernels.configs import TILE_CONFIGS, max_rows, min_rows, tile_config  # noqa: E402
from moeserve.kernels.gemm import nvfp4_gemv as _gemv  # noqa: E402
from moeserve.kernels.gemm import nvfp4_gemv_mma as _gemv_mma  # noqa: E402

log = logging.getLogger(__name__)


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
    x, packed, scale, gs = _probe_case(device)
    ref = nvfp4_gemm_ref(x, packed, scale, gs)
    try:
        cfg = {"BLOCK_N": 32, "SPLIT_K": 0, "num_warps": 4}
        y = _gemv_mma.nvfp4_gemv_mma(
            x, packed, scale, gs.reshape(1), torch.empty_like(ref), None, cfg
        )
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


def _default_kernel(m: int, key: str, packed: torch.Tensor, device: torch.device) -> str:
    """By row count, from tiles.json: the register-fed MMA GEMV between "nvfp4_gemv_mma"'s
    min_m and max_m (where the shape allows it and the start-up probe passed), else the
    CUDA-core GEMV up to "nvfp4_gemv"'s rows; dequantize+cuBLAS from "nvfp4_dequant"'s min_m;
    the tensor-core GEMM between."""
    if min_rows("nvfp4_gemv_mma", key) <= m <= max_rows("nvfp4_gemv_mma", key):
        n, k = packed.shape[0], packed.shape[1] * 2
        bn = tile_config("nvfp4_gemv_mma", m, key)["BLOCK_N"]
        if _gemv_mma.mma_supported(n, k, bn, packed) and gemv_mma_enabled(device):
            return "gemv_mma"
    if m <= max_rows("nvfp4_gemv", key):
        return "gemv"
    if m >= min_rows("nvfp4_dequant", key):
        return "dequant"
    return "mma"


# The tiles.json table each kernel of nvfp4_gemm reads its config from.
_TABLE = {
    "gemv_mma": "nvfp4_gemv_mma",
    "gemv": "nvfp4_gemv",
    "dequant": "nvfp4_dequant",
    "mma": "nvfp4_gemm",
}


@dataclass(frozen=True)
class Nvfp4GemmPlan:
    """nvfp4_gemm's choices for one weight on one device, made once (at engine start) so that
    a call only looks its row count up: the decode mode, and (kernel, tile config) for the row
    ranges ..bounds[0], (bounds[0], bounds[1]], ..., above bounds[-1]. The configs are shared
    between calls: read them, never modify them."""

    decode: int
    bounds: tuple[int, ...]
    choices: tuple[tuple[str, dict[str, int]], ...]  # len(bounds) + 1

    def pick(self, m: int) -> tuple[str, dict[str, int]]:
        return self.choices[bisect.bisect_left(self.bounds, m)]


def plan_nvfp4_gemm(packed: torch.Tensor) -> Nvfp4GemmPlan:
    """What nvfp4_gemm with kernel=None, config=None, decode=None would choose for this weight
    (packed uint8 [N, K/2] on its device) at every row count; runs the one-time device probes,
    so build it before CUDA-graph capture.

    Every choice is a step function of the row count that can only change past an entry's
    max_m or below a table's min_m, so evaluating it at those cuts covers all row counts."""
    n, k = packed.shape[0], packed.shape[1] * 2
    key = f"{n}x{k}"
    cuts = {min_rows("nvfp4_gemv_mma", key) - 1, min_rows("nvfp4_dequant", key) - 1}
    for table in _TABLE.values():
        entries = TILE_CONFIGS[table]
        cuts.update(e["max_m"] for e in entries.get(key, entries["default"]))
    bounds = tuple(sorted(c for c in cuts if c >= 1))
    choices = []
    for m in (*bounds, bounds[-1] + 1):
        kernel = _default_kernel(m, key, packed, packed.device)
        choices.append((kernel, tile_config(_TABLE[kernel], m, key)))
    return Nvfp4GemmPlan(default_decode(packed.device), bounds, tuple(choices))


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
    plan: Nvfp4GemmPlan | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """W4A16 GEMM: x [M, K] bf16 @ dequant(W [N, K])^T -> out [M, N] bf16 (fp32 accumulate).

    packed uint8 [N, K/2], scale float8_e4m3fn [N, K/16], global_scale fp32 scalar (a device
    tensor keeps it CUDA-graph safe). `workspace` (SplitKWorkspace) is needed for graph capture
    when the chosen config splits K; without it a zeroed one is allocated per call.
    `kernel`: "gemv" (CUDA cores, nvfp4_gemv.py), "gemv_mma" (register-fed mma.sync,
    nvfp4_gemv_mma.py, GPU only), "mma" (tensor cores, below), "dequant" (bf16 weight chunks +
    cuBLAS) or None: see _default_kernel. `plan` (plan_nvfp4_gemm of this weight) stands for
    the choices made when kernel, config or decode are None. `pdl`: the CUDA-core GEMV
    launches with programmatic dependent launch (kernels/pdl.py).
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
    gs = _as_scalar_tensor(global_scale, x.device)
    planned: dict[str, int] | None = None
    if plan is not None:
        dec = plan.decode if decode is None else decode
        if kernel is None:
            kernel, planned = plan.pick(m)
    else:
        dec = default_decode(x.device) if decode is None else decode
        if kernel is None:
            kernel = _default_kernel(m, f"{n}x{k}", packed, x.device)
    if kernel not in _TABLE:
        raise ValueError(f"unknown NVFP4 kernel {kernel!r}")
    cfg = config or planned or tile_config(_TABLE[kernel], m, f"{n}x{k}")
    if kernel == "gemv_mma":
        return _gemv_mma.nvfp4_gemv_mma(x, packed, scale, gs, out, workspace, cfg)
    if kernel == "gemv":
        if pdl:
            cfg = {**cfg, "PDL": 1}
        return _gemv.nvfp4_gemv(x, packed, scale, gs, out, workspace, cfg, dec)
    if kernel == "dequant":
        return _gemv.nvfp4_dequant_matmul(x, packed, scale, gs, out, cfg, dec)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    grid_n, grid_m = triton.cdiv(n, bn), triton.cdiv(m, bm)
    k_tiles = triton.cdiv(k, bk)
    split, k_iters = split_k_plan(cfg["SPLIT_K"], grid_n * grid_m, k_tiles, x.device)
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
