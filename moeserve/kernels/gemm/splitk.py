"""What the weight-only GEMM and GEMV kernels (NVFP4, FP8 block, fused MoE) share that is not
the NVFP4 format: split-K over a zeroed fp32 workspace and the
exponent bias of the bf16 E2M1 decode.

Split-K: with few rows, one program per output tile leaves most SMs idle, so K is split over
programs that add fp32 partials into a workspace; the last program of a tile (counted by an
int32 lock) writes the output and re-zeroes both, so one workspace serves every sequential
call and CUDA-graph replay.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# The tensor-core decodes (nvfp4_gemm.py, nvfp4_gemv_mma.py, moe.py) produce E2M1 value *
# block scale * 2^-8: the scale is pre-multiplied by 2^118 so that it fits bf16
# (448 * 2^118 < 2^127) while the E2M1 bits land at 2^-126; the accumulator gets the 2^8 back.
# Jitted code may only read constexpr globals.
SCALE_BIAS_EXP = tl.constexpr(118)
ACC_FIX_EXP = tl.constexpr(8)  # 126 - SCALE_BIAS_EXP: applied once to the accumulator

CTAS_PER_SM_TARGET = 4  # split-K aims at this many programs per SM so HBM sees enough requests


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


def split_k_plan(cfg_split: int, tiles: int, k_tiles: int, device: torch.device) -> tuple[int, int]:
    """(programs per output tile, K tiles each): choose_split_k's split, rounded so that no
    program gets an empty K range."""
    k_iters = triton.cdiv(k_tiles, choose_split_k(cfg_split, tiles, k_tiles, device))
    return triton.cdiv(k_tiles, k_iters), k_iters


@triton.jit
def splitk_finish(acc, out_ptrs, ws_ptrs, lock_ptr, mask, SPLIT_K: tl.constexpr):
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
def dense_x_rows(x_ptr, row0, stride_xm, M):
    """The up to 4 x rows a GEMV program serves from row row0: (row pointers, row exists)."""
    x0 = x_ptr + row0.to(tl.int64) * stride_xm
    rows = (x0, x0 + stride_xm, x0 + 2 * stride_xm, x0 + 3 * stride_xm)
    return rows, (row0 < M, row0 + 1 < M, row0 + 2 < M, row0 + 3 < M)


@triton.jit
def slot_x_rows(x_ptr, slots, slots_per_row: tl.constexpr, stride, Mk):
    """The x rows of a MoE block's 4 slots (row = slot // slots_per_row; padding slots are
    Mk): (row pointers, slot is real)."""
    s0, s1, s2, s3 = slots
    rows = (
        x_ptr + (s0 // slots_per_row).to(tl.int64) * stride,
        x_ptr + (s1 // slots_per_row).to(tl.int64) * stride,
        x_ptr + (s2 // slots_per_row).to(tl.int64) * stride,
        x_ptr + (s3 // slots_per_row).to(tl.int64) * stride,
    )
    return rows, (s0 < Mk, s1 < Mk, s2 < Mk, s3 < Mk)
