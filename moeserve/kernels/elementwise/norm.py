"""RMSNorm kernels: plain, fused with the residual add, and MLA's two a-norms in one launch.

Numerics (the torch references below are the oracle): each row is normalised in fp32,
    y = (x * rsqrt(mean(x^2) + eps) * weight) rounded once to the output dtype,
with x upcast to fp32. With a residual, s = x + residual is computed in fp32 and rounded to
the activation dtype first (that rounded sum is ``residual_out`` and is what gets normalised,
exactly as ``x = x + residual; rms_norm(x)`` in the activation dtype does).

Layouts: rows are ``[T, N]`` with the last dim contiguous and any row stride (a column slice
of a wider buffer is fine). Outputs may alias their inputs (``out=x``, ``residual_out=
residual``): each program reads its whole row segment before writing it.

``rms_norm_pair`` normalises two column ranges of each row with their own weights in one
launch: MLA's q_a_layernorm (cols ``[0, n_a)``) and kv_a_layernorm (cols ``[n_a, n_a+n_b)``)
on the merged q_a + kv_a projection output, whose remaining columns (the rope part of the
key) are copied through unchanged (nothing to do when writing in place).

All launches depend only on tensor shapes: CUDA-graph capturable with no host syncs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.pdl import pdl_launch, pdl_start

# a row is held in registers: beyond this many columns the block would spill
MAX_COLS = 32768


def _num_warps(block: int) -> int:
    # ~16-32 fp32 values per thread; more warps keep more loads in flight at batch 1
    return max(1, min(16, block // 256))


@triton.jit
def _norm_segment(x_row, y_row, w_ptr, n_cols, eps, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # HBM latency first
    x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(y_row + offs, (x * rstd * w).to(y_row.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    y_ptr,
    ro_ptr,
    stride_x,
    stride_r,
    stride_y,
    stride_ro,
    n_cols,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    # the weight first: at batch 1 it comes from HBM (the step's GEMVs evicted it from L2),
    # and its latency then overlaps the activation loads and the reduction (and, with PDL,
    # the previous kernel's drain)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    z = pdl_start(PDL)
    x_ptr += z
    r_ptr += z
    y_ptr += z
    ro_ptr += z
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(ro_ptr.dtype.element_ty)
        tl.store(ro_ptr + row * stride_ro + offs, s, mask=mask)
        x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    y = x * rstd * w
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_pair_kernel(
    x_ptr,
    wa_ptr,
    wb_ptr,
    y_ptr,
    stride_x,
    stride_y,
    n_a,
    n_b,
    n_rest,
    eps_a,
    eps_b,
    BLOCK_A: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # grid (T, 2 or 3): segment a, segment b, and (out of place only) the pass-through copy
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    if seg == 0:
        _norm_segment(x_row, y_row, wa_ptr, n_a, eps_a, BLOCK_A)
    elif seg == 1:
        _norm_segment(x_row + n_a, y_row + n_a, wb_ptr, n_b, eps_b, BLOCK_B)
    else:
        offs = tl.arange(0, BLOCK_R)
        mask = offs < n_rest
        v = tl.load(x_row + n_a + n_b + offs, mask=mask, other=0.0)
        tl.store(y_row + n_a + n_b + offs, v.to(y_ptr.dtype.element_ty), mask=mask)


# ---- checks -------------------------------------------------------------------------------------
def _check_rows(name: str, t: torch.Tensor, rows: int, cols: int) -> None:
    if t.dim() != 2 or tuple(t.shape) != (rows, cols) or (cols > 1 and t.stride(1) != 1):
        raise ValueError(
            f"{name} must be [{rows}, {cols}] with a contiguous last dim, got {tuple(t.shape)}"
        )


def _check_weight(name: str, w: torch.Tensor, cols: int) -> None:
    if w.shape != (cols,) or not w.is_contiguous():
        raise ValueError(f"{name} must be a contiguous [{cols}] vector, got {tuple(w.shape)}")


def _check_x(x: torch.Tensor) -> tuple[int, int]:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, N], got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a float tensor, got {x.dtype}")
    rows, cols = x.shape
    if cols > MAX_COLS:
        raise ValueError(f"rows of more than {MAX_COLS} columns are not supported")
    _check_rows("x", x, rows, cols)
    return rows, cols


# ---- wrappers -----------------------------------------------------------------------------------
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """RMSNorm of each row of ``x [T, N]``; writes ``out`` (default: a new tensor like x).
    ``pdl``: launched with programmatic dependent launch (kernels/pdl.py)."""
    rows, cols = _check_x(x)
    _check_weight("weight", weight, cols)
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    _check_rows("out", out, rows, cols)
    if rows == 0:
        return out
    block = triton.next_power_of_2(cols)
    _rms_norm_kernel[(rows,)](
        x, x, weight, out, out,
        x.stride(0), 0, out.stride(0), 0,
        cols, float(eps),
        HAS_RES=False, BLOCK=block, PDL=pdl_launch(pdl), num_warps=_num_warps(block),
        launch_pdl=pdl_launch(pdl),
    )  # fmt: skip
    return out


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) in one launch; the sum is computed in fp32 and
    stored in the activation dtype. ``out=x`` / ``residual_out=residual`` write in place."""
    rows, cols = _check_x(x)
    _check_rows("residual", residual, rows, cols)
    if residual.dtype != x.dtype:
        raise TypeError(f"residual dtype {residual.dtype} differs from x's {x.dtype}")
    _check_weight("weight", weight, cols)
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    if residual_out is None:
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _check_rows("out", out, rows, cols)
    _check_rows("residual_out", residual_out, rows, cols)
    if rows == 0:
        return out, residual_out
    block = triton.next_power_of_2(cols)
    _rms_norm_kernel[(rows,)](
        x, residual, weight, out, residual_out,
        x.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0),
        cols, float(eps),
        HAS_RES=True, BLOCK=block, PDL=pdl_launch(pdl), num_warps=_num_warps(block),
        launch_pdl=pdl_launch(pdl),
    )  # fmt: skip
    return out, residual_out


