"""16-bit dense GEMV for decode rows (1 to 4), split over K, with an optional fused RMSNorm of
column segments of each output row.

out [T, N] = x [T, K] @ W [N, K]^T for bf16 / fp16 x, W and out, fp32 accumulation. At decode
sizes the product is a stream of weight bytes with two flops per element and row, so what
matters is keeping enough requests in flight: each program loads a [BLOCK_N, BLOCK_K] weight
tile once (16-byte vectors along K), multiplies it with every x row (one pass over W serves
all T rows) and accumulates elementwise, reducing across threads once after its K loop. The K
loop names STAGES software-pipeline stages, so Triton streams the tiles through shared memory
by cp.async (kernels/gemm/fp8_block_gemm.py has the same loop).

Split-K (SPLIT_K > 1): the K tiles are shared out over SPLIT_K programs per output tile; each
stores its fp32 partials in the workspace and arrives at the tile's int32 counter (acq_rel);
the last to arrive sums the partials in split order (the same bits whatever the arrival order)
and finishes the tile, then sets the counter back to zero.

Norm segments (`NormSegment`): columns [start, start + width) of each row become
    y = v * rsqrt(mean(v^2) + eps) * weight,
in fp32 on the unrounded fp32 products v, rounded once to out's dtype (the formula of
kernels/elementwise/norm.py, whose rms_norm_pair does this for MLA's q_a / kv_a outputs as a
separate launch). A row needs every tile before it can be normalised, so a second counter
counts finished tiles: each tile's finisher writes its columns outside every segment to out
directly and its segment columns, still fp32, to a row buffer in the workspace; the last tile
to finish normalises every segment of every row and resets that counter.

Workspace (`W16Workspace`): fp32 partials and pre-norm rows plus int32 counters, zeroed once;
every launch leaves the counters at zero, so a workspace serves any number of sequential calls
and CUDA-graph replays. Keep one per layer shape, or share one between calls that run one
after another on one stream (concurrent launches must not share one). Without one, a zeroed
workspace is allocated per call where the launch needs one (inside a CUDA-graph capture it
comes from the graph's pool).

Tile parameters come from tiles.json's "w16_gemv" table, keyed "NxK" (kernels/configs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeserve.kernels.configs import max_rows, tile_config
from moeserve.kernels.gemm.splitk import split_k_plan
from moeserve.kernels.runtime import interpreting

TABLE = "w16_gemv"
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
K_ALIGN = 8  # elements of one 16-byte vector load: K must be a multiple (rows stay aligned)
MAX_ROWS = 4  # x rows one weight pass serves (the kernel holds one accumulator per row)
MIN_BLOCK_N = 4  # smallest BLOCK_N a workspace's counters are sized for
MAX_NORM_SEGMENTS = 4
NORM_BLOCK_MAX = 4096  # segment columns the normalising program holds per row at once
TILE_COUNTERS_AT = 1  # counters[0] counts a call's finished tiles, counters[1 + t] tile t's splits
# the same for jitted code (which may read constexpr globals only)
_K_ALIGN = tl.constexpr(K_ALIGN)
_TILE_COUNTERS_AT = tl.constexpr(TILE_COUNTERS_AT)


@dataclass(frozen=True)
class NormSegment:
    """Columns [start, start + width) of each output row, RMS-normalised with `weight` [width]
    (any float dtype, contiguous) and `eps`."""

    start: int
    width: int
    weight: torch.Tensor
    eps: float


@dataclass(frozen=True)
class W16Workspace:
    """Zeroed fp32 buffer (split-K partials [split, T, N], then pre-norm rows [T, N]) and int32
    counters ([0]: finished tiles of the call, [1 + t]: split-K arrivals at tile t). Every
    launch leaves the counters at zero; the fp32 contents need no zeroing."""

    buffer: torch.Tensor
    counters: torch.Tensor

    @staticmethod
    def allocate(max_rows: int, n: int, max_split: int, device: torch.device | str) -> W16Workspace:
        """Room for calls of up to `max_rows` rows, `n` output columns and `max_split` splits."""
        return W16Workspace(
            torch.zeros((max_split + 1) * max_rows * n, dtype=torch.float32, device=device),
            torch.zeros(TILE_COUNTERS_AT + triton.cdiv(n, MIN_BLOCK_N), dtype=torch.int32,
                        device=device),
        )  # fmt: skip

    @staticmethod
    def for_shape(
        n: int,
        k: int,
        device: torch.device | str,
        rows: int | None = None,
        config: dict[str, int] | None = None,
    ) -> W16Workspace:
        """A workspace for every call on a weight [n, k] with up to `rows` rows (default: the
        table's max_m) under the tile table (or `config` over it)."""
        device = torch.device(device)
        top = max(1, max_rows(TABLE, f"{n}x{k}") if rows is None else rows)
        split = max(planned_split(m, n, k, device, config) for m in range(1, top + 1))
        return W16Workspace.allocate(top, n, split, device)

    def fits(self, rows: int, n: int, split: int) -> bool:
        """True when a call with `rows` rows, `n` columns and `split` K-splits fits."""
        floats = (split + 1) * rows * n
        counters = TILE_COUNTERS_AT + triton.cdiv(n, MIN_BLOCK_N)
        return self.buffer.numel() >= floats and self.counters.numel() >= counters


def _config(rows: int, n: int, k: int, config: dict[str, int] | None) -> dict[str, int]:
    return {**tile_config(TABLE, rows, f"{n}x{k}"), **(config or {})}


def _plan(cfg: dict[str, int], n: int, k: int, device: torch.device) -> tuple[int, int, int]:
    """(output tiles, K-splits, K tiles per split) of a launch."""
    tiles = triton.cdiv(n, cfg["BLOCK_N"])
    split, k_iters = split_k_plan(cfg["SPLIT_K"], tiles, triton.cdiv(k, cfg["BLOCK_K"]), device)
    return tiles, split, k_iters


def planned_split(
    rows: int, n: int, k: int, device: torch.device, config: dict[str, int] | None = None
) -> int:
    """The number of K-splits a call of this shape launches (what a workspace must hold)."""
    return _plan(_config(rows, n, k, config), n, k, device)[1]


def w16_gemv_rows(n: int, k: int) -> int:
    """Most rows the GEMV serves for a weight [n, k] (0: the table leaves that shape to
    cuBLAS)."""
    return min(MAX_ROWS, max_rows(TABLE, f"{n}x{k}"))


def w16_gemv_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True when `w16_gemv(x, w)` serves this product: 16-bit x and W of one dtype, 2-D,
    matching K that is a multiple of 8, at most the table's max_m rows, on CUDA (or under the
    interpreter)."""
    if x.dim() != 2 or w.dim() != 2 or x.dtype not in SUPPORTED_DTYPES or w.dtype != x.dtype:
        return False
    n, k = w.shape
    if x.shape[1] != k or k % K_ALIGN:
        return False
    if x.shape[0] > w16_gemv_rows(n, k):
        return False
    return (x.is_cuda and w.is_cuda) or interpreting()


# ---- kernels ------------------------------------------------------------------------------------
@triton.jit
def _fma_row(acc, w, x_row, kk, K, K_FOLD: tl.constexpr, EVEN_K: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K / K_FOLD] += w [BLOCK_N, BLOCK_K] * x[kk], each K_FOLD adjacent
    products summed first (K_FOLD = one thread's vector: the sum stays inside the thread)."""
    if EVEN_K:
        xv = tl.load(x_row + kk)
    else:
        xv = tl.load(x_row + kk, mask=kk < K, other=0.0)
    p = w * xv.to(tl.float32)[None, :]
    if K_FOLD > 1:
        p = tl.sum(tl.reshape(p, (p.shape[0], p.shape[1] // K_FOLD, K_FOLD)), axis=2)
    return acc + p


@triton.jit
def _row_dots(
    x_ptr, stride_xm, w_ptr, offs_n, N, K, k_begin,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr,
    STAGES: tl.constexpr, K_FOLD: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """Dot products of weight rows offs_n with the ROWS x rows over K_ITERS tiles from column
    k_begin: four [BLOCK_N] fp32 vectors (rows past ROWS are zero)."""
    # rows past N re-read row N - 1 (their results are never stored): no mask along N
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    # the row stride as a visible multiple of K_ALIGN, so that the loads are 16-byte vectors
    # even where K itself is not specialised as a multiple of 16
    w_rows = w_ptr + rows[:, None] * ((K // _K_ALIGN) * _K_ALIGN)
    x0 = x_ptr
    x1 = x_ptr + stride_xm
    x2 = x_ptr + 2 * stride_xm
    x3 = x_ptr + 3 * stride_xm
    zero = tl.zeros((BLOCK_N, BLOCK_K // K_FOLD), dtype=tl.float32)
    a0, a1, a2, a3 = zero, zero, zero, zero
    for it in tl.range(0, K_ITERS, num_stages=STAGES if STAGES > 0 else None):
        kk = k_begin + it * BLOCK_K + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_rows + kk[None, :])
        else:
            w = tl.load(w_rows + kk[None, :], mask=kk[None, :] < K, other=0.0)
        w = w.to(tl.float32)
        a0 = _fma_row(a0, w, x0, kk, K, K_FOLD, EVEN_K)
        if ROWS > 1:
            a1 = _fma_row(a1, w, x1, kk, K, K_FOLD, EVEN_K)
        if ROWS > 2:
            a2 = _fma_row(a2, w, x2, kk, K, K_FOLD, EVEN_K)
        if ROWS > 3:
            a3 = _fma_row(a3, w, x3, kk, K, K_FOLD, EVEN_K)
    return tl.sum(a0, axis=1), tl.sum(a1, axis=1), tl.sum(a2, axis=1), tl.sum(a3, axis=1)


@triton.jit
def _store_rows(ptr, stride, v0, v1, v2, v3, mask, ROWS: tl.constexpr):
    """Rows r < ROWS of (v0..v3) at ptr + r * stride, as ptr's dtype."""
    tl.store(ptr, v0.to(ptr.dtype.element_ty), mask=mask)
    if ROWS > 1:
        tl.store(ptr + stride, v1.to(ptr.dtype.element_ty), mask=mask)
    if ROWS > 2:
        tl.store(ptr + 2 * stride, v2.to(ptr.dtype.element_ty), mask=mask)
    if ROWS > 3:
        tl.store(ptr + 3 * stride, v3.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_exchange(
    v0, v1, v2, v3, part_ptr, cnt_ptr, offs_n, n_ok, N,
    ROWS: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """Split-K meeting of one output tile (grid axis 0) over its SPLIT_K programs (axis 1):
    each stores its partials in part_ptr [SPLIT_K, ROWS, N] and arrives at the tile's counter;
    the last to arrive gets (True, the partials summed in split order) and zeroes the counter,
    the others (False, _)."""
    tile = tl.program_id(0)
    mine = part_ptr + tl.program_id(1) * ROWS * N + offs_n
    _store_rows(mine, N, v0, v1, v2, v3, n_ok, ROWS)
    tl.debug_barrier()  # every thread's partials precede the release below
    counter = cnt_ptr + _TILE_COUNTERS_AT + tile
    last = tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1
    t0 = tl.zeros_like(v0)
    t1, t2, t3 = t0, t0, t0
    if last:
        for j in tl.static_range(SPLIT_K):
            # .cg: other SMs wrote these; read them from L2, never from a stale L1 line
            p = part_ptr + j * ROWS * N + offs_n
            t0 += tl.load(p, mask=n_ok, other=0.0, cache_modifier=".cg")
            if ROWS > 1:
                t1 += tl.load(p + N, mask=n_ok, other=0.0, cache_modifier=".cg")
            if ROWS > 2:
                t2 += tl.load(p + 2 * N, mask=n_ok, other=0.0, cache_modifier=".cg")
            if ROWS > 3:
                t3 += tl.load(p + 3 * N, mask=n_ok, other=0.0, cache_modifier=".cg")
        tl.store(counter, 0)
    return last, t0, t1, t2, t3


@triton.jit
def _w16_gemv_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr, cnt_ptr, N, K, stride_xm, stride_om,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    K_ITERS: tl.constexpr, STAGES: tl.constexpr, K_FOLD: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """out [ROWS, N] = x @ W^T: grid (cdiv(N, BLOCK_N), SPLIT_K), every program all rows."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k_begin = tl.program_id(1) * (K_ITERS * BLOCK_K)
    v0, v1, v2, v3 = _row_dots(x_ptr, stride_xm, w_ptr, offs_n, N, K, k_begin, ROWS, BLOCK_N,
                               BLOCK_K, K_ITERS, STAGES, K_FOLD, EVEN_K)  # fmt: skip
    if SPLIT_K == 1:
        _store_rows(out_ptr + offs_n, stride_om, v0, v1, v2, v3, n_ok, ROWS)
    else:
        last, v0, v1, v2, v3 = _split_exchange(v0, v1, v2, v3, part_ptr, cnt_ptr, offs_n, n_ok,
                                               N, ROWS, SPLIT_K)  # fmt: skip
        if last:
            _store_rows(out_ptr + offs_n, stride_om, v0, v1, v2, v3, n_ok, ROWS)


@triton.jit
def _normalize_segments(
    out_ptr, stride_om, rows_ptr, N, starts, widths, weights, epss,
    NSEG: tl.constexpr, ROWS: tl.constexpr, NORM_BLOCK: tl.constexpr, ONE_CHUNK: tl.constexpr,
):  # fmt: skip
    """Every segment of every row: the fp32 values in rows_ptr [ROWS, N] normalised into out.
    All rows of a segment go through one [ROWS_P, NORM_BLOCK] tile (one reduction each)."""
    ROWS_P: tl.constexpr = 1 if ROWS == 1 else (2 if ROWS == 2 else 4)
    offs_r = tl.arange(0, ROWS_P)
    offs_c = tl.arange(0, NORM_BLOCK)
    r_ok = offs_r[:, None] < ROWS
    src_rows = rows_ptr + offs_r[:, None] * N
    dst_rows = out_ptr + offs_r[:, None].to(tl.int64) * stride_om
    for s in tl.static_range(NSEG):
        start = starts[s]
        width = widths[s]
        src = src_rows + start
        dst = dst_rows + start
        if ONE_CHUNK:
            c_ok = offs_c < width
            wt = tl.load(weights[s] + offs_c, mask=c_ok, other=0.0).to(tl.float32)
            m = r_ok & c_ok[None, :]
            v = tl.load(src + offs_c[None, :], mask=m, other=0.0, cache_modifier=".cg")
            rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / width + epss[s])
            y = v * rstd[:, None] * wt[None, :]
            tl.store(dst + offs_c[None, :], y.to(out_ptr.dtype.element_ty), mask=m)
        else:
            sq = tl.zeros((ROWS_P, NORM_BLOCK), dtype=tl.float32)
            for c0 in range(0, width, NORM_BLOCK):
                cc = c0 + offs_c
                m = r_ok & (cc < width)[None, :]
                v = tl.load(src + cc[None, :], mask=m, other=0.0, cache_modifier=".cg")
                sq += v * v
            rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=1) / width + epss[s])
            for c0 in range(0, width, NORM_BLOCK):
                cc = c0 + offs_c
                c_ok = cc < width
                wt = tl.load(weights[s] + cc, mask=c_ok, other=0.0).to(tl.float32)
                m = r_ok & c_ok[None, :]
                v = tl.load(src + cc[None, :], mask=m, other=0.0, cache_modifier=".cg")
                y = v * rstd[:, None] * wt[None, :]
                tl.store(dst + cc[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _finish_norm_tile(
    v0, v1, v2, v3, out_ptr, stride_om, rows_ptr, cnt_ptr, offs_n, n_ok, N,
    starts, widths, weights, epss,
    NSEG: tl.constexpr, ROWS: tl.constexpr, NORM_BLOCK: tl.constexpr, ONE_CHUNK: tl.constexpr,
):  # fmt: skip
    """A finished tile's totals: columns outside every segment to out, segment columns (fp32)
    to the row buffer; the call's last tile to get here normalises all segments."""
    in_seg = offs_n < 0
    for s in tl.static_range(NSEG):
        in_seg = in_seg | ((offs_n >= starts[s]) & (offs_n < starts[s] + widths[s]))
    _store_rows(out_ptr + offs_n, stride_om, v0, v1, v2, v3, n_ok & (in_seg == 0), ROWS)
    _store_rows(rows_ptr + offs_n, N, v0, v1, v2, v3, n_ok & in_seg, ROWS)
    tl.debug_barrier()  # every thread's row-buffer stores precede the release below
    if tl.atomic_add(cnt_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        _normalize_segments(out_ptr, stride_om, rows_ptr, N, starts, widths, weights, epss,
                            NSEG, ROWS, NORM_BLOCK, ONE_CHUNK)  # fmt: skip
        tl.store(cnt_ptr, 0)


@triton.jit
def _w16_gemv_norm_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr, rows_ptr, cnt_ptr, N, K, stride_xm, stride_om,
    starts, widths, weights, epss,
    NSEG: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, K_ITERS: tl.constexpr, STAGES: tl.constexpr, K_FOLD: tl.constexpr,
    EVEN_K: tl.constexpr, NORM_BLOCK: tl.constexpr, ONE_CHUNK: tl.constexpr,
):  # fmt: skip
    """_w16_gemv_kernel with NSEG norm segments (tuples starts / widths / weights / epss)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k_begin = tl.program_id(1) * (K_ITERS * BLOCK_K)
    v0, v1, v2, v3 = _row_dots(x_ptr, stride_xm, w_ptr, offs_n, N, K, k_begin, ROWS, BLOCK_N,
                               BLOCK_K, K_ITERS, STAGES, K_FOLD, EVEN_K)  # fmt: skip
    if SPLIT_K == 1:
        _finish_norm_tile(v0, v1, v2, v3, out_ptr, stride_om, rows_ptr, cnt_ptr, offs_n, n_ok,
                          N, starts, widths, weights, epss, NSEG, ROWS, NORM_BLOCK,
                          ONE_CHUNK)  # fmt: skip
    else:
        last, v0, v1, v2, v3 = _split_exchange(v0, v1, v2, v3, part_ptr, cnt_ptr, offs_n, n_ok,
                                               N, ROWS, SPLIT_K)  # fmt: skip
        if last:
            _finish_norm_tile(v0, v1, v2, v3, out_ptr, stride_om, rows_ptr, cnt_ptr, offs_n,
                              n_ok, N, starts, widths, weights, epss, NSEG, ROWS, NORM_BLOCK,
                              ONE_CHUNK)  # fmt: skip


# ---- wrapper ------------------------------------------------------------------------------------
def _check_inputs(x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x must be bf16 or fp16, got {x.dtype}")
    if w.dtype != x.dtype:
        raise ValueError(f"w must have x's dtype {x.dtype}, got {w.dtype}")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, K] with a unit stride along K, got {tuple(x.shape)}")
    if w.dim() != 2 or w.shape[1] != x.shape[1] or not w.is_contiguous():
        raise ValueError(f"w must be contiguous [N, {x.shape[1]}], got {tuple(w.shape)}")
    if x.shape[1] % K_ALIGN:
        raise ValueError(f"K = {x.shape[1]} must be a multiple of {K_ALIGN}")
    if w.device != x.device:
        raise ValueError(f"w is on {w.device}, x on {x.device}")


def _check_out(out: torch.Tensor, x: torch.Tensor, n: int) -> None:
    t = x.shape[0]
    if out.dtype != x.dtype:
        raise ValueError(f"out must have x's dtype {x.dtype}, got {out.dtype}")
    if out.dim() != 2 or tuple(out.shape) != (t, n) or (n > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be [{t}, {n}] with a unit column stride, got "
                         f"{tuple(out.shape)}")  # fmt: skip
    if out.device != x.device:
        raise ValueError(f"out is on {out.device}, x on {x.device}")


def _check_norms(norms: tuple[NormSegment, ...], n: int, device: torch.device) -> None:
    if len(norms) > MAX_NORM_SEGMENTS:
        raise ValueError(f"at most {MAX_NORM_SEGMENTS} norm segments, got {len(norms)}")
    end = 0
    for seg in sorted(norms, key=lambda s: s.start):
        if seg.width <= 0 or seg.start < end or seg.start + seg.width > n:
            raise ValueError(f"norm segments must be disjoint, non-empty and inside [0, {n}): "
                             f"got [{seg.start}, {seg.start + seg.width})")  # fmt: skip
        end = seg.start + seg.width
        wt = seg.weight
        if wt.dim() != 1 or wt.shape[0] != seg.width or not wt.is_contiguous():
            raise ValueError(f"a segment's weight must be a contiguous [{seg.width}] vector, "
                             f"got {tuple(wt.shape)}")  # fmt: skip
        if not wt.is_floating_point() or wt.device != device:
            raise ValueError(f"a segment's weight must be a float tensor on {device}, got "
                             f"{wt.dtype} on {wt.device}")  # fmt: skip


def w16_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor | None = None,
    norms: tuple[NormSegment, ...] = (),
    workspace: W16Workspace | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """out [T, N] = x [T, K] @ w [N, K]^T (T <= the table's max_m, at most 4), then the RMSNorm
    of each `norms` segment (module docstring); returns out.

    x, w, out: one 16-bit dtype; w contiguous, K a multiple of 8; x and out need a unit column
    stride only (a column view of a wider buffer is fine). `workspace`: see W16Workspace
    (checked to fit; without one a zeroed one is allocated where the launch needs one).
    `config`: tile parameters over the table's (BLOCK_N, BLOCK_K, SPLIT_K (0: automatic),
    num_warps, num_stages, STAGES, K_FOLD)."""
    _check_inputs(x, w)
    t, k = x.shape
    n = w.shape[0]
    limit = min(MAX_ROWS, max_rows(TABLE, f"{n}x{k}"))
    if t > limit:
        raise ValueError(f"at most {limit} rows for a weight [{n}, {k}], got {t}")
    if out is None:
        out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    _check_out(out, x, n)
    norms = tuple(norms)
    _check_norms(norms, n, x.device)
    if t == 0 or n == 0:
        return out
    cfg = _config(t, n, k, config)
    bn, bk, k_fold = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg.get("K_FOLD", 1)
    if bn < MIN_BLOCK_N or bn & (bn - 1) or bk & (bk - 1) or bk % k_fold:
        raise ValueError(f"BLOCK_N {bn} (>= {MIN_BLOCK_N}) and BLOCK_K {bk} must be powers of "
                         f"two, K_FOLD {k_fold} must divide BLOCK_K")  # fmt: skip
    tiles, split, k_iters = _plan(cfg, n, k, x.device)
    buffer, counters = out, out  # placeholders: a launch without split-K or norms reads neither
    if split > 1 or norms:
        if workspace is None:
            workspace = W16Workspace.allocate(t, n, split, x.device)
        if not workspace.fits(t, n, split):
            raise ValueError(f"workspace too small for {t} rows, N = {n}, {split} splits")
        buffer, counters = workspace.buffer, workspace.counters
    common = dict(
        ROWS=t, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, K_ITERS=k_iters,
        STAGES=cfg.get("STAGES", 0), K_FOLD=k_fold, EVEN_K=int(split * k_iters * bk == k),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if not norms:
        _w16_gemv_kernel[(tiles, split)](
            x, w, out, buffer, counters, n, k, x.stride(0), out.stride(0), **common
        )
        return out
    widest = max(seg.width for seg in norms)
    norm_block = min(triton.next_power_of_2(widest), NORM_BLOCK_MAX)
    _w16_gemv_norm_kernel[(tiles, split)](
        x, w, out, buffer, buffer[split * t * n :], counters, n, k, x.stride(0), out.stride(0),
        tuple(seg.start for seg in norms), tuple(seg.width for seg in norms),
        tuple(seg.weight for seg in norms), tuple(float(seg.eps) for seg in norms),
        NSEG=len(norms), NORM_BLOCK=norm_block, ONE_CHUNK=int(widest <= norm_block), **common,
    )  # fmt: skip
    return out
