"""Speculative decoding on a GPU, CUDA graphs on, for tiny Kimi-K2.5 NVFP4 and DeepSeek-V3
block-FP8 checkpoints in the published 512 + 64 MLA layout: under --deterministic (every
logit independent of how a sequence is split into steps) the suffix and ngram proposers give
exactly the tokens and log-probabilities of plain decoding, batched, prompts of mixed lengths,
each prompt run twice so the suffix cache drafts (as do DeepSeek's MTP layer and tiny EAGLE-3
heads, MLA and Llama-style); by default they run and their drafts are
verified in CUDA-graph decode steps (the verify rows are one-token rows), and the tokens
that differ from plain decoding are counted and printed (the default GPU kernels pick by
row count, as batching does)."""

from __future__ import annotations

import pytest
import torch

from moeserve.engine.offline import LLM
from moeserve.sampling import SamplingParams
from moeserve.testing.checkpoints import (
    EAGLE_LIKES,
    KERNEL_SHAPE,
    write_checkpoint,
    write_eagle3_checkpoint,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FORMATS = {
    "kimi-k2.5-nvfp4": ("kimi-k2.5", "nvfp4-modelopt"),
    "deepseek-v3-fp8": ("deepseek-v3", "fp8-block"),
}
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(40, 75)), [7] * 20]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    return {
        name: write_checkpoint(str(root / name), like, fmt, shape=KERNEL_SHAPE, seed=11).path
        for name, (like, fmt) in FORMATS.items()
    }


def _run(path: str, spec: dict | None, deterministic: bool) -> tuple[list, LLM]:
    kw = {} if spec is None else {"speculative_config": spec}
    llm = LLM(
        path, device="cuda", max_model_len=512, max_num_seqs=32, deterministic=deterministic, **kw
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    got = []
    for _ in range(2):
        outs = llm.generate(PROMPTS, params)
        got.append([(o.token_ids, [(lp.logprob, lp.top) for lp in o.logprobs]) for o in outs])
    return got, llm


@pytest.mark.parametrize("method", ["suffix", "ngram"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_deterministic_speculative_equals_plain(checkpoints, name, method):
    want, _ = _run(checkpoints[name], None, True)
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    got, llm = _run(checkpoints[name], spec, True)
    assert got == want
    assert llm.engine.metrics.spec.drafts > 0


@pytest.mark.parametrize("k", [1, 3])
def test_deterministic_mtp_equals_plain(checkpoints, k):
    """DeepSeek's MTP layer drafting (catch-up and chained draft steps eager, target verify
    steps in CUDA graphs)."""
    path = checkpoints["deepseek-v3-fp8"]
    want, _ = _run(path, None, True)
    got, llm = _run(path, {"method": "mtp", "num_speculative_tokens": k, "adaptive": False}, True)
    assert got == want
    assert llm.engine.metrics.spec.drafts > 0


@pytest.fixture(scope="module")
def eagle_heads(checkpoints, tmp_path_factory):
    """Tiny EAGLE-3 heads for the Kimi-K2.5 NVFP4 checkpoint (its 512 + 64 latent layout:
    the MLA head runs the Triton MLA kernels, so its draft steps are captured)."""
    root = tmp_path_factory.mktemp("eagle3")
    target = checkpoints["kimi-k2.5-nvfp4"]
    return {
        like: write_eagle3_checkpoint(str(root / like), like, target, seed=12).path
        for like in EAGLE_LIKES
    }


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("like", EAGLE_LIKES)
def test_deterministic_eagle3_equals_plain(checkpoints, eagle_heads, like, k):
    """EAGLE-3 heads drafting (the target's aux hidden states written inside its decode
    graphs; the MLA head's one-token draft steps replayed from graphs of their own, the
    Llama-style head's GQA attention eager)."""
    path = checkpoints["kimi-k2.5-nvfp4"]
    want, _ = _run(path, None, True)
    spec = {
        "method": "eagle3",
        "model": eagle_heads[like],
        "num_speculative_tokens": k,
        "adaptive": False,
    }
    got, llm = _run(path, spec, True)
    assert got == want
    assert llm.engine.metrics.spec.drafts > 0
    runner = llm.engine.runner
    assert runner.graphs is not None and sum(runner.graphs.replays.values()) > 0
    if like.endswith("-mla"):
        assert runner.draft_graphs is not None, runner.graph_status
        assert sum(runner.draft_graphs.replays.values()) > 0


@pytest.mark.parametrize("name", list(FORMATS))
def test_default_kernels_speculative_report(checkpoints, name):
    want, _ = _run(checkpoints[name], None, False)
    spec = {"method": "suffix", "num_speculative_tokens": 3, "adaptive": False}
    got, llm = _run(checkpoints[name], spec, False)
    assert llm.engine.runner.graphs is not None
    stats = llm.engine.metrics.spec
    assert stats.accepted_tokens > 0, stats
    differ = sum(a[0] != b[0] for a, b in zip(got[1], want[1], strict=True))
    print(f"{name}: default kernels, {differ} of {len(PROMPTS)} answers differ from plain; {stats}")
