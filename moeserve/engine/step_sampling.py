"""A step's logits turned into each request's token and logprobs (one batched sampler pass)
and into the prompt logprobs asked for; a row that fails alone is reported, not raised."""

from __future__ import annotations

import torch

from moeserve.engine.outputs import TokenLogprob
from moeserve.engine.request import Request
from moeserve.engine.scheduler import ScheduledBatch
from moeserve.engine.step_builder import StepPlan
from moeserve.sampling import Sampler, is_device_error


def sample_step(
    sampler: Sampler,
    batch: ScheduledBatch,
    plan: StepPlan,
    logits: torch.Tensor | None,
    failed: dict[int, Exception],
) -> tuple[dict[int, int], dict[int, TokenLogprob]]:
    """Per batch index: its sampled token and (if asked) logprob; rows that fail alone go to
    `failed`."""
    if not plan.sample or logits is None:
        return {}, {}
    idx = list(plan.sample)
    reqs = [batch.requests[i] for i in idx]
    res = sampler(
        logits[list(plan.sample.values())],
        [r.params for r in reqs],
        [r.request_id for r in reqs],
        [r.prompt_ids for r in reqs],
        [r.output_ids for r in reqs],
    )
    tokens: dict[int, int] = {}
    lps: dict[int, TokenLogprob] = {}
    for j, i in enumerate(idx):
        token = res.token_ids[j]
        if j in res.errors or token is None:
            failed[i] = res.errors.get(j) or RuntimeError("sampling failed")
            continue
        tokens[i] = token
        if res.logprobs[j] is not None:
            lp, top = res.logprobs[j]
            lps[i] = TokenLogprob(token, lp, top)
    return tokens, lps


def prompt_logprobs(
    sampler: Sampler,
    batch: ScheduledBatch,
    plan: StepPlan,
    logits: torch.Tensor | None,
    failed: dict[int, Exception],
) -> dict[int, list[TokenLogprob | None]]:
    """Logprob of each prompt token given what precedes it (None for the first), over the
    tokenizer's vocabulary; a request whose computation fails goes to `failed`."""
    out: dict[int, list[TokenLogprob | None]] = {}
    for i, span in plan.prompt.items():
        try:
            out[i] = _prompt_logprobs_of(sampler, batch.requests[i], span, logits)
        except Exception as e:
            if is_device_error(e):
                raise
            failed[i] = e
    return out


def _prompt_logprobs_of(
    sampler: Sampler, req: Request, span: tuple[int, int, int], logits: torch.Tensor | None
) -> list[TokenLogprob | None]:
    row, start, count = span
    entries: list[TokenLogprob | None] = [None] if start == 0 else []
    if count > 0 and logits is not None:
        targets = req.prompt_ids[start + 1 : start + count + 1]
        scored = sampler.logprobs_of(
            logits[row : row + count], targets, req.params.prompt_logprobs or 0
        )
        for tok, (lp, top) in zip(targets, scored, strict=True):
            entries.append(TokenLogprob(tok, lp, top))
    return entries
