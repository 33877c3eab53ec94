"""Native CPU kernels (moeserve/kernels/cpu): each against an fp64 reference written from its
definition, and the property they exist for: a row's bits do not depend on how many rows the
call holds, which ones, the thread count, or (attention) whether its keys were written in
this step or an earlier one. Both builds are tested: the one for this CPU (AVX-512 BF16 where
present) and the portable C one; each must agree with itself.

Attention pages follow FlashMLA's tests: pages in a permuted order, every page no sequence
owns and every slot past a sequence's length filled with NaN."""

from __future__ import annotations

import platform

import pytest
import torch

import moeserve.kernels.cpu as K
from moeserve.kernels.cpu import build

BF16_REL = 2.0**-8  # one bf16 rounding of the output


def _builds() -> list[str]:
    names = ["native"]
    if platform.machine() in ("x86_64", "AMD64"):
        names.append("x86-64")  # no AVX-512: the portable C path
    return names


@pytest.fixture(params=_builds())
def lib(request, monkeypatch):
    cc = build.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    native = build.open_library(build.build(cc, request.param))
    if request.param != "native":
        assert not native.simd
    monkeypatch.setattr(K, "native", lambda: native)
    return native


def _weight(fmt: str, n: int, k: int, gen: torch.Generator) -> K.PackedWeight:
    if fmt == "bf16":
        return K.pack_bf16(torch.randn(n, k, generator=gen))
    if fmt == "i8":
        return K.pack_i8(
            torch.randint(-127, 128, (n, k), generator=gen), torch.rand(n, generator=gen) / 50
        )
    codes = torch.randint(0, 16, (n, k), generator=gen)
    d = torch.rand(n, k // K.GROUP, generator=gen) / 50
    c = torch.randn(n, k // K.GROUP, generator=gen) / 50 - K.Q4_BIAS * d
    return K.pack_q4(codes, d, c)


@pytest.mark.parametrize("fmt", ["bf16", "q4", "i8"])
@pytest.mark.parametrize("n, k", [(100, 96), (16, 64), (40, 32)])
def test_linear_matches_reference_and_rows_are_independent(lib, fmt, n, k):
    gen = torch.Generator().manual_seed(n * k)
    w = _weight(fmt, n, k, gen)
    x = torch.randn(37, k, generator=gen).bfloat16()
    full = K.linear(x, w, torch.float32)
    ref = K.linear_reference(x, w)
    assert (full.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    for rows in (slice(36, 37), slice(0, 1), slice(3, 11), slice(30, 37), slice(5, 6)):
        assert torch.equal(K.linear(x[rows], w, torch.float32), full[rows])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(K.linear(x, w, torch.float32), full)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(K.linear(x, w), full.bfloat16())  # bf16 output: one rounding


def test_q4_packing_round_trips():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (40, 64), generator=gen)
    d, c = torch.rand(40, 2, generator=gen), torch.randn(40, 2, generator=gen)
    w = K.pack_q4(codes, d, c)
    dense = (K.Q4_BIAS + codes.double()) * d.double().repeat_interleave(32, 1)
    assert torch.allclose(K.unpack(w), dense + c.double().repeat_interleave(32, 1))


def test_silu_mul_and_sigmoid(lib):
    gen = torch.Generator().manual_seed(1)
    gu = (3 * torch.randn(9, 2 * 70, generator=gen)).bfloat16()
    g, u = gu[:, :70].double(), gu[:, 70:].double()
    ref = g * torch.sigmoid(g) * u
    out = K.silu_mul(gu)
    assert ((out.double() - ref).abs() <= BF16_REL * ref.abs() + 1e-30).all()
    assert torch.equal(K.silu_mul(gu[4:5]), out[4:5])
    assert torch.equal(K.silu_mul(gu[:, :70].contiguous(), gu[:, 70:].contiguous()), out)
    x = 8 * torch.randn(203, generator=gen)
    s = K.sigmoid_(x.clone())
    assert torch.allclose(s.double(), torch.sigmoid(x.double()), rtol=1e-6, atol=1e-7)
    assert torch.equal(K.sigmoid_(x[50:51].clone()), s[50:51])  # position in the tensor


def _paged(
    kvh: int, d: int, seq_lens: list[int], page_size: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V caches with the sequences' pages in a permuted order; every slot that no
    sequence owns is NaN."""
    need = [-(-s // page_size) for s in seq_lens]
    pages = sum(need) + 3
    perm = torch.randperm(pages, generator=gen).int()
    width = max(need)
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    kc = torch.full((pages, page_size, kvh, d), float("nan"), dtype=torch.bfloat16)
    vc = kc.clone()
    o = 0
    for b, (s, n) in enumerate(zip(seq_lens, need, strict=True)):
        table[b, :n] = perm[o : o + n]
        for t in range(s):
            page, off = int(table[b, t // page_size]), t % page_size
            kc[page, off] = torch.randn(kvh, d, generator=gen).bfloat16()
            vc[page, off] = torch.randn(kvh, d, generator=gen).bfloat16()
        o += n
    return kc, vc, table


@pytest.mark.parametrize(
    "heads, kvh, d, v_dim, page_size",
    [(6, 2, 64, 64, 16), (4, 4, 40, 40, 32), (8, 1, 72, 64, 16)],  # GQA, MHA, MLA-like
)
def test_attention_matches_reference_and_any_split(lib, heads, kvh, d, v_dim, page_size):
    gen = torch.Generator().manual_seed(heads * d)
    seq_lens, query_lens = [70, 1, 33], [70, 1, 5]
    kc, vc, table = _paged(kvh, d, seq_lens, page_size, gen)
    q = torch.randn(sum(query_lens), heads, d, generator=gen).bfloat16()
    scale = d**-0.5
    out = K.attention(q, kc, vc, table, query_lens, seq_lens, scale, v_dim)
    ref = K.attention_reference(q, kc, vc, table, query_lens, seq_lens, scale, v_dim)
    assert not out.isnan().any()
    assert (out.double() - ref).abs().max() <= 4 * BF16_REL * ref.abs().max()
    # sequence 0 (70 positions, all new in the batch above): alone, in chunks after its
    # cached context, and one position at a time, every row has the same bits
    t0 = table[:1]
    assert torch.equal(K.attention(q[:70], kc, vc, t0, [70], [70], scale, v_dim), out[:70])
    for start, stop in ((0, 16), (16, 40), (40, 69), (69, 70)):
        chunk = K.attention(q[start:stop], kc, vc, t0, [stop - start], [stop], scale, v_dim)
        assert torch.equal(chunk, out[start:stop]), (start, stop)
    for pos in (0, 15, 16, 31, 47, 69):
        one = K.attention(q[pos : pos + 1], kc, vc, t0, [1], [pos + 1], scale, v_dim)
        assert torch.equal(one, out[pos : pos + 1]), pos
    # the last query rows of sequence 2 batched differently
    tail = K.attention(q[71:], kc, vc, table[2:], [5], [33], scale, v_dim)
    assert torch.equal(tail, out[71:])


def test_attention_refuses_unsupported_head_layouts(lib):
    kc = torch.zeros(2, 16, 3, 8, dtype=torch.bfloat16)
    q = torch.zeros(1, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="heads"):
        K.attention(q, kc, kc, torch.zeros(1, 1, dtype=torch.int32), [1], [1], 1.0, 8)
