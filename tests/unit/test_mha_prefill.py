"""The CPU paged attention (flash passes merged by log-sum-exp for prefill chunks, batched
decode) against one plain masked softmax attention over each sequence's whole history."""

from __future__ import annotations

import pytest
import torch

from moeserve.layers.attention.metadata import AttentionMetadata, ForwardContext
from moeserve.layers.attention.mha import PagedAttention

H, KVH, D, PS = 6, 2, 16, 4


def reference(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, start: int) -> torch.Tensor:
    """q [T, H, D] at positions start.., keys/vals [start+T, KVH, D]: softmax(qk/sqrt d) v."""
    k = keys.repeat_interleave(H // KVH, dim=1).transpose(0, 1)  # [H, L, D]
    v = vals.repeat_interleave(H // KVH, dim=1).transpose(0, 1)
    s = torch.einsum("thd,hld->htl", q.double(), k.double()) * D**-0.5
    pos = torch.arange(start, start + q.shape[0])[:, None]
    s = s.masked_fill(torch.arange(keys.shape[0])[None, :] > pos, float("-inf"))
    return torch.einsum("htl,hld->thd", s.softmax(-1), v.double()).float()


@pytest.mark.parametrize("invariant", [False, True])
def test_chunks_with_context_and_decodes_in_one_step(invariant):
    torch.manual_seed(0)
    attn = PagedAttention(H, KVH, D, D**-0.5)
    attn.batch_invariant = invariant
    attn.bind_kv_cache(64, PS, torch.float32, "cpu")
    pages = torch.randperm(64).tolist()
    # three sequences: full histories, how much is already cached, and this step's new tokens
    total, cached, new = [9, 23, 40], [8, 10, 0], [1, 13, 40]
    hist_k = [torch.randn(n, KVH, D) for n in total]
    hist_v = [torch.randn(n, KVH, D) for n in total]
    tables = torch.zeros(3, 16, dtype=torch.int32)
    for b, n in enumerate(total):
        for p in range(-(-n // PS)):
            tables[b, p] = pages.pop()
    kf = attn.k_cache.view(-1, KVH, D)
    vf = attn.v_cache.view(-1, KVH, D)
    for b in range(3):  # the cached part
        for t in range(cached[b]):
            slot = int(tables[b, t // PS]) * PS + t % PS
            kf[slot], vf[slot] = hist_k[b][t], hist_v[b][t]
    slots, qs, ks, vs = [], [], [], []
    for b in range(3):
        for t in range(cached[b], total[b]):
            slots.append(int(tables[b, t // PS]) * PS + t % PS)
        qs.append(torch.randn(new[b], H, D))
        ks.append(hist_k[b][cached[b] :])
        vs.append(hist_v[b][cached[b] :])
    qstart = [0, 1, 14, 54]
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=tables,
        seq_lens=torch.tensor(total, dtype=torch.int32),
        query_start=torch.tensor(qstart, dtype=torch.int32),
        page_size=PS,
        seq_lens_host=total,
        query_lens_host=new,
    )
    out = attn(torch.cat(qs), torch.cat(ks), torch.cat(vs), ForwardContext(md))
    for b in range(3):
        ref = reference(qs[b], hist_k[b], hist_v[b], cached[b])
        got = out[qstart[b] : qstart[b + 1]]
        assert torch.allclose(got, ref, atol=2e-5), (b, (got - ref).abs().max())


def _run(attn, seqs, tables):
    """One step over `seqs` = [(history k, history v, q, cached)], new keys written first."""
    slots, qs, ks, vs, qlens, lens = [], [], [], [], [], []
    for b, (hk, hv, q, cached) in enumerate(seqs):
        for t in range(cached, hk.shape[0]):
            slots.append(int(tables[b, t // PS]) * PS + t % PS)
        qs.append(q), ks.append(hk[cached:]), vs.append(hv[cached:])
        qlens.append(q.shape[0]), lens.append(hk.shape[0])
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=tables,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start=torch.tensor(starts, dtype=torch.int32),
        page_size=PS,
        seq_lens_host=lens,
        query_lens_host=qlens,
    )
    return attn(torch.cat(qs), torch.cat(ks), torch.cat(vs), ForwardContext(md))


def test_invariant_rows_are_bitwise_equal_alone_batched_and_chunked():
    """The same query rows computed alone, next to another sequence, and split in chunks
    (the later chunk reading the earlier one from the cache) agree bit for bit."""
    torch.manual_seed(1)
    n = 700  # more than one 512-key block
    hk, hv, q = torch.randn(n, KVH, D), torch.randn(n, KVH, D), torch.randn(n, H, D)
    other = (torch.randn(30, KVH, D), torch.randn(30, KVH, D), torch.randn(30, H, D), 0)
    results = []
    for layout in ("alone", "batched", "chunked"):
        attn = PagedAttention(H, KVH, D, D**-0.5)
        attn.batch_invariant = True
        attn.bind_kv_cache(256, PS, torch.float32, "cpu")
        tables = torch.arange(2 * 200, dtype=torch.int32).view(2, 200)
        if layout == "alone":
            out = _run(attn, [(hk, hv, q, 0)], tables[:1])
        elif layout == "batched":
            out = _run(attn, [other, (hk, hv, q, 0)], tables.flip(0))[30:]
        else:
            first = _run(attn, [(hk[:333], hv[:333], q[:333], 0)], tables[:1])
            rest = _run(attn, [(hk, hv, q[333:], 333)], tables[:1])
            out = torch.cat([first, rest])
        results.append(out)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    ref = reference(q, hk, hv, 0)
    assert torch.allclose(results[0], ref, atol=2e-5)
