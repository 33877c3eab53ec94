"""Fused block-FP8 / bf16 MoE (CPU interpreter) against a per-token oracle written from the
model's maths (DeepSeek's `Expert.forward`: w2(silu(w1 x) * w3 x), weighted sum over top-k)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from moeserve.kernels.gemm.fp8_block_gemm import quantize_fp8_block  # noqa: E402
from moeserve.kernels.moe.fp8 import check_fp8_moe_shapes, fused_moe_fp8  # noqa: E402
from tests.kernels.interpreter_shims import install_interpreter_shims  # noqa: E402

install_interpreter_shims()  # the one-token combine loops over a run-time slot count

E, H, INTER = 5, 192, 256  # H not a multiple of the 128 block: a partial scale block at the end


def _bank(n, k, gen, fp8):
    ws = [torch.randn(n, k, generator=gen) * 0.05 for _ in range(E)]
    if not fp8:
        return torch.stack(ws).to(torch.bfloat16), None, torch.stack(ws).to(torch.bfloat16).float()
    q = [quantize_fp8_block(w) for w in ws]
    w8 = torch.stack([a for a, _ in q])
    s = torch.stack([b for _, b in q])
    # the oracle dequantizes block by block, independently of the kernels' module
    dense = w8.float().clone()
    for e in range(E):
        for bi in range(s.shape[1]):
            for bj in range(s.shape[2]):
                dense[e, bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128] *= s[e, bi, bj]
    return w8, s, dense


@pytest.fixture(scope="module", params=["fp8", "bf16"])
def bank(request):
    gen = torch.Generator().manual_seed(0)
    fp8 = request.param == "fp8"
    w13, s13, d13 = _bank(2 * INTER, H, gen, fp8)
    w2, s2, d2 = _bank(H, INTER, gen, fp8)
    check_fp8_moe_shapes(w13, s13, w2, s2)
    return w13, s13, d13, w2, s2, d2


def _oracle(x, ids, tw, d13, d2):
    out = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < E:
                continue
            gu = d13[e] @ x[t].float()
            a = (torch.nn.functional.silu(gu[:INTER]) * gu[INTER:]).to(torch.bfloat16).float()
            out[t] += float(tw[t, j]) * (d2[e] @ a)
    return out


def _route(m, k, seed, foreign=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(m)]).to(torch.int32)
    if foreign:  # expert parallelism: ids of other ranks' experts fall outside [0, E)
        ids[::2, 0] = E + 3
        ids[1::3, -1] = -2
    return ids, torch.rand(m, k, generator=g)


@pytest.mark.parametrize(
    "m,k,kernel,foreign",
    [
        (1, 2, "gemv", False),  # one token: direct blocks, no alignment launch
        (1, 3, "gemv", True),
        (3, 3, "gemv", True),
        (6, 2, "gemv", False),
        (5, 3, "mma", True),
    ],
)
def test_fused_moe_matches_oracle(bank, m, k, kernel, foreign):
    w13, s13, d13, w2, s2, d2 = bank
    ids, tw = _route(m, k, m + k, foreign)
    x = torch.randn(m, H, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    cfg = {"MP": 4 if m > 2 else 1} if kernel == "gemv" else {"BLOCK_M": 16}
    cfg.update(BLOCK_N=64, DOWN_BLOCK_N=64, BLOCK_K=64)
    got = fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, kernel=kernel, config=cfg)
    want = _oracle(x, ids, tw, d13, d2)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-3)


def test_accumulate_adds_to_out(bank):
    w13, s13, d13, w2, s2, d2 = bank
    ids, tw = _route(2, 2, 7)
    x = torch.randn(2, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    base = torch.randn(2, H, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    out = base.clone()
    fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, out=out, accumulate=True)
    moe = _oracle(x, ids, tw, d13, d2)
    # where base and the MoE output cancel, the bf16 error of the MoE part is what remains
    atol = 1e-2 * moe.abs().max().item()
    torch.testing.assert_close(out.float(), moe + base.float(), rtol=2e-2, atol=atol)


@pytest.mark.parametrize("accumulate", [False, True])
def test_one_token_combines_in_the_down_launch_and_rezeroes_its_counters(bank, accumulate):
    """One token: the down launch's last program per column tile combines (no combine
    launch). Two calls share the caller's counters, as CUDA-graph replays do: each result
    matches the oracle and the counters end zeroed."""
    w13, s13, d13, w2, s2, d2 = bank
    counters = torch.zeros(H, dtype=torch.int32)
    # the down launch with its own K tile and warps, products summed once per program
    cfg = dict(MP=1, BLOCK_N=64, DOWN_BLOCK_N=32, BLOCK_K=64, LATE_SUM=1)
    cfg.update(DOWN_BLOCK_K=32, DOWN_WARPS=2, DOWN_STAGES=2)
    for seed in (5, 6):
        ids, tw = _route(1, 3, seed, foreign=seed == 6)
        x = torch.randn(1, H, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        base = torch.randn(1, H, generator=torch.Generator().manual_seed(seed + 9))
        out = base.to(torch.bfloat16)
        fused_moe_fp8(
            x, ids, tw, w13, s13, w2, s2, out=out, accumulate=accumulate, kernel="gemv",
            config=cfg, combine_counters=counters,
        )  # fmt: skip
        want = _oracle(x, ids, tw, d13, d2) + (base.to(torch.bfloat16).float() if accumulate else 0)
        atol = 1e-2 * want.abs().max().item()
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=atol)
        assert not counters.any()


def test_shape_check_rejects_unaligned_intermediate():
    w13 = torch.zeros(2, 2 * 96, 128, dtype=torch.float8_e4m3fn)
    w2 = torch.zeros(2, 128, 96, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiple of 128"):
        check_fp8_moe_shapes(w13, torch.ones(2, 2, 1), w2, torch.ones(2, 1, 1))
