"""RoPE fused into the MLA cache write vs its torch reference and vs the model's own
RotaryEmbedding (YaRN tables, interleaved pairs), under the Triton CPU interpreter: strided
q views, padding slots, permuted pages with NaN elsewhere, BF16 and FP8 caches."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported (triton.jit reads it)

import pytest  # noqa: E402
import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import moeserve.kernels.attention.kv_cache as kv_mod  # noqa: E402
from moeserve.config import RopeScaling  # noqa: E402
from moeserve.layers.rotary import RotaryEmbedding  # noqa: E402
from tests.kernels.interpreter_shims import install_interpreter_shims  # noqa: E402
from tests.kernels.rounding_shim import install_bf16_rounding_shim  # noqa: E402

install_interpreter_shims()
install_bf16_rounding_shim()
if not isinstance(kv_mod._write_mla_cache_kernel, InterpretedFunction):
    kv_mod = importlib.reload(kv_mod)

FP8 = torch.float8_e4m3fn
NOPE = 128


def _rotary() -> RotaryEmbedding:
    yarn = RopeScaling(
        type="yarn",
        factor=32.0,
        original_max_position_embeddings=128,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    return RotaryEmbedding(64, 256, 50000.0, yarn, interleaved=True)


def _case(tokens: int, heads: int, page_size: int, act: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_pages = -(-tokens // page_size) + 3
    c = (torch.randn(tokens, 512, generator=gen) * 2).to(act)
    kv_a = (torch.randn(tokens, 512 + 64, generator=gen) * 2).to(act)  # k_pe: a strided view
    q = (torch.randn(tokens, heads, NOPE + 64, generator=gen) * 2).to(act)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:tokens].long()
    slots[1::4] = -1  # padding tokens
    return c, kv_a[:, 512:], q, positions, slots, num_pages


def _caches(num_pages: int, page_size: int, dtype: torch.dtype):
    cache = torch.full((num_pages, page_size, 576), float("nan"))
    if dtype == FP8:
        return cache.to(FP8), cache.to(FP8)
    return cache.to(dtype), cache.to(dtype)


@pytest.mark.parametrize(
    ("tokens", "heads", "page_size", "act", "cache_dtype"),
    [
        (13, 8, 16, torch.bfloat16, torch.bfloat16),
        (6, 5, 1, torch.bfloat16, FP8),
        (9, 16, 64, torch.float32, torch.bfloat16),
        (1, 64, 64, torch.bfloat16, torch.bfloat16),
        (3, 40, 64, torch.bfloat16, FP8),  # head blocks of 16: two full, one partial
    ],
)
def test_rope_and_write_match_reference_and_rotary_embedding(
    tokens, heads, page_size, act, cache_dtype
):
    rot = _rotary()
    c, k_pe, q, positions, slots, num_pages = _case(tokens, heads, page_size, act, tokens + heads)
    scale = torch.tensor([0.07]) if cache_dtype == FP8 else None
    cache, ref_cache = _caches(num_pages, page_size, cache_dtype)
    # the kernel rotates q's rope columns into the absorbed query buffer's rope columns
    qcat = torch.full((tokens, heads, 576), float("nan"), dtype=act)
    rope = kv_mod.CacheRope(positions, rot.cos, rot.sin, q[..., NOPE:], qcat[..., 512:])
    kv_mod.write_mla_cache(c, k_pe, cache, slots, scale, rope)
    ref_q = torch.empty(tokens, heads, 64, dtype=act)
    ref_rope = kv_mod.CacheRope(positions, rot.cos, rot.sin, q[..., NOPE:], ref_q)
    kv_mod.write_mla_cache_ref(c, k_pe, ref_cache, slots, scale, ref_rope)
    assert torch.equal(qcat[..., 512:], ref_q)
    assert qcat[..., :512].isnan().all()  # nothing else written
    assert torch.equal(cache.float().isnan(), ref_cache.float().isnan())
    assert torch.equal(cache.float().nan_to_num(), ref_cache.float().nan_to_num())

    # independent oracle: the model's RotaryEmbedding on the same inputs
    want_q, want_k = rot(positions, q[..., NOPE:], k_pe.unsqueeze(1))
    assert torch.equal(ref_q, want_q)
    for t in range(tokens):
        s = int(slots[t])
        if s < 0:
            continue
        row = cache[s // page_size, s % page_size].float()
        want = torch.cat([c[t], want_k[t, 0].to(c.dtype)]).float()
        if cache_dtype == FP8:
            want = (want / scale).clamp(-448, 448).to(FP8).float()
        else:
            want = want.to(cache_dtype).float()
        assert torch.equal(row, want), t
    # every page row that no token owns is still NaN
    written = {int(s) for s in slots if s >= 0}
    flat = cache.float().view(-1, 576)
    for s in range(flat.shape[0]):
        assert flat[s].isnan().all() != (s in written)


def test_q_rotated_in_place_and_padding_rows_rotated_too():
    rot = _rotary()
    c, k_pe, q, positions, slots, num_pages = _case(7, 4, 16, torch.bfloat16, 3)
    slots[:] = -1  # an all-padding batch (CUDA-graph warm-up): the cache stays untouched
    cache, _ = _caches(num_pages, 16, torch.bfloat16)
    q0 = q.clone()
    kv_mod.write_mla_cache(
        c, k_pe, cache, slots, None, kv_mod.CacheRope(positions, rot.cos, rot.sin, q[..., NOPE:])
    )
    want_q, _ = rot(positions, q0[..., NOPE:], k_pe.unsqueeze(1))
    assert torch.equal(q[..., NOPE:], want_q)
    assert torch.equal(q[..., :NOPE], q0[..., :NOPE])
    assert cache.isnan().all()


def test_rope_argument_checks():
    rot = _rotary()
    c, k_pe, q, positions, slots, num_pages = _case(3, 2, 16, torch.bfloat16, 5)
    cache, _ = _caches(num_pages, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="positions"):
        kv_mod.write_mla_cache(
            c, k_pe, cache, slots, None, kv_mod.CacheRope(positions[:2], rot.cos, rot.sin)
        )
    with pytest.raises(ValueError, match="cos"):
        kv_mod.write_mla_cache(
            c, k_pe, cache, slots, None, kv_mod.CacheRope(positions, rot.cos.double(), rot.sin)
        )
    with pytest.raises(ValueError, match="q_pe"):
        kv_mod.write_mla_cache(
            c, k_pe, cache, slots, None, kv_mod.CacheRope(positions, rot.cos, rot.sin, q[..., :32])
        )


@pytest.mark.parametrize(
    ("tokens", "heads", "page_size", "cache_dtype"),
    [(1, 3, 16, torch.bfloat16), (3, 5, 1, FP8), (6, 2, 64, torch.bfloat16)],
)
def test_absorbed_uk_launch_carries_the_rope_and_cache_write(tokens, heads, page_size, cache_dtype):
    """Decode rows: mla_absorb's W_UK launch also ropes q_pe and writes the cache (no launch
    of its own). Oracles: the write's torch reference, and per-head fp32 matmuls on the
    dequantized kv_b_proj weight for the product."""
    from moeserve.kernels.attention import mla_absorb as ma
    from moeserve.kernels.gemm import fp8_block_gemm as f8

    if ma.rope_write_program is not kv_mod.rope_write_program:  # follow the reload above
        ma = importlib.reload(ma)
    rot = _rotary()
    act = torch.bfloat16
    c, k_pe, q, positions, slots, num_pages = _case(tokens, heads, page_size, act, 40 + tokens)
    scale = torch.tensor([0.07]) if cache_dtype == FP8 else None
    cache, ref_cache = _caches(num_pages, page_size, cache_dtype)
    gen = torch.Generator().manual_seed(tokens)
    w, ws = f8.quantize_fp8_block(torch.randn(heads * (NOPE + 128), 512, generator=gen) * 0.05)
    q_abs = torch.full((tokens, heads, 576), float("nan"), dtype=act)
    rope = kv_mod.CacheRope(positions, rot.cos, rot.sin, q[..., NOPE:], q_abs[..., 512:])
    write = kv_mod.CacheWrite(c, k_pe, cache, slots, scale, rope)
    ma.absorb_gemv(q[..., :NOPE], w, ws, q_abs[..., :512], "uk", NOPE, cache_write=write)

    ref_q = torch.empty(tokens, heads, 64, dtype=act)
    ref_rope = kv_mod.CacheRope(positions, rot.cos, rot.sin, q[..., NOPE:], ref_q)
    kv_mod.write_mla_cache_ref(c, k_pe, ref_cache, slots, scale, ref_rope)
    assert torch.equal(q_abs[..., 512:], ref_q)
    assert torch.equal(cache.float().isnan(), ref_cache.float().isnan())
    assert torch.equal(cache.float().nan_to_num(), ref_cache.float().nan_to_num())
    want = ma.absorb_ref(q[..., :NOPE], w, ws, "uk", NOPE)
    atol = 1e-2 * want.abs().max().item()
    torch.testing.assert_close(q_abs[..., :512].float(), want, rtol=1.6e-2, atol=atol)
    with pytest.raises(ValueError, match="tokens and heads"):
        ma.absorb_gemv(q[:, :1, :NOPE], w[: NOPE + 128], ws[:2], q_abs[:, :1, :512], "uk", NOPE,
                       cache_write=write)  # fmt: skip
