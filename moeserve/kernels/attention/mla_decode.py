"""MLA decode attention over the paged latent cache (absorbed form, split-KV).

Layouts (DeepSeek-V3 / Kimi-K2.5: kv_lora_rank 512, qk_rope_head_dim 64):

- ``q``            ``[B, H, 576]`` bf16/fp16/fp32, last dim contiguous: the absorbed query,
                   ``[q_nope @ W_UK_T (512) | q_pe (64)]``.
- ``kv_cache``     ``[num_pages, page_size, 576]`` bf16 or float8_e4m3fn, last dim contiguous.
                   Row = ``[normalised latent c (512) | roped k_pe (64)]``. One KV head (MQA):
                   keys are the whole row, values are its first 512 entries.
- ``kv_scale``     FP8 only: fp32 tensor with one element, dequant = fp8 * scale (whole row).
- ``block_tables`` ``[B, max_pages]`` int32: page ids of each sequence, in token order.
                   Entries past a sequence's last page are never read (any value is fine).
- ``seq_lens``     ``[B]`` int32, tokens in the cache per sequence (may differ; 0 -> zeros).
- ``out``          ``[B, H, 512]`` preallocated, last dim contiguous; written, also returned.

``page_size`` may be any value >= 1 (token -> page is a runtime division; page size 1
compiles its own specialisation). 64 is what the benchmark measures and recommends.

Algorithm: stage 1 runs one program per (head group x value slice, KV split, sequence).
It walks its token range in tiles of ``BLOCK_N`` tokens. When ``page_size`` is a multiple
of ``BLOCK_N`` a tile is one page slice (one block-table read per tile); otherwise each
row is gathered through the block table (any page size, pages in any order). All heads of
the group share the tile: ``scores = q[BLOCK_H, 576] @ k[BLOCK_N, 576]^T`` and
``acc += p @ k[:, :512]`` on the tensor cores with an online (log2-domain) softmax. FP8
tiles are converted to bf16 in registers (exact: every e4m3 value is a bf16 value); the
scalar scale is folded into the softmax scale and the final normalisation, so no
per-element multiply is spent on it. Stage 2 merges the per-split partial outputs with
their log-sum-exp. With one split, stage 1 writes ``out`` directly and stage 2 is skipped.

Fused merge (``MLADecodeConfig.fused_merge``, off by default, see below): stage 2 runs
inside stage 1, so a call with several splits is one launch, not two. Why: at batch 1 on a
tensor-parallel rank (8 heads, a few hundred cached tokens) the merge launch is ~2.5 us of
a ~7.8 us call on an H200 (split kernel alone 5.3 us, in a CUDA graph), once per layer.
Once a split program has stored its partial (and lse), it arrives at its group's int32
counter (atomic add, acq_rel, gpu scope, after a CTA barrier so that every thread's stores
precede the release). A group is one (sequence, head block): with ``vsplit == 2`` both
value slices arrive at it, because only slice 0 stores the lse that the merge needs. The
program that sees ``active * vsplit - 1`` earlier arrivals is the last: it reads the
group's lse and partials back (from L2) in split order ``0 .. active-1``, in fixed steps,
so the result does not depend on which program came last, merges all 512 values of its
heads into ``out`` (leaving the merge weights in the group's lse slots) and resets the
counter to 0 for the next call or graph replay. The merged values agree with the
two-kernel merge to fp32 rounding (the sums are grouped differently), not bit for bit.

Measured (H200, triton 3.6, default config and split count, capacity 4096, CUDA graph;
``benchmarks/kernels_mla_heads.py --fused-merge``): the arrival (fence + atomic) costs
~0.7 us and the tail, serial in one program, ~0.25-0.3 us per active split (latency-bound
L2 reads of ``active x heads x 1 KB``). The fused call is 0.82-0.91x the two-kernel time
with 16-row head blocks and <= 4 active splits at batch 8 (and 128 heads at batch 1, 256
tokens), even (0.99-1.04x) at 8-16 heads, batch 1, 256 tokens and at batch 64 (2 splits),
but 1.05-1.6x with 16-32 active splits (batch 1-8, 1024-4096 tokens) and 1.1-1.4x with
64-row head blocks (128 heads, batch 8). Since the active split count depends on
``seq_lens`` (no static rule can pick the winner per graph), the two-kernel path stays the
default; the fused one is kept, tested and benchmarked for GPUs or Triton versions where
the tail is cheaper.

Active splits (decided per sequence inside both kernels, from ``seq_lens``): a sequence of
``n_tiles = cdiv(seq_len, BLOCK_N)`` tiles gives each split ``tiles_per_split =
max(cdiv(n_tiles, num_splits), MIN_SPLIT_TILES)`` tiles, so ``active = cdiv(n_tiles,
tiles_per_split)`` splits hold tokens (0 for an empty sequence). ``MIN_SPLIT_TILES`` is
``MLADecodeConfig.min_split_tokens`` (default: one tile) in whole tiles:
the static ``num_splits`` is sized for the block-table capacity, and a short sequence
would otherwise spread a few tiles over many splits, each paying a partial write and the
merge a read. Who writes what, per sequence:

- ``active <= 1`` (always so with ``num_splits == 1``): split 0 normalises straight into
  ``out`` (zeros for an empty sequence); it writes no partials and no lse, and the merge
  program returns at once, reading nothing else.
- ``active > 1``: splits ``0 .. active-1`` write their partial and lse, the merge (the
  last arriving split program, or the merge kernel) reads exactly those and writes ``out``.
  Only these splits arrive at the fused merge's counter.
- Splits ``>= max(active, 1)`` return at once and write nothing: their workspace slots
  keep whatever they held (stale data, NaN) and are never read.

Performance (H200, benchmarks/results/kernels_mla.md): up to 47-48% of HBM bandwidth for a
BF16 cache at batch 64 / 128k, 3x the torch peer; FP8 is 0.7-0.9x BF16 speed (the kernel is
tensor-core-issue bound, see benchmarks/results/kernels_mla_analysis.md for why).
``num_splits`` should fill whole waves of CTAs: ``default_num_splits`` does that.

CUDA graphs: every launch shape depends only on tensor shapes and ``num_splits`` (never on
``seq_lens`` values: the active-split rule above runs inside the kernels, and the merge is
launched whenever ``num_splits > 1`` without the fused merge), and the per-split partials
and the fused merge's counters live in a :class:`MLADecodeWorkspace`. Allocate one
workspace for the largest batch before capture and pass it on every call (``workspace=``);
the captured graph then reads new ``seq_lens``/``block_tables`` contents on replay. The
counters are zero between calls (each group's last program resets its own), so one
workspace serves any sequence of stream-ordered calls, but not two calls running at once
on different streams. Without a workspace the wrapper allocates one per call (fine
eagerly, and inside a capture it comes from the graph's private pool; the counters' zeroing
is then one more small launch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeserve.kernels.formats import E4M3_MAX
from moeserve.kernels.formats import MLA_KV_LORA_RANK as KV_LORA_RANK
from moeserve.kernels.formats import MLA_ROPE_DIM as ROPE_DIM

LATENT_DIM = KV_LORA_RANK + ROPE_DIM  # one cached row per token and layer
LOG2E = 1.4426950408889634

# SMs of an H100/H200, used when the tensors are not on a GPU (interpreter tests).
_DEFAULT_SM_COUNT = 132
# Each split should still stream enough KV to amortise its partial write and merge: the
# split heuristic's bound on the static split count. Inside the kernels a sequence's splits
# get one tile or more (MLADecodeConfig.min_split_tokens): at batch 1-8 a 64-token tile
# costs a program ~3 us in series, so one tile per split beat 128 / 256 / 512 tokens at
# every point measured (benchmarks/results/mla_split_rule.md).
_MIN_TOKENS_PER_SPLIT = 128
# The merge grid is (batch, head blocks, value blocks). Its programs are tiny, and past a
# few hundred of them the launch itself costs ~5 ns per program (H200: 4096 programs took
# 22 us, 16384 took 82 us, linear in the count whatever the split count;
# benchmarks/results/kernels_mla_heads.md), so blocks grow until at most this many remain;
# 128-value blocks of one head keep batch 1 spread over the SMs.
_MERGE_MAX_PROGRAMS = 512
MERGE_MIN_D_BLOCK = 128
_MERGE_MAX_HEADS_BLOCK = 8
# Where a program holds one head's 128 values (small batches: many splits), each step reads
# CHUNK splits' partials at once ([CHUNK, 1, 128] tiles), so 32-132 splits take few steps;
# elsewhere (fewer splits) one split per step. Both measured on an H200 at 2232beb
# (benchmarks/results/kernels_mla_heads.md, mla_merge_profile.log): chunks of wider blocks
# ([8, 1, 256], [4, 1, 512], [2, 2, 512]) took 1.3-2.5x the one-split loop.
MERGE_CHUNK = 16
# Upper bound of num_splits: the merge keeps all split lse values of a head in registers.
MAX_SPLITS = 1024
# tl.dot's smallest M: the smallest head block of any config, which sizes the workspace's
# fused-merge counters (one per sequence and head block).
MIN_BLOCK_H = 16
# Fused merge tail (the last split program of a group): accumulator values per thread (it
# takes [block_h, up to 512] values per step), and splits whose partials are loaded per
# step, as independent loads in flight together. H200: [chunk, heads, values] tiles of
# 64-128 values per thread spilled on sm_90a; 8 splits per step instead of 4 took 0.9x
# the time with 32 active splits but 1.1-1.15x with 4 (batch 1 and 8).
FUSED_MERGE_ELEMS_PER_THREAD = 32
FUSED_MERGE_UNROLL = 4
# lse values of one head read per step when the fused tail finds its maximum and the sum
# of weights (one step for up to this many active splits).
FUSED_MERGE_LSE_CHUNK = 64
_THREADS_PER_WARP = 32


@dataclass(frozen=True)
class MLADecodeConfig:
    """Launch parameters of the split kernel. The default won the H200 sweep for both BF16
    and FP8 caches (benchmarks/results/kernels_mla_analysis.md); the other knobs are kept because
    they are measured there and may win on other GPUs or Triton versions."""

    block_h: int = 64  # heads per program; >= 16 (tl.dot minimum), power of two
    block_n: int = 64  # tokens per KV tile, power of two >= 16
    num_warps: int = 8
    num_stages: int = 2
    # FP8 cache only, experimental: q @ k^T on FP8 tensor cores with q quantised per head.
    fp8_qk: bool = False
    # 1 or 2: programs sharing one KV tile, each accumulating 512 / vsplit value columns.
    # 2 halves the accumulator (so one warpgroup can own all 64 head rows) at the price
    # of computing q @ k^T twice; the second read of the tile comes from L2.
    vsplit: int = 1
    # CTAs of this config resident per SM (sets the split heuristic's wave size).
    ctas_per_sm: int = 1
    # Load tile t+1 into registers while tile t is computed (use with num_stages=1).
    prefetch: bool = False
    # Fewest tokens (rounded up to whole tiles) a split of one sequence streams, so short
    # sequences use fewer splits than the capacity-sized grid and, in one split, skip the
    # merge. None: one tile (block_n).
    min_split_tokens: int | None = None
    # Merge the split partials inside the split kernel (its last program per sequence and
    # head block): one launch per call instead of two. Off by default: on an H200 it won
    # only where <= 4 splits are active and lost up to 1.6x where 16-32 are (module
    # docstring, "Measured").
    fused_merge: bool = False


DEFAULT_CONFIG = MLADecodeConfig()
# 16 heads or fewer (the TP8 share of 128): a 64-row head block would be three-quarters
# masked rows; 16-row blocks with 8 warps were 10-25% faster at every batch and context
# measured (benchmarks/results/kernels_mla_heads.md). With more heads they also win where
# little KV is streamed per call, batch x capacity <= 8192 tokens (128 heads at capacity
# 1024, batch 1-8: 9.6-12.6 us against 13.1-30.2 us; at 4096, batch 1-2: 18.3 / 33.6
# against 20.5 / 37.4 us), and lose beyond (capacity 1024 batch 64: 31 against 15 us).
SMALL_HEADS_CONFIG = MLADecodeConfig(block_h=16, num_warps=8)
_SMALL_BLOCKS_MAX_TOKENS = 8192


def default_config(
    num_heads: int, batch: int | None = None, max_context: int | None = None
) -> MLADecodeConfig:
    """The launch config used when none is given: by the (per-rank) head count and, when
    known, the static batch x cache capacity of the launch."""
    if num_heads <= SMALL_HEADS_CONFIG.block_h:
        return SMALL_HEADS_CONFIG
    if batch is not None and max_context is not None:
        if batch * max_context <= _SMALL_BLOCKS_MAX_TOKENS:
            return SMALL_HEADS_CONFIG
    return DEFAULT_CONFIG


@dataclass
class MLADecodeWorkspace:
    """Static split-KV scratch (partial outputs, their log2-sum-exp and the fused merge's
    arrival counters) for CUDA graphs.

    ``partial_out`` is ``[max_batch, heads, max_splits, 512]`` and ``partial_lse``
    ``[max_batch, heads, max_splits]`` fp32. Any batch <= max_batch and num_splits <=
    max_splits can use it. Partials default to bf16: each is already normalised (O(1)
    values), so bf16 adds at most one bf16 rounding to a bf16 output while halving the
    partial traffic, which at batch 1 is comparable to the cache bytes themselves.

    ``counters`` is flat int32, zero between calls: one per (sequence, head block) of a
    fused-merge launch, which needs ``batch * cdiv(heads, block_h)`` of them (both value
    slices of ``vsplit=2`` share their head block's). ``allocate`` sizes it for the smallest
    head block any config may use (:data:`MIN_BLOCK_H`) at ``max_batch``, so every config
    fits: ``max_batch * cdiv(heads, 16)`` counters, 2 KB for 128 heads at batch 64.
    """

    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    counters: torch.Tensor

    @classmethod
    def allocate(
        cls,
        max_batch: int,
        num_heads: int,
        max_splits: int,
        device: torch.device | str,
        dtype: torch.dtype = torch.bfloat16,
    ) -> MLADecodeWorkspace:
        po = torch.empty(
            (max_batch, num_heads, max_splits, KV_LORA_RANK), dtype=dtype, device=device
        )
        pl = torch.empty((max_batch, num_heads, max_splits), dtype=torch.float32, device=device)
        counters = torch.zeros(
            merge_counters_needed(max_batch, num_heads), dtype=torch.int32, device=device
        )
        return cls(po, pl, counters)

    @property
    def max_splits(self) -> int:
        return self.partial_out.shape[2]


def merge_counters_needed(batch: int, num_heads: int, block_h: int = MIN_BLOCK_H) -> int:
    """Fused-merge counters of a launch of ``batch`` sequences with ``num_heads`` heads in
    blocks of ``block_h`` (default: the smallest block any config uses, so enough for all)."""
    return batch * triton.cdiv(num_heads, block_h)


def device_sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(
    batch: int,
    num_heads: int,
    max_context: int,
    config: MLADecodeConfig | None = None,
    sm_count: int = _DEFAULT_SM_COUNT,
) -> int:
    """Splits so that batch * head_groups * vsplit * splits is at most one full wave.

    Measured on H200 (benchmarks/results/kernels_mla.json): one CTA per SM is resident,
    the best split count fills exactly one wave, and a few CTAs more than a wave double the
    time (a second, nearly empty wave), so round down. Splits keep >= 128 tokens each.
    Depends only on static sizes (``max_context`` = block_tables capacity), so it is the
    same for every replay of a captured graph.
    """
    config = config or default_config(num_heads, batch, max_context)
    head_groups = triton.cdiv(num_heads, config.block_h)
    programs = batch * head_groups * config.vsplit
    want = max(1, (config.ctas_per_sm * sm_count) // programs)
    by_length = max(1, max_context // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, by_length))


def min_split_tiles(min_split_tokens: int, block_n: int) -> int:
    """``MIN_SPLIT_TILES`` of the kernels: ``min_split_tokens`` rounded up to whole tiles of
    ``block_n`` tokens (at least one)."""
    if min_split_tokens < 1:
        raise ValueError(f"min_split_tokens must be >= 1, got {min_split_tokens}")
    return max(1, triton.cdiv(min_split_tokens, block_n))


def active_splits(seq_len: int, num_splits: int, block_n: int, min_tiles: int) -> int:
    """Splits that hold tokens of a ``seq_len``-token sequence: the rule the split and merge
    kernels apply (see the module docstring), for callers and tests that must agree."""
    n_tiles = triton.cdiv(seq_len, block_n)
    tiles_per_split = max(triton.cdiv(n_tiles, num_splits), min_tiles)
    return triton.cdiv(n_tiles, tiles_per_split)


@triton.jit
def _split_tiles(seq_len, num_splits, BLOCK_N: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr):
    """(tiles per split, active splits) of one sequence; the split and merge kernels both
    call this so that they agree on which partials exist."""
    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.maximum(tl.cdiv(n_tiles, num_splits), MIN_SPLIT_TILES)
    return tiles_per_split, tl.cdiv(n_tiles, tiles_per_split)


@triton.jit
def _load_kv_tile(
    kv_ptr,
    bt_row,
    tile,
    tok_limit,  # tokens >= this are masked (0 masks the whole tile: no memory traffic)
    page_size,
    stride_kv_page,
    stride_kv_tok,
    offs_n,
    offs_own,
    offs_oth,
    offs_r,
    BLOCK_N: tl.constexpr,
    D_LAT: tl.constexpr,
    VSPLIT: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr,
):
    """Rows of tile ``tile`` through the block table: (own latent cols, rope, other cols)."""
    tok = tile * BLOCK_N + offs_n
    mask_n = tok < tok_limit
    if TILE_IN_PAGE:
        # page_size % BLOCK_N == 0: one page per tile, a scalar lookup and provably
        # consecutive rows.
        start = tile * BLOCK_N
        page = tl.load(bt_row + start // page_size, mask=start < tok_limit, other=0)
        row = page.to(tl.int64) * stride_kv_page + (start % page_size + offs_n) * stride_kv_tok
    else:
        page = tl.load(bt_row + tok // page_size, mask=mask_n, other=0)
        row = page.to(tl.int64) * stride_kv_page + (tok % page_size) * stride_kv_tok
    k_own = tl.load(kv_ptr + row[:, None] + offs_own[None, :], mask=mask_n[:, None], other=0.0)
    k_pe = tl.load(kv_ptr + row[:, None] + D_LAT + offs_r[None, :], mask=mask_n[:, None], other=0.0)
    if VSPLIT > 1:
        k_oth = tl.load(kv_ptr + row[:, None] + offs_oth[None, :], mask=mask_n[:, None], other=0.0)
    else:
        k_oth = k_pe  # unused
    return k_own, k_pe, k_oth


@triton.jit
def _merge_if_last(
    cnt_ptr,  # this group's counter
    po_ptr,  # this sequence's partials, [H, splits, 512] by the strides
    pl_ptr,  # this sequence's lse, [H, splits]
    out_ptr,  # this sequence's output, [H, 512]
    n_active,
    offs_h,
    mask_h,
    stride_poh,
    stride_pos,
    stride_plh,
    stride_oh,
    BLOCK_H: tl.constexpr,
    D_LAT: tl.constexpr,
    ARRIVALS_PER_SPLIT: tl.constexpr,  # VSPLIT: each value slice of a split arrives
    D_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,  # splits per step (unrolled)
    LSE_CHUNK: tl.constexpr,
):
    """Fused stage 2 for one (sequence, head block): arrive at the group's counter once this
    program's partial and lse are stored; the last of the group's ``n_active *
    ARRIVALS_PER_SPLIT`` programs merges every active split (as the merge kernel does: out =
    sum_s w_s * partial_s / sum_s w_s, w_s = 2^(lse_s - max lse)) into ``out`` for all
    D_LAT values of the block's heads, then resets the counter. Partials are read back in
    split order in fixed steps, the arriving program's own included, so the result is the
    same whichever program arrives last. The group's lse slots end up holding w_s."""
    tl.debug_barrier()  # every thread's partial and lse stores precede the release below
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == n_active * ARRIVALS_PER_SPLIT - 1:
        # .cg: other SMs wrote these partials and lse; read them from L2, never a stale L1
        # line
        pl = pl_ptr + offs_h * stride_plh  # [BLOCK_H]
        offs_l = tl.arange(0, LSE_CHUNK)
        n_lse = tl.cdiv(n_active, LSE_CHUNK)
        lse_ok = mask_h[:, None] & (offs_l < n_active)[None, :]
        # The first LSE_CHUNK splits' lse stay in registers for both passes (one L2 round
        # trip where that is all of them). Later chunks are combined element-wise and
        # reduced once after the loop, as the merge kernel's single reduction (a reduction
        # inside the loop whose result is used twice trips Triton 3.6's thread-locality pass).
        lse0 = tl.load(pl[:, None] + offs_l[None, :], mask=lse_ok, other=float("-inf"),
                       cache_modifier=".cg")  # fmt: skip
        m_all = lse0
        for c in range(1, n_lse):
            s = c * LSE_CHUNK + offs_l
            lse = tl.load(pl[:, None] + s[None, :], mask=mask_h[:, None] & (s < n_active)[None, :],
                          other=float("-inf"), cache_modifier=".cg")  # fmt: skip
            m_all = tl.maximum(m_all, lse)
        m = tl.max(m_all, axis=1)
        m = tl.where(m == float("-inf"), 0.0, m)  # masked heads: weights 0, nothing stored
        # The weights go back into the lse slots (this program owns them now): the partial
        # loop then loads each split's weights in the accumulator's row layout. Computed in
        # the loop from lse and m (another layout), they cost a shared-memory layout
        # conversion and two CTA barriers per split, which serialised the partial loads.
        w_all = tl.where(lse0 > float("-inf"), tl.exp2(lse0 - m[:, None]), 0.0)
        tl.store(pl[:, None] + offs_l[None, :], w_all, mask=lse_ok)
        for c in range(1, n_lse):
            s = c * LSE_CHUNK + offs_l
            ok = mask_h[:, None] & (s < n_active)[None, :]
            lse = tl.load(pl[:, None] + s[None, :], mask=ok, other=float("-inf"),
                          cache_modifier=".cg")  # fmt: skip
            w = tl.where(lse > float("-inf"), tl.exp2(lse - m[:, None]), 0.0)
            tl.store(pl[:, None] + s[None, :], w, mask=ok)
            w_all += w
        denom = tl.sum(w_all, axis=1)
        denom = tl.where(denom > 0.0, denom, 1.0)
        tl.debug_barrier()  # the weights are stored before any thread reads them back

        # 2-D tiles in the accumulator's own layout; the CHUNK splits of a step are
        # independent loads, in flight together.
        po = po_ptr + offs_h[:, None] * stride_poh
        for d0 in range(0, D_LAT, D_BLOCK):
            offs_d = d0 + tl.arange(0, D_BLOCK)
            acc = tl.zeros([BLOCK_H, D_BLOCK], tl.float32)
            for c in range(0, tl.cdiv(n_active, CHUNK)):
                for u in tl.static_range(CHUNK):
                    s = c * CHUNK + u
                    ok = mask_h & (s < n_active)
                    w = tl.load(pl + s, mask=ok, other=0.0)  # this program's own stores
                    part = tl.load(po + s * stride_pos + offs_d[None, :], mask=ok[:, None],
                                   other=0.0, cache_modifier=".cg")  # fmt: skip
                    acc += part.to(tl.float32) * w[:, None]
            o = acc / denom[:, None]
            o_ptrs = out_ptr + offs_h[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_h[:, None])
        tl.store(cnt_ptr, 0)  # every arrival is in: zero for the next call or graph replay


@triton.jit
def _mla_decode_split_kernel(
    q_ptr,
    kv_ptr,
    bt_ptr,
    seq_lens_ptr,
    scale_ptr,
    out_ptr,
    po_ptr,
    pl_ptr,
    cnt_ptr,  # fused merge: int32 arrival counters, one per (sequence, head block)
    qk_scale,  # sm_scale * log2(e)
    num_heads,
    stride_qb,
    stride_qh,
    stride_kv_page,
    stride_kv_tok,
    page_size,  # runtime: any page size >= 1 (value 1 gets its own specialisation)
    stride_btb,
    stride_ob,
    stride_oh,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_LAT: tl.constexpr,
    D_ROPE: tl.constexpr,
    VSPLIT: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr,
    PREFETCH: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    DIRECT_OUT: tl.constexpr,  # num_splits == 1: no partial path compiled
    FP8_QK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SPLIT_TILES: tl.constexpr,
    FUSED_MERGE: tl.constexpr,  # the last split program of a group merges (no merge launch)
    TAIL_D_BLOCK: tl.constexpr,  # fused merge: values per step ...
    TAIL_CHUNK: tl.constexpr,  # ... of this many splits
    TAIL_LSE_CHUNK: tl.constexpr,
):
    # Grid: (head_groups * VSPLIT, splits, batch). The VSPLIT programs of one (group,
    # split) are adjacent in launch order, so the second one's KV reads hit L2.
    pid0 = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    num_splits = tl.num_programs(1)  # runtime, so changing it does not recompile
    hg = pid0 // VSPLIT
    vpart = pid0 % VSPLIT
    D_V: tl.constexpr = D_LAT // VSPLIT  # value columns this program accumulates

    seq_len = tl.load(seq_lens_ptr + b)
    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split, n_active = _split_tiles(seq_len, num_splits, BLOCK_N, MIN_SPLIT_TILES)
    # Splits past the active ones hold no tokens and the merge never reads their slots, so
    # they skip even the q load. Split 0 stays for an empty sequence: it writes the zeros.
    # (Never taken with one split, where the return alone cost 12 registers on sm_90a.)
    if not DIRECT_OUT:
        if split >= tl.maximum(n_active, 1):
            return
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, n_tiles)

    offs_h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    # Latent columns in "own value slice first" order: the QK product is a sum over
    # columns, so the order is free, and the own slice is then reused as V.
    offs_own = vpart * D_V + tl.arange(0, D_V)
    if VSPLIT > 1:
        offs_oth = (vpart * D_V + D_V + tl.arange(0, D_LAT - D_V)) % D_LAT
    offs_r = tl.arange(0, D_ROPE)
    offs_n = tl.arange(0, BLOCK_N)

    q_row = q_ptr + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh
    q_own = tl.load(q_row + offs_own[None, :], mask=mask_h[:, None], other=0.0)
    q_pe = tl.load(q_row + D_LAT + offs_r[None, :], mask=mask_h[:, None], other=0.0)
    if VSPLIT > 1:
        q_oth = tl.load(q_row + offs_oth[None, :], mask=mask_h[:, None], other=0.0)

    if HAS_SCALE:
        kv_scale = tl.load(scale_ptr).to(tl.float32)
    else:
        kv_scale = 1.0
    if FP8_QK:
        # Experimental: q quantised per head to e4m3 so q @ k^T runs on FP8 tensor cores
        # straight from the cached bytes; p @ v stays bf16. Costs accuracy (~e4m3 q).
        q_own = q_own.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
        q_amax = tl.maximum(tl.max(tl.abs(q_own), axis=1), tl.max(tl.abs(q_pe), axis=1))
        if VSPLIT > 1:
            q_oth = q_oth.to(tl.float32)
            q_amax = tl.maximum(q_amax, tl.max(tl.abs(q_oth), axis=1))
        q_deq = tl.where(q_amax > 0.0, q_amax / FP8_MAX, 1.0)
        q_own = (q_own / q_deq[:, None]).to(kv_ptr.dtype.element_ty)
        q_pe = (q_pe / q_deq[:, None]).to(kv_ptr.dtype.element_ty)
        if VSPLIT > 1:
            q_oth = (q_oth / q_deq[:, None]).to(kv_ptr.dtype.element_ty)
        row_scale = q_deq * (qk_scale * kv_scale)
    else:
        q_own = q_own.to(tl.bfloat16)
        q_pe = q_pe.to(tl.bfloat16)
        if VSPLIT > 1:
            q_oth = q_oth.to(tl.bfloat16)
        row_scale = tl.full([BLOCK_H], 1.0, tl.float32) * (qk_scale * kv_scale)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_V], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb

    if VSPLIT == 1:
        offs_oth = offs_r  # placeholder, never loaded
    if PREFETCH:
        # Software pipelining by hand: tile t+1 is loaded into registers before tile t is
        # computed, so its HBM latency hides behind the tensor-core work (Triton's own
        # cp.async pipelining of this loop issues the next copy after the compute).
        nxt_own, nxt_pe, nxt_oth = _load_kv_tile(
            kv_ptr, bt_row, tile_lo, tl.where(tile_lo < tile_hi, seq_len, 0), page_size,
            stride_kv_page, stride_kv_tok, offs_n, offs_own, offs_oth, offs_r,
            BLOCK_N, D_LAT, VSPLIT, TILE_IN_PAGE,
        )  # fmt: skip
    for tile in range(tile_lo, tile_hi):
        mask_n = tile * BLOCK_N + offs_n < seq_len
        if PREFETCH:
            k_own, k_pe, k_oth = nxt_own, nxt_pe, nxt_oth
            nxt_own, nxt_pe, nxt_oth = _load_kv_tile(
                kv_ptr, bt_row, tile + 1, tl.where(tile + 1 < tile_hi, seq_len, 0), page_size,
                stride_kv_page, stride_kv_tok, offs_n, offs_own, offs_oth, offs_r,
                BLOCK_N, D_LAT, VSPLIT, TILE_IN_PAGE,
            )  # fmt: skip
        else:
            k_own, k_pe, k_oth = _load_kv_tile(
                kv_ptr, bt_row, tile, seq_len, page_size,
                stride_kv_page, stride_kv_tok, offs_n, offs_own, offs_oth, offs_r,
                BLOCK_N, D_LAT, VSPLIT, TILE_IN_PAGE,
            )  # fmt: skip
        if FP8_QK:
            s = tl.dot(q_own, tl.trans(k_own))
            s = tl.dot(q_pe, tl.trans(k_pe), s)
            if VSPLIT > 1:
                s = tl.dot(q_oth, tl.trans(k_oth), s)
            k_own = k_own.to(tl.bfloat16)
        else:
            k_own = k_own.to(tl.bfloat16)
            s = tl.dot(q_own, tl.trans(k_own))
            s = tl.dot(q_pe, tl.trans(k_pe.to(tl.bfloat16)), s)
            if VSPLIT > 1:
                s = tl.dot(q_oth, tl.trans(k_oth.to(tl.bfloat16)), s)
        s = tl.where(mask_n[None, :], s * row_scale[:, None], float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(tl.bfloat16), k_own, acc)
        m_i = m_new

    # Empty sequence (split 0 is its only program left): l_i == 0, so the output is zeros.
    has = l_i > 0.0
    inv_l = tl.where(has, kv_scale / tl.where(has, l_i, 1.0), 0.0)
    o = acc * inv_l[:, None]
    if DIRECT_OUT:
        to_out: tl.constexpr = True  # the one-split build carries no partial path
    else:
        to_out = n_active <= 1  # the whole sequence is in this split: nothing to merge
    if to_out:
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + offs_h[:, None] * stride_oh
        tl.store(o_ptrs + offs_own[None, :], o.to(out_ptr.dtype.element_ty), mask=mask_h[:, None])
    else:
        po = po_ptr + b.to(tl.int64) * stride_pob + offs_h[:, None] * stride_poh
        po += split * stride_pos
        tl.store(po + offs_own[None, :], o.to(po_ptr.dtype.element_ty), mask=mask_h[:, None])
        if vpart == 0:  # every value slice has the same softmax statistics
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            pl = pl_ptr + b.to(tl.int64) * stride_plb + offs_h * stride_plh + split
            tl.store(pl, lse, mask=mask_h)
        if FUSED_MERGE:
            _merge_if_last(
                cnt_ptr + b * (tl.num_programs(0) // VSPLIT) + hg,
                po_ptr + b.to(tl.int64) * stride_pob,
                pl_ptr + b.to(tl.int64) * stride_plb,
                out_ptr + b.to(tl.int64) * stride_ob,
                n_active, offs_h, mask_h, stride_poh, stride_pos, stride_plh, stride_oh,
                BLOCK_H, D_LAT, VSPLIT, TAIL_D_BLOCK, TAIL_CHUNK, TAIL_LSE_CHUNK,
            )  # fmt: skip


@triton.jit
def _mla_decode_merge_kernel(
    po_ptr,
    pl_ptr,
    out_ptr,
    seq_lens_ptr,
    num_splits,
    num_heads,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_ob,
    stride_oh,
    SPLITS_P2: tl.constexpr,
    HEADS_BLOCK: tl.constexpr,
    D_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_N: tl.constexpr,  # the split kernel's tile and MIN_SPLIT_TILES: same split rule
    MIN_SPLIT_TILES: tl.constexpr,
):
    """out[b, h, d] = sum_s w_s * partial_s / sum_s w_s, w_s = 2^(lse_s - max lse), over
    the sequence's active splits, for HEADS_BLOCK heads x D_BLOCK values per program, CHUNK
    splits per step. Sequences with at most one active split are left alone."""
    b = tl.program_id(0)
    _, n_active = _split_tiles(tl.load(seq_lens_ptr + b), num_splits, BLOCK_N, MIN_SPLIT_TILES)
    if n_active <= 1:
        return  # split 0 wrote out (zeros for an empty sequence); no partial exists
    offs_h = tl.program_id(1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
    h_ok = offs_h[:, None] < num_heads
    pl = pl_ptr + b.to(tl.int64) * stride_plb + offs_h[:, None] * stride_plh  # [HB, 1]
    offs_all = tl.arange(0, SPLITS_P2)
    # Only the active splits' slots were written by this call; the rest may hold anything.
    lse_all = tl.load(
        pl + offs_all[None, :], mask=h_ok & (offs_all[None, :] < n_active), other=float("-inf")
    )
    m = tl.max(lse_all, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)  # masked heads: weights 0, nothing stored
    denom = tl.sum(tl.where(lse_all > float("-inf"), tl.exp2(lse_all - m[:, None]), 0.0), axis=1)

    offs_d = tl.program_id(2) * D_BLOCK + tl.arange(0, D_BLOCK)
    po = po_ptr + b.to(tl.int64) * stride_pob + offs_h[:, None] * stride_poh + offs_d[None, :]
    offs_c = tl.arange(0, CHUNK)
    acc = tl.zeros([HEADS_BLOCK, D_BLOCK], tl.float32)
    for c in range(0, tl.cdiv(n_active, CHUNK)):
        offs_s = c * CHUNK + offs_c
        s_ok = (offs_s < n_active)[:, None, None]
        lse = tl.load(pl[None, :, :] + offs_s[:, None, None], mask=s_ok & h_ok[None, :, :],
                      other=float("-inf"))  # fmt: skip
        w = tl.where(lse > float("-inf"), tl.exp2(lse - m[None, :, None]), 0.0)  # [C, HB, 1]
        parts = tl.load(po[None, :, :] + offs_s[:, None, None] * stride_pos, mask=w > 0.0,
                        other=0.0)  # fmt: skip
        acc += tl.sum(parts.to(tl.float32) * w, axis=0)
    o = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
    out = out_ptr + b.to(tl.int64) * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=h_ok)


def split_workspace(
    out: torch.Tensor, num_splits: int, workspace: MLADecodeWorkspace | None
) -> MLADecodeWorkspace:
    """The workspace for ``num_splits`` (> 1) splits of ``out``'s batch and heads: the
    caller's (checked to fit) or a fresh one (partials in bf16, fp32 for an fp32 ``out``)."""
    if not 2 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [2, {MAX_SPLITS}] with partials, got {num_splits}")
    batch, heads = out.shape[0], out.shape[1]
    if workspace is None:
        po_dtype = torch.float32 if out.dtype == torch.float32 else torch.bfloat16
        workspace = MLADecodeWorkspace.allocate(batch, heads, num_splits, out.device, po_dtype)
    if workspace.max_splits < num_splits or workspace.partial_out.shape[0] < batch:
        raise ValueError("workspace too small for this batch / num_splits")
    if workspace.partial_out.shape[1] != heads:
        raise ValueError("workspace was allocated for a different head count")
    return workspace


def split_partials(
    out: torch.Tensor, num_splits: int, workspace: MLADecodeWorkspace | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial outputs, partial lse) the split kernel writes for ``num_splits`` splits of
    ``out``'s batch and heads: the workspace's (checked), a fresh one without it, or ``out``
    twice as unused placeholders for one split (stage 1 writes ``out`` directly)."""
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if num_splits == 1:
        return out, out
    ws = split_workspace(out, num_splits, workspace)
    return ws.partial_out, ws.partial_lse


def merge_counters(
    workspace: MLADecodeWorkspace, batch: int, num_heads: int, block_h: int
) -> torch.Tensor:
    """The workspace's fused-merge counters, checked to hold one per (sequence, head block)
    of the launch."""
    counters = workspace.counters
    need = merge_counters_needed(batch, num_heads, block_h)
    if counters.dtype != torch.int32 or counters.numel() < need:
        raise ValueError(f"workspace counters must be int32 with >= {need} elements")
    return counters


def fused_merge_tile(block_h: int, num_warps: int) -> tuple[int, int]:
    """(values, splits) per step of the fused merge tail: a [block_h, values] accumulator of
    FUSED_MERGE_ELEMS_PER_THREAD values per thread (up to all 512), FUSED_MERGE_UNROLL
    splits' partials loaded per step."""
    elems = FUSED_MERGE_ELEMS_PER_THREAD * _THREADS_PER_WARP * num_warps
    d_block = min(KV_LORA_RANK, 1 << (max(elems // block_h, 1).bit_length() - 1))
    return d_block, FUSED_MERGE_UNROLL


def launch_merge(
    po: torch.Tensor,
    pl: torch.Tensor,
    out: torch.Tensor,
    num_splits: int,
    heads_block: int,
    d_block: int,
    chunk: int,
    num_warps: int = 4,
    *,
    seq_lens: torch.Tensor,
    block_n: int,
    min_tiles: int,
) -> None:
    """Stage 2: merge the split partials (``po`` [B, H, splits, 512], ``pl`` [B, H, splits])
    into ``out`` [B, H, 512], ``heads_block`` x ``d_block`` values per program and ``chunk``
    splits per step (shared by the Triton and Gluon split kernels).

    ``seq_lens``, ``block_n`` (tokens per KV tile) and ``min_tiles`` (``MIN_SPLIT_TILES``)
    must be the split kernel's: from them each program finds its sequence's active splits,
    merges only those, and leaves ``out`` alone where the split kernel wrote it (at most one
    active split)."""
    batch, heads = out.shape[0], out.shape[1]
    grid = (batch, triton.cdiv(heads, heads_block), KV_LORA_RANK // d_block)
    _mla_decode_merge_kernel[grid](
        po,
        pl,
        out,
        seq_lens,
        num_splits,
        heads,
        po.stride(0),
        po.stride(1),
        po.stride(2),
        pl.stride(0),
        pl.stride(1),
        out.stride(0),
        out.stride(1),
        SPLITS_P2=triton.next_power_of_2(num_splits),
        HEADS_BLOCK=heads_block,
        D_BLOCK=d_block,
        CHUNK=chunk,
        BLOCK_N=block_n,
        MIN_SPLIT_TILES=min_tiles,
        num_warps=num_warps,
    )


def merge_blocks(batch: int, num_heads: int) -> tuple[int, int]:
    """(heads, values) per merge program: 1 x 128 grown (values first, to all 512, then
    heads) until the grid has at most _MERGE_MAX_PROGRAMS programs."""
    heads_block, d_block = 1, MERGE_MIN_D_BLOCK

    def programs() -> int:
        return batch * triton.cdiv(num_heads, heads_block) * (KV_LORA_RANK // d_block)

    while programs() > _MERGE_MAX_PROGRAMS and d_block < KV_LORA_RANK:
        d_block *= 2
    while programs() > _MERGE_MAX_PROGRAMS and heads_block < _MERGE_MAX_HEADS_BLOCK:
        heads_block *= 2
    return heads_block, d_block


def check_decode_inputs(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    kv_scale: torch.Tensor | None,
) -> None:
    if q.dim() != 3 or q.shape[-1] != LATENT_DIM or q.stride(-1) != 1:
        raise ValueError(f"q must be [B, H, {LATENT_DIM}] with a contiguous last dim")
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != LATENT_DIM or kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache must be [pages, page_size, {LATENT_DIM}], last dim contiguous")
    page_size = kv_cache.shape[1]
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    batch, heads = q.shape[0], q.shape[1]
    if out.shape != (batch, heads, KV_LORA_RANK) or out.stride(-1) != 1:
        raise ValueError(f"out must be [B, H, {KV_LORA_RANK}] with a contiguous last dim")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError("block_tables must be [B, max_pages]")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_tables and seq_lens must be int32")
    if seq_lens.shape != (batch,):
        raise ValueError("seq_lens must be [B]")
    if kv_cache.dtype == torch.float8_e4m3fn:
        if kv_scale is None or kv_scale.numel() != 1:
            raise ValueError("an FP8 cache needs kv_scale, a one-element fp32 tensor")
    elif kv_cache.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"unsupported kv_cache dtype {kv_cache.dtype}")


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    workspace: MLADecodeWorkspace | None = None,
    config: MLADecodeConfig | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode attention; writes ``out [B, H, 512]`` and returns it.

    ``num_splits`` defaults to :func:`default_num_splits` of the static sizes and ``config``
    to :func:`default_config` of the head count, batch and cache capacity. ``kv_scale``
    is required for (and only used with) a float8_e4m3fn cache. See the module docstring
    for layouts and CUDA-graph use of ``workspace``.
    """
    check_decode_inputs(q, kv_cache, block_tables, seq_lens, out, kv_scale)
    batch, heads = q.shape[0], q.shape[1]
    page_size = kv_cache.shape[1]
    max_context = block_tables.shape[1] * page_size
    config = config or default_config(heads, batch, max_context)
    if num_splits is None:
        num_splits = default_num_splits(
            batch, heads, max_context, config, device_sm_count(q.device)
        )
    num_splits = int(num_splits)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if config.vsplit not in (1, 2):
        raise ValueError("config.vsplit must be 1 or 2")
    direct = num_splits == 1
    fused = config.fused_merge and not direct
    head_groups = triton.cdiv(heads, config.block_h)
    if direct:
        po, pl, counters = out, out, out  # unused placeholders: stage 1 writes out
    else:
        ws = split_workspace(out, num_splits, workspace)
        po, pl = ws.partial_out, ws.partial_lse
        counters = merge_counters(ws, batch, heads, config.block_h) if fused else out
    min_tokens = config.min_split_tokens
    min_tiles = min_split_tiles(
        config.block_n if min_tokens is None else min_tokens, config.block_n
    )
    has_scale = kv_cache.dtype == torch.float8_e4m3fn
    scale_arg = kv_scale if has_scale else out
    tail_d_block, tail_chunk = fused_merge_tile(config.block_h, config.num_warps)
    grid = (head_groups * config.vsplit, num_splits, batch)
    _mla_decode_split_kernel[grid](
        q,
        kv_cache,
        block_tables,
        seq_lens,
        scale_arg,
        out,
        po,
        pl,
        counters,
        float(sm_scale) * LOG2E,
        heads,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.shape[1],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        po.stride(0),
        po.stride(1),
        po.stride(2) if not direct else 0,
        pl.stride(0),
        pl.stride(1),
        BLOCK_H=config.block_h,
        BLOCK_N=config.block_n,
        D_LAT=KV_LORA_RANK,
        D_ROPE=ROPE_DIM,
        VSPLIT=config.vsplit,
        TILE_IN_PAGE=page_size % config.block_n == 0,
        PREFETCH=config.prefetch,
        HAS_SCALE=has_scale,
        DIRECT_OUT=direct,
        FP8_QK=bool(config.fp8_qk and has_scale),
        FP8_MAX=E4M3_MAX,
        MIN_SPLIT_TILES=min_tiles,
        FUSED_MERGE=fused,
        TAIL_D_BLOCK=tail_d_block,
        TAIL_CHUNK=tail_chunk,
        TAIL_LSE_CHUNK=FUSED_MERGE_LSE_CHUNK,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if not direct and not fused:
        hb, db = merge_blocks(batch, heads)
        chunk = MERGE_CHUNK if (hb, db) == (1, MERGE_MIN_D_BLOCK) else 1
        launch_merge(
            po,
            pl,
            out,
            num_splits,
            hb,
            db,
            chunk,
            seq_lens=seq_lens,
            block_n=config.block_n,
            min_tiles=min_tiles,
        )
    return out


def gather_latent_rows(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``seq_len`` cached rows of one sequence as fp32 ``[seq_len, 576]`` (dequantised)."""
    page_size = kv_cache.shape[1]
    tok = torch.arange(seq_len, device=kv_cache.device)
    pages = block_table.long()[tok // page_size]
    rows = kv_cache[pages, tok % page_size].float()
    if kv_cache.dtype == torch.float8_e4m3fn:
        assert kv_scale is not None, "an FP8 cache needs kv_scale"
        rows = rows * kv_scale.float().reshape(())
    return rows


def mla_decode_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """fp32 torch reference of :func:`mla_decode` (``num_splits`` is ignored)."""
    del num_splits
    check_decode_inputs(q, kv_cache, block_tables, seq_lens, out, kv_scale)
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            out[b].zero_()
            continue
        kv = gather_latent_rows(kv_cache, block_tables[b], n, kv_scale)
        scores = (q[b].float() @ kv.t()) * sm_scale
        probs = torch.softmax(scores, dim=-1)
        out[b] = (probs @ kv[:, :KV_LORA_RANK]).to(out.dtype)
    return out
