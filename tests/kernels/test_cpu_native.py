"""Native CPU kernels (moeserve/kernels/cpu): each against an fp64 reference written from its
definition, and the property they exist for: a row's bits do not depend on how many rows the
call holds, which ones, the thread count, or (attention) whether its keys were written in
this step or an earlier one. Both builds are tested: the one for this CPU (AVX-512 BF16 where
present) and the portable C one; each must agree with itself.

Attention pages follow FlashMLA's tests: pages in a permuted order, every page no sequence
owns and every slot past a sequence's length filled with NaN."""

from __future__ import annotations

import os
import platform

import pytest
import torch

import moeserve.kernels.cpu as K
from moeserve.kernels.cpu import build, decoder

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
    monkeypatch.setattr(decoder, "native", lambda: native)
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
    lo = torch.randn(n, k // K.GROUP, generator=gen) / 50
    if fmt == "q4h":  # GGUF Q4_1: fp16 scale and minimum
        return K.pack_q4h(codes, d.half().float(), lo.half().float())
    return K.pack_q4(codes, d, lo - K.Q4_BIAS * d)


@pytest.mark.parametrize("fmt", ["bf16", "q4", "q4h", "i8"])
@pytest.mark.parametrize("n, k", [(100, 96), (16, 64), (40, 32), (200, 64)])
def test_linear_matches_reference_and_rows_are_independent(lib, fmt, n, k):
    gen = torch.Generator().manual_seed(n * k)
    w = _weight(fmt, n, k, gen)
    x = torch.randn(37, k, generator=gen).bfloat16()
    full = K.linear(x, w, torch.float32)
    ref = K.linear_reference(x, w)
    assert (full.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    for rows in (slice(36, 37), slice(0, 1), slice(3, 11), slice(30, 37), slice(5, 6)):
        assert torch.equal(K.linear(x[rows], w, torch.float32), full[rows])
    for threads in (1, 3):  # the kernels' own pool
        K.set_threads(threads)
        assert torch.equal(K.linear(x, w, torch.float32), full)
    K.set_threads(os.cpu_count() or 1)
    assert torch.equal(K.linear(x, w), full.bfloat16())  # bf16 output: one rounding


def test_q4_packing_round_trips():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (40, 64), generator=gen)
    d, c = torch.rand(40, 2, generator=gen), torch.randn(40, 2, generator=gen)
    w = K.pack_q4(codes, d, c)
    dense = (K.Q4_BIAS + codes.double()) * d.double().repeat_interleave(32, 1)
    assert torch.allclose(K.unpack(w), dense + c.double().repeat_interleave(32, 1))
    d16, lo16 = d.half().float(), c.half().float()
    w = K.pack_q4h(codes, d16, lo16)
    dense = codes.double() * d16.double().repeat_interleave(32, 1)
    assert torch.equal(K.unpack(w), dense + lo16.double().repeat_interleave(32, 1))
    with pytest.raises(ValueError, match="fp16"):
        K.pack_q4h(codes, d, c)


def test_q4h_computes_what_q4_does(lib):
    """The fp16 form of GGUF Q4_1 weights (scale d, minimum lo) gives the bits of the fp32 form
    with c = lo - 128 d: the compact layout changes no result."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (72, 96), generator=gen)
    d = (torch.rand(72, 3, generator=gen) / 50).half().float()
    lo = (torch.randn(72, 3, generator=gen) / 50).half().float()
    x = torch.randn(9, 96, generator=gen).bfloat16()
    full = K.linear(x, K.pack_q4(codes, d, lo - K.Q4_BIAS * d), torch.float32)
    assert torch.equal(K.linear(x, K.pack_q4h(codes, d, lo), torch.float32), full)


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


def test_rmsnorm_is_torchs_to_the_bit(lib):
    """The decoder's RMSNorm (with the residual add) gives torch's bits: the native decoder
    path computes what the layer-by-layer path does."""
    gen = torch.Generator().manual_seed(4)
    for n in (64, 576, 4096, 1000):
        x = (3 * torch.randn(5, n, generator=gen)).bfloat16()
        res = (3 * torch.randn(5, n, generator=gen)).bfloat16()
        w = (1 + torch.randn(n, generator=gen) / 4).bfloat16()
        ref = torch.nn.functional.rms_norm(x + res, (n,), w, 1e-5)
        stream = res.clone()
        assert torch.equal(decoder.add_rmsnorm(x, stream, w, 1e-5), ref), n
        assert torch.equal(stream, x + res)


def _layer_reference(layer_w, x, res, first, positions, scale):
    """fp64 Llama decoder layer (HF's modelling, one sequence, causal over `positions`)."""
    qkv, o, gu, down, n_in, n_post, heads, kvh, d, cos, sin = layer_w
    f = lambda t: t.double()  # noqa: E731

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * f(w)

    r = f(x) if first else f(x) + f(res)
    y = rms(r, n_in) @ K.unpack(qkv).t()
    q, k, v = y.split([heads * d, kvh * d, kvh * d], -1)
    c = torch.cat([cos[positions]] * 2, -1).double()[:, None]
    s = torch.cat([sin[positions]] * 2, -1).double()[:, None]

    def rope(t, h):
        t = t.view(-1, h, d)
        return t * c + torch.cat([-t[..., d // 2 :], t[..., : d // 2]], -1) * s

    q, k, v = rope(q, heads), rope(k, kvh), v.view(-1, kvh, d)
    k, v = k.repeat_interleave(heads // kvh, 1), v.repeat_interleave(heads // kvh, 1)
    att = torch.einsum("qhd,khd->hqk", q, k) * scale
    att = att.masked_fill(positions[None, :, None] < positions[None, None, :], float("-inf"))
    a = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(len(positions), -1)
    r = r + a @ K.unpack(o).t()
    g, u = (rms(r, n_post) @ K.unpack(gu).t()).chunk(2, -1)
    return (g * torch.sigmoid(g) * u) @ K.unpack(down).t(), r


def test_decoder_layer_matches_reference_and_any_split(lib):
    """One native call per layer: against an fp64 reference of the Llama layer; and each row's
    bits the same in one prefill call, in chunks after cached context, one token per step,
    next to another sequence, and on 1 or 3 threads."""
    gen = torch.Generator().manual_seed(5)
    heads, kvh, d, hidden, inter, page, T = 4, 2, 16, 64, 96, 8, 21
    qkv = _weight("q4h", (heads + 2 * kvh) * d, hidden, gen)
    o, gu = _weight("q4h", hidden, heads * d, gen), _weight("q4h", 2 * inter, hidden, gen)
    down = _weight("q4", hidden, inter, gen)
    n_in, n_post = ((1 + torch.randn(hidden, generator=gen) / 4).bfloat16() for _ in range(2))
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    freqs = torch.outer(torch.arange(64).float(), inv)
    cos, sin = freqs.cos(), freqs.sin()
    layer = decoder.DecoderLayer(
        qkv, o, gu, down, n_in, n_post, 1e-5, heads, kvh, d, d**-0.5, cos, sin
    )
    x0 = torch.randn(T, hidden, generator=gen).bfloat16()
    res0 = torch.randn(T, hidden, generator=gen).bfloat16()
    table = torch.tensor([[3, 0, 5]], dtype=torch.int32)  # the sequence's pages, permuted
    slots = torch.tensor([int(table[0, p // page]) * page + p % page for p in range(T)])

    def run(splits: list[tuple[int, int]], first: bool, other: bool = False):
        kc = torch.full((6 + 2, page, kvh, d), float("nan"), dtype=torch.bfloat16)
        vc = kc.clone()
        layer.bind_cache(kc, vc)
        x, res = x0.clone(), res0.clone()
        for a, b in splits:
            xs, rs, pos, sl = x[a:b].clone(), res[a:b].clone(), torch.arange(a, b), slots[a:b]
            tables, qlens, slens = table, [b - a], [b]
            if other:  # another sequence (pages 6, 7) decodes first in the same step
                xs, rs = torch.cat([x0[:1], xs]), torch.cat([res0[:1], rs])
                pos, sl = torch.cat([torch.tensor([3]), pos]), torch.cat([torch.tensor([48]), sl])
                tables = torch.tensor([[6, 7, 7], [3, 0, 5]], dtype=torch.int32)
                qlens, slens = [1, b - a], [4, b]
            step = decoder.DecoderStep(layer, pos, sl, tables, qlens, slens)
            layer(step, xs, rs, first)
            x[a:b], res[a:b] = xs[-(b - a) :], rs[-(b - a) :]
        return x, res

    for first in (False, True):
        x, res = run([(0, T)], first)
        ref_x, ref_r = _layer_reference(
            (qkv, o, gu, down, n_in, n_post, heads, kvh, d, cos, sin),
            x0, res0, first, torch.arange(T), d**-0.5,
        )  # fmt: skip
        assert (x.double() - ref_x).abs().max() <= 0.03 * ref_x.abs().max()
        assert (res.double() - ref_r).abs().max() <= 0.03 * ref_r.abs().max()
        for splits in ([(0, 7), (7, 16), (16, T)], [(i, i + 1) for i in range(T)]):
            assert all(map(torch.equal, run(splits, first), (x, res))), splits
        assert all(map(torch.equal, run([(0, 9), (9, T)], first, other=True), (x, res)))
        for threads in (1, 3):
            K.set_threads(threads)
            assert all(map(torch.equal, run([(0, T)], first), (x, res)))
        K.set_threads(os.cpu_count() or 1)
