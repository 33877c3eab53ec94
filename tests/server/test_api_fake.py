"""Protocol tests of the HTTP front end against the deterministic fake engine."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from fake_engine import EOS, MODEL, OFFSET, FakeEngine, FakeTokenizer, fake_logprob, make_client
from server_thread import ServerThread

from moeserve.config import ServerConfig
from moeserve.sampling import SamplingParams
from moeserve.server import protocol
from moeserve.server.api import create_app

TOK = FakeTokenizer()


def sse_events(text: str) -> list:
    """Parsed `data:` payloads of an SSE body; the final [DONE] is kept as a string."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def chat(content: str, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


def rendered_ids(messages: list[dict], **kw) -> list[int]:
    return TOK.encode(TOK.apply_chat_template(messages, **kw), add_special_tokens=False)


# ----------------------------------------------------------------------------- basics


def test_models_health_version_metrics(client):
    r = client.get("/v1/models")
    assert r.status_code == 200
    data = r.json()["data"]
    assert [m["id"] for m in data] == [MODEL] and data[0]["max_model_len"] == 512
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert client.get("/health").status_code == 200
    assert "version" in client.get("/version").json()
    client.post("/v1/chat/completions", json=chat("SAY:x"))
    text = client.get("/metrics").text
    assert "fake_engine_requests_total 1" in text
    line = 'moeserve_http_requests_total{method="POST",route="/v1/chat/completions",status="200"} 1'
    assert line in text


def test_unhealthy_engine_gives_503():
    c, _ = make_client(FakeEngine(healthy=False))
    with c:
        r = c.get("/health")
    assert r.status_code == 503 and r.json()["error"]["message"]


