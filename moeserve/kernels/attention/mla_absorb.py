"""The absorbed MLA products of decode rows, read straight from kv_b_proj's stored weight.

kv_b_proj's weight W is [H * (nope + v), L] (L = kv_lora_rank): per head h, rows
h*(nope+v) .. +nope are W_UK[h] [nope, L] and the next v rows W_UV[h] [v, L]. It is stored
block-FP8 (e4m3 + fp32 128x128 ``weight_scale_inv``, DeepSeek-V3/R1) or 16-bit (Kimi).
Absorbed decode (layers/attention/mla.py) needs, for T rows,

- ``uk``: q_lat[t, h, l] = sum_d q_nope[t, h, d] * W[h*(nope+v) + d, l]      (over W's rows)
- ``uv``: o[t, h, j]     = sum_l o_lat[t, h, l] * W[h*(nope+v) + nope + j, l] (over its columns)

torch.bmm on a dequantized bf16 copy reads 2 B per weight (6.6 us per product at 128 heads
on an H200, ~59% of HBM); these CUDA-core kernels read the stored bytes (1 B for FP8) once
per up to 4 rows: 6.1 + 4.6 us for the pair at one row (benchmarks/results/
kernels_mla_absorb.md). They win only there, so tiles.json serves one row of FP8 and leaves
16-bit weights and more rows to bmm. ``uv`` is the block-FP8 GEMV's own loop
(`fp8_gemv_rows`, the scale folded into the activation chunk); ``uk`` walks W_UK[h] down
its rows for a slab of columns, accumulating elementwise and reducing once. Grids are
(column tiles, heads, row groups): the heads give the parallelism, so there is no split-K
and nothing to zero. Tile configs: tiles.json "mla_absorb_uk" / "mla_absorb_uv", keyed
"fp8" or "w16" (":few_heads" for <= 16 heads per rank); rows beyond their max_m go to the
caller's bmm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.attention.kv_cache import CacheWrite, rope_write_program
from moeserve.kernels.configs import max_rows, tile_config
from moeserve.kernels.gemm.fp8_block_gemm import FP8_BLOCK, dequantize_fp8_block, fp8_gemv_rows
from moeserve.kernels.gemm.splitk import dense_x_rows

MAX_MP = 4  # x rows per program (one weight pass serves them all)
TABLES = {"uk": "mla_absorb_uk", "uv": "mla_absorb_uv"}


def absorb_ref(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, mode: str, nope: int
) -> torch.Tensor:
    """fp32 torch reference: x [T, H, nope] (uk) or [T, H, L] (uv) -> [T, H, L] / [T, H, v]."""
    wd = w.float() if scale is None else dequantize_fp8_block(w, scale, torch.float32)
    heads = x.shape[1]
    wd = wd.view(heads, -1, wd.shape[-1])
    if mode == "uk":
        return torch.einsum("thd,hdl->thl", x.float(), wd[:, :nope])
    return torch.einsum("thl,hjl->thj", x.float(), wd[:, nope:])


@triton.jit
def _scaled_x(x_row, ok, dd, d_ok, s):
    return tl.load(x_row + dd, mask=ok & d_ok, other=0.0).to(tl.float32) * s


@triton.jit
def _uk_rows(
    x_rows,
    oks,
    cols,
    l_ok,
    s_col,
    KB,
    D,
    L,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MP: tl.constexpr,
    SCALED: tl.constexpr,
    D_ITERS: tl.constexpr,
    STAGES: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
):
    """Sums down D rows of W (cols: pointers [1, BLOCK_L] into row 0 of the head's block)
    weighted by up to 4 activation rows (pointers x_rows, used where oks) -> four [BLOCK_L]
    fp32 accumulators. BLOCK_D divides SCALE_BLOCK and the slab lies in one scale column, so
    a tile has one scale: s_col points at the head's first row block's, KB is the scale
    row stride. The products accumulate elementwise in [BLOCK_D, BLOCK_L] and are reduced
    over D once at the end (a reduction per tile would cross warps every iteration).
    STAGES as in fp8_gemv_rows."""
    acc0 = tl.zeros((BLOCK_D, BLOCK_L), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_D, BLOCK_L), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_D, BLOCK_L), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_D, BLOCK_L), dtype=tl.float32)
    x0, x1, x2, x3 = x_rows
    ok0, ok1, ok2, ok3 = oks
    for it in tl.range(0, D_ITERS, num_stages=STAGES if STAGES > 0 else None):
        d0 = it * BLOCK_D
        dd = d0 + tl.arange(0, BLOCK_D)
        d_ok = dd < D
        w = tl.load(cols + dd[:, None].to(tl.int64) * L, mask=d_ok[:, None] & l_ok, other=0)
        s = 1.0
        if SCALED:
            w = w.to(tl.float8e4nv, bitcast=True)
            s = tl.load(s_col + (d0 // SCALE_BLOCK) * KB)
        w = w.to(tl.float32)
        acc0 += w * _scaled_x(x0, ok0, dd, d_ok, s)[:, None]
        if MP > 1:
            acc1 += w * _scaled_x(x1, ok1, dd, d_ok, s)[:, None]
        if MP > 2:
            acc2 += w * _scaled_x(x2, ok2, dd, d_ok, s)[:, None]
            acc3 += w * _scaled_x(x3, ok3, dd, d_ok, s)[:, None]
    return tl.sum(acc0, axis=0), tl.sum(acc1, axis=0), tl.sum(acc2, axis=0), tl.sum(acc3, axis=0)


@triton.jit
def _store_rows(accs, out_ptr, row0, stride_ot, offs, o_ok, T, MP: tl.constexpr):
    """Row row0 + i of out (row pointer base out_ptr, row stride stride_ot) = accs[i]."""
    a0, a1, a2, a3 = accs
    o0 = out_ptr + row0.to(tl.int64) * stride_ot + offs
    ty = out_ptr.dtype.element_ty
    tl.store(o0, a0.to(ty), mask=o_ok & (row0 < T))
    if MP > 1:
        tl.store(o0 + stride_ot, a1.to(ty), mask=o_ok & (row0 + 1 < T))
    if MP > 2:
        tl.store(o0 + 2 * stride_ot, a2.to(ty), mask=o_ok & (row0 + 2 < T))
        tl.store(o0 + 3 * stride_ot, a3.to(ty), mask=o_ok & (row0 + 3 < T))


@triton.jit
def _absorb_uk_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    T,
    L,
    KB,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    HEAD_ROWS: tl.constexpr,
    NOPE: tl.constexpr,
    MP: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D_ITERS: tl.constexpr,
    SCALED: tl.constexpr,
    STAGES: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    # kv_cache.rope_write_program's arguments (CacheWrite.kernel_args), used with ROPE_WRITE
    c_ptr,
    pe_ptr,
    kv_ptr,
    slot_ptr,
    kv_scale_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    q_pe_ptr,
    q_pe_out_ptr,
    stride_c,
    stride_pe,
    stride_kv_page,
    stride_kv_tok,
    page_size,
    stride_cs,
    rope_heads,
    stride_qt,
    stride_qh,
    stride_qot,
    stride_qoh,
    D_LAT: tl.constexpr,
    D_ROPE: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    ROPE: tl.constexpr,
    HAS_Q: tl.constexpr,
    ROPE_WRITE: tl.constexpr,
):
    """out[t, h, l] = sum_d x[t, h, d] W[h*HEAD_ROWS + d, l]; grid (cdiv(L, BLOCK_L), H,
    cdiv(T, MP)); BLOCK_L divides SCALE_BLOCK. ROPE_WRITE: the first column tile's programs
    also run the decode rows' rope + cache write, head h each (the write's own launch, ~3 us
    at one row, is then gone)."""
    pid_l = tl.program_id(0)
    h = tl.program_id(1)
    row0 = tl.program_id(2) * MP
    if ROPE_WRITE:
        if pid_l == 0:
            for i in tl.static_range(MP):
                if row0 + i < T:
                    rope_write_program(
                        row0 + i, h, c_ptr, pe_ptr, kv_ptr, slot_ptr, kv_scale_ptr, pos_ptr,
                        cos_ptr, sin_ptr, q_pe_ptr, q_pe_out_ptr, stride_c, stride_pe,
                        stride_kv_page, stride_kv_tok, page_size, stride_cs, rope_heads,
                        stride_qt, stride_qh, stride_qot, stride_qoh, D_LAT, D_ROPE, QUANT,
                        FP8_MAX, ROPE, HAS_Q, 1,
                    )  # fmt: skip
    offs_l = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    l_ok = offs_l < L
    first = h.to(tl.int64) * HEAD_ROWS
    cols = w_ptr + first * L + offs_l[None, :]
    s_col = s_ptr + (first // SCALE_BLOCK) * KB + pid_l * BLOCK_L // SCALE_BLOCK
    x_rows, oks = dense_x_rows(x_ptr + h.to(tl.int64) * stride_xh, row0, stride_xt, T)
    accs = _uk_rows(
        x_rows, oks, cols, l_ok[None, :], s_col, KB, NOPE, L,
        BLOCK_L, BLOCK_D, MP, SCALED, D_ITERS, STAGES, SCALE_BLOCK,
    )  # fmt: skip
    _store_rows(accs, out_ptr + h.to(tl.int64) * stride_oh, row0, stride_ot, offs_l, l_ok, T, MP)


@triton.jit
def _absorb_uv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    T,
    L,
    KB,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    HEAD_ROWS: tl.constexpr,
    NOPE: tl.constexpr,
    V: tl.constexpr,
    MP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_ITERS: tl.constexpr,
    SCALED: tl.constexpr,
    STAGES: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    LATE_SUM: tl.constexpr = 0,
):
    """out[t, h, j] = sum_l x[t, h, l] W[h*HEAD_ROWS + NOPE + j, l]; grid (cdiv(V, BLOCK_N),
    H, cdiv(T, MP)); BLOCK_N and BLOCK_K divide SCALE_BLOCK."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    row0 = tl.program_id(2) * MP
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < V
    first = h.to(tl.int64) * HEAD_ROWS + NOPE
    rows = w_ptr + (first + offs_n[:, None]) * L
    s_row = s_ptr + ((first + pid_n * BLOCK_N) // SCALE_BLOCK) * KB
    x_rows, oks = dense_x_rows(x_ptr + h.to(tl.int64) * stride_xh, row0, stride_xt, T)
    accs = fp8_gemv_rows(
        x_rows, oks, rows, n_ok[:, None], s_row, 0, L,
        BLOCK_N, BLOCK_K, MP, SCALED, K_ITERS, STAGES, SCALE_BLOCK, LATE_SUM,
    )  # fmt: skip
    _store_rows(accs, out_ptr + h.to(tl.int64) * stride_oh, row0, stride_ot, offs_n, n_ok, T, MP)


FEW_HEADS = 16  # at most this many heads per rank (the TP8 share of 128): own table entries


def table_key(w: torch.Tensor, heads: int) -> str:
    """tiles.json key: "fp8" (e4m3 bytes) or "w16", with ":few_heads" for <= FEW_HEADS heads
    (whose grids are 8x smaller: the uk kernel then has too few programs to beat bmm)."""
    key = "fp8" if w.element_size() == 1 else "w16"
    return key + ":few_heads" if heads <= FEW_HEADS else key


def absorb_max_rows(mode: str, w: torch.Tensor, heads: int) -> int:
    """Rows up to which `absorb_gemv` serves this weight (its table's last max_m)."""
    return max_rows(TABLES[mode], table_key(w, heads))


def check_absorb_weight(
    w: torch.Tensor, scale: torch.Tensor | None, heads: int, nope: int, v_dim: int
) -> None:
    """Raise ValueError unless (w, scale) is a kv_b_proj weight these kernels read: contiguous
    [heads * (nope + v), L], e4m3 with whole 128-row scale blocks per part, or 16-bit."""
    rows = heads * (nope + v_dim)
    if w.dim() != 2 or w.shape[0] != rows or not w.is_contiguous():
        raise ValueError(f"kv_b_proj weight must be contiguous [{rows}, L], got {tuple(w.shape)}")
    if scale is None:
        if w.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"an unscaled kv_b_proj weight must be 16-bit, got {w.dtype}")
        return
    if w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"a block-scaled kv_b_proj weight must be e4m3, got {w.dtype}")
    if nope % FP8_BLOCK or v_dim % FP8_BLOCK:
        raise ValueError(f"nope {nope} and v {v_dim} must be whole {FP8_BLOCK}-row scale blocks")
    want = (rows // FP8_BLOCK, triton.cdiv(w.shape[1], FP8_BLOCK))
    if tuple(scale.shape) != want or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"weight_scale_inv must be contiguous fp32 {want}")


