"""No request can take the server down: the real engine (SmolLM2 default, CPU, fp32) behind
the real HTTP app. Requests that once killed the engine thread, and errors injected into one
request's sampling, detokenizing and output parsing, fail that request alone (a 4xx, or a
500 with an OpenAI error object) while three other streams finish normally; the next request
succeeds and /health stays 200. An error outside per-request code poisons the engine: every
stream gets an error, /health turns 503 and the process would exit (recorded here)."""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from moeserve.config import ServerConfig  # noqa: E402
from moeserve.engine import async_engine as engine_mod  # noqa: E402
from moeserve.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from moeserve.sampling.rows import RowStates  # noqa: E402
from moeserve.server import api  # noqa: E402
from moeserve.server import parsers as chat_parsers  # noqa: E402

STREAM_TOKENS = 24


@pytest.fixture(scope="module")
def server():
    import sys

    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "server"))
    from server_thread import ServerThread

    threads = torch.get_num_threads()
    poisoned: list[BaseException] = []
    core = engine_mod.build_engine(dtype="float32", max_model_len=512, max_num_seqs=8, threads=1)
    eng = engine_mod.AsyncEngine(core, "smol", on_poison=poisoned.append)
    app = api.create_app(eng, ServerConfig(served_model_name="smol"))
    try:
        with ServerThread(app, startup_timeout=60) as srv:
            srv.engine, srv.poisoned = eng, poisoned
            yield srv
    finally:
        eng.shutdown()
        torch.set_num_threads(threads)


def chat_body(content: str, **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], **kw}


class Streams:
    """Three streaming chats running in threads while the test sends other requests."""

    def __init__(self, base: str) -> None:
        self.results: list[tuple[str | None, int]] = []
        self.threads = [
            threading.Thread(target=self._one, args=(base, i), daemon=True) for i in range(3)
        ]
        for t in self.threads:
            t.start()

    def _one(self, base: str, i: int) -> None:
        body = chat_body(
            f"Tell me about rivers, part {i}.",
            stream=True,
            max_tokens=STREAM_TOKENS,
            ignore_eos=True,
            temperature=0,
        )
        finish, n = None, 0
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                for c in event["choices"]:
                    n += 1 if c["delta"].get("content") else 0
                    finish = c["finish_reason"] or finish
        self.results.append((finish, n))

    def join(self) -> list[tuple[str | None, int]]:
        for t in self.threads:
            t.join(timeout=300)
        return self.results


def kv_usage(base: str) -> float:
    text = httpx.get(base + "/metrics").text
    line = next(ln for ln in text.splitlines() if ln.startswith("moeserve_kv_cache_usage_ratio"))
    return float(line.split()[-1])


