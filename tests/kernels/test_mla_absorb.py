"""The absorbed MLA products on kv_b_proj's stored weight (CPU interpreter) against per-head
fp32 matmuls on the dequantized weight."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from moeserve.kernels.attention import mla_absorb as ma  # noqa: E402
from moeserve.kernels.gemm.fp8_block_gemm import dequantize_fp8_block, quantize_fp8_block  # noqa: E402

NOPE, ROPE, V, LAT = 128, 64, 128, 512


def _kv_b(heads: int, fp8: bool, seed: int):
    """(stored weight, scale or None, dense fp32 [heads, nope + v, L])."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(heads * (NOPE + V), LAT, generator=g) * 0.05
    if not fp8:
        w = w.to(torch.bfloat16)
        return w, None, w.float().view(heads, NOPE + V, LAT)
    q, s = quantize_fp8_block(w)
    s = s * (0.5 + torch.rand(s.shape, generator=g))  # distinct scale per 128x128 block
    return q, s, dequantize_fp8_block(q, s, torch.float32).view(heads, NOPE + V, LAT)


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
@pytest.mark.parametrize("tokens", [1, 2, 5])
def test_absorbed_products_match_per_head_matmuls(fp8, tokens):
    heads = 3
    w, s, dense = _kv_b(heads, fp8, seed=tokens)
    ma.check_absorb_weight(w, s, heads, NOPE, V)
    g = torch.Generator().manual_seed(100 + tokens)
    # the layer's own strided views: q_nope is a column slice of q [T, H, nope + rope], the
    # latent query a column slice of [T, H, L + rope]
    q = torch.randn(tokens, heads, NOPE + ROPE, generator=g).to(torch.bfloat16)
    q_abs = torch.full((tokens, heads, LAT + ROPE), float("nan"), dtype=torch.bfloat16)
    ma.absorb_gemv(q[..., :NOPE], w, s, q_abs[..., :LAT], "uk", NOPE)
    o_lat = torch.randn(tokens, heads, LAT, generator=g).to(torch.bfloat16)
    o = torch.empty(tokens, heads, V, dtype=torch.bfloat16)
    ma.absorb_gemv(o_lat, w, s, o, "uv", NOPE)
    for h in range(heads):
        want_uk = q[:, h, :NOPE].float() @ dense[h, :NOPE]
        want_uv = o_lat[:, h].float() @ dense[h, NOPE:].t()
        tol = dict(rtol=1.6e-2, atol=1e-2 * want_uk.abs().max().item())
        torch.testing.assert_close(q_abs[:, h, :LAT].float(), want_uk, **tol)
        tol = dict(rtol=1.6e-2, atol=1e-2 * want_uv.abs().max().item())
        torch.testing.assert_close(o[:, h].float(), want_uv, **tol)
    assert torch.isnan(q_abs[..., LAT:].float()).all()  # the rope columns are left alone


def test_tile_configs_and_stages_are_honoured():
    # a non-default schedule (small tiles, pipelined loops, 2-row groups) gives the same
    heads, tokens = 2, 3
    w, s, dense = _kv_b(heads, True, seed=7)
    x = torch.randn(tokens, heads, NOPE).to(torch.bfloat16)
    out = torch.empty(tokens, heads, LAT, dtype=torch.bfloat16)
    cfg = dict(BLOCK_L=32, BLOCK_D=16, num_warps=1, num_stages=1, STAGES=3)
    ma.absorb_gemv(x, w, s, out, "uk", NOPE, config=cfg)
    want = torch.einsum("thd,hdl->thl", x.float(), dense[:, :NOPE])
    torch.testing.assert_close(out.float(), want, rtol=1.6e-2, atol=1e-2 * want.abs().max().item())
    # W_UK's whole head in one tile; W_UV on one row with its products summed once
    ma.absorb_gemv(x, w, s, out, "uk", NOPE, config=dict(cfg, BLOCK_D=128, STAGES=0))
    torch.testing.assert_close(out.float(), want, rtol=1.6e-2, atol=1e-2 * want.abs().max().item())
    o_lat = torch.randn(1, heads, LAT).to(torch.bfloat16)
    o = torch.empty(1, heads, V, dtype=torch.bfloat16)
    cfg = dict(BLOCK_N=16, BLOCK_K=64, num_warps=2, num_stages=1, STAGES=2, LATE_SUM=1)
    ma.absorb_gemv(o_lat, w, s, o, "uv", NOPE, config=cfg)
    want = torch.einsum("thl,hjl->thj", o_lat.float(), dense[:, NOPE:])
    torch.testing.assert_close(o.float(), want, rtol=1.6e-2, atol=1e-2 * want.abs().max().item())


def test_bad_weights_are_refused():
    w, s, _ = _kv_b(2, True, seed=1)
    with pytest.raises(ValueError, match="must be contiguous"):
        ma.check_absorb_weight(w, s, 3, NOPE, V)
    with pytest.raises(ValueError, match="scale blocks"):
        ma.check_absorb_weight(w, s, 2, 64, 192)
    with pytest.raises(ValueError, match="weight_scale_inv"):
        ma.check_absorb_weight(w, s[:, :2].contiguous(), 2, NOPE, V)
    with pytest.raises(ValueError, match="16-bit"):
        ma.check_absorb_weight(w.float(), None, 2, NOPE, V)