# _absorb_uk_kernel's parameters that take CacheWrite.kernel_args' runtime arguments, in order
_ROPE_WRITE_PARAMS = (
    "c_ptr", "pe_ptr", "kv_ptr", "slot_ptr", "kv_scale_ptr", "pos_ptr", "cos_ptr", "sin_ptr",
    "q_pe_ptr", "q_pe_out_ptr", "stride_c", "stride_pe", "stride_kv_page", "stride_kv_tok",
    "page_size", "stride_cs", "rope_heads", "stride_qt", "stride_qh", "stride_qot", "stride_qoh",
)  # fmt: skip


def _rope_write_args(write: CacheWrite | None, x: torch.Tensor) -> dict:
    """The uk launch's rope + cache write arguments by name: `write`'s, or placeholders."""
    if write is None:
        args = (x,) * 10 + (0,) * 11
        constexprs = dict(D_LAT=1, D_ROPE=1, QUANT=False, FP8_MAX=1.0, ROPE=False, HAS_Q=False)
    else:
        args, constexprs = write.kernel_args()
    named = dict(zip(_ROPE_WRITE_PARAMS, args, strict=True))
    return {**named, **constexprs, "ROPE_WRITE": write is not None}


def absorb_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor | None,
    out: torch.Tensor,
    mode: str,
    nope: int,
    config: dict[str, int] | None = None,
    cache_write: CacheWrite | None = None,
) -> torch.Tensor:
    """One absorbed product (module docstring) into `out`, returned. x [T, H, nope] ("uk") or
    [T, H, L] ("uv"), out [T, H, L] or [T, H, v], both with a unit last stride (other
    strides free: q_nope and q_lat are column views); (w, scale) checked once by the caller
    with `check_absorb_weight`. `cache_write` ("uk" only): the same T tokens' rope + cache
    write (kv_cache.write_mla_cache), done by this launch; its query must have H heads."""
    t, heads = x.shape[0], x.shape[1]
    if x.stride(-1) != 1 or out.stride(-1) != 1 or out.shape[:2] != x.shape[:2]:
        raise ValueError("x and out must be [T, H, *] with a unit last stride")
    if t == 0:
        return out
    lat = w.shape[1]
    head_rows = w.shape[0] // heads
    scaled = scale is not None
    cfg = {**tile_config(TABLES[mode], t, table_key(w, heads)), **(config or {})}
    mp = 1 if t == 1 else 2 if t == 2 else MAX_MP
    common = (
        x.stride(0), x.stride(1), out.stride(0), out.stride(1),
    )  # fmt: skip
    wb = w.view(torch.uint8) if scaled else w
    s = scale if scaled else w
    kb = scale.shape[1] if scaled else 0
    if mode == "uk":
        bl, bd = cfg["BLOCK_L"], cfg["BLOCK_D"]
        if FP8_BLOCK % bl or FP8_BLOCK % bd:
            raise ValueError(f"BLOCK_L={bl} and BLOCK_D={bd} must divide {FP8_BLOCK}")
        if cache_write is not None and (
            cache_write.c.shape[0] != t
            or (cache_write.rope is not None and cache_write.heads != heads)
        ):
            raise ValueError("the cache write must cover the product's tokens and heads")
        rope_write = _rope_write_args(cache_write, x)
        grid = (triton.cdiv(lat, bl), heads, triton.cdiv(t, mp))
        _absorb_uk_kernel[grid](
            x, wb, s, out, t, lat, kb, *common,
            HEAD_ROWS=head_rows, NOPE=nope, MP=mp, BLOCK_L=bl, BLOCK_D=bd,
            D_ITERS=triton.cdiv(nope, bd), SCALED=scaled,
            STAGES=cfg.get("STAGES", 0), SCALE_BLOCK=FP8_BLOCK,
            **rope_write,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )  # fmt: skip
        return out
    if mode != "uv":
        raise ValueError(f"unknown absorbed product {mode!r}")
    if cache_write is not None:
        raise ValueError("only the uk product carries a cache write")
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    if FP8_BLOCK % bn or FP8_BLOCK % bk:
        raise ValueError(f"BLOCK_N={bn} and BLOCK_K={bk} must divide {FP8_BLOCK}")
    v_dim = head_rows - nope
    grid = (triton.cdiv(v_dim, bn), heads, triton.cdiv(t, mp))
    _absorb_uv_kernel[grid](
        x, wb, s, out, t, lat, kb, *common,
        HEAD_ROWS=head_rows, NOPE=nope, V=v_dim, MP=mp, BLOCK_N=bn, BLOCK_K=bk,
        K_ITERS=triton.cdiv(lat, bk), SCALED=scaled, STAGES=cfg.get("STAGES", 0),
        SCALE_BLOCK=FP8_BLOCK, LATE_SUM=cfg.get("LATE_SUM", 0),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out