def test_chat_non_stream_usage_and_content(client):
    r = client.post("/v1/chat/completions", json=chat("SAY:hello", temperature=0))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    (choice,) = body["choices"]
    assert choice["message"] == {
        "role": "assistant",
        "content": "hello",
        "reasoning_content": None,
        "reasoning": None,
        "tool_calls": [],
    }
    assert choice["finish_reason"] == "stop"
    n_prompt = len(rendered_ids([{"role": "user", "content": "SAY:hello"}]))
    # 5 characters then EOS: EOS counts as a generated token, as in vLLM
    assert body["usage"] == {
        "prompt_tokens": n_prompt,
        "completion_tokens": 6,
        "total_tokens": n_prompt + 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    rid, prompt_ids, params = client.engine.requests[0]
    assert rid == body["id"] + "-0"
    assert prompt_ids == rendered_ids([{"role": "user", "content": "SAY:hello"}])
    assert params.temperature == 0.0
    # max_tokens absent = up to the context
    assert params.max_tokens == 512 - n_prompt


def test_chat_stream_protocol(client):
    body = chat("SAY:hey!", stream=True, stream_options={"include_usage": True})
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert all(c["usage"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == "hey!"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks[:-1]]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    n_prompt = len(rendered_ids([{"role": "user", "content": "SAY:hey!"}]))
    assert usage_chunk["usage"] == {
        "prompt_tokens": n_prompt,
        "completion_tokens": 5,
        "total_tokens": n_prompt + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_stream_without_usage_has_no_usage_chunk(client):
    r = client.post("/v1/chat/completions", json=chat("count", stream=True, max_tokens=3))
    chunks = sse_events(r.text)[:-1]
    assert all(c["choices"] for c in chunks) and all(c["usage"] is None for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "012" and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_n_choices_and_seeds(client):
    r = client.post("/v1/chat/completions", json=chat("count", n=3, max_tokens=4, seed=7))
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "0123" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 12
    reqs = client.engine.requests
    assert sorted(r[0] for r in reqs) == [f"{body['id']}-{i}" for i in range(3)]
    assert sorted(r[2].seed for r in reqs) == [7, 8, 9]
    # streamed: every index gets its role chunk, its text and its finish
    body = chat("count", n=2, max_tokens=3, stream=True, stream_options={"include_usage": True})
    chunks = sse_events(client.post("/v1/chat/completions", json=body).text)[:-1]
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(m["delta"].get("content", "") for m in mine) == "012"
        assert mine[-1]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_chat_logprobs(client):
    body = chat("SAY:ab", logprobs=True, top_logprobs=2)
    lp = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]
    toks = [OFFSET + ord("a"), OFFSET + ord("b"), EOS]
    assert [e["token"] for e in lp["content"]] == ["a", "b", "</s>"]
    assert [e["logprob"] for e in lp["content"]] == pytest.approx([fake_logprob(t) for t in toks])
    first = lp["content"][0]
    assert first["bytes"] == [ord("a")]
    assert [t["token"] for t in first["top_logprobs"]] == ["a", "b"]
    # stream: one logprob entry per generated token
    body = chat("count", logprobs=True, max_tokens=5, stream=True)
    chunks = sse_events(client.post("/v1/chat/completions", json=body).text)[:-1]
    entries = [
        e
        for c in chunks
        if c["choices"][0]["logprobs"]
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert [e["token"] for e in entries] == list("01234")


def test_sampling_fields_reach_the_engine(client):
    body = chat(
        "count",
        max_completion_tokens=5,
        max_tokens=9,
        temperature=0.5,
        top_p=0.9,
        top_k=4,
        min_p=0.1,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        stop=["zz", "yy"],
        stop_token_ids=[7],
        min_tokens=2,
        ignore_eos=True,
        include_stop_str_in_output=True,
        seed=3,
    )
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    p: SamplingParams = client.engine.requests[0][2]
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (5, 0.5, 0.9, 4, 0.1)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.2, 0.5, 0.25)
    assert p.stop == ("zz", "yy") and p.stop_token_ids == (7,) and p.min_tokens == 2
    assert p.ignore_eos and p.include_stop_str_in_output and p.seed == 3
    assert p.skip_special_tokens


def test_stop_string(client):
    r = client.post("/v1/chat/completions", json=chat("count", stop="4", max_tokens=9))
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "0123" and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == "4"


def test_chat_template_options(client):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": msgs,
            "max_tokens": 1,
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    )
    assert r.status_code == 200, r.text
    prompt = TOK.decode(client.engine.requests[-1][1], skip_special_tokens=False)
    assert prompt == "<|user|>hi<|end|><|assistant|>Once upon"
    body = chat("x", max_tokens=1, add_generation_prompt=False)
    client.post("/v1/chat/completions", json=body)
    assert TOK.decode(client.engine.requests[-1][1], False) == "<|user|>x<|end|>"
    body = chat("x", max_tokens=1, chat_template_kwargs={"thinking": True})
    client.post("/v1/chat/completions", json=body)
    assert TOK.decode(client.engine.requests[-1][1], False).endswith("<|assistant|><think>")
    # content parts and the developer role (rendered as system)
    body = {
        "model": MODEL,
        "max_tokens": 1,
        "messages": [
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
    }
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert TOK.decode(client.engine.requests[-1][1], False).startswith(
        "<|system|>be brief<|end|><|user|>ab<|end|>"
    )


# ----------------------------------------------------------------------------- completions


def test_completion_prompt_forms(client):
    ids = TOK.encode("hi", add_special_tokens=False)
    for prompt, n_prompts in [("hi", 1), (["hi", "yo!"], 2), (ids, 1), ([ids, ids + ids], 2)]:
        r = client.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3, "n": 2}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion"
        assert [c["index"] for c in body["choices"]] == list(range(2 * n_prompts))
        assert all(c["text"] == "012" and c["finish_reason"] == "length" for c in body["choices"])
        assert body["usage"]["completion_tokens"] == 3 * 2 * n_prompts
    # text prompts get the BOS (add_special_tokens defaults to true); token prompts are as sent
    sent = [r[1] for r in client.engine.requests]
    assert sent[0] == [1, *ids]
    assert sent[-1] == ids + ids
    body = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": ["hi", "yo!"], "max_tokens": 1}
    ).json()
    assert body["usage"]["prompt_tokens"] == 3 + 4


def test_completion_stream(client):
    body = {
        "model": MODEL,
        "prompt": ["a", "b"],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "echo": True,
    }
    chunks = sse_events(client.post("/v1/completions", json=body).text)[:-1]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all(c["usage"] is None for c in chunks[:-1])
    for i, p in enumerate("ab"):
        texts = [c["choices"][0]["text"] for c in chunks[:-1] if c["choices"][0]["index"] == i]
        assert "".join(texts) == p + "012"


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_completion_echo_logprobs_for_lm_eval(client, max_tokens):
    prompt = TOK.encode("abc", add_special_tokens=False)
    body = {
        "model": MODEL,
        "prompt": [prompt],
        "max_tokens": max_tokens,
        "logprobs": 1,
        "echo": True,
        "temperature": 0,
    }
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    gen = [OFFSET + ord("0")][:max_tokens]
    assert choice["text"] == "abc" + "0" * max_tokens
    assert lp["tokens"][1:] == ["b", "c", *["0"] * max_tokens]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expect = [fake_logprob(t) for t in prompt[1:] + gen]
    assert lp["token_logprobs"][1:] == pytest.approx(expect)
    assert lp["text_offset"] == list(range(3 + max_tokens))
    for top, tok, val in zip(lp["top_logprobs"][1:], lp["tokens"][1:], expect, strict=True):
        assert top[tok] == pytest.approx(val)  # the actual token is always listed
    # what lm-eval computes: sum(token_logprobs[ctxlen:-1]) for context "a"
    params = client.engine.requests[-1][2]
    assert params.prompt_logprobs == 1 and params.max_tokens == max_tokens


def test_completion_logprobs_without_echo(client):
    body = {"model": MODEL, "prompt": "q", "max_tokens": 3, "logprobs": 2}
    lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["0", "1", "2"] and lp["text_offset"] == [0, 1, 2]
    assert all(len(t) == 2 for t in lp["top_logprobs"])


# ----------------------------------------------------------------------------- errors


GOOD_CHAT = chat("SAY:ok", max_tokens=4)

BAD_REQUESTS = [
    # (path, body, status, error type, param)
    ("/v1/chat/completions", b"{not json", 400, "invalid_request_error", None),
    ("/v1/chat/completions", b"[1, 2]", 400, "invalid_request_error", None),
    ("/v1/chat/completions", {**GOOD_CHAT, "model": "nope"}, 404, "NotFoundError", "model"),
    (
        "/v1/chat/completions",
        {**GOOD_CHAT, "max_tokens": -1},
        400,
        "invalid_request_error",
        "max_tokens",
    ),
    (
        "/v1/chat/completions",
        {**GOOD_CHAT, "max_tokens": 10**12},
        400,
        "invalid_request_error",
        "messages",
    ),
    (
        "/v1/chat/completions",
        {**GOOD_CHAT, "max_tokens": "many"},
        400,
        "invalid_request_error",
        "max_tokens",
    ),
    (
        "/v1/chat/completions",
        {**GOOD_CHAT, "messages": "hi"},
        400,
        "invalid_request_error",
        "messages",
    ),
    (
        "/v1/chat/completions",
        {**GOOD_CHAT, "messages": []},
        400,
        "invalid_request_error",
        "messages",
    ),
    ("/v1/chat/completions", {"model": MODEL}, 400, "invalid_request_error", "messages"),
    ("/v1/chat/completions", chat("x", n=0), 400, "invalid_request_error", "n"),
    ("/v1/chat/completions", chat("x", n=10_000), 400, "invalid_request_error", "n"),
    (
        "/v1/chat/completions",
        chat("x", logprobs=True, top_logprobs=21),
        400,
        "invalid_request_error",
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        chat("x", temperature=-1),
        400,
        "invalid_request_error",
        "temperature",
    ),
    ("/v1/chat/completions", chat("x", top_p=0), 400, "invalid_request_error", "top_p"),
    ("/v1/chat/completions", chat("x", top_k=-5), 400, "invalid_request_error", "top_k"),
    (
        "/v1/chat/completions",
        chat("x", stream_options={"include_usage": True}),
        400,
        "invalid_request_error",
        "stream_options",
    ),
    ("/v1/chat/completions", chat("x", stop=[""]), 400, "invalid_request_error", "stop"),
    ("/v1/chat/completions", chat("x" * 600), 400, "invalid_request_error", "messages"),
    ("/v1/chat/completions", chat("REJECT", max_tokens=2), 400, "invalid_request_error", None),
    (
        "/v1/chat/completions",
        chat("REJECT", max_tokens=2, stream=True),
        400,
        "invalid_request_error",
        None,
    ),
    (
        "/v1/chat/completions",
        chat("x", chat_template_kwargs={"explode": True}),
        400,
        "invalid_request_error",
        None,
    ),
    (
        "/v1/chat/completions",
        chat("x", tool_choice="required"),
        400,
        "invalid_request_error",
        "tool_choice",
    ),
    (
        "/v1/chat/completions",
        chat("x", logit_bias={"5": 500.0}),
        400,
        "invalid_request_error",
        "logit_bias",
    ),
    (
        "/v1/chat/completions",
        chat("x", logit_bias={"five": 1.0}),
        400,
        "invalid_request_error",
        "logit_bias",
    ),
    (
        "/v1/chat/completions",
        chat("x", logit_bias={str(10**9): 1.0}),
        400,
        "invalid_request_error",
        "logit_bias",
    ),
    # requests that once stopped the engine for good: caught at the door, field named
    ("/v1/completions", {"prompt": "Hi", "seed": 2**64}, 400, "invalid_request_error", "seed"),
    (
        "/v1/completions",
        {"prompt": "Hi", "min_tokens": 2, "stop_token_ids": [10**9]},
        400,
        "invalid_request_error",
        "stop_token_ids",
    ),
    (
        "/v1/completions",
        {"prompt": "Hi", "max_tokens": 2, "min_tokens": 3},
        400,
        "invalid_request_error",
        "min_tokens",
    ),
    (
        "/v1/completions",
        {"prompt": "Hi", "min_tokens": 1, "stop_token_ids": list(range(FakeTokenizer.vocab_size))},
        400,
        "invalid_request_error",
        "min_tokens",
    ),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
        400,
        "invalid_request_error",
        "messages.0.content",
    ),
    (
        "/v1/completions",
        {"prompt": ["a"] * 1000, "n": 128},
        400,
        "invalid_request_error",
        "n",
    ),
    ("/tokenize", b'{"prompt": "\\udfff"}', 400, "invalid_request_error", "prompt"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "invalid_request_error",
        "messages.0.role",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "invalid_request_error",
        "messages.0.content.0.image_url",  # this model takes no images
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
        400,
        "invalid_request_error",
        "messages",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "invalid_request_error", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, "invalid_request_error", "prompt"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": [-1, 4]},
        400,
        "invalid_request_error",
        "prompt",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": [[5], [10**9]]},
        400,
        "invalid_request_error",
        "prompt.1",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "logprobs": 21},
        400,
        "invalid_request_error",
        "logprobs",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 512},
        400,
        "invalid_request_error",
        "prompt",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": -3},
        400,
        "invalid_request_error",
        "max_tokens",
    ),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "NotFoundError", "model"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "suffix": "y"},
        400,
        "invalid_request_error",
        "suffix",
    ),
    ("/tokenize", {"prompt": "x", "messages": []}, 400, "invalid_request_error", None),
    ("/detokenize", {"tokens": [10**9]}, 400, "invalid_request_error", "tokens"),
    ("/v1/nothing", {}, 404, "NotFoundError", None),
]


