"""Scheduling must not change results: batching, chunked prefill, preemption, prefix cache."""

import pytest

from moeserve.engine.errors import EngineInputError
from moeserve.engine.offline import LLM
from moeserve.sampling import SamplingParams

PROMPTS = [
    "Tell me a short story about a robot.",
    "What is 2 + 2?",
    "Name the planets of the solar system in order from the sun, with one fact about each.",
    "Hi",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def solo(llm):
    return [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


def test_batch_equals_solo(llm, solo):
    assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY)] == solo


def test_chunked_prefill_and_preemption_do_not_change_tokens(gguf_path, solo):
    # 6-token prefill chunks; 12 pages of 4 tokens cannot hold 4 sequences: preemption
    small = LLM(
        gguf_path,
        dtype="float32",
        max_model_len=512,
        max_num_batched_tokens=6,
        page_size=4,
        num_pages=24,
    )
    outs = small.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in outs] == solo
    assert small.engine.metrics.preemptions > 0


def test_prefix_cache_hit_same_output(llm):
    text = "Summarize the plot of Hamlet in one paragraph. " * 4
    first = llm.generate([text], GREEDY)[0].token_ids
    hits = llm.engine.allocator.stats.hits
    again = llm.generate([text], GREEDY)[0].token_ids
    assert llm.engine.allocator.stats.hits > hits and again == first


def test_stop_strings_and_finish_reasons(llm):
    base = llm.generate(["Count: 1, 2, 3,"], SamplingParams(max_tokens=12, temperature=0))[0]
    assert base.finish_reason in ("length", "stop")
    word = base.text.strip().split()[1]
    cut = llm.generate(
        ["Count: 1, 2, 3,"], SamplingParams(max_tokens=12, temperature=0, stop=[word])
    )[0]
    assert cut.finish_reason == "stop" and word not in cut.text
    assert base.text.startswith(cut.text)


def test_rejects_what_cannot_fit(llm):
    with pytest.raises(EngineInputError, match="maximum context length"):
        llm.engine.add_request("x", [1] * 2000, SamplingParams(max_tokens=100))
    with pytest.raises(EngineInputError, match="empty"):
        llm.engine.add_request("y", [], SamplingParams())
