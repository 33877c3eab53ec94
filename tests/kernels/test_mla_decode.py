"""MLA decode kernel vs its fp32 torch reference, under the Triton CPU interpreter.

Oracle independence: the reference gathers rows with torch indexing and runs a plain fp32
softmax; the kernel walks tiles through the block table with an online softmax and
split-KV merge. Unused cache rows/pages are NaN so any stray read poisons the output.
"""

from __future__ import annotations

import dataclasses
import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported (triton.jit reads it)

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import moeserve.kernels.attention.mla_decode as mla_decode_mod  # noqa: E402
from tests.kernels.interpreter_shims import install_interpreter_shims  # noqa: E402
from tests.kernels.mla_cases import (  # noqa: E402
    check_split_slots,
    make_case,
    poison_workspace,
)

install_interpreter_shims()
if not isinstance(mla_decode_mod._mla_decode_split_kernel, InterpretedFunction):
    # Imported earlier without TRITON_INTERPRET (e.g. by another test): rebuild as interpreted.
    mla_decode_mod = importlib.reload(mla_decode_mod)

# Triton's own jit helpers (tl.cdiv, tl.max, ...) are built when triton is first imported;
# if that happened before TRITON_INTERPRET=1 was set (another test imported it first),
# interpreted kernels cannot call them. Say so instead of failing obscurely.
_TRITON_INTERPRETED = isinstance(triton.language.cdiv, InterpretedFunction)


@pytest.fixture(autouse=True)
def _require_interpreted_triton():
    if not _TRITON_INTERPRETED:
        pytest.fail(
            "triton was imported before TRITON_INTERPRET=1 was set; set it in tests/conftest.py"
            " (os.environ.setdefault('TRITON_INTERPRET', '1')) or in the environment"
        )


LATENT = mla_decode_mod.LATENT_DIM
FP8 = torch.float8_e4m3fn


def _run_both(q, cache, bt, seq, kv_scale, num_splits, config=None):
    sm_scale = 0.1352
    out = torch.full((q.shape[0], q.shape[1], 512), float("nan"), dtype=torch.bfloat16)
    kwargs = {} if config is None else {"config": config}
    mla_decode_mod.mla_decode(q, cache, bt, seq, sm_scale, out, kv_scale, num_splits, **kwargs)
    ref = torch.empty(q.shape[0], q.shape[1], 512, dtype=torch.float32)
    mla_decode_mod.mla_decode_ref(q, cache, bt, seq, sm_scale, ref, kv_scale)
    return out.float(), ref


