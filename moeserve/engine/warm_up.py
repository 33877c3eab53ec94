"""The start-up warm-up of a GPU runner: each step shape the JIT kernels specialise on, run
once before serving, so that no request waits for a compilation."""

from __future__ import annotations

import time

import torch

from moeserve.engine.runner_view import RunnerView
from moeserve.engine.step import StepInput

# a mixed warm-up step: up to this many one-token rows beside a prefill chunk of this many
MIXED_DECODE_ROWS = 4
MIXED_PREFILL_TOKENS = 17


@torch.inference_mode()
def warm_up(runner: RunnerView) -> str:
    """Prefill chunks of 1 to the token budget (powers of two and one past them: Triton
    specialises integer arguments on ==1 and divisibility by 16, and the kernels pick their
    tiles by size), one chunk after cached context, and a mixed decode + prefill step.
    Without it the first request of each new shape waits ~0.5-1 s for a compilation. The
    steps write into KV pages no request owns yet; the page-table rows are cleared after.
    Returns the banner's line."""
    t0 = time.perf_counter()
    ps, table = runner.page_size, runner.pages.table
    budget = min(
        runner.config.scheduler.max_num_batched_tokens,
        runner.max_model_len,
        (runner.num_pages - runner.max_rows - 1) * ps,
    )
    if budget < 2:
        return "kernel warm-up skipped (no room in the KV cache)"
    sizes = {budget}
    for p in range(budget.bit_length()):
        sizes |= {n for n in (1 << p, (1 << p) + 1) if n <= budget}
    pages = -(-budget // ps)
    table[0, :pages] = torch.arange(pages, dtype=torch.int32, device=runner.device)
    vocab = runner.vocab_limit
    for n in sorted(sizes):
        runner.execute_model(prefill_step(0, n, 0, vocab))
    context = min(ps, budget // 2)  # a later chunk: attention over cached context too
    runner.execute_model(prefill_step(0, budget - context, context, vocab))
    decode = min(runner.max_rows, MIXED_DECODE_ROWS)  # one-token rows, then a prefill chunk
    rows = list(range(1, decode + 1))
    table[1 : decode + 1, 0] = torch.arange(
        pages, pages + decode, dtype=torch.int32, device=runner.device
    )
    chunk = min(MIXED_PREFILL_TOKENS, budget - decode)
    runner.execute_model(
        StepInput(
            ids=varied_ids(decode + chunk, vocab),
            positions=[0] * decode + list(range(chunk)),
            rows=rows + [0],
            seq_lens=[1] * decode + [chunk],
            query_lens=[1] * decode + [chunk],
            logit_rows=list(range(decode)) + [decode + chunk - 1],
        )
    )
    torch.cuda.synchronize(runner.device)
    table.zero_()
    for cache in runner.cache_tensors():  # serving starts from an empty cache
        cache.zero_()
    return (
        f"kernels warmed up for {len(sizes) + 2} prefill shapes (1-{budget} tokens) in "
        f"{time.perf_counter() - t0:.1f}s"
    )


def varied_ids(n: int, vocab: int) -> list[int]:
    """Token ids spread over the vocabulary: tokens route to many experts, as real text does
    (one repeated id would send every token to the same few and skip the kernels' other
    variants)."""
    return [(i * 40503 + 7) % vocab for i in range(n)]


def prefill_step(row: int, tokens: int, context: int, vocab: int) -> StepInput:
    """One sequence in page-table row `row` computing `tokens` new tokens after `context`
    cached ones."""
    return StepInput(
        ids=varied_ids(tokens, vocab),
        positions=list(range(context, context + tokens)),
        rows=[row],
        seq_lens=[context + tokens],
        query_lens=[tokens],
        logit_rows=[tokens - 1],
    )
