"""Speculative decoding is exact: over HTTP on the default model at the default dtype, a
server drafting with prompt lookup (ngram) or suffix trees answers every request with the
tokens, text, log-probabilities and finish reasons of the same server without speculation,
with the requests sent concurrently (batched beside each other, prompts of mixed lengths),
a stop string, max_tokens reached in the middle of a draft, n = 2 and logprobs. The oracle is
the plain server; the drafts must also have been accepted (else nothing was tested)."""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_thread import ServerThread

from moeserve.config import ServerConfig
from moeserve.server.api import create_app

os.environ.setdefault("HF_HUB_OFFLINE", "1")

engine_mod = pytest.importorskip("moeserve.engine.async_engine")

PARAGRAPH = (
    "The lighthouse stood at the end of the rocky point, and every night its keeper climbed "
    "the one hundred and twelve steps to light the lamp. Ships passing in the dark saw the "
    "beam sweep across the water and knew where the rocks were."
)
CODE = "def area(width, height):\n    result = width * height\n    return result\n"

# (messages, extra request fields): copying tasks where drafts get accepted, and others
REQUESTS = [
    ([f"Repeat this text exactly, word for word:\n\n{PARAGRAPH}"], {"max_tokens": 64}),
    ([f"Rename the variable result to total in this code:\n\n{CODE}"], {"max_tokens": 48}),
    (["Count from 1 to 40, separated by commas."], {"max_tokens": 60}),
    ([f"Repeat this text exactly:\n\n{PARAGRAPH}"], {"max_tokens": 7}),  # ends mid-draft
    ([f"Repeat this text exactly:\n\n{PARAGRAPH}"], {"max_tokens": 64, "stop": ["keeper"]}),
    (["Count from 1 to 20, one number per line."], {"max_tokens": 40, "stop": ["\n7"]}),
    ([f"Repeat this code exactly:\n\n{CODE}"], {"max_tokens": 40, "n": 2}),
    (
        [f"Repeat this text exactly:\n\n{PARAGRAPH}"],
        {"max_tokens": 32, "logprobs": True, "top_logprobs": 3},
    ),
    (["Why is the sky blue?"], {"max_tokens": 24}),
    (["Hi"], {"max_tokens": 12}),
]


def _server(spec: dict | None):
    import torch

    threads = torch.get_num_threads()
    settings = {"max_model_len": 2048, "threads": 1}
    if spec is not None:
        settings["speculative_config"] = spec
    engine = engine_mod.build_async_engine(**settings)
    app = create_app(engine, ServerConfig(served_model_name=engine.model_name))
    return engine, app, threads


def _run_all(spec: dict | None) -> tuple[list[dict], str]:
    import torch

    engine, app, threads = _server(spec)
    try:
        with ServerThread(app, startup_timeout=60) as srv:

            def ask(item):
                messages, extra = item
                body = {
                    "model": engine.model_name,
                    "messages": [{"role": "user", "content": m} for m in messages],
                    "temperature": 0,
                    **extra,
                }
                r = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=300)
                assert r.status_code == 200, r.text
                return r.json()

            with ThreadPoolExecutor(len(REQUESTS)) as pool:
                answers = list(pool.map(ask, REQUESTS))
            metrics = httpx.get(srv.base_url + "/metrics").text
    finally:
        engine.shutdown()
        torch.set_num_threads(threads)
    return answers, metrics


def _choices(answer: dict) -> list[tuple]:
    return [
        (c["message"]["content"], c["finish_reason"], c.get("logprobs")) for c in answer["choices"]
    ]


@pytest.fixture(scope="module")
def plain():
    return _run_all(None)[0]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculative_answers_equal_plain_answers(plain, method):
    spec = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
    answers, metrics = _run_all(spec)
    for item, want, got in zip(REQUESTS, plain, answers, strict=True):
        assert _choices(got) == _choices(want), item[1]
        assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    accepted = re.search(r"^vllm:spec_decode_num_accepted_tokens_total (\d+)$", metrics, re.M)
    drafted = re.search(r"^vllm:spec_decode_num_draft_tokens_total (\d+)$", metrics, re.M)
    assert accepted and drafted, metrics
    # the copying tasks must have been drafted and mostly accepted: otherwise this test
    # compared plain decoding with itself
    assert int(accepted.group(1)) >= 40, metrics
    assert int(drafted.group(1)) > int(accepted.group(1))  # and some drafts were rejected
