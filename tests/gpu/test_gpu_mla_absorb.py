"""The absorbed MLA products on kv_b_proj's stored weight (kernels/attention/mla_absorb.py) on a
GPU, at the published shapes (128 or 16 heads, nope = v = 128, kv_lora 512), against per-head fp32
matmuls on the dequantized weight, for every row count the tables serve and in a CUDA graph.

    python3 -m pytest -q tests/gpu/test_gpu_mla_absorb.py
"""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.attention import mla_absorb as ma
from moeserve.kernels.gemm.fp8_block_gemm import dequantize_fp8_block, quantize_fp8_block

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"
NOPE, ROPE, V, LAT = 128, 64, 128, 512


def _kv_b(heads: int, fp8: bool, seed: int):
    gen = torch.Generator(DEV).manual_seed(seed)
    w = torch.randn(heads * (NOPE + V), LAT, device=DEV, generator=gen) * 0.05
    if not fp8:
        w = w.bfloat16()
        return w, None, w.float().view(heads, NOPE + V, LAT)
    q, s = quantize_fp8_block(w)
    s = s * (0.5 + torch.rand(s.shape, device=DEV, generator=gen))
    return q, s, dequantize_fp8_block(q, s, torch.float32).view(heads, NOPE + V, LAT)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_absorbed_products_match_per_head_matmuls(heads, fp8):
    w, s, dense = _kv_b(heads, fp8, seed=heads)
    ma.check_absorb_weight(w, s, heads, NOPE, V)
    top = max(ma.absorb_max_rows("uk", w, heads), ma.absorb_max_rows("uv", w, heads))
    for tokens in sorted({1, 2, 3, 4, 5, 9, max(top, 1)}):  # top 0: bmm serves every row
        gen = torch.Generator(DEV).manual_seed(tokens)
        q = torch.randn(tokens, heads, NOPE + ROPE, device=DEV, generator=gen).bfloat16()
        q_abs = torch.full((tokens, heads, LAT + ROPE), float("nan"), device=DEV).bfloat16()
        ma.absorb_gemv(q[..., :NOPE], w, s, q_abs[..., :LAT], "uk", NOPE)
        _close(
            q_abs[..., :LAT], torch.einsum("thd,hdl->thl", q[..., :NOPE].float(), dense[:, :NOPE])
        )
        assert torch.isnan(q_abs[..., LAT:].float()).all()
        o_lat = torch.randn(tokens, heads, LAT, device=DEV, generator=gen).bfloat16()
        o = torch.empty(tokens, heads, V, device=DEV, dtype=torch.bfloat16)
        ma.absorb_gemv(o_lat, w, s, o, "uv", NOPE)
        _close(o, torch.einsum("thl,hjl->thj", o_lat.float(), dense[:, NOPE:]))


def test_graph_replay_reads_new_inputs():
    heads, tokens = 128, 4
    w, s, dense = _kv_b(heads, True, seed=5)
    x = torch.zeros(tokens, heads, NOPE, device=DEV, dtype=torch.bfloat16)
    out = torch.empty(tokens, heads, LAT, device=DEV, dtype=torch.bfloat16)
    ma.absorb_gemv(x, w, s, out, "uk", NOPE)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ma.absorb_gemv(x, w, s, out, "uk", NOPE)
    for seed in (1, 2):
        x.copy_(torch.randn(x.shape, device=DEV, generator=torch.Generator(DEV).manual_seed(seed)))
        g.replay()
        _close(out, torch.einsum("thd,hdl->thl", x.float(), dense[:, :NOPE]))


@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_uk_launch_carries_the_rope_and_cache_write(heads, cache_dtype):
    """The decode rows' rope + cache write inside the W_UK launch against the write's own
    torch reference (padding slot, permuted pages, NaN elsewhere) and the product against
    per-head matmuls."""
    from moeserve.kernels.attention import kv_cache as kv
    from moeserve.layers.rotary import RotaryEmbedding

    w, s, dense = _kv_b(heads, True, seed=11)
    rot = RotaryEmbedding(ROPE, 4096, 10000.0, None, interleaved=True).to(DEV)
    for tokens in (1, 3):
        gen = torch.Generator(DEV).manual_seed(tokens)
        q = torch.randn(tokens, heads, NOPE + ROPE, device=DEV, generator=gen).bfloat16()
        kv_a = torch.randn(tokens, LAT + ROPE, device=DEV, generator=gen).bfloat16()
        positions = torch.randint(0, 4096, (tokens,), device=DEV, generator=gen)
        slots = torch.randperm(64, device=DEV, generator=gen)[:tokens].long()
        slots[1:2] = -1  # a padding row (CUDA-graph batch)
        scale = torch.tensor([0.05], device=DEV) if cache_dtype != torch.bfloat16 else None
        cache = torch.full((4, 16, LAT + ROPE), float("nan"), device=DEV).to(cache_dtype)
        ref_cache = cache.clone()
        q_abs = torch.full((tokens, heads, LAT + ROPE), float("nan"), device=DEV).bfloat16()
        rope = kv.CacheRope(positions, rot.cos, rot.sin, q[..., NOPE:], q_abs[..., LAT:])
        write = kv.CacheWrite(kv_a[:, :LAT], kv_a[:, LAT:], cache, slots, scale, rope)
        ma.absorb_gemv(q[..., :NOPE], w, s, q_abs[..., :LAT], "uk", NOPE, cache_write=write)
        ref_q = torch.empty(tokens, heads, ROPE, device=DEV, dtype=torch.bfloat16)
        ref_rope = kv.CacheRope(positions, rot.cos, rot.sin, q[..., NOPE:], ref_q)
        kv.write_mla_cache_ref(kv_a[:, :LAT], kv_a[:, LAT:], ref_cache, slots, scale, ref_rope)
        # as the write's own launch (test_gpu_mla_fused.py): within one bf16 ulp (fused
        # multiply-adds), one e4m3 step where that rounding differed
        got_q, want_q = q_abs[..., LAT:].float(), ref_q.float()
        assert torch.all((got_q - want_q).abs() <= want_q.abs() / 128 + 1e-6)
        got, want = cache.float(), ref_cache.float()
        assert torch.equal(got.isnan(), want.isnan())
        got, want = got.nan_to_num(), want.nan_to_num()
        step = 128 if cache_dtype == torch.bfloat16 else 8
        assert torch.all((got - want).abs() <= want.abs() / step + 1e-3)
        assert (got == want).float().mean() > 0.95
        _close(
            q_abs[..., :LAT], torch.einsum("thd,hdl->thl", q[..., :NOPE].float(), dense[:, :NOPE])
        )
