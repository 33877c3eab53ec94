"""MLA decode attention in Gluon for Hopper (sm_90): TMA-fed KV ring + wgmma.

Same contract as :func:`moeserve.kernels.attention.mla_decode.mla_decode` (read its module docstring
for the layouts, split-KV and CUDA-graph rules): ``q [B, H, 576]``, a paged latent cache
``kv_cache [pages, page_size, 576]`` (BF16), ``block_tables [B, max_pages]`` int32,
``seq_lens [B]`` int32, ``out [B, H, 512]``; per-split partials live in the same
:class:`MLADecodeWorkspace` and are merged by mla_decode's own merge kernel.

Why a second kernel: Triton 3.6 does not overlap the KV-tile loads with the MMAs of the
Triton kernel (benchmarks/results/kernels_mla_analysis.md). Here the overlap is explicit:

- KV tiles of 64 tokens (one page slice each, the page id read from the block table one
  tile ahead) are copied by TMA into a two-slot shared-memory ring, each slot guarded by an
  mbarrier: tile t+1 streams in while tile t is multiplied.
- Both products run on ``warpgroup_mma`` (wgmma) with fp32 accumulators; online softmax
  in the log2 domain as in the Triton kernel; the softmax denominators are accumulated
  element-wise and reduced once after the loop.
- More than 16 heads (``_mla_decode_gluon_kernel``): one program = (64-head block, KV
  split, sequence), 8 warps. ``scores = q @ k^T`` with heads on wgmma's M (padded to 64);
  the two warpgroups split the tile's tokens for the scores and the 512 value columns for
  ``acc += p @ v`` (p goes through shared memory). q (72 KB) + two 72 KB slots fill the
  227 KB of shared memory. The output leaves through shared memory as 16-byte stores.
- Up to 16 heads (``_mla_decode_gluon_small_kernel``): one warpgroup, tokens and values
  on wgmma's M and the (up to) 16 heads on N: ``scores^T = k @ q^T``,
  ``out^T += v^T @ p^T``. A quarter of the tensor work and operand reads of padding the
  heads to 64 rows; at batch >= 8 it streams the cache at ~85-100% of 4.3 TB/s.

The rows of a tile past ``seq_len`` are whatever the cache holds (possibly NaN); their
scores are masked to -inf, and the last tile's value rows past ``seq_len`` are zeroed in
shared memory first, because 0 * NaN would otherwise poison the p @ v product.

Splits follow mla_decode's active-split rule and output contract (its module docstring)
with this kernel's tile (``GluonMLAConfig.block_n``) and ``GluonMLAConfig.min_split_tokens``
(default one tile per split): a sequence with at most one active split is written to
``out`` by split 0 (zeros when empty) and the merge skips it; only active splits of a
longer one write partials and lse; inactive splits return at once and write nothing.

Supported (:func:`gluon_mla_supported`): a CUDA sm_90 device, BF16 cache, page_size a
multiple of 64, pages laid out back to back (the cache viewed as one
``[pages * page_size, 576]`` matrix for the TMA descriptor), 16-byte aligned. Anything else
(FP8 caches included) keeps the Triton kernel.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from moeserve.kernels.attention.mla_decode import (
    KV_LORA_RANK,
    LATENT_DIM,
    LOG2E,
    MAX_SPLITS,
    MERGE_CHUNK,
    MERGE_MIN_D_BLOCK,
    ROPE_DIM,
    MLADecodeWorkspace,
    check_decode_inputs,
    device_sm_count,
    launch_merge,
    merge_blocks,
    min_split_tiles,
    mla_decode_ref,
    split_partials,
)

log = logging.getLogger(__name__)

try:  # Gluon is experimental: any import problem means "not supported", never a crash.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _GLUON_OK = True
except Exception:  # noqa: BLE001 (any failure disables the path)
    _GLUON_OK = False

# what gluon_mla_supported asks of the device and the cache (also read by moeserve plan)
GLUON_CAPABILITY = (9, 0)
GLUON_PAGE_MULTIPLE = 64

# wgmma's M is 64 rows per warpgroup: heads are padded to a 64-row block.
BLOCK_H = 64
NUM_WARPS = 8  # two warpgroups: one per half of the 512 value columns
# Few-head kernel: heads on wgmma's N (16 columns) instead of padded to 64 rows.
SMALL_BLOCK_H = 16
SMALL_NUM_WARPS = 4
SMALL_BLOCK_N = 64  # its tile's tokens are the 64 rows of one warpgroup's wgmma
# Shared memory one block may use on an H100/H200 (227 KB).
SMEM_LIMIT_BYTES = 232_448
# TMA needs 16-byte aligned global addresses and strides.
_TMA_ALIGN_BYTES = 16
# A split streams at least one tile: at batch 1 / 4k, one tile per program (64 splits) beat
# two (benchmarks/results/kernels_mla_gluon.md, split variants). This bounds the static
# split count; the per-sequence bound inside the kernels defaults to one tile for the same
# reason (GluonMLAConfig.min_split_tokens).
_MIN_TOKENS_PER_SPLIT = 64
# Merge launch for many splits of one head (see _merge_launch).
_MERGE_MANY_SPLITS = 32
_MERGE_FINE_CHUNK = 32
_MERGE_FINE_D_BLOCK = 64
_MERGE_FINE_MAX_PROGRAMS = 1024
# prefer_gluon's measured boundaries
_GLUON_MIN_CAPACITY = 4096
_GLUON_MIN_BATCH_MANY_HEADS = 8


def _nvmma_layout(block_shape: list[int]):
    return gl.NVMMASharedLayout.get_default_for(block_shape, gl.bfloat16)


if _GLUON_OK:

    @gluon.jit
    def _tile_row(bt_row, tile, page_size, valid, BLOCK_N: gl.constexpr):
        """Cache row (page * page_size + offset) where KV tile ``tile`` starts; 0 when not
        ``valid`` (then the block table is not read: entries past a sequence are garbage)."""
        start = tile * BLOCK_N
        page = gl.load(bt_row + start // page_size, mask=valid, other=0)
        return page * page_size + start % page_size

    @gluon.jit
    def _split_tiles(seq_len, num_splits, BLOCK_N: gl.constexpr, MIN_SPLIT_TILES: gl.constexpr):
        """(tiles per split, active splits) of one sequence: mla_decode's ``_split_tiles``
        rule, which the merge kernel applies to find the partials."""
        n_tiles = gl.cdiv(seq_len, BLOCK_N)
        tiles_per_split = gl.maximum(gl.cdiv(n_tiles, num_splits), MIN_SPLIT_TILES)
        return tiles_per_split, gl.cdiv(n_tiles, tiles_per_split)

    @gluon.jit
    def _output_base(
        to_out, out_ptr, po_ptr, b, split, stride_ob, stride_oh, stride_pob, stride_poh,
        stride_pos,
    ):  # fmt: skip
        """(base pointer, head stride) of this program's output rows: the sequence's rows of
        out, or its split's partial slot (out and partials of one dtype). One store with a
        runtime destination instead of a store per destination: the second store path
        cost the 64-row kernel 12 bytes of spills (ptxas, sm_90a)."""
        if to_out:
            dst = out_ptr + b.to(gl.int64) * stride_ob
            dst_h = stride_oh
        else:
            dst = po_ptr + b.to(gl.int64) * stride_pob + split * stride_pos
            dst_h = stride_poh
        return dst, dst_h

    @gluon.jit
    def _issue_tile(lat_desc, pe_desc, row, bar, lat_dst, pe_dst):
        """TMA copy of the KV tile starting at cache row ``row`` into a ring slot."""
        mbarrier.expect(bar, lat_desc.block_type.nbytes + pe_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(lat_desc, [row, 0], bar, lat_dst)
        tma.async_copy_global_to_shared(pe_desc, [row, 0], bar, pe_dst)

    @gluon.jit
    def _start_ring(
        bars, lat_desc, pe_desc, k_lat_s, k_pe_s, bt_row, tile_lo, n_local, page_size,
        NUM_STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
    ):  # fmt: skip
        """Initialise the ring's mbarriers and issue its first NUM_STAGES tiles."""
        for st in gl.static_range(NUM_STAGES):
            mbarrier.init(bars.index(st), count=1)
        for st in gl.static_range(NUM_STAGES):
            if st < n_local:
                row = _tile_row(bt_row, tile_lo + st, page_size, True, BLOCK_N)
                _issue_tile(lat_desc, pe_desc, row, bars.index(st), k_lat_s.index(st),
                            k_pe_s.index(st))  # fmt: skip

    @gluon.jit
    def _stage_q(
        q_ptr, b, hg, stride_qb, stride_qh, num_heads, q_lat_s, q_pe_s,
        layout: gl.constexpr, BLOCK_H: gl.constexpr, D_LAT: gl.constexpr, D_ROPE: gl.constexpr,
    ):  # fmt: skip
        """q of head block hg -> bf16 in shared memory (rows past num_heads are zeros:
        finite scores, never stored), fenced for the async (wgmma) proxy."""
        offs_qh = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))
        offs_ql = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, layout))
        offs_qr = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, layout))
        q_rows = q_ptr + b.to(gl.int64) * stride_qb + offs_qh[:, None] * stride_qh
        qh_ok = offs_qh[:, None] < num_heads
        q_lat = gl.load(q_rows + offs_ql[None, :], mask=qh_ok, other=0.0)
        q_lat_s.store(q_lat.to(gl.bfloat16))
        q_pe = gl.load(q_rows + D_LAT + offs_qr[None, :], mask=qh_ok, other=0.0)
        q_pe_s.store(q_pe.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _mla_decode_gluon_kernel(
        q_ptr,
        lat_desc,  # [pages * page_size, 512] view of the cache, block [BLOCK_N, 512]
        pe_desc,  # [pages * page_size, 64] view (the rope columns), block [BLOCK_N, 64]
        bt_ptr,
        seq_lens_ptr,
        out_ptr,
        po_ptr,
        pl_ptr,
        qk_scale,  # sm_scale * log2(e)
        num_heads,
        stride_qb,
        stride_qh,
        page_size,
        stride_btb,
        stride_ob,
        stride_oh,
        stride_pob,
        stride_poh,
        stride_pos,
        stride_plb,
        stride_plh,
        BLOCK_H: gl.constexpr,
        BLOCK_N: gl.constexpr,
        D_LAT: gl.constexpr,
        D_ROPE: gl.constexpr,
        NUM_STAGES: gl.constexpr,
        DIRECT_OUT: gl.constexpr,  # num_splits == 1: no partial path compiled
        BF16_OUT: gl.constexpr,  # out and the partials (either may be written) are bf16
        MIN_SPLIT_TILES: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        hg = gl.program_id(0)
        split = gl.program_id(1)
        b = gl.program_id(2)
        num_splits = gl.num_programs(1)

        seq_len = gl.load(seq_lens_ptr + b)
        n_tiles = gl.cdiv(seq_len, BLOCK_N)
        tiles_per_split, n_active = _split_tiles(seq_len, num_splits, BLOCK_N, MIN_SPLIT_TILES)
        # Inactive splits are never read by the merge: leave before staging q. Split 0 of
        # an empty sequence stays to write its zeros.
        if split >= gl.maximum(n_active, 1):
            return
        tile_lo = split * tiles_per_split
        n_local = gl.maximum(gl.minimum(tile_lo + tiles_per_split, n_tiles) - tile_lo, 0)

        # Warpgroup layouts: both warpgroups own all 64 head rows; they split the score
        # columns (tokens) and the output columns (values).
        WG_N: gl.constexpr = num_warps // 4
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, WG_N], instr_shape=[16, BLOCK_N // WG_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, WG_N], instr_shape=[16, D_LAT // WG_N, 16]
        )
        ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
        lat_sl: gl.constexpr = lat_desc.layout
        pe_sl: gl.constexpr = pe_desc.layout
        p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16)

        q_lat_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_LAT], lat_sl)
        q_pe_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_ROPE], pe_sl)
        k_lat_s = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BLOCK_N, D_LAT], lat_sl)
        k_pe_s = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BLOCK_N, D_ROPE], pe_sl)
        p_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], p_sl)
        bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        bt_row = bt_ptr + b.to(gl.int64) * stride_btb
        # Start the ring before anything else, so the first tiles' HBM latency overlaps
        # the q staging.
        _start_ring(bars, lat_desc, pe_desc, k_lat_s, k_pe_s, bt_row, tile_lo, n_local,
                    page_size, NUM_STAGES, BLOCK_N)  # fmt: skip
        _stage_q(q_ptr, b, hg, stride_qb, stride_qh, num_heads, q_lat_s, q_pe_s, ld_layout,
                 BLOCK_H, D_LAT, D_ROPE)  # fmt: skip

        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_l: gl.constexpr = gl.SliceLayout(0, s_layout)
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, row_l)
        # Softmax denominators kept per score element and summed over the row only once,
        # after the loop: the row sum spans both warpgroups, and a per-tile cross-warpgroup
        # reduction costs three CTA barriers.
        l_2d = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
        acc = gl.zeros([BLOCK_H, D_LAT], gl.float32, o_layout)
        s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
        offs_n = gl.arange(0, BLOCK_N, layout=col_l)
        offs_zn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_layout))

        for i in range(n_local):
            stage = i % NUM_STAGES
            # The page id of the tile that refills this slot, read now so that its global
            # load latency hides behind this tile's MMAs instead of stalling the refill.
            nxt = i + NUM_STAGES
            nxt_row = _tile_row(bt_row, tile_lo + nxt, page_size, nxt < n_local, BLOCK_N)
            mbarrier.wait(bars.index(stage), (i // NUM_STAGES) & 1)
            k_lat = k_lat_s.index(stage)
            k_pe = k_pe_s.index(stage)
            tok0 = (tile_lo + i) * BLOCK_N
            n_valid = seq_len - tok0
            if n_valid < BLOCK_N:
                # Last, partial tile: rows past seq_len may hold NaN (p = 0 does not cancel
                # NaN in p @ v), so zero them; their scores are masked below.
                v = k_lat.load(ld_layout)
                k_lat.store(gl.where(offs_zn[:, None] < n_valid, v, gl.zeros_like(v)))
                fence_async_shared()
                gl.thread_barrier()

            s = warpgroup_mma(q_lat_s, k_lat.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(q_pe_s, k_pe.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=[s])

            s = gl.where((offs_n < n_valid)[None, :], s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - m_new[:, None])
            l_2d = l_2d * alpha[:, None] + p
            m_i = m_new
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]

            p_s.store(p.to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()
            acc = warpgroup_mma(p_s, k_lat, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            # Both warpgroups are done with this slot and with p before either is reused.
            gl.thread_barrier()
            if nxt < n_local:
                _issue_tile(lat_desc, pe_desc, nxt_row, bars.index(stage), k_lat, k_pe)

        for st in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(bars.index(st))

        # Empty sequence (only its split 0 gets here): l_i == 0 -> zeros.
        l_i = gl.sum(l_2d, axis=1)
        has = l_i > 0.0
        inv_l = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
        o = acc * gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout))[:, None]
        if BF16_OUT:
            # Through shared memory (q's buffer is free now): from the wgmma accumulator
            # layout each store would be 4 bytes per row; this way each is a 16-byte vector.
            q_lat_s.store(o.to(gl.bfloat16))
            gl.thread_barrier()
            o_st = q_lat_s.load(ld_layout)
            offs_sh = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld_layout))
            offs_sd = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, ld_layout))
        else:  # out or the partials are not bf16: no bf16 rounding, store from the wgmma layout
            o_st = o
            offs_sh = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
            offs_sd = gl.arange(0, D_LAT, layout=gl.SliceLayout(0, o_layout))
        sh_ok = offs_sh[:, None] < num_heads
        if DIRECT_OUT:
            to_out: gl.constexpr = True  # the one-split build carries no partial path
        else:
            to_out = n_active <= 1  # the whole sequence is in this split: nothing to merge
        if out_ptr.dtype == po_ptr.dtype:
            dst, dst_h = _output_base(to_out, out_ptr, po_ptr, b, split, stride_ob, stride_oh,
                                      stride_pob, stride_poh, stride_pos)  # fmt: skip
            dst = dst + offs_sh[:, None] * dst_h + offs_sd[None, :]
            gl.store(dst, o_st.to(dst.dtype.element_ty), mask=sh_ok)
        elif to_out:  # a caller's workspace of another dtype: a store per destination
            o_ptrs = out_ptr + b.to(gl.int64) * stride_ob + offs_sh[:, None] * stride_oh
            gl.store(o_ptrs + offs_sd[None, :], o_st.to(out_ptr.dtype.element_ty), mask=sh_ok)
        else:
            po = po_ptr + b.to(gl.int64) * stride_pob + split * stride_pos
            po = po + offs_sh[:, None] * stride_poh + offs_sd[None, :]
            gl.store(po, o_st.to(po_ptr.dtype.element_ty), mask=sh_ok)
        if not to_out:
            lse = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
            offs_lh = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_l)
            pl = pl_ptr + b.to(gl.int64) * stride_plb + offs_lh * stride_plh + split
            gl.store(pl, lse, mask=offs_lh < num_heads)