def rms_norm_pair(
    x: torch.Tensor,
    weight_a: torch.Tensor,
    weight_b: torch.Tensor,
    eps_a: float,
    eps_b: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Columns ``[0, n_a)`` of each row of ``x [T, n_a + n_b + rest]`` normalised with
    ``weight_a [n_a]``, ``[n_a, n_a + n_b)`` with ``weight_b [n_b]``, the rest copied through.
    ``out=x`` normalises in place (the rest is then left as it is)."""
    rows, cols = _check_x(x)
    n_a, n_b = weight_a.shape[0], weight_b.shape[0]
    n_rest = cols - n_a - n_b
    if weight_a.dim() != 1 or weight_b.dim() != 1 or n_rest < 0:
        raise ValueError(f"weights of {n_a} + {n_b} columns do not fit rows of {cols}")
    _check_weight("weight_a", weight_a, n_a)
    _check_weight("weight_b", weight_b, n_b)
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    _check_rows("out", out, rows, cols)
    if rows == 0:
        return out
    in_place = out.data_ptr() == x.data_ptr() and out.stride() == x.stride()
    segments = 2 if in_place or n_rest == 0 else 3
    block_a, block_b = triton.next_power_of_2(n_a), triton.next_power_of_2(n_b)
    _rms_norm_pair_kernel[(rows, segments)](
        x, weight_a, weight_b, out,
        x.stride(0), out.stride(0),
        n_a, n_b, n_rest, float(eps_a), float(eps_b),
        BLOCK_A=block_a, BLOCK_B=block_b, BLOCK_R=triton.next_power_of_2(max(n_rest, 1)),
        num_warps=_num_warps(max(block_a, block_b)),
    )  # fmt: skip
    return out


# ---- torch references ---------------------------------------------------------------------------
def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """torch reference of :func:`rms_norm` (same formula, fp32 throughout)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (xf * rstd * weight.float()).to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch reference of :func:`add_rmsnorm`."""
    s = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(s, weight, eps), s


def rms_norm_pair_ref(
    x: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor, eps_a: float, eps_b: float
) -> torch.Tensor:
    """torch reference of :func:`rms_norm_pair` (returns a new tensor)."""
    n_a, n_b = weight_a.shape[0], weight_b.shape[0]
    a, b, rest = x.split([n_a, n_b, x.shape[1] - n_a - n_b], dim=1)
    return torch.cat(
        [rms_norm_ref(a, weight_a, eps_a), rms_norm_ref(b, weight_b, eps_b), rest], dim=1
    )