@pytest.mark.parametrize(("path", "body", "status", "etype", "param"), BAD_REQUESTS)
def test_bad_input_gets_openai_error_then_server_still_serves(
    client, path, body, status, etype, param
):
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == etype and err["param"] == param
    msg = err["message"]
    assert msg and "Traceback" not in msg and msg.endswith(".") and "\n" not in msg
    ok = client.post("/v1/chat/completions", json=GOOD_CHAT)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "ok"


def test_context_length_message(client):
    r = client.post("/v1/chat/completions", json=chat("hello", max_tokens=10**6))
    n = len(rendered_ids([{"role": "user", "content": "hello"}]))
    assert r.json()["error"]["message"].startswith(
        f"This model's maximum context length is 512 tokens. However, you requested "
        f"{n + 10**6} tokens ({n} in the messages, {10**6} in the completion)."
    )
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x" * 600, "max_tokens": None}
    )
    assert "However, your request has 601 input tokens" in r.json()["error"]["message"]


def test_model_not_found_code(client):
    err = client.post("/v1/chat/completions", json={**GOOD_CHAT, "model": "x"}).json()["error"]
    assert err["code"] == "model_not_found" and "'x'" in err["message"]


def test_limits_match_sampling_params():
    assert protocol.MAX_LOGPROBS == SamplingParams.MAX_LOGPROBS


