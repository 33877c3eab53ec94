"""A sequence's logits depend only on its tokens, at the default dtype (bf16 on CPUs with bf16
instructions): one prompt prefilled whole, in chunks of 16 and of 64, with its first half
computed in an earlier step (what a prefix-cache hit reuses), and its last tokens decoded one
per step or verified several at once, gives bit-identical last-position logits. For the
SmolLM2 default (Q4_1 GGUF), and tiny Kimi-K2.5 NVFP4 and DeepSeek-V3 block-FP8 checkpoints.

The model runs through the engine's own runner: real paged KV cache, page table and kernels.
With torch's CPU kernels (`--cpu-kernels torch`) these logits differ (a 37-row GEMM or
attention call takes another path than a 5-row or one-row one), so the test can fail; the
last test shows it for the default model. Then the same through the whole engine: the
scheduler's chunking and the prefix cache."""

from __future__ import annotations

import random

import pytest
import torch

from moeserve.engine.engine import LLM
from moeserve.engine.step import StepInput
from moeserve.loader.checkpoint_writer import write_checkpoint
from moeserve.sampling import SamplingParams

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
    runner.block_table[0].zero_()
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


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    kimi = write_checkpoint(str(root / "kimi"), "kimi-k2.5", "nvfp4-modelopt", seed=3).path
    ds = write_checkpoint(str(root / "ds"), "deepseek-v3", "fp8-block", seed=5).path
    return {"smollm2": None, "kimi-k2.5-nvfp4": kimi, "deepseek-v3-fp8": ds}


def _engine(path: str | None, **kw) -> LLM:
    extra = {} if path is None else dict(device="cpu", dtype="bfloat16")
    return LLM(path, max_model_len=256, **extra, **kw)


def _prompt(llm: LLM) -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(3, llm.engine.runner.vocab_limit) for _ in range(PROMPT_LEN)]


@pytest.mark.parametrize("name", ["smollm2", "kimi-k2.5-nvfp4", "deepseek-v3-fp8"])
def test_last_logits_do_not_depend_on_the_step_split(models, name):
    llm = _engine(models[name])
    assert llm.engine.loaded.config.dtype is not None
    assert llm.engine.runner.kv_dtype == torch.bfloat16
    ids = _prompt(llm)
    whole = last_logits(llm, ids, [PROMPT_LEN])
    assert whole.isfinite().all()
    for what, splits in SPLITS.items():
        assert sum(splits) == PROMPT_LEN
        got = last_logits(llm, ids, splits)
        assert torch.equal(got, whole), f"{name}, {what}: max diff {(got - whole).abs().max()}"


def test_torch_kernels_do_depend_on_it():
    """The same check on torch's kernels fails: what makes the test above meaningful."""
    llm = _engine(None, cpu_kernels="torch")
    ids = _prompt(llm)
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
    ids = _prompt(whole)
    want = run(whole, ids)
    chunked = _engine(path, enable_prefix_caching=False, long_prefill_token_threshold=16)
    assert run(chunked, ids) == want
    cached = _engine(path, enable_prefix_caching=True)
    cached.generate([ids[:48]], SamplingParams(max_tokens=1, temperature=0))
    assert run(cached, ids) == want
    assert cached.engine.allocator.stats.hits == 48
