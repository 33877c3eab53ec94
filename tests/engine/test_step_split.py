"""A sequence's logits depend only on its tokens, at bf16 (the default on CPUs with bf16
instructions; asked for here so that the native kernels run on any CPU): one prompt prefilled
whole, in chunks of 16 and of 64, with its first half computed in an earlier step (what a
prefix-cache hit reuses), and its last tokens decoded one per step or verified several at once,
gives bit-identical last-position logits. For the SmolLM2 default (Q4_1 GGUF), and tiny
Kimi-K2.5 NVFP4 and DeepSeek-V3 block-FP8 checkpoints.

The model runs through the engine's own runner: real paged KV cache, page table and kernels.
With torch's CPU kernels (`--cpu-kernels torch`) these logits differ (a 37-row GEMM or
attention call takes another path than a 5-row or one-row one), so the test can fail; the
last test shows it for the default model. Then the same through the whole engine: the
scheduler's chunking and the prefix cache."""

from __future__ import annotations

import pytest
import torch
from step_split import PROMPT_LEN, SPLITS, last_logits, random_prompt

from moeserve.engine.offline import LLM
from moeserve.sampling import SamplingParams
from moeserve.testing.checkpoints import write_checkpoint


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    kimi = write_checkpoint(str(root / "kimi"), "kimi-k2.5", "nvfp4-modelopt", seed=3).path
    ds = write_checkpoint(str(root / "ds"), "deepseek-v3", "fp8-block", seed=5).path
    return {"smollm2": None, "kimi-k2.5-nvfp4": kimi, "deepseek-v3-fp8": ds}


def _engine(path: str | None, **kw) -> LLM:
    return LLM(path, max_model_len=256, device="cpu", dtype="bfloat16", **kw)


@pytest.mark.parametrize("name", ["smollm2", "kimi-k2.5-nvfp4", "deepseek-v3-fp8"])
def test_last_logits_do_not_depend_on_the_step_split(models, name):
    llm = _engine(models[name])
    assert llm.engine.loaded.config.dtype is not None
    assert llm.engine.runner.kv_dtype == torch.bfloat16
    ids = random_prompt(llm)
    whole = last_logits(llm, ids, [PROMPT_LEN])
    assert whole.isfinite().all()
    for what, splits in SPLITS.items():
        assert sum(splits) == PROMPT_LEN
        got = last_logits(llm, ids, splits)
        assert torch.equal(got, whole), f"{name}, {what}: max diff {(got - whole).abs().max()}"


def test_torch_kernels_do_depend_on_it():
    """The same check on torch's kernels fails: what makes the test above meaningful."""
    llm = _engine(None, cpu_kernels="torch")
    ids = random_prompt(llm)
    whole = last_logits(llm, ids, [PROMPT_LEN])
    differ = [w for w, s in SPLITS.items() if not torch.equal(last_logits(llm, ids, s), whole)]
    assert differ


def test_engine_chunking_and_prefix_cache_give_the_same_tokens_and_logprobs(models):
    """Through the scheduler: whole prompts, 16-token chunks, and a prefix-cache hit on the
    first half (48 tokens = 3 pages, filled by an earlier request) give the same greedy tokens
    and the same top-20 log-probabilities at every step."""
    path = models["kimi-k2.5-nvfp4"]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=20)

    def run(llm: LLM, ids: list[int]) -> list:
        out = llm.generate([ids], params)[0]
        return [out.token_ids, [(lp.logprob, lp.top) for lp in out.logprobs]]

    whole = _engine(path, enable_prefix_caching=False)
    ids = random_prompt(whole)
    want = run(whole, ids)
    chunked = _engine(path, enable_prefix_caching=False, long_prefill_token_threshold=16)
    assert run(chunked, ids) == want
    cached = _engine(path, enable_prefix_caching=True)
    cached.generate([ids[:48]], SamplingParams(max_tokens=1, temperature=0))
    assert run(cached, ids) == want
    assert cached.engine.allocator.stats.hits == 48