# ----------------------------------------------------------------------------- auth


def test_api_key():
    c, _ = make_client(api_key="s3cret")
    with c:
        assert c.get("/health").status_code == 200
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}]:
            r = c.post("/v1/chat/completions", json=GOOD_CHAT, headers=headers)
            assert r.status_code == 401
            err = r.json()["error"]
            assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
        assert c.get("/v1/models").status_code == 401
        assert c.post("/tokenize", json={"prompt": "a"}).status_code == 401
        ok = c.post(
            "/v1/chat/completions", json=GOOD_CHAT, headers={"Authorization": "Bearer s3cret"}
        )
        assert ok.status_code == 200
        assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_endpoints(client):
    r = client.post("/tokenize", json={"prompt": "hi</s>", "add_special_tokens": False}).json()
    assert r == {"tokens": TOK.encode("hi</s>", False), "count": 3, "max_model_len": 512}
    assert client.post("/tokenize", json={"prompt": "hi"}).json()["tokens"][0] == 1  # BOS
    msgs = [{"role": "user", "content": "yo"}]
    r = client.post("/tokenize", json={"messages": msgs}).json()
    assert r["tokens"] == rendered_ids(msgs)
    r = client.post(
        "/tokenize", json={"prompt": "ab", "add_special_tokens": False, "return_token_strs": True}
    )
    assert r.json()["token_strs"] == ["a", "b"]
    r = client.post("/detokenize", json={"tokens": TOK.encode("hé<think>", False)}).json()
    assert r == {"prompt": "hé<think>"}
    info = client.get("/tokenizer_info").json()
    assert (
        info["eos_token"] == "</s>" and info["bos_token"] == "<s>" and info["pad_token"] == "<pad>"
    )
    assert info["chat_template"] == TOK.chat_template and info["model_max_length"] == 512