def healthy_and_serving(base: str) -> None:
    assert httpx.get(base + "/health").status_code == 200
    r = httpx.post(base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def assert_error_object(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in err["message"]
    return err


KILLERS = [
    # (body for /v1/completions, expected status, param named in the 400)
    ({"prompt": "Hi", "max_tokens": 2, "seed": 18446744073709551616}, 400, "seed"),
    ({"prompt": "Hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [49153]}, 400, None),
    ({"prompt": "Hi", "min_tokens": 1, "stop_token_ids": list(range(49152))}, 400, "min_tokens"),
    ({"prompt": "Hi", "max_tokens": 4, "logit_bias": {"49152": 5}}, 400, "logit_bias"),
    # a valid parameter: sanitised (no inf/nan draw), it simply succeeds
    (
        {"prompt": "Hi Hi Hi", "max_tokens": 4, "temperature": 1, "repetition_penalty": 1e-38},
        200,
        None,
    ),
]


def test_engine_killing_requests_fail_alone(server):
    base = server.base_url
    streams = Streams(base)
    time.sleep(0.5)  # the streams are running
    for body, status, param in KILLERS:
        r = httpx.post(base + "/v1/completions", json=body, timeout=120)
        if status == 200:
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        else:
            err = assert_error_object(r, status)
            if param is not None:
                assert err["param"] == param, err
        assert httpx.get(base + "/health").status_code == 200
    assert streams.join() == [("length", STREAM_TOKENS)] * 3
    healthy_and_serving(base)
    assert not server.poisoned


@pytest.mark.parametrize("where", ["sampling", "detokenizing", "parser"])
def test_injected_error_fails_one_request(server, monkeypatch, where):
    base = server.base_url
    if where == "sampling":  # this request's sampler state cannot be built
        real = RowStates.new_row

        def broken_row(self, p, *args):
            if p.seed == 4242:
                raise RuntimeError("injected sampling failure")
            return real(self, p, *args)

        monkeypatch.setattr(RowStates, "new_row", broken_row)
        body = chat_body("Hi", max_tokens=8, seed=4242, temperature=0.8)
    elif where == "detokenizing":  # this request's detokenizer raises on its third token
        real_add = IncrementalDetokenizer.add

        def broken_add(self, token, final=False):
            if "ZZSTOP" in self.stops and len(self.ids) > 8:
                raise KeyError("injected detokenizer failure")
            return real_add(self, token, final)

        monkeypatch.setattr(IncrementalDetokenizer, "add", broken_add)
        body = chat_body("Hi", max_tokens=8, stop=["ZZSTOP"], ignore_eos=True)
    else:  # this request's output parser raises (front end, per choice)
        real_make = chat_parsers.make_output_parser

        class Broken(chat_parsers.ChatOutputParser):
            def feed(self, text):
                raise ValueError("injected parser failure") if text else None
                return super().feed(text)

        def make(reasoning, tools, prompt_text, use_tools):
            if "PARSERBOOM" in prompt_text:
                return Broken()
            return real_make(reasoning, tools, prompt_text, use_tools)

        monkeypatch.setattr(chat_parsers, "make_output_parser", make)
        body = chat_body("PARSERBOOM", max_tokens=8, ignore_eos=True)
    streams = Streams(base)
    time.sleep(0.5)
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
    # the parser's error is a ValueError raised in the front end: a 500 all the same (the
    # request's own failure), never a dead engine
    err = assert_error_object(r, 500)
    assert err["type"] == "internal_server_error"
    stream_body = {**body, "stream": True}
    with httpx.stream("POST", base + "/v1/chat/completions", json=stream_body, timeout=120) as s:
        s.read()
    if s.status_code == 500:  # failed before its first token: a plain error response
        assert_error_object(s, 500)
    else:  # failed mid-stream: an error event, then the end of the stream
        events = [ln for ln in s.text.splitlines() if ln.startswith("data: ")]
        assert any('"error"' in e for e in events) and events[-1] == "data: [DONE]"
    assert streams.join() == [("length", STREAM_TOKENS)] * 3
    healthy_and_serving(base)
    for _ in range(50):  # the failed requests' pages are free again
        if kv_usage(base) == 0.0:
            break
        time.sleep(0.1)
    assert kv_usage(base) == 0.0
    assert not server.poisoned


def test_idle_engine_gives_freed_memory_back(server, monkeypatch):
    """Once the engine has been idle for a moment it collects garbage and trims the C heap
    (glibc keeps what finished requests freed)."""
    calls: list[int] = []
    monkeypatch.setattr(engine_mod, "trim_host_heap", lambda: calls.append(1))
    healthy_and_serving(server.base_url)  # some work, then idle
    deadline = time.monotonic() + 10 * engine_mod._IDLE_TRIM_AFTER_S
    while not calls and time.monotonic() < deadline:
        time.sleep(0.1)
    assert calls == [1]  # once per idle period, not on every wake-up
    time.sleep(2 * engine_mod._IDLE_TRIM_AFTER_S)
    assert calls == [1]


def test_an_error_outside_one_request_poisons_the_engine(server, monkeypatch):
    """Last in the module: the engine is dead afterwards."""
    base = server.base_url
    streams_done = threading.Event()
    events: list[str] = []

    def one_stream() -> None:
        body = chat_body("Count to fifty.", stream=True, max_tokens=200, ignore_eos=True)
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as s:
            events.extend(ln for ln in s.iter_lines() if ln.startswith("data: "))
        streams_done.set()

    t = threading.Thread(target=one_stream, daemon=True)
    t.start()
    time.sleep(1.0)
    executor = server.engine.engine.executor

    def dead_device(step):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

    monkeypatch.setattr(executor, "execute", dead_device)
    assert streams_done.wait(60)
    assert any('"error"' in e for e in events)
    for _ in range(50):
        if server.poisoned:
            break
        time.sleep(0.1)
    assert len(server.poisoned) == 1  # the process would exit here (one line, code 70)
    assert httpx.get(base + "/health").status_code == 503
    r = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert_error_object(r, 503)
