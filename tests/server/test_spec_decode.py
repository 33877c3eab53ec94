"""Speculative decoding is exact: over HTTP on the default model at bf16 (its default on CPUs
with bf16 instructions; asked for so that the native kernels run on any CPU), a
server drafting with prompt lookup (ngram) or suffix trees answers every request with the
tokens, text, log-probabilities and finish reasons of the same server without speculation,
with the requests sent concurrently (batched beside each other, prompts of mixed lengths),
a stop string, max_tokens reached in the middle of a draft, n = 2 and logprobs. The oracle is
the plain server; the drafts must also have been accepted (else nothing was tested).

EAGLE-3 draft heads (an MLA one and a Llama-style one, tiny and random) on a tiny Kimi-K2.5
NVFP4 checkpoint, the same way: their drafts are rarely right, so the answers are compared
and the drafts counted (their acceptance is tests/engine/test_spec_eagle3.py's)."""

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


def _server(spec: dict | None, model: str | None = None):
    import torch

    threads = torch.get_num_threads()
    settings = {"max_model_len": 2048, "threads": 1, "dtype": "bfloat16"}
    if model is not None:  # a tiny checkpoint
        settings.update(model=model, max_model_len=512)
    if spec is not None:
        settings["speculative_config"] = spec
    engine = engine_mod.build_async_engine(**settings)
    app = create_app(engine, ServerConfig(served_model_name=engine.model_name))
    return engine, app, threads


def _run_all(
    spec: dict | None, model: str | None = None, requests: list = REQUESTS
) -> tuple[list[dict], str]:
    import torch

    engine, app, threads = _server(spec, model)
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

            with ThreadPoolExecutor(len(requests)) as pool:
                answers = list(pool.map(ask, requests))
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


# ---- EAGLE-3 heads on a tiny Kimi-K2.5 -----------------------------------------------------
EAGLE_HEADS = ("kimi-k2.5-eagle3-mla", "kimi-k2.5-eagle3")
KIMI_REQUESTS = [
    (["Count from 1 to 40, separated by commas."], {"max_tokens": 40}),
    (["Hi"], {"max_tokens": 7}),  # ends mid-draft
    ([f"Repeat this text exactly:\n\n{PARAGRAPH}"], {"max_tokens": 24, "n": 2}),
    (["Why is the sky blue?"], {"max_tokens": 20, "logprobs": True, "top_logprobs": 3}),
    ([f"Rename the variable result to total:\n\n{CODE}"], {"max_tokens": 32}),  # + a stop
]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """A tiny Kimi-K2.5 NVFP4, its two heads, and its plain answers to KIMI_REQUESTS with the
    last one stopped by a string from the middle of its own plain answer."""
    from moeserve.testing.checkpoints import TinyShape, write_checkpoint, write_eagle3_checkpoint

    root = tmp_path_factory.mktemp("eagle3-http")
    target = write_checkpoint(
        str(root / "kimi"), "kimi-k2.5", "nvfp4-modelopt", TinyShape(layers=3), seed=8
    ).path
    heads = {h: write_eagle3_checkpoint(str(root / h), h, target, seed=9).path for h in EAGLE_HEADS}
    text = _run_all(None, target, KIMI_REQUESTS)[0][-1]["choices"][0]["message"]["content"]
    assert len(text) >= 8, text
    messages, extra = KIMI_REQUESTS[-1]
    requests = KIMI_REQUESTS[:-1] + [(messages, {**extra, "stop": [text[len(text) // 2 :][:2]]})]
    return target, heads, requests, _run_all(None, target, requests)[0]


@pytest.mark.parametrize("head", EAGLE_HEADS)
def test_eagle3_answers_equal_plain_answers(kimi, head):
    target, heads, requests, plain_answers = kimi
    spec = {
        "method": "eagle3",
        "model": heads[head],
        "num_speculative_tokens": 3,
        "adaptive": False,
    }
    answers, metrics = _run_all(spec, target, requests)
    for item, want, got in zip(requests, plain_answers, answers, strict=True):
        assert _choices(got) == _choices(want), item[1]
        assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    assert plain_answers[-1]["choices"][0]["finish_reason"] == "stop"
    drafted = re.search(r"^vllm:spec_decode_num_draft_tokens_total (\d+)$", metrics, re.M)
    assert drafted and int(drafted.group(1)) >= 40, metrics
