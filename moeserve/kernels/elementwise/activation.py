"""SiLU(gate) * up of a merged gate_up projection output, in one launch.

Layout: ``gu`` is ``[T, 2I]`` (gate columns, then up columns; last dim contiguous, any row
stride); the result is ``[T, I]``. Numerics: fp32 from the loaded values, rounded once to the
output dtype (torch's own ``F.silu(g) * u`` in bf16 rounds twice).
Launch shape depends only on tensor shapes: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per program: a decode row of a 2048-wide expert is two programs


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, stride_gu, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + inter + offs, mask=mask, other=0.0).to(tl.float32)
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_out + offs, h.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gu: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[T, 2I] -> [T, I] = silu(gate) * up (module docstring)."""
    if gu.dim() != 2 or gu.shape[1] % 2 or gu.stride(-1) != 1:
        raise ValueError(f"gu must be [T, 2I] with a unit last stride, got {tuple(gu.shape)}")
    tokens, inter = gu.shape[0], gu.shape[1] // 2
    if out is None:
        out = gu.new_empty(tokens, inter)
    if tuple(out.shape) != (tokens, inter) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{tokens}, {inter}] with a unit last stride")
    if tokens:
        _silu_mul_kernel[(tokens, triton.cdiv(inter, BLOCK))](
            gu, out, inter, gu.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4
        )
    return out
