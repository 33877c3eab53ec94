"""Paged MLA cache cases shared by the MLA kernel tests: NaN in every unused row, sequences
on randomly permuted pages, garbage page ids past each sequence's pages."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # not imported at run time: the kernel tests set up triton first
    from moeserve.kernels.attention.mla_decode import MLADecodeWorkspace

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


def poison_workspace(workspace: MLADecodeWorkspace) -> MLADecodeWorkspace:
    """Fill an MLADecodeWorkspace's partials and lse with NaN: a slot the kernels should not
    read then poisons the output, and one they should not write stays NaN."""
    workspace.partial_out.fill_(float("nan"))
    workspace.partial_lse.fill_(float("nan"))
    return workspace


def check_split_slots(workspace: MLADecodeWorkspace, seq: int, heads: int, active: int) -> None:
    """Sequence ``seq``'s workspace slots after one call on a poisoned workspace: with more
    than one active split, exactly the first ``active`` splits' partials and lse are written
    (finite) for every head; with at most one, none is (split 0 writes ``out`` itself)."""
    written = active if active > 1 else 0
    lse = workspace.partial_lse[seq, :heads].float().cpu()
    parts = workspace.partial_out[seq, :heads].float().cpu()
    assert torch.isfinite(lse[:, :written]).all(), (seq, active)
    assert torch.isfinite(parts[:, :written]).all(), (seq, active)
    assert torch.isnan(lse[:, written:]).all(), (seq, active, "an inactive split wrote its lse")
    assert torch.isnan(parts[:, written:]).all(), (seq, active, "an inactive split wrote")