if _GLUON_OK:

    @gluon.jit
    def _mla_decode_gluon_small_kernel(
        q_ptr,
        lat_desc,
        pe_desc,
        bt_ptr,
        seq_lens_ptr,
        out_ptr,
        po_ptr,
        pl_ptr,
        qk_scale,
        num_heads,
        stride_qb,
        stride_qh,
        page_size,
        stride_btb,
        stride_ob,
        stride_oh,
        stride_pob,
        stride_poh,
        stride_pos,
        stride_plb,
        stride_plh,
        BLOCK_H: gl.constexpr,  # heads per program: 16 (the wgmma N of both products)
        BLOCK_N: gl.constexpr,  # tokens per tile: 64 (the wgmma M of the scores)
        D_LAT: gl.constexpr,
        D_ROPE: gl.constexpr,
        NUM_STAGES: gl.constexpr,
        DIRECT_OUT: gl.constexpr,
        MIN_SPLIT_TILES: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """Few heads (<= BLOCK_H): tokens and values on wgmma's M, heads on N.

        ``scores^T [tokens, heads] = k @ q^T`` and ``out^T [512, heads] += v^T @ p^T``, so
        16 heads cost 16 MMA columns instead of 64 padded rows (a quarter of the tensor
        work and of the operand reads of the 64-row kernel). Same ring, masking and
        outputs as _mla_decode_gluon_kernel.
        """
        hg = gl.program_id(0)
        split = gl.program_id(1)
        b = gl.program_id(2)
        num_splits = gl.num_programs(1)

        seq_len = gl.load(seq_lens_ptr + b)
        n_tiles = gl.cdiv(seq_len, BLOCK_N)
        tiles_per_split, n_active = _split_tiles(seq_len, num_splits, BLOCK_N, MIN_SPLIT_TILES)
        # Inactive splits are never read by the merge: leave before staging q. Split 0 of
        # an empty sequence stays to write its zeros.
        if split >= gl.maximum(n_active, 1):
            return
        tile_lo = split * tiles_per_split
        n_local = gl.maximum(gl.minimum(tile_lo + tiles_per_split, n_tiles) - tile_lo, 0)

        st_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_H, 16]
        )
        ot_layout: gl.constexpr = st_layout  # [512, heads]: same warp tiling, M repeats
        q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
        # out^T -> out: each thread holds 8 consecutive values of one head (16-byte stores).
        o_st_layout: gl.constexpr = gl.BlockedLayout([8, 1], [32, 1], [1, num_warps], [0, 1])
        lat_sl: gl.constexpr = lat_desc.layout
        pe_sl: gl.constexpr = pe_desc.layout
        q_lat_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_LAT], gl.bfloat16)
        q_pe_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_ROPE], gl.bfloat16)
        pt_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], gl.bfloat16)

        q_lat_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_LAT], q_lat_sl)
        q_pe_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_ROPE], q_pe_sl)
        k_lat_s = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BLOCK_N, D_LAT], lat_sl)
        k_pe_s = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BLOCK_N, D_ROPE], pe_sl)
        pt_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, BLOCK_H], pt_sl)
        bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        bt_row = bt_ptr + b.to(gl.int64) * stride_btb
        _start_ring(bars, lat_desc, pe_desc, k_lat_s, k_pe_s, bt_row, tile_lo, n_local,
                    page_size, NUM_STAGES, BLOCK_N)  # fmt: skip
        _stage_q(q_ptr, b, hg, stride_qb, stride_qh, num_heads, q_lat_s, q_pe_s, q_layout,
                 BLOCK_H, D_LAT, D_ROPE)  # fmt: skip

        head_l: gl.constexpr = gl.SliceLayout(0, st_layout)
        tok_l: gl.constexpr = gl.SliceLayout(1, st_layout)
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, head_l)
        l_2d = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, st_layout)  # summed after the loop
        acc = gl.zeros([D_LAT, BLOCK_H], gl.float32, ot_layout)
        s_zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, st_layout)
        offs_n = gl.arange(0, BLOCK_N, layout=tok_l)
        offs_zn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, q_layout))

        for i in range(n_local):
            stage = i % NUM_STAGES
            nxt = i + NUM_STAGES
            nxt_row = _tile_row(bt_row, tile_lo + nxt, page_size, nxt < n_local, BLOCK_N)
            mbarrier.wait(bars.index(stage), (i // NUM_STAGES) & 1)
            k_lat = k_lat_s.index(stage)
            k_pe = k_pe_s.index(stage)
            n_valid = seq_len - (tile_lo + i) * BLOCK_N
            if n_valid < BLOCK_N:  # last, partial tile: NaN rows would poison v^T @ p^T
                v = k_lat.load(q_layout)
                k_lat.store(gl.where(offs_zn[:, None] < n_valid, v, gl.zeros_like(v)))
                fence_async_shared()
                gl.thread_barrier()

            s = warpgroup_mma(k_lat, q_lat_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(k_pe, q_pe_s.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=[s])

            s = gl.where((offs_n < n_valid)[:, None], s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=0))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - m_new[None, :])
            l_2d = l_2d * alpha[None, :] + p
            m_i = m_new
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, ot_layout))[None, :]

            pt_s.store(p.to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()
            acc = warpgroup_mma(k_lat.permute((1, 0)), pt_s, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            gl.thread_barrier()
            if nxt < n_local:
                _issue_tile(lat_desc, pe_desc, nxt_row, bars.index(stage), k_lat, k_pe)

        for st in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(bars.index(st))

        l_i = gl.sum(l_2d, axis=0)
        has = l_i > 0.0
        inv_l = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
        o = acc * gl.convert_layout(inv_l, gl.SliceLayout(0, ot_layout))[None, :]
        o = gl.convert_layout(o, o_st_layout)
        offs_oh = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, o_st_layout))
        offs_od = gl.arange(0, D_LAT, layout=gl.SliceLayout(1, o_st_layout))
        oh_ok = offs_oh[None, :] < num_heads
        if DIRECT_OUT:
            to_out: gl.constexpr = True
        else:
            to_out = n_active <= 1
        if out_ptr.dtype == po_ptr.dtype:
            dst, dst_h = _output_base(to_out, out_ptr, po_ptr, b, split, stride_ob, stride_oh,
                                      stride_pob, stride_poh, stride_pos)  # fmt: skip
            dst = dst + offs_oh[None, :] * dst_h + offs_od[:, None]
            gl.store(dst, o.to(dst.dtype.element_ty), mask=oh_ok)
        elif to_out:  # a caller's workspace of another dtype: a store per destination
            o_ptrs = out_ptr + b.to(gl.int64) * stride_ob + offs_oh[None, :] * stride_oh
            gl.store(o_ptrs + offs_od[:, None], o.to(out_ptr.dtype.element_ty), mask=oh_ok)
        else:
            po = po_ptr + b.to(gl.int64) * stride_pob + split * stride_pos
            po = po + offs_oh[None, :] * stride_poh + offs_od[:, None]
            gl.store(po, o.to(po_ptr.dtype.element_ty), mask=oh_ok)
        if not to_out:
            lse = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
            offs_lh = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=head_l)
            pl = pl_ptr + b.to(gl.int64) * stride_plb + offs_lh * stride_plh + split
            gl.store(pl, lse, mask=offs_lh < num_heads)