# ----------------------------------------------------------------------------- disconnects


def _wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_client_disconnect_aborts_stream_and_non_stream():
    engine = FakeEngine(delay=0.02)
    app = create_app(engine, ServerConfig(served_model_name=MODEL))
    with ServerThread(app) as srv:
        # streaming: read a few chunks, then hang up
        with httpx.Client(base_url=srv.base_url) as http:
            body = chat("count", max_tokens=400, stream=True)
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(4)]
                assert any(line.startswith("data: ") for line in got)
        assert _wait_for(lambda: len(engine.aborted) == 1), engine.aborted
        assert engine.aborted[0] == engine.requests[0][0]
        # non-streaming: the client gives up before the answer exists
        with (
            httpx.Client(base_url=srv.base_url, timeout=0.3) as http,
            pytest.raises(httpx.ReadTimeout),
        ):
            http.post(
                "/v1/completions", json={"model": MODEL, "prompt": "p", "max_tokens": 400, "n": 2}
            )
        assert _wait_for(lambda: len(engine.aborted) == 3), engine.aborted
        assert set(engine.aborted[1:]) == {r[0] for r in engine.requests[1:]}
        # and it still serves
        with httpx.Client(base_url=srv.base_url) as http:
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "p", "max_tokens": 2})
            assert r.json()["choices"][0]["text"] == "01"
    assert not set(engine.aborted) & set(engine.finished)


# ----------------------------------------------------------------------------- parsers, via HTTP

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
]
CALL = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
)


@pytest.fixture
def kimi_client():
    c, engine = make_client(reasoning_parser="kimi_k2", tool_parser="kimi_k2")
    with c:
        c.engine = engine
        yield c


def test_reasoning_and_tool_calls_non_stream(kimi_client):
    c = kimi_client
    msg = c.post("/v1/chat/completions", json=chat("SAY:<think>plan</think>The answer")).json()
    m = msg["choices"][0]["message"]
    assert (m["reasoning_content"], m["reasoning"], m["content"]) == ("plan", "plan", "The answer")
    assert not c.engine.requests[-1][2].skip_special_tokens  # markers must survive decoding
    # thinking mode: the prompt opened <think>, the output starts inside it
    body = chat("SAY:deep thought</think>42", chat_template_kwargs={"thinking": True})
    m = c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (m["reasoning_content"], m["content"]) == ("deep thought", "42")
    # reasoning ended by the tool-call section, then a call
    body = chat("SAY:<think>need weather" + CALL, tools=TOOLS)
    r = c.post("/v1/chat/completions", json=body).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "need weather"
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [
        {
            "id": "functions.get_weather:0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ]
    # tool_choice none: the section stays plain text
    body = chat("SAY:" + CALL, tools=TOOLS, tool_choice="none")
    choice = c.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["tool_calls"] == []
    assert choice["message"]["content"] == CALL


def test_reasoning_and_tool_calls_stream(kimi_client):
    body = chat("SAY:<think>hmm</think>ok" + CALL, tools=TOOLS, stream=True)
    chunks = sse_events(kimi_client.post("/v1/chat/completions", json=body).text)[:-1]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "hmm"
    assert "".join(d.get("reasoning", "") for d in deltas) == "hmm"
    assert "".join(d.get("content", "") for d in deltas) == "ok"
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls[0] == {
        "index": 0,
        "id": "functions.get_weather:0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert all(
        tc == {"index": 0, "function": {"arguments": tc["function"]["arguments"]}}
        for tc in calls[1:]
    )
    assert "".join(tc["function"]["arguments"] for tc in calls) == '{"city": "Paris"}'
    assert len(calls) > 2  # arguments are streamed in pieces, not at the end
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_unknown_parser_name():
    with pytest.raises(ValueError, match="Unknown reasoning parser"):
        make_client(reasoning_parser="bogus")
    with pytest.raises(ValueError, match="Unknown tool-call parser"):
        make_client(tool_parser="bogus")
