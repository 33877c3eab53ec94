"""Same question, same answer, over HTTP on the default model at bf16 (its default on CPUs with
bf16 instructions; asked for so that the native kernels run on any CPU; prefix caching on, one
engine thread as `moeserve serve` runs on two cores): a question asked again after others, its
prompt's first pages now served from the prefix cache, gets the same text and the same log-
probabilities; a seeded sampled request sent twice gives the same text; streamed and non-
streamed greedy answers are equal.

With torch's CPU kernels the repeated France question below gave another answer (its first
token's top two log-probabilities are 0.1 apart and moved by that much when 32 of its 37
prompt tokens came from the cache)."""

from __future__ import annotations

import os
import re

import httpx
import openai
import pytest
from server_thread import ServerThread

from moeserve.config import ServerConfig
from moeserve.server.api import create_app

os.environ.setdefault("HF_HUB_OFFLINE", "1")

engine_mod = pytest.importorskip("moeserve.engine.async_engine")

FRANCE = "What is the capital of France?"
HAMLET = "Who wrote Hamlet?"
OTHERS = [
    "Name three primary colors.",
    "What is the boiling point of water?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "Why do leaves change color in autumn?",
]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def server():
    import torch

    threads = torch.get_num_threads()
    engine = engine_mod.build_async_engine(max_model_len=2048, threads=1, dtype="bfloat16")
    app = create_app(engine, ServerConfig(served_model_name=engine.model_name))
    try:
        with ServerThread(app, startup_timeout=60) as srv:
            srv.engine = engine
            srv.model = engine.model_name
            yield srv
    finally:
        engine.shutdown()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _ask(server, client, question: str, **kw) -> tuple[str, list]:
    r = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": question}],
        max_tokens=MAX_TOKENS,
        **{"temperature": 0, "logprobs": True, "top_logprobs": 5, **kw},
    )
    choice = r.choices[0]
    lps = []
    if choice.logprobs is not None:
        lps = [
            (t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
            for t in choice.logprobs.content
        ]
    return choice.message.content, lps


def _cache_hits(server) -> float:
    text = httpx.get(server.base_url + "/metrics").text
    return float(re.search(r"^moeserve_prefix_cache_hits_total (\S+)$", text, re.M).group(1))


def test_bf16_runs_the_native_kernels_and_is_the_default_where_the_cpu_has_bf16(server):
    import torch

    from moeserve.config import cpu_has_bf16, parse_dtype

    loaded = server.engine.engine.loaded
    assert loaded.kv_cache_dtype == torch.bfloat16
    assert loaded.kernel_plan.cpu_native
    default = parse_dtype("auto", torch.float32, "cpu")
    assert default == (torch.bfloat16 if cpu_has_bf16() else torch.float32)


def test_a_question_asked_again_gets_the_same_answer(server, client):
    first = _ask(server, client, FRANCE)
    assert "Paris" in first[0]
    _ask(server, client, HAMLET)
    hits = _cache_hits(server)
    assert _ask(server, client, FRANCE) == first
    assert _cache_hits(server) > hits  # the repeat was served partly from the prefix cache


def test_five_questions_asked_three_times_between_others(server, client):
    answers: dict[str, list] = {q: [] for q in OTHERS}
    for _ in range(3):
        for q in OTHERS:
            answers[q].append(_ask(server, client, q))
    for q, got in answers.items():
        assert got[0][0], q
        assert got[1] == got[0] and got[2] == got[0], q


def test_a_seeded_sampled_request_repeats(server, client):
    kw = dict(temperature=0.9, seed=1234, logprobs=False, top_logprobs=None)
    a = _ask(server, client, "Write a short poem about the sea.", **kw)
    _ask(server, client, HAMLET)
    assert _ask(server, client, "Write a short poem about the sea.", **kw) == a


def test_stream_and_non_stream_greedy_answers_are_equal(server, client):
    question = "Explain what a rainbow is."
    plain = _ask(server, client, question)[0]
    stream = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": question}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == plain