@dataclass(frozen=True)
class GluonMLAConfig:
    """Launch choices of :func:`mla_decode_gluon`; the defaults won the H200 runs in
    benchmarks/results/kernels_mla_gluon.md.

    Ring geometry (64-row kernel): a slot holds one tile of block_n x 576 bf16 (72 KB at
    64 tokens); q takes 72 KB and p block_n x 128 B, so 64-token tiles allow two slots and
    32-token tiles four (measured 1.3-1.5x slower than 64 x 2; the few-head kernel needs
    block_n = 64)."""

    block_n: int = 64  # tokens per KV tile (power of two, 32 or 64; divides page_size)
    num_stages: int = 2  # ring slots
    # Merge launch (mla_decode's merge kernel). None: merge_blocks' choice and its chunk
    # rule; else the values per program and splits per step (powers of two) and warps.
    merge_d_block: int | None = None
    merge_chunk: int | None = None
    merge_warps: int | None = None
    # Head counts up to this use the tokens-on-M kernel (16-head blocks); 0 disables it.
    small_heads_max: int = SMALL_BLOCK_H
    # More heads also use it (several 16-head blocks, each tile then read once from HBM
    # and again from L2) when each program walks at most this many tiles of the
    # block-table capacity: latency-bound launches, where a program's per-tile MMA time
    # matters more than the extra reads (H200: 1.4x faster at batch 1 / 4k / 64 heads,
    # 1.2x slower at batch 8 / 4k and 2x at batch 8 / 32k). 0 disables it.
    small_max_tiles: int = 8
    # Fewest tokens (rounded up to whole tiles) a split of one sequence streams; None: one
    # tile, which measured best at batch 1 / 4k (see _MIN_TOKENS_PER_SPLIT).
    min_split_tokens: int | None = None

    def min_tiles(self) -> int:
        """``MIN_SPLIT_TILES`` of the split kernels and the merge."""
        tokens = self.block_n if self.min_split_tokens is None else self.min_split_tokens
        return min_split_tiles(tokens, self.block_n)

    def smem_bytes(self) -> int:
        tile = self.block_n * LATENT_DIM * 2
        return BLOCK_H * LATENT_DIM * 2 + self.num_stages * tile + BLOCK_H * self.block_n * 2


