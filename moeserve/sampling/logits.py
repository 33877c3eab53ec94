"""The logit processing of one batched pass, in the order of operations of the sampler: the
LM head's padded rows masked, then penalties, logit bias and the min_tokens mask on the raw
logits, then temperature, then min-p / top-k / top-p truncation, then the draw by exponential
race (argmax of p / E with E ~ Exp(1), which picks token i with probability p_i)."""

from __future__ import annotations

import torch

from moeserve.sampling.params import SamplingParams
from moeserve.sampling.rows import RowState, TokenCounts

TINY = 1e-20  # floor of the exponential noise: p / 0 must never decide a draw


def mask_padded(x: torch.Tensor, vocab_limit: int | None) -> None:
    """Ids at or beyond `vocab_limit` (the LM head's padding) can never be chosen."""
    if vocab_limit is not None and vocab_limit < x.shape[1]:
        x[:, vocab_limit:] = float("-inf")


def adjust(
    x: torch.Tensor,
    rows: list[RowState],
    out_lens: list[int],
    counts: TokenCounts | None,
    extra: list[list[int]] | None = None,
) -> torch.Tensor:
    """Penalties, logit bias and the min_tokens mask applied to the raw logits `x` (in
    place), and nan counted as masked: a row with no finite logit left cannot be sampled.
    `out_lens[i]`: row i's output length; `extra[i]`: tokens row i's history holds beyond the
    request's output (the draft tokens before a verified position)."""
    pen = [i for i, r in enumerate(rows) if r.slot >= 0]
    if pen:
        assert counts is not None
        _apply_penalties(x, pen, rows, counts, extra)
    _apply_bias(x, rows)
    _apply_min_tokens(x, rows, out_lens)
    return torch.nan_to_num(x, nan=float("-inf"))


def _apply_penalties(
    x: torch.Tensor,
    pen: list[int],
    rows: list[RowState],
    counts: TokenCounts,
    extra: list[list[int]] | None,
) -> None:
    """Repetition penalty over prompt and output tokens (HF / vLLM convention); presence
    and frequency penalties over output tokens only. Batched over the penalised rows."""
    dev = x.device
    slots = torch.tensor([rows[i].slot for i in pen], dtype=torch.long).to(dev)
    idx = torch.tensor(pen, dtype=torch.long).to(dev)
    gen = counts.generated.index_select(0, slots)  # [k, V] int32
    if extra is not None:
        which = [n for n, i in enumerate(pen) for _ in extra[i]]
        if which:
            toks = [t for i in pen for t in extra[i]]
            at = torch.tensor([which, toks], dtype=torch.long).to(dev)
            ones = torch.ones(len(toks), dtype=torch.int32, device=dev)
            gen.index_put_((at[0], at[1]), ones, accumulate=True)
    seen = counts.in_prompt.index_select(0, slots) | (gen > 0)
    ps = [rows[i].params for i in pen]
    rep = torch.tensor([p.repetition_penalty for p in ps], dtype=torch.float32).to(dev)
    freq = torch.tensor([p.frequency_penalty for p in ps], dtype=torch.float32).to(dev)
    pres = torch.tensor([p.presence_penalty for p in ps], dtype=torch.float32).to(dev)
    sub = x.index_select(0, idx)
    r = rep[:, None]
    sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    sub = sub - freq[:, None] * gen.float() - pres[:, None] * (gen > 0).float()
    x.index_copy_(0, idx, sub)


def _apply_bias(x: torch.Tensor, rows: list[RowState]) -> None:
    biased = [(i, r) for i, r in enumerate(rows) if r.bias_ids is not None]
    if not biased:
        return
    dev = x.device
    ids = torch.cat([r.bias_ids for _, r in biased])  # type: ignore[misc]
    vals = torch.cat([r.bias_values for _, r in biased])  # type: ignore[misc]
    counts = torch.tensor([len(r.bias_ids) for _, r in biased])  # type: ignore[arg-type]
    which = torch.tensor([i for i, _ in biased]).repeat_interleave(counts).to(dev)
    x.index_put_((which, ids), vals, accumulate=True)


