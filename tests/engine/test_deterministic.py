"""Batch invariance at bf16 activations + int4 weights (the default on CPUs with bf16
instructions; asked for here so that the native kernels run on any CPU): 16 concurrent greedy
requests give exactly the tokens of their solo runs, the solo runs hitting the prefix cache the
batched run filled. The native CPU kernels are batch-invariant by construction; torch's kernels
are with `--deterministic` (its batch-invariant attention). torch's kernels without it are not
(measured in benchmarks/results/cpu_decode.md), so this test can fail."""

from __future__ import annotations

import pytest
import torch

from moeserve.engine.offline import LLM
from moeserve.sampling import SamplingParams

TOPICS = ["cats", "rain", "trains", "tea", "maps", "snow", "jazz", "bread"]


@pytest.mark.parametrize(
    "settings",
    [dict(dtype="bfloat16"), dict(cpu_kernels="torch", deterministic=True)],
    ids=["native", "torch-deterministic"],
)
def test_sixteen_batched_greedy_requests_equal_their_solo_runs(settings):
    threads = torch.get_num_threads()
    try:
        llm = LLM(None, max_model_len=1024, max_num_seqs=16, **settings)
        layers = llm.engine.loaded.model.attention_layers()
        if settings.get("deterministic"):
            assert all(layer.batch_invariant for layer in layers)
        else:
            assert all(layer.backend.name == "native" for layer in layers)
        tok = llm.tokenizer
        prompts = [f"Write a short note number {i} about {t}." for i, t in enumerate(TOPICS * 2)]
        ids = [
            tok.encode(
                tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False
            )
            for p in prompts
        ]
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        together = [c.token_ids for c in llm.generate(ids, params)]
        solo = [llm.generate([i], params)[0].token_ids for i in ids]
    finally:
        torch.set_num_threads(threads)
    assert len({tuple(s) for s in solo}) > 8  # different prompts, different answers
    for i, (a, b) in enumerate(zip(solo, together, strict=True)):
        assert a == b, f"request {i}: solo and batched differ at token {_first_diff(a, b)}"


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