# min_split_tokens of one 16-token tile keeps the tests' short sequences spread over
# several splits, so the partials and the merge are exercised (the default 128 tokens would
# put most of them in one split).
SMALL = mla_decode_mod.MLADecodeConfig(
    block_h=16, block_n=16, num_warps=4, num_stages=1, min_split_tokens=16
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize(
    ("page_size", "seq_lens", "num_splits"),
    [
        (1, [5, 37], 3),
        (16, [1, 50, 33], 2),
        (64, [70, 3], 1),
        (16, [45], 4),
        (3, [20, 7], 2),  # not a power of two
    ],
)
def test_decode_matches_reference(dtype, page_size, seq_lens, num_splits):
    q, cache, bt, seq, kv_scale = make_case(seq_lens, 4, page_size, dtype, seed=page_size)
    out, ref = _run_both(q, cache, bt, seq, kv_scale, num_splits, SMALL)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_more_splits_than_tiles_and_empty_sequence():
    # seq 0 -> zeros; 8 splits over 2 tiles leaves 6 splits without tokens.
    q, cache, bt, seq, kv_scale = make_case([0, 20], 4, 16, torch.bfloat16, seed=7)
    out, ref = _run_both(q, cache, bt, seq, kv_scale, 8, SMALL)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_heads_not_multiple_of_block_and_default_splits():
    # 20 heads over BLOCK_H=16 -> a masked second head group; default split heuristic.
    q, cache, bt, seq, kv_scale = make_case([300, 17], 20, 64, torch.bfloat16, seed=3)
    out, ref = _run_both(q, cache, bt, seq, kv_scale, None, SMALL)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("ws_dtype", [torch.bfloat16, torch.float32])
def test_many_splits_merge_in_chunks_with_stale_workspace(ws_dtype):
    # 40 splits > the merge chunk; 700 tokens = 44 tiles -> 22 busy splits, 18 empty ones
    # whose stale (NaN) workspace slots must not be read.
    q, cache, bt, seq, kv_scale = make_case([700, 5], 4, 16, torch.bfloat16, seed=5)
    ws = mla_decode_mod.MLADecodeWorkspace.allocate(2, 4, 40, "cpu", ws_dtype)
    ws.partial_out.fill_(float("nan"))
    out = torch.empty(2, 4, 512, dtype=torch.bfloat16)
    mla_decode_mod.mla_decode(q, cache, bt, seq, 0.1352, out, None, 40, ws, SMALL)
    ref = mla_decode_mod.mla_decode_ref(q, cache, bt, seq, 0.1352, torch.empty(2, 4, 512))
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_workspace_reuse_and_fp8_scale_matters():
    q, cache, bt, seq, kv_scale = make_case([40, 9], 4, 16, FP8, seed=11)
    ws = mla_decode_mod.MLADecodeWorkspace.allocate(4, 4, 4, "cpu")
    out = torch.empty(2, 4, 512, dtype=torch.bfloat16)
    mla_decode_mod.mla_decode(q, cache, bt, seq, 0.1, out, kv_scale, 3, ws, SMALL)
    ref = mla_decode_mod.mla_decode_ref(q, cache, bt, seq, 0.1, torch.empty(2, 4, 512), kv_scale)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    # A different scale must change the answer (the kernel really applies it).
    other = mla_decode_mod.mla_decode_ref(
        q, cache, bt, seq, 0.1, torch.empty(2, 4, 512), kv_scale * 2
    )
    assert (other - ref).abs().max() > 0.1


def test_rejects_missing_fp8_scale():
    q, cache, bt, seq, _ = make_case([8], 4, 16, FP8, seed=1)
    out = torch.empty(1, 4, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kv_scale"):
        mla_decode_mod.mla_decode(q, cache, bt, seq, 0.1, out)


def test_experimental_fp8_qk_variant_is_close():
    # q quantised per head to e4m3 for the FP8 tensor-core q @ k^T: looser tolerance.
    q, cache, bt, seq, kv_scale = make_case([70, 33], 4, 16, FP8, seed=21)
    cfg = dataclasses.replace(SMALL, num_stages=2, fp8_qk=True)
    out, ref = _run_both(q, cache, bt, seq, kv_scale, 2, cfg)
    assert torch.isfinite(out).all()
    err = (out - ref).abs()
    assert err.max() < 0.15 and err.mean() < 0.02, (err.max(), err.mean())


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_value_split_variant(dtype, num_splits):
    # vsplit=2: two programs per tile, each accumulating 256 of the 512 value columns.
    cfg = dataclasses.replace(SMALL, num_stages=2, vsplit=2)
    q, cache, bt, seq, kv_scale = make_case([61, 8], 20, 16, dtype, seed=13)
    out, ref = _run_both(q, cache, bt, seq, kv_scale, num_splits, cfg)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_value_split_with_fp8_qk():
    cfg = dataclasses.replace(SMALL, num_stages=2, fp8_qk=True, vsplit=2)
    q, cache, bt, seq, kv_scale = make_case([70, 33], 4, 16, FP8, seed=21)
    out, ref = _run_both(q, cache, bt, seq, kv_scale, 2, cfg)
    err = (out - ref).abs()
    assert err.max() < 0.15 and err.mean() < 0.02, (err.max(), err.mean())


@pytest.mark.parametrize("vsplit", [1, 2])
@pytest.mark.parametrize(("page_size", "dtype"), [(16, torch.bfloat16), (1, FP8), (5, FP8)])
def test_register_prefetch_variant(vsplit, page_size, dtype):
    # prefetch=True loads tile t+1 while tile t is computed; the last prefetch is fully
    # masked. Splits with 0, 1 and several tiles all occur (seq 50 -> 4 tiles, 3 splits).
    cfg = dataclasses.replace(SMALL, vsplit=vsplit, prefetch=True)
    q, cache, bt, seq, kv_scale = make_case([50, 1, 16], 4, page_size, dtype, seed=17)
    out, ref = _run_both(q, cache, bt, seq, kv_scale, 3, cfg)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_default_config_follows_the_head_count():
    # the TP8 share (16 heads) or fewer takes 16-row head blocks, more heads 64-row ones; the
    # split heuristic sizes its grid with the same config
    assert mla_decode_mod.default_config(16).block_h == 16
    assert mla_decode_mod.default_config(8) == mla_decode_mod.SMALL_HEADS_CONFIG
    assert mla_decode_mod.default_config(17) == mla_decode_mod.DEFAULT_CONFIG
    assert mla_decode_mod.default_num_splits(1, 16, 4096, sm_count=132) == 32  # 132 // 1 group
    assert mla_decode_mod.default_num_splits(1, 128, 16384, sm_count=132) == 66  # 132 // 2
    assert mla_decode_mod.default_num_splits(4, 16, 1 << 20, sm_count=132) == 33
    assert mla_decode_mod.default_num_splits(4, 128, 1 << 20, sm_count=132) == 16


def test_default_config_takes_small_blocks_where_little_kv_is_streamed():
    # 128 heads at batch x capacity <= 8192 tokens take 16-row blocks, beyond 64-row ones
    md = mla_decode_mod
    assert md.default_config(128, 1, 1024) == md.SMALL_HEADS_CONFIG
    assert md.default_config(128, 8, 1024) == md.SMALL_HEADS_CONFIG
    assert md.default_config(128, 2, 4096) == md.SMALL_HEADS_CONFIG
    assert md.default_config(128, 16, 1024) == md.DEFAULT_CONFIG
    assert md.default_config(128, 1, 32768) == md.DEFAULT_CONFIG
    # the split count follows the config: 8 head groups of 16 at batch 1, capacity 1024
    assert md.default_num_splits(1, 128, 1024, sm_count=132) == 8
    q, cache, bt, seq, kv_scale = make_case([70, 9], 8, 64, torch.bfloat16, seed=11)
    out, ref = _run_both(q, cache, bt, seq, kv_scale, None, None)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_merge_blocks_bound_the_merge_grid():
    mb = mla_decode_mod.merge_blocks
    assert mb(1, 128) == (1, 128)  # 512 programs: one head, a quarter of the values each
    assert mb(2, 128) == (1, 256)
    assert mb(8, 128) == (2, 512)
    assert mb(16, 128) == (4, 512)
    assert mb(64, 128) == (8, 512)  # capped: 1024 programs
    assert mb(1, 16) == (1, 128)


def test_merge_of_head_blocks_with_a_ragged_last_block():
    # 26 sequences x 21 heads: the merge takes 2 heads x 512 values per program, the last
    # head block half masked; stale (NaN) slots of empty splits must not be read.
    assert mla_decode_mod.merge_blocks(26, 21) == (2, 512)
    gen = torch.Generator().manual_seed(3)
    lens = torch.randint(1, 40, (26,), generator=gen).tolist()
    q, cache, bt, seq, kv_scale = make_case(lens, 21, 16, torch.bfloat16, seed=13)
    ws = mla_decode_mod.MLADecodeWorkspace.allocate(26, 21, 3, "cpu")
    ws.partial_out.fill_(float("nan"))
    out = torch.full((26, 21, 512), float("nan"), dtype=torch.bfloat16)
    mla_decode_mod.mla_decode(q, cache, bt, seq, 0.1352, out, None, 3, ws, SMALL)
    ref = mla_decode_mod.mla_decode_ref(q, cache, bt, seq, 0.1352, torch.empty(26, 21, 512))
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def _run_on_poisoned_workspace(q, cache, bt, seq, kv_scale, num_splits, config, ws=None):
    """mla_decode with a NaN-filled ``out`` (every element must be written) and a caller's
    NaN-filled workspace (no inactive slot may be read), against the fp32 reference."""
    batch, heads = q.shape[0], q.shape[1]
    if ws is None:
        ws = poison_workspace(
            mla_decode_mod.MLADecodeWorkspace.allocate(batch, heads, num_splits, "cpu")
        )
    out = torch.full((batch, heads, 512), float("nan"), dtype=torch.bfloat16)
    mla_decode_mod.mla_decode(q, cache, bt, seq, 0.1352, out, kv_scale, num_splits, ws, config)
    ref = torch.empty(batch, heads, 512)
    mla_decode_mod.mla_decode_ref(q, cache, bt, seq, 0.1352, ref, kv_scale)
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for b, n in enumerate(seq.tolist()):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
    return ws


_ONE_VARIANT = {
    "bf16": (torch.bfloat16, {}),
    "fp8-vsplit2-prefetch": (FP8, {"vsplit": 2, "prefetch": True}),
}


@pytest.mark.parametrize("variant", list(_ONE_VARIANT))
@pytest.mark.parametrize(
    ("min_split_tokens", "seq_lens", "active"),
    [
        # default one tile (16 tokens): empty, one tile, one split exactly full, one token
        # past it, several (38 tiles -> 10 per split)
        (None, [0, 10, 16, 17, 600], [0, 1, 1, 2, 4]),
        # 128 tokens = 8 tiles of 16: empty, one split, several (38 tiles -> 10 per split),
        # one split exactly full, one token past it, four full splits
        (128, [0, 100, 600, 128, 129, 512], [0, 1, 4, 1, 2, 4]),
        # 32 tokens = 2 tiles: the boundaries move accordingly
        (32, [0, 20, 600, 32, 33, 100], [0, 1, 4, 1, 2, 4]),
    ],
)
def test_sequences_in_one_split_write_out_and_skip_the_merge(
    variant, min_split_tokens, seq_lens, active
):
    dtype, knobs = _ONE_VARIANT[variant]
    cfg = dataclasses.replace(SMALL, min_split_tokens=min_split_tokens, **knobs)
    tokens = cfg.block_n if min_split_tokens is None else min_split_tokens
    min_tiles = mla_decode_mod.min_split_tiles(tokens, cfg.block_n)
    assert [mla_decode_mod.active_splits(n, 4, cfg.block_n, min_tiles) for n in seq_lens] == active
    q, cache, bt, seq, kv_scale = make_case(seq_lens, 4, 16, dtype, seed=31)
    ws = _run_on_poisoned_workspace(q, cache, bt, seq, kv_scale, 4, cfg)
    for b, a in enumerate(active):
        check_split_slots(ws, b, 4, a)


@pytest.mark.parametrize("fused_merge", [True, False])
def test_reused_workspace_stale_slots_are_not_merged(fused_merge):
    # A sequence that was spread over 4 splits leaves finite partials behind; the next call
    # puts one in a single split and another in 2 of the 4: reading a stale slot changes
    # the output (finite, so only the comparison with the reference can tell).
    cfg = dataclasses.replace(SMALL, min_split_tokens=32, fused_merge=fused_merge)
    q, cache, bt, seq, kv_scale = make_case([600, 100, 0, 33], 4, 16, torch.bfloat16, seed=41)
    ws = _run_on_poisoned_workspace(q, cache, bt, seq, kv_scale, 4, cfg)
    q2, cache2, bt2, seq2, _ = make_case([20, 33, 600, 0], 4, 16, torch.bfloat16, seed=42)
    _run_on_poisoned_workspace(q2, cache2, bt2, seq2, None, 4, cfg, ws)


@pytest.mark.parametrize("fused_merge", [False, True])
def test_default_min_split_at_batch_one_short_contexts(fused_merge):
    # The measured case: 64-token tiles, 8 splits of a 1024-token capacity, one tile per
    # split at least: up to 64 tokens one split (no merge), 124 / 128 -> 2 splits,
    # 129 -> 3, 1000 (16 tiles) -> all 8.
    q, cache, bt, seq, kv_scale = make_case(
        [0, 64, 124, 128, 129, 1000], 16, 64, torch.bfloat16, seed=5
    )
    assert bt.shape[1] * 64 >= 1024
    cfg = mla_decode_mod.default_config(16, 1, 1024)
    assert cfg.block_n == 64 and cfg.min_split_tokens is None
    cfg = dataclasses.replace(cfg, fused_merge=fused_merge)
    ws = _run_on_poisoned_workspace(q, cache, bt, seq, kv_scale, 8, cfg)
    for b, a in enumerate([0, 1, 2, 2, 3, 8]):
        check_split_slots(ws, b, 16, a)


def test_min_split_tokens_rounds_up_to_whole_tiles():
    assert mla_decode_mod.min_split_tiles(128, 64) == 2
    assert mla_decode_mod.min_split_tiles(100, 64) == 2
    assert mla_decode_mod.min_split_tiles(1, 64) == 1
    assert mla_decode_mod.min_split_tiles(128, 16) == 8
    q, cache, bt, seq, kv_scale = make_case([8], 4, 16, torch.bfloat16, seed=1)
    out = torch.empty(1, 4, 512, dtype=torch.bfloat16)
    bad = dataclasses.replace(SMALL, min_split_tokens=0)
    with pytest.raises(ValueError, match="min_split_tokens"):
        mla_decode_mod.mla_decode(q, cache, bt, seq, 0.1, out, num_splits=2, config=bad)


# ---- the fused merge (the last split program of a group merges; one launch per call) ----
FUSED = dataclasses.replace(SMALL, fused_merge=True)
TWO_KERNEL = SMALL
assert not SMALL.fused_merge  # the default: the merge kernel


def _fused_case(seq_lens, heads, dtype, seed, page_size=16):
    """A case plus its fp32 reference output."""
    q, cache, bt, seq, kv_scale = make_case(seq_lens, heads, page_size, dtype, seed=seed)
    ref = torch.empty(len(seq_lens), heads, 512)
    mla_decode_mod.mla_decode_ref(q, cache, bt, seq, 0.1352, ref, kv_scale)
    return (q, cache, bt, seq, kv_scale), ref


def _decode(case, num_splits, config, ws):
    """mla_decode into a NaN-filled out (every element must be written) with ``ws``."""
    q, cache, bt, seq, kv_scale = case
    out = torch.full((q.shape[0], q.shape[1], 512), float("nan"), dtype=torch.bfloat16)
    mla_decode_mod.mla_decode(q, cache, bt, seq, 0.1352, out, kv_scale, num_splits, ws, config)
    return out.float()


def _workspace(batch, heads, num_splits):
    ws = mla_decode_mod.MLADecodeWorkspace.allocate(batch, heads, num_splits, "cpu")
    assert ws.counters.dtype == torch.int32 and not ws.counters.any()  # zeroed at allocation
    return poison_workspace(ws)


@pytest.mark.parametrize(
    ("dtype", "knobs"), [(torch.bfloat16, {}), (FP8, {"vsplit": 2}), (FP8, {"prefetch": True})]
)
def test_fused_merge_matches_reference_over_mixed_lengths(dtype, knobs):
    # empty, one token, one split, a few splits, all splits; 20 heads: a ragged second head
    # block, whose masked rows must neither count as arrivals nor be merged
    seq_lens, splits = [0, 1, 10, 37, 200], 6
    cfg = dataclasses.replace(FUSED, **knobs)
    case, ref = _fused_case(seq_lens, 20, dtype, seed=51)
    ws = _workspace(len(seq_lens), 20, splits)
    out = _decode(case, splits, cfg, ws)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert not ws.counters.any()  # every group's last program reset its counter
    for b, n in enumerate(seq_lens):
        check_split_slots(ws, b, 20, mla_decode_mod.active_splits(n, splits, 16, 1))


def test_fused_merge_counters_reset_for_the_next_call():
    # the same workspace (as a captured graph replays it) with new lengths and q: each call
    # must start from zeroed counters, or the last arrival is missed (NaN out) or early
    ws = _workspace(3, 4, 5)
    for seed, seq_lens in ((61, [70, 0, 33]), (62, [5, 80, 17]), (63, [80, 80, 1])):
        case, ref = _fused_case(seq_lens, 4, torch.bfloat16, seed=seed)
        out = _decode(case, 5, FUSED, ws)
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
        assert not ws.counters.any()


def test_fused_merge_over_more_splits_than_one_lse_step():
    # 69 active splits (one 16-token tile each) > FUSED_MERGE_LSE_CHUNK: the tail's max and
    # sum of weights take two steps; the other sequence uses 2 of the 72 splits
    assert mla_decode_mod.FUSED_MERGE_LSE_CHUNK < 69
    case, ref = _fused_case([1100, 20], 4, torch.bfloat16, seed=71)
    out = _decode(case, 72, FUSED, _workspace(2, 4, 72))
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("vsplit", [1, 2])
def test_fused_and_two_kernel_merges_agree(vsplit):
    # Same partials (bit for bit), and the merged output equal up to one bf16 rounding: the
    # fused tail groups its fp32 sums differently from the merge kernel.
    seq_lens, splits = [0, 1, 30, 130], 6
    case, ref = _fused_case(seq_lens, 20, torch.bfloat16, seed=81)
    ws_fused, ws_two = _workspace(4, 20, splits), _workspace(4, 20, splits)
    fused = _decode(case, splits, dataclasses.replace(FUSED, vsplit=vsplit), ws_fused)
    two = _decode(case, splits, dataclasses.replace(TWO_KERNEL, vsplit=vsplit), ws_two)
    torch.testing.assert_close(fused, two, atol=1e-6, rtol=2**-7)
    torch.testing.assert_close(two, ref, atol=2e-2, rtol=2e-2)
    for b, n in enumerate(seq_lens):
        a = mla_decode_mod.active_splits(n, splits, 16, 1)
        if a > 1:
            assert torch.equal(ws_fused.partial_out[b, :, :a], ws_two.partial_out[b, :, :a])
            # the fused tail leaves the merge weights 2^(lse - max lse) in the lse slots
            lse = ws_two.partial_lse[b, :, :a]
            weights = torch.exp2(lse - lse.max(dim=1, keepdim=True).values)
            torch.testing.assert_close(ws_fused.partial_lse[b, :, :a], weights)
    assert not ws_two.counters.any()  # the two-kernel path leaves them alone


def test_fused_merge_rejects_too_few_counters():
    case, _ = _fused_case([40, 9], 20, torch.bfloat16, seed=91)
    ws = mla_decode_mod.MLADecodeWorkspace.allocate(2, 20, 4, "cpu")
    assert ws.counters.numel() == mla_decode_mod.merge_counters_needed(2, 20) == 4
    short = dataclasses.replace(ws, counters=ws.counters[:3])  # 2 sequences x 2 head blocks
    with pytest.raises(ValueError, match="counters"):
        _decode(case, 4, FUSED, short)
    _decode(case, 4, TWO_KERNEL, short)  # the merge kernel needs none
    # 64-row head blocks: one group per sequence
    assert mla_decode_mod.merge_counters_needed(2, 20, block_h=64) == 2
