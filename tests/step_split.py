"""One prompt computed in different step splits through the engine's own runner (real paged KV
cache, page table and kernels), for the step-split tests on CPUs and GPUs."""

from __future__ import annotations

import random

import torch

from moeserve.engine.offline import LLM
from moeserve.engine.step import StepInput

PROMPT_LEN = 100
SPLITS = {
    "chunks of 16": [16] * 6 + [4],
    "chunks of 64": [64, 36],
    "first half cached": [48, 52],
    "last 5 decoded one per step": [95, 1, 1, 1, 1, 1],
    "last 4 verified at once": [96, 4],
}


def last_logits(llm: LLM, ids: list[int], splits: list[int]) -> torch.Tensor:
    """Logits of the last position after computing `ids` in steps of `splits` tokens, each
    step attending the pages the earlier ones wrote (page-table row 0, fresh pages)."""
    runner = llm.engine.runner
    ps = runner.page_size
    pages = list(range(1, -(-len(ids) // ps) + 1))
    runner.pages.table[0].zero_()
    done = sent = 0
    logits = None
    for n in splits:
        end = done + n
        need = -(-end // ps)
        updates = [0, sent, need - sent, *pages[sent:need]] if need > sent else []
        sent = need
        step = StepInput(
            ids=ids[done:end],
            positions=list(range(done, end)),
            rows=[0],
            seq_lens=[end],
            query_lens=[n],
            page_updates=updates,
            logit_rows=[n - 1],
        )
        logits = runner.execute_model(step)
        done = end
    return logits[0].clone()


def random_prompt(llm: LLM, n: int = PROMPT_LEN, seed: int = 7) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, llm.engine.runner.vocab_limit) for _ in range(n)]