DEFAULT_GLUON_CONFIG = GluonMLAConfig()


def gluon_mla_supported(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """True when :func:`mla_decode_gluon` can serve these tensors; False keeps Triton's.

    Needs Gluon, an sm_90 CUDA device, a BF16 cache whose page size is a multiple of
    ``GLUON_PAGE_MULTIPLE`` (64, the default tile), pages back to back (``stride(0) == page_size *
    stride(1)``), rows contiguous, and 16-byte aligned cache base and row stride (TMA).
    """
    if not _GLUON_OK or not (q.is_cuda and kv_cache.is_cuda):
        return False
    if torch.cuda.get_device_capability(kv_cache.device) != GLUON_CAPABILITY:
        return False
    if kv_cache.dtype != torch.bfloat16 or kv_cache.dim() != 3:
        return False
    if kv_cache.shape[-1] != LATENT_DIM or kv_cache.stride(-1) != 1:
        return False
    page_size = kv_cache.shape[1]
    if page_size % GLUON_PAGE_MULTIPLE != 0:
        return False
    if kv_cache.stride(0) != page_size * kv_cache.stride(1):
        return False
    itemsize = kv_cache.element_size()
    return (
        kv_cache.data_ptr() % _TMA_ALIGN_BYTES == 0
        and (kv_cache.stride(1) * itemsize) % _TMA_ALIGN_BYTES == 0
    )


def gluon_num_splits(
    batch: int, num_heads: int, max_context: int, sm_count: int, block_h: int = BLOCK_H
) -> int:
    """Splits so that batch * head blocks * splits fills at most one wave (one CTA per SM:
    the ring and q take most of shared memory), each split >= _MIN_TOKENS_PER_SPLIT tokens.
    Static sizes only (``max_context`` = block-table capacity), so CUDA-graph safe."""
    programs = batch * triton.cdiv(num_heads, block_h)
    want = max(1, sm_count // programs)
    by_length = max(1, max_context // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, by_length, MAX_SPLITS))


def _use_small_kernel(
    batch: int, heads: int, max_context: int, config: GluonMLAConfig, sm_count: int
) -> bool:
    """Whether the tokens-on-M kernel serves this launch. Static sizes only, and not the
    caller's num_splits: the same kernel serves a shape whatever the split count."""
    if config.block_n != SMALL_BLOCK_N:  # its tile's tokens are one warpgroup's 64 rows
        return False
    if heads <= config.small_heads_max:
        return True
    splits = gluon_num_splits(batch, heads, max_context, sm_count, SMALL_BLOCK_H)
    tiles_per_program = triton.cdiv(triton.cdiv(max_context, config.block_n), splits)
    return tiles_per_program <= config.small_max_tiles


def gluon_default_num_splits(
    batch: int,
    heads: int,
    max_context: int,
    sm_count: int,
    config: GluonMLAConfig | None = None,
) -> int:
    """The split count :func:`mla_decode_gluon` takes when none is given (static sizes)."""
    config = config or DEFAULT_GLUON_CONFIG
    small = _use_small_kernel(batch, heads, max_context, config, sm_count)
    return gluon_num_splits(
        batch, heads, max_context, sm_count, SMALL_BLOCK_H if small else BLOCK_H
    )


def prefer_gluon(batch: int, heads: int, max_context: int) -> bool:
    """Where the Gluon kernel measured faster than the Triton one on an H200
    (benchmarks/results/kernels_mla_gluon.md): a block-table capacity of
    _GLUON_MIN_CAPACITY tokens or more (1.14-1.70x at every batch and head count measured),
    or more than 16 heads at batch _GLUON_MIN_BATCH_MANY_HEADS or more (1.23-1.78x at
    capacity 1024). Elsewhere (short capacity at batch 1, or few heads) the Triton kernel
    was 3-8% faster."""
    return max_context >= _GLUON_MIN_CAPACITY or (
        heads > SMALL_BLOCK_H and batch >= _GLUON_MIN_BATCH_MANY_HEADS
    )


def _merge_launch(batch: int, heads: int, num_splits: int, config: GluonMLAConfig) -> tuple:
    """(heads, values, splits per step, warps) per merge program.

    merge_blocks' choice, except where it gives one head x 128 values and there are many
    splits (small batch, long context): there 64 values and 32 splits per step were
    1.1-1.3x faster on an H200 (benchmarks/results/kernels_mla_gluon.md, "Tuning measured
    on the way"), as long as the grid stays within _MERGE_FINE_MAX_PROGRAMS.
    """
    hb, db = merge_blocks(batch, heads)
    chunk, warps = (MERGE_CHUNK if (hb, db) == (1, MERGE_MIN_D_BLOCK) else 1), 4
    if (hb, db) == (1, MERGE_MIN_D_BLOCK) and num_splits >= _MERGE_MANY_SPLITS:
        chunk = _MERGE_FINE_CHUNK
        if batch * heads * (KV_LORA_RANK // _MERGE_FINE_D_BLOCK) <= _MERGE_FINE_MAX_PROGRAMS:
            db = _MERGE_FINE_D_BLOCK
    db = config.merge_d_block or db
    chunk = config.merge_chunk or chunk
    return hb, db, chunk, config.merge_warps or warps


def _descriptors(kv_cache: torch.Tensor, block_n: int) -> tuple:
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    row_stride = kv_cache.stride(1)
    flat = kv_cache.as_strided((rows, LATENT_DIM), (row_stride, 1))
    lat_block, pe_block = [block_n, KV_LORA_RANK], [block_n, ROPE_DIM]
    lat = TensorDescriptor(
        flat, [rows, KV_LORA_RANK], [row_stride, 1], lat_block, _nvmma_layout(lat_block)
    )
    pe = TensorDescriptor(
        flat[:, KV_LORA_RANK:], [rows, ROPE_DIM], [row_stride, 1], pe_block, _nvmma_layout(pe_block)
    )
    return lat, pe


def mla_decode_gluon(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    workspace: MLADecodeWorkspace | None = None,
    config: GluonMLAConfig | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode attention on Hopper; writes ``out [B, H, 512]`` and returns it.

    Contract of :func:`moeserve.kernels.attention.mla_decode.mla_decode`. Only what
    :func:`gluon_mla_supported` accepts (``kv_scale`` is then unused: BF16 cache). The
    kernel (few-head or 64-row, see ``GluonMLAConfig.small_heads_max`` / ``small_max_tiles``)
    follows from the static sizes (batch, heads, block-table capacity) only, and
    ``num_splits`` defaults to :func:`gluon_num_splits` for that kernel's head block, so a
    captured graph stays valid for any ``seq_lens``. ``config`` defaults to
    ``DEFAULT_GLUON_CONFIG``.
    """
    check_decode_inputs(q, kv_cache, block_tables, seq_lens, out, kv_scale)
    config = config or DEFAULT_GLUON_CONFIG
    if not gluon_mla_supported(q, kv_cache) or kv_cache.shape[1] % config.block_n != 0:
        raise ValueError("mla_decode_gluon: unsupported device/cache; use mla_decode")
    if config.smem_bytes() > SMEM_LIMIT_BYTES:
        raise ValueError(f"{config} needs more than {SMEM_LIMIT_BYTES} B of shared memory")
    batch, heads = q.shape[0], q.shape[1]
    page_size = kv_cache.shape[1]
    max_context = block_tables.shape[1] * page_size
    small = _use_small_kernel(batch, heads, max_context, config, device_sm_count(q.device))
    block_h = SMALL_BLOCK_H if small else BLOCK_H
    if num_splits is None:
        num_splits = gluon_num_splits(batch, heads, max_context, device_sm_count(q.device), block_h)
    num_splits = int(num_splits)
    direct = num_splits == 1
    po, pl = split_partials(out, num_splits, workspace)
    lat_desc, pe_desc = _descriptors(kv_cache, config.block_n)
    grid = (triton.cdiv(heads, block_h), num_splits, batch)
    args = (
        q,
        lat_desc,
        pe_desc,
        block_tables,
        seq_lens,
        out,
        po,
        pl,
        float(sm_scale) * LOG2E,
        heads,
        q.stride(0),
        q.stride(1),
        page_size,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        po.stride(0),
        po.stride(1),
        po.stride(2) if not direct else 0,
        pl.stride(0),
        pl.stride(1),
    )
    min_tiles = config.min_tiles()
    common = dict(
        BLOCK_H=block_h,
        BLOCK_N=config.block_n,
        D_LAT=KV_LORA_RANK,
        D_ROPE=ROPE_DIM,
        NUM_STAGES=config.num_stages,
        DIRECT_OUT=direct,
        MIN_SPLIT_TILES=min_tiles,
    )
    if small:
        _mla_decode_gluon_small_kernel[grid](*args, **common, num_warps=SMALL_NUM_WARPS)
    else:
        # Which of out / partials a program writes depends on seq_lens, so the 16-byte
        # (bf16-rounding) store path is compiled only where both are bf16.
        bf16_out = out.dtype == torch.bfloat16 and po.dtype == torch.bfloat16
        _mla_decode_gluon_kernel[grid](*args, **common, BF16_OUT=bf16_out, num_warps=NUM_WARPS)
    if not direct:
        hb, db, chunk, warps = _merge_launch(batch, heads, num_splits, config)
        launch_merge(
            po,
            pl,
            out,
            num_splits,
            hb,
            db,
            chunk,
            warps,
            seq_lens=seq_lens,
            block_n=config.block_n,
            min_tiles=min_tiles,
        )
    return out


# The start-up probe: two sequences (several tiles, and a partial one) on permuted pages.
_PROBE_SEQ_LENS = (200, 37)
_PROBE_PAGE = GLUON_PAGE_MULTIPLE
_PROBE_SCALE = 0.1
_PROBE_TOLERANCE = 3e-2  # of the largest output: bf16 partials and output


def check_decode_kernel(
    kernel: Callable, num_heads: int, device: torch.device, **kwargs: object
) -> bool:
    """Whether `kernel` (mla_decode's signature) matches mla_decode_ref on a small case with
    `num_heads` heads: False, with one log line, on any error or mismatch."""
    g = torch.Generator(device="cpu").manual_seed(0)
    lens = torch.tensor(_PROBE_SEQ_LENS, dtype=torch.int32)
    pages_per_seq = [-(-int(n) // _PROBE_PAGE) for n in lens]
    num_pages = sum(pages_per_seq)
    cache = torch.randn(num_pages, _PROBE_PAGE, LATENT_DIM, generator=g).to(torch.bfloat16)
    order = torch.randperm(num_pages, generator=g).to(torch.int32)
    tables = torch.zeros(len(lens), max(pages_per_seq), dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_seq):
        tables[b, :n] = order[used : used + n]
        used += n
    q = torch.randn(len(lens), num_heads, LATENT_DIM, generator=g).to(torch.bfloat16)
    args = [t.to(device) for t in (q, cache, tables, lens)]
    ref = mla_decode_ref(*args, _PROBE_SCALE, torch.empty(len(lens), num_heads, KV_LORA_RANK))
    try:
        out = torch.empty(len(lens), num_heads, KV_LORA_RANK, dtype=torch.bfloat16, device=device)
        kernel(*args, _PROBE_SCALE, out, **kwargs)
        err = float((out.float().cpu() - ref.cpu()).abs().max())
    except Exception as e:  # noqa: BLE001 (any compile/launch failure means "not this one")
        log.warning("MLA decode kernel %s unavailable (%s)", getattr(kernel, "__name__", kernel), e)
        return False
    if not err <= _PROBE_TOLERANCE * float(ref.abs().max()):
        log.warning("MLA decode kernel %s is wrong here (max error %.3g)", kernel, err)
        return False
    return True


@functools.lru_cache(maxsize=8)
def probe_gluon_mla(device: torch.device, num_heads: int) -> bool:
    """Whether both Gluon kernels (few-head and 64-row) reproduce the reference on this
    device for this head count. Runs once per (device, heads); call it before CUDA-graph
    capture (it synchronises). The engine falls back to the Triton kernel when False."""
    if device.type != "cuda":
        return False
    forced_64_row = GluonMLAConfig(small_heads_max=0, small_max_tiles=0)
    return check_decode_kernel(mla_decode_gluon, num_heads, device) and (
        num_heads <= SMALL_BLOCK_H
        or check_decode_kernel(mla_decode_gluon, num_heads, device, config=forced_64_row)
    )
