"""Paged MLA cache cases shared by the MLA kernel tests: NaN in every unused row, sequences
on randomly permuted pages, garbage page ids past each sequence's pages."""

from __future__ import annotations

import torch

LATENT = 576  # kv_lora_rank 512 + rope 64
FP8 = torch.float8_e4m3fn


def make_case(
    seq_lens: list[int],
    heads: int,
    page_size: int,
    dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, ...]:
    """Random q, a NaN-filled cache with each sequence on randomly permuted pages."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    pages_per_seq = [max(1, -(-n // page_size)) for n in seq_lens]
    max_pages = max(pages_per_seq) + 1  # one spare column, filled with garbage ids
    num_pages = sum(pages_per_seq) + 3  # some pages belong to nobody
    perm = torch.randperm(num_pages, generator=gen)
    block_tables = torch.full((batch, max_pages), 10_000, dtype=torch.int32)  # out of range
    cache = torch.full((num_pages, page_size, LATENT), float("nan"))
    used = 0
    for b, n in enumerate(seq_lens):
        ids = perm[used : used + pages_per_seq[b]]
        used += pages_per_seq[b]
        block_tables[b, : len(ids)] = ids.int()
        rows = torch.randn(n, LATENT, generator=gen)
        tok = torch.arange(n)
        cache[ids[tok // page_size], tok % page_size] = rows
    kv_scale = None
    if dtype == FP8:
        kv_scale = torch.tensor([0.05])
        # Store values that dequantise to ~N(0,1): fp8 = x / scale (NaN stays NaN).
        cache = (cache / kv_scale).clamp(-448, 448).to(FP8)
    else:
        cache = cache.to(dtype)
    q = torch.randn(batch, heads, LATENT, generator=gen).to(torch.bfloat16)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return q, cache, block_tables, seq, kv_scale
