"""`usage.prompt_tokens_details.cached_tokens` against the real engine's prefix cache.

A tiny random Kimi-K2.5 checkpoint on the CPU, prefix caching on (the default): a prompt
the server has not seen reports 0 cached tokens; the same prompt again reports the full
pages the first request left in the cache, a multiple of the page size. Chat and
completions, streamed (the final usage chunk) and not, through the `openai` client.
"""

from __future__ import annotations

import itertools

import httpx
import openai
import pytest
from server_thread import ServerThread

from moeserve.config import ServerConfig
from moeserve.server.api import create_app
from moeserve.testing.checkpoints import write_checkpoint

engine_mod = pytest.importorskip("moeserve.engine.async_engine")

SENTENCE = "the quick brown fox jumps over the lazy dog and counts the stars. "
_fresh = itertools.count()


def fresh_text() -> str:
    """Text no earlier prompt starts like: its first page is new to the cache."""
    return f"Note {next(_fresh)}: " + SENTENCE * 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = write_checkpoint(
        str(tmp_path_factory.mktemp("cached") / "kimi"), "kimi-k2.5", "bf16", seed=1
    ).path
    engine = engine_mod.build_async_engine(
        path, device="cpu", dtype="bfloat16", max_model_len=512, threads=1
    )
    app = create_app(engine, ServerConfig(served_model_name="tiny"))
    try:
        with ServerThread(app, startup_timeout=60) as srv:
            srv.page_size = engine.engine.config.cache.page_size
            yield srv
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def chat_usage(client, text: str, stream: bool):
    # the system turn leads the prompt, so a fresh text makes the first page fresh
    messages = [{"role": "system", "content": text}, {"role": "user", "content": "Go on."}]
    kw = dict(model="tiny", messages=messages, max_tokens=2, temperature=0)
    if not stream:
        return client.chat.completions.create(**kw).usage
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    return chunks[-1].usage


def completion_usage(client, text: str, stream: bool):
    kw = dict(model="tiny", prompt=text, max_tokens=2, temperature=0)
    if not stream:
        return client.completions.create(**kw).usage
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[-1].choices == []
    return chunks[-1].usage


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_cached_tokens_count_the_prefix_cache(server, client, endpoint, stream):
    ask = chat_usage if endpoint == "chat" else completion_usage
    text = fresh_text()
    first = ask(client, text, stream)
    assert first.prompt_tokens > 3 * server.page_size
    assert first.prompt_tokens_details.cached_tokens == 0
    again = ask(client, text, stream)
    cached = again.prompt_tokens_details.cached_tokens
    assert again.prompt_tokens == first.prompt_tokens
    assert 0 < cached < again.prompt_tokens and cached % server.page_size == 0
    assert cached >= again.prompt_tokens - 2 * server.page_size  # the full pages, near enough


def test_each_prompt_counts_once_and_a_new_one_counts_nothing(server, client):
    """Two prompts, two choices each: the one seen before counts its cached pages once, the
    new one 0 even if one of its choices reused the other's freshly computed pages."""
    old, new = fresh_text(), fresh_text()
    seen = client.completions.create(model="tiny", prompt=old, max_tokens=1).usage
    again = client.completions.create(model="tiny", prompt=old, max_tokens=1).usage
    both = client.completions.create(model="tiny", prompt=[old, new], max_tokens=1, n=2).usage
    new_len = httpx.post(server.base_url + "/tokenize", json={"prompt": new}).json()["count"]
    assert both.prompt_tokens == seen.prompt_tokens + new_len  # once each, not per choice
    assert both.prompt_tokens_details.cached_tokens == again.prompt_tokens_details.cached_tokens