def _apply_min_tokens(x: torch.Tensor, rows: list[RowState], out_lens: list[int]) -> None:
    """EOS and stop ids cannot be sampled before min_tokens (batched)."""
    early = [
        (i, r)
        for i, r in enumerate(rows)
        if r.blocked is not None and out_lens[i] < r.params.min_tokens
    ]
    if not early:
        return
    dev = x.device
    ids = torch.cat([r.blocked for _, r in early])  # type: ignore[misc]
    counts = torch.tensor([len(r.blocked) for _, r in early])  # type: ignore[arg-type]
    which = torch.tensor([i for i, _ in early]).repeat_interleave(counts).to(dev)
    x.index_put_((which, ids), torch.tensor(float("-inf"), device=dev))


def tempered_probs(
    x: torch.Tensor, params: list[SamplingParams], greedy: list[bool]
) -> torch.Tensor:
    """Each row's probabilities at its temperature (1 for greedy rows), truncated. +inf (an
    overflowed penalty or bias) becomes the largest finite logit: softmax stays defined; rows
    that are all -inf are reported by the caller, never drawn from."""
    temp = torch.tensor(
        [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
        dtype=torch.float32,
    ).to(x.device)
    big = torch.finfo(torch.float32).max
    scaled = torch.nan_to_num(x / temp[:, None], nan=float("-inf"), posinf=big)
    return truncate(
        torch.softmax(scaled, dim=-1),
        [p.top_k for p in params],
        [p.top_p for p in params],
        [p.min_p for p in params],
    )


def draw(x: torch.Tensor, rows: list[RowState], greedy: list[bool]) -> torch.Tensor:
    """Sampled ids [B] on the device (greedy rows take the argmax); a seeded row's noise comes
    from its own generator, so it draws the same whatever else is in the batch."""
    probs = tempered_probs(x, [r.params for r in rows], greedy)
    noise = torch.empty_like(probs)
    noise.exponential_()
    for i, r in enumerate(rows):
        if r.generator is not None and not greedy[i]:
            noise[i].exponential_(generator=r.generator)
    drawn = (probs / noise.clamp_(min=TINY)).nan_to_num_(nan=0.0).argmax(dim=-1)
    is_greedy = torch.tensor(greedy).to(x.device)
    return torch.where(is_greedy, x.argmax(dim=-1), drawn)


def truncate(
    probs: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]
) -> torch.Tensor:
    """Batched min-p, top-k and top-p truncation of probabilities [B, V] (rows renormalised
    implicitly: the draw only compares ratios). Same rules as `truncated_probs`."""
    dev = probs.device
    if any(m > 0.0 for m in min_p):
        mp = torch.tensor(min_p, dtype=probs.dtype).to(dev)
        floor = mp[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = torch.where(probs < floor, torch.zeros_like(probs), probs)
    width = probs.shape[1]
    use_k = any(0 < k < width for k in top_k)
    use_p = any(p < 1.0 for p in top_p)
    if not (use_k or use_p):
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    if use_k:
        ks = torch.tensor([k if 0 < k < width else width for k in top_k]).to(dev)
        kth = sorted_p.gather(1, (ks - 1)[:, None])
        sorted_p = torch.where(sorted_p < kth, torch.zeros_like(sorted_p), sorted_p)
    if use_p:
        tp = torch.tensor(top_p, dtype=probs.dtype).to(dev)
        cum = sorted_p.cumsum(dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = (cum - sorted_p) >= tp[:, None] * cum[:, -1:]
        drop &= (tp < 1.0)[:, None]
        sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_p)


def truncated_probs(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Probabilities of a 1-D logit row after top-k, top-p and min-p truncation (the
    one-row reference of `truncate`)."""
    probs = torch.softmax(logits, dim=-1)
    if min_p > 0.0:
        probs = torch.where(probs < min_p * probs.max(), torch.zeros_like(probs), probs)
    if top_k and top_k < probs.numel():
        kth = probs.topk(top_k).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        cum = sorted_p.cumsum(0)
        drop = (cum - sorted_p) >= top_p * cum[-1]
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    return probs / probs.sum()
