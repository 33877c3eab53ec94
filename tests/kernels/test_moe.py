"""Fused NVFP4 MoE (CPU interpreter) against the torch reference and a per-token oracle."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from moeserve.kernels.gemm.nvfp4_format import dequantize_nvfp4, quantize_nvfp4  # noqa: E402
from moeserve.kernels.gemm.nvfp4_gemm import DECODE_ARITH, DECODE_BITS  # noqa: E402
from moeserve.kernels.moe import nvfp4 as moe  # noqa: E402
from tests.kernels.interpreter_shims import install_interpreter_shims  # noqa: E402

install_interpreter_shims()  # the one-token combine loops over a run-time slot count


def _stack(e, n, k, gen):
    parts = [quantize_nvfp4(torch.randn(n, k, generator=gen) * 0.1) for _ in range(e)]
    return tuple(torch.stack([p[i] for p in parts]) for i in range(3))


@pytest.fixture(scope="module")
def weights():
    gen = torch.Generator().manual_seed(0)
    e, h, i = 6, 48, 32  # H, I not multiples of the tiles used below
    w13 = _stack(e, 2 * i, h, gen)
    w2 = _stack(e, h, i, gen)
    return e, h, i, w13, w2


def _route(m, e, k, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).to(torch.int32)
    return ids, torch.rand(m, k, generator=g)


def test_reference_matches_per_token_oracle(weights):
    e, h, i, (w13, s13, g13), (w2, s2, g2) = weights
    ids, tw = _route(3, e, 2, 1)
    x = torch.randn(3, h).to(torch.bfloat16)
    ref = moe.fused_moe_nvfp4_ref(x, ids, tw, w13, s13, g13, w2, s2, g2).float()
    for t in range(3):
        acc = torch.zeros(h)
        for j in range(2):
            ex = ids[t, j].item()
            w_gu = dequantize_nvfp4(w13[ex], s13[ex], g13[ex], torch.float32)
            w_d = dequantize_nvfp4(w2[ex], s2[ex], g2[ex], torch.float32)
            gu = w_gu @ x[t].float()
            a = (torch.nn.functional.silu(gu[:i]) * gu[i:]).to(torch.bfloat16).float()
            acc += tw[t, j] * (w_d @ a)
        torch.testing.assert_close(ref[t], acc.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("m,k,block_m", [(1, 3, 16), (9, 4, 16), (40, 2, 16), (7, 3, 32)])
def test_align(m, k, block_m):
    e = 6
    ids, _ = _route(m, e, k, m)
    sorted_ids, expert_ids = moe.moe_align(ids, e, block_m)
    flat = ids.flatten()
    nb = expert_ids.numel()
    assert nb == moe.max_aligned_blocks(m * k, e, block_m)
    seen = []
    for b in range(nb):
        slots = sorted_ids[b * block_m : (b + 1) * block_m]
        real = slots[slots < m * k]
        if expert_ids[b] < 0:
            assert real.numel() == 0
            continue
        assert (flat[real.long()] == expert_ids[b]).all()
        seen += real.tolist()
    assert sorted(seen) == list(range(m * k))  # every slot exactly once
    # blocks of one expert are contiguous and each expert's blocks are full except the last
    used = expert_ids[expert_ids >= 0].tolist()
    assert used == sorted(used)


GU = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2)
DN = dict(BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)


def _gemv(mp):
    return dict(MP=mp, BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=1)


@pytest.mark.parametrize(
    "m,k,cfgs,decode,kernel",
    [
        (1, 3, (GU, DN), DECODE_BITS, "mma"),
        (5, 3, (None, None), DECODE_ARITH, "mma"),
        (40, 2, (GU, DN), DECODE_BITS, "mma"),  # experts with more than BLOCK_M slots
        (1, 3, (_gemv(1), None), DECODE_BITS, "gemv"),
        (5, 3, (None, None), DECODE_ARITH, "gemv"),  # tiles.json's decode config
        (9, 4, (_gemv(2), None), DECODE_BITS, "gemv"),
        (40, 2, (_gemv(4), None), DECODE_BITS, "gemv"),  # experts with many blocks
        (3, 3, (dict(_gemv(1), STAGES=3), None), DECODE_BITS, "gemv"),  # pipelined K loop
        # 16-wide K tiles divide H: unmasked loads in both launches (EVEN)
        (2, 3, (dict(_gemv(1), BLOCK_K=16, STAGES=2), None), DECODE_BITS, "gemv"),
        (1, 3, (dict(_gemv(1), BLOCK_K=16, STAGES=2, F16=1), None), DECODE_BITS, "gemv"),
        (3, 3, (dict(_gemv(1), BLOCK_K=16, PREFETCH=2, F16=1), None), DECODE_BITS, "gemv"),
        # split-K: gate_up in 3 K ranges, down in 2 (its 2 K tiles); one token, then aligned blocks
        (1, 3, (dict(_gemv(1), BLOCK_K=16, SPLIT_K=3, STAGES=2), None), DECODE_BITS, "gemv"),
        (1, 3, (dict(_gemv(1), BLOCK_K=16, SPLIT_K=2, F16=1), None), DECODE_BITS, "gemv"),
        (5, 3, (dict(_gemv(1), BLOCK_K=16, SPLIT_K=3, DOWN_SPLIT_K=2), None), DECODE_BITS, "gemv"),
    ],
)
def test_fused_matches_reference(weights, m, k, cfgs, decode, kernel):
    # "gemv" is the CUDA-core decode path, "mma" the tensor-core one; H = 48 is not a multiple
    # of BLOCK_K, so the last K tile of gate_up is partly masked.
    e, h, i, (w13, s13, g13), (w2, s2, g2) = weights
    ids, tw = _route(m, e, k, 100 + m)
    x = torch.randn(m, h).to(torch.bfloat16)
    ref = moe.fused_moe_nvfp4_ref(x, ids, tw, w13, s13, g13, w2, s2, g2).float()
    out = torch.empty(m, h, dtype=torch.bfloat16)
    y = moe.fused_moe_nvfp4(
        x,
        ids,
        tw,
        w13,
        s13,
        g13,
        w2,
        s2,
        g2,
        out=out,
        gate_up_config=cfgs[0],
        down_config=cfgs[1],
        decode=decode,
        kernel=kernel,
    )
    assert y.data_ptr() == out.data_ptr()
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.parametrize("m", [1, 4])
def test_split_k_counters_are_left_zeroed(weights, m):
    """The split-K tile counters live in the caller's zeroed scratch (after the combine's) and
    must be zero again after each call, or the next call (a CUDA-graph replay) would miss its
    last program: two calls in a row on one scratch both match the reference."""
    e, h, i, (w13, s13, g13), (w2, s2, g2) = weights
    cfg = dict(_gemv(1), BLOCK_K=16, SPLIT_K=3)
    counters = torch.zeros(moe.combine_counters_needed(h, i, 3) * m, dtype=torch.int32)
    for seed in (1, 2):
        ids, tw = _route(m, e, 3, seed)
        x = torch.randn(m, h).to(torch.bfloat16)
        ref = moe.fused_moe_nvfp4_ref(x, ids, tw, w13, s13, g13, w2, s2, g2).float()
        y = moe.fused_moe_nvfp4(
            x, ids, tw, w13, s13, g13, w2, s2, g2, gate_up_config=cfg, kernel="gemv",
            decode=DECODE_BITS, combine_counters=counters,
        )  # fmt: skip
        torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
        assert not counters.any()


def test_shape_checks(weights):
    e, h, i, (w13, s13, g13), (w2, s2, g2) = weights
    ids, tw = _route(2, e, 2, 0)
    x = torch.randn(2, h).to(torch.bfloat16)
    with pytest.raises(ValueError):
        moe.fused_moe_nvfp4(x, ids, tw[:, :1], w13, s13, g13, w2, s2, g2)
    with pytest.raises(ValueError):
        moe.fused_moe_nvfp4(x, ids, tw, w13, s13, g13[:2], w2, s2, g2)


@pytest.mark.parametrize("kernel,m", [("gemv", 6), ("gemv", 1), ("gemv-split", 1), ("mma", 6)])
def test_other_ranks_experts_are_skipped_and_shared_output_accumulates(weights, kernel, m):
    """Expert parallelism: ids outside [0, E) are another rank's experts and add nothing
    (the oracle: the reference on the same slots with those slots' weights zeroed); the
    combine adds the given output (the shared expert's) instead of overwriting it. One token
    takes the GEMV's direct blocks (no alignment), which must skip those ids themselves."""
    e, h, i, (w13, s13, g13), (w2, s2, g2) = weights
    k = 3
    ids, tw = _route(m, e, k, 7)
    foreign = torch.rand(m, k, generator=torch.Generator().manual_seed(3)) < 0.4
    # token 0: one id shifted above E (even), one below 0 (odd), one local
    foreign[0] = torch.tensor([True, True, False])
    ids[0] = torch.tensor([0, 1, 2 + int(ids[0, 2]) % (e - 2)], dtype=ids.dtype)
    ids_ep = torch.where(foreign, ids + e * torch.where(ids % 2 == 0, 1, -1), ids)
    x = torch.randn(m, h).to(torch.bfloat16)
    shared = torch.randn(m, h).to(torch.bfloat16)
    tw_local = torch.where(foreign, torch.zeros_like(tw), tw)
    ref = moe.fused_moe_nvfp4_ref(x, ids, tw_local, w13, s13, g13, w2, s2, g2).float()
    ref = ref + shared.float()
    cfgs = {
        "gemv": (_gemv(2), None),
        "gemv-split": (dict(_gemv(1), BLOCK_K=16, SPLIT_K=3), None),
        "mma": (GU, DN),
    }[kernel]
    kernel = kernel.split("-")[0]
    out = shared.clone()
    y = moe.fused_moe_nvfp4(
        x,
        ids_ep,
        tw,
        w13,
        s13,
        g13,
        w2,
        s2,
        g2,
        out=out,
        accumulate=True,
        gate_up_config=cfgs[0],
        down_config=cfgs[1],
        kernel=kernel,
    )
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    # and the reference itself skips foreign ids
    ref_ep = moe.fused_moe_nvfp4_ref(x, ids_ep, tw, w13, s13, g13, w2, s2, g2).float()
    torch.testing.assert_close(ref_ep + shared.float(), ref, rtol=1e-2, atol=1e-2)
