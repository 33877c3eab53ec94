"""Logprobs of the model's raw distribution over the tokenizer's vocabulary (log_softmax of
the logits before penalties, bias or temperature): a chosen token's, and its row's top k."""

from __future__ import annotations

import torch

# (logprob of a token, [(token, logprob), ...] the row's top k)
ScoredToken = tuple[float, list[tuple[int, float]]]


def scored(
    raw: torch.Tensor, rows: list[int], tokens: list[int], ks: list[int]
) -> list[ScoredToken]:
    """For each (row, token, k): the token's logprob in that row of `raw` and the row's
    top k (token, logprob), in one gather and one top-k."""
    dev = raw.device
    sub = raw.index_select(0, torch.tensor(rows, dtype=torch.long).to(dev))
    ids = torch.tensor(tokens, dtype=torch.long).to(dev)
    picked = sub.gather(1, ids[:, None]).squeeze(1).tolist()
    k = max(ks)
    tops_v: list[list[float]] = [[] for _ in rows]
    tops_i: list[list[int]] = [[] for _ in rows]
    if k:
        v, ix = sub.topk(k, dim=-1)
        tops_v, tops_i = v.tolist(), ix.tolist()
    return [
        (picked[n], list(zip(tops_i[n][:kk], tops_v[n][:kk], strict=True)))
        for n, kk in enumerate(ks)
    ]


def sampled_logprobs(
    raw: torch.Tensor, ks: list[int | None], chosen: list[int | None]
) -> list[ScoredToken | None]:
    """The chosen tokens' logprobs and top-k for the rows that asked (`ks[i]` not None)."""
    want = [i for i, k in enumerate(ks) if k is not None and chosen[i] is not None]
    out: list[ScoredToken | None] = [None] * len(ks)
    if not want:
        return out
    tokens = [int(chosen[i]) for i in want]  # type: ignore[arg-type]
    for i, entry in zip(want, scored(raw, want, tokens, [ks[i] or 0 for i in want]), strict=True):
        out[i] = entry
    return out


def logprobs_of(
    logits: torch.Tensor, targets: list[int], k: int, vocab_limit: int | None
) -> list[ScoredToken]:
    """Per row of `logits` [n, V]: the logprob of `targets[row]` under the model's raw
    distribution over the allowed vocabulary, and that row's top `k` (token, logprob)."""
    logp = torch.log_softmax(logits[:, :vocab_limit].float(), dim=-1)
    ids = torch.tensor(targets, device=logp.device)
    chosen = logp.gather(1, ids[:, None]).squeeze(1).tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in chosen]
    if k:
        tv, ti = logp.topk(k, dim=-1)
        tops = [list(zip(a, b, strict=True)) for a, b in zip(ti.tolist(), tv.tolist(), strict=True)]
    return list(zip(chosen, tops, strict=True))
