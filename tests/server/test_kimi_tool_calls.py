"""Kimi-K2.5 tool calling over HTTP with the official `openai` client, streamed and not.

The server runs the fake engine (fake_engine.py) with a real Kimi tokenizer whose chat
template is Kimi-K2.5's published one: the model "says" what follows `SAY:` in the last user
turn, encoded by that tokenizer, so the tool-call markers it writes are the model's own
special tokens (text between « and » is encoded as ordinary tokens instead). Every prompt the
engine receives is checked against the published template (tests/kimi_k25_oracle.py).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from fake_engine import EOS, MODEL, FakeEngine
from kimi_k25_oracle import TEMPLATE_PATH, oracle
from server_thread import ServerThread

from moeserve.config import ServerConfig
from moeserve.engine.outputs import RequestOutput
from moeserve.sampling import SamplingParams
from moeserve.server import parsers
from moeserve.server.api import create_app
from moeserve.testing.checkpoints import write_kimi_tokenizer
from moeserve.tokenizer.hf import load_hf_tokenizer
from moeserve.tokenizer.kimi import KIMI_K25, KimiTokenizer

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
    },
}
TOOLS = [WEATHER, SEARCH]


def call_text(cid: str, args: str) -> str:
    return f"{CB}{cid}{AB}{args}{CE}"


TWO_CALLS = (
    SB
    + call_text("functions.get_weather:0", '{"city": "Paris"}')
    + call_text("functions.get_weather:1", '{"city": "Oslo"}')
    + SE
)


class KimiFakeEngine(FakeEngine):
    """The fake engine over a Kimi tokenizer; it honours stop_token_ids as the engine does
    (the stop token's own text is not shown)."""

    def __init__(self, tokenizer: KimiTokenizer) -> None:
        super().__init__(model_name=MODEL, max_model_len=4096)
        self.tokenizer = tokenizer

    def script(self, prompt_ids: list[int]) -> list[int] | None:
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        if "SAY:" not in text:
            return None
        said = text.rsplit("SAY:", 1)[1].split("<|im_end|>", 1)[0]
        ids: list[int] = []
        for i, part in enumerate(said.replace("»", "«").split("«")):
            if i % 2:  # quoted: the marker characters as ordinary text
                ids += self.tokenizer._enc.encode(
                    part, allowed_special=set(), disallowed_special=()
                )
            else:
                ids += self.tokenizer.encode(part)
        return ids + [EOS]

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        async for out in super().generate(prompt_token_ids, params, request_id):
            stop = [t for t in out.token_ids if t in params.stop_token_ids]
            if stop and not out.finished:
                yield RequestOutput(
                    request_id, "", out.token_ids, None, True, "stop",
                    out.num_prompt_tokens, out.num_output_tokens, stop_reason=stop[0],
                )  # fmt: skip
                return
            yield out


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> KimiTokenizer:
    folder = tmp_path_factory.mktemp("k25")
    write_kimi_tokenizer(str(folder), 300)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template")  # the checkpoint's template is its chat_template.jinja
    cfg_path.write_text(json.dumps(cfg))
    shutil.copy(TEMPLATE_PATH, folder / "chat_template.jinja")
    tok = load_hf_tokenizer(str(folder))
    assert isinstance(tok, KimiTokenizer) and tok.chat_format == KIMI_K25
    return tok


def _serve(tokenizer: KimiTokenizer, tool_parser: str | None):
    engine = KimiFakeEngine(tokenizer)
    app = create_app(
        engine,
        ServerConfig(served_model_name=MODEL),
        reasoning_parser="kimi_k2",
        tool_parser=tool_parser,
    )
    return engine, ServerThread(app)


@pytest.fixture(scope="module")
def server(tokenizer):
    engine, thread = _serve(tokenizer, "kimi_k2")
    with thread as srv:
        srv.engine = engine
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def prompt_of_last_request(server) -> str:
    _, ids, _ = server.engine.requests[-1]
    return server.engine.tokenizer.decode(ids, skip_special_tokens=False)


def say(text: str, history: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    return [*(history or []), {"role": "user", "content": "SAY:" + text}]


def calls_of(message) -> list[tuple[str, str, str]]:
    return [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]


def stream_calls(chunks) -> tuple[list[tuple[str, str, str]], list[str], str, str]:
    """(calls rebuilt from the tool-call deltas, the argument pieces, reasoning, content)."""
    calls: dict[int, list[str]] = {}
    pieces, reasoning, content = [], "", ""
    for ch in chunks:
        if not ch.choices:
            continue
        delta = ch.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.index not in calls:  # id, type and name come in a call's first piece only
                assert tc.id and tc.type == "function" and tc.function.name
                calls[tc.index] = [tc.id, tc.function.name, ""]
            else:
                assert tc.id is None and tc.function.name is None
            calls[tc.index][2] += tc.function.arguments or ""
            pieces.append(tc.function.arguments or "")
    return [tuple(calls[i]) for i in sorted(calls)], pieces, reasoning, content


# ----------------------------------------------------------------------------- the parser


def test_parser_takes_a_marker_only_with_its_token():
    """With the markers' token ids the parser sees which markers the model produced: split
    anywhere, the same text is a call when their ids came with it and content when not."""
    ids = {101: SB, 102: SE, 103: CB, 104: AB, 105: CE}
    text = "See: " + SB + call_text("functions.f:0", '{"x": 1}') + SE + " done"
    for cut in range(len(text) + 1):
        for with_ids in (True, False):
            p = parsers.make_output_parser(None, "kimi_k2", "", use_tools=True)
            p.use_marker_tokens(ids)
            content, deltas = "", []
            for k, piece in enumerate((text[:cut], text[cut:])):
                if with_ids and k == 0:
                    p.see_tokens(list(ids))  # ids never come after their text
                d = p.feed(piece)
                content += d.content
                parsers.merge_tool_deltas(deltas, d.tool_calls)
            content += p.flush().content
            if with_ids:
                assert content == "See:  done"
                assert [(c.id, c.name, c.arguments) for c in p.tool_calls] == [
                    ("functions.f:0", "f", '{"x": 1}')
                ]
            else:
                assert content == text and p.tool_calls == []


def test_parser_resumes_a_call_the_server_started():
    p = parsers.make_output_parser("kimi_k2", "kimi_k2", "...", use_tools=True)
    p.resume_tool_call(SB + CB + "functions.f:3" + AB)
    first = p.feed('{"a"')
    assert [(d.index, d.id, d.name, d.arguments) for d in first.tool_calls] == [
        (0, "functions.f:3", "f", '{"a"')
    ]
    rest = p.feed(": 1}" + CE + SE)
    assert [(d.id, d.arguments) for d in rest.tool_calls] == [(None, ": 1}")]
    assert [(c.id, c.arguments) for c in p.tool_calls] == [("functions.f:3", '{"a": 1}')]


# ----------------------------------------------------------------------------- tool_choice auto

PARIS_OSLO = [
    ("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
    ("functions.get_weather:1", "get_weather", '{"city": "Oslo"}'),
]


def test_tools_round_trip(server, client):
    # reasoning that ends in the tool-call section (no </think>), two calls in one turn
    messages = say("Two cities, two calls." + TWO_CALLS)
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert prompt_of_last_request(server) == oracle(messages, TOOLS)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "Two cities, two calls."
    assert calls_of(choice.message) == PARIS_OSLO
    assert r.usage.prompt_tokens_details.cached_tokens == 0

    # the client sends the turn back with the results: the published template's prompt
    assistant = choice.message.model_dump(exclude_none=True)
    assert set(assistant) >= {"role", "tool_calls", "reasoning_content"}
    results = [
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18 C"},
        {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "9 C"},
    ]
    follow = say("</think>Paris 18 C, Oslo 9 C.", [*messages, assistant, *results])
    r2 = client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS)
    sent = [{k: v for k, v in m.items() if k != "reasoning"} for m in follow]
    assert prompt_of_last_request(server) == oracle(sent, TOOLS)
    assert "<think>Two cities, two calls.</think><|tool_calls_section_begin|>" in oracle(
        sent, TOOLS
    )  # the current round keeps its reasoning
    assert r2.choices[0].finish_reason == "stop"
    assert r2.choices[0].message.content == "Paris 18 C, Oslo 9 C."
    assert r2.choices[0].message.tool_calls in (None, [])


def test_tools_round_trip_streamed(server, client):
    messages = say("Checking.</think>On it." + TWO_CALLS)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert prompt_of_last_request(server) == oracle(messages, TOOLS)
    calls, pieces, reasoning, content = stream_calls(chunks)
    assert calls == PARIS_OSLO
    assert len(pieces) > 4  # arguments stream as they are generated
    assert (reasoning, content) == ("Checking.", "On it.")
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0


def test_a_schema_typescript_cannot_hold_is_declared_as_the_json_sent(server, client):
    odd = [
        {
            "type": "function",
            "function": {
                "name": "odd",
                "parameters": {"type": "object", "properties": {"x": {"format": "uuid"}}},
            },
        }
    ]
    messages = say("</think>ok")
    client.chat.completions.create(model=MODEL, messages=messages, tools=odd)
    prompt = prompt_of_last_request(server)
    assert prompt == oracle(messages, odd)
    assert prompt.startswith('<|im_system|>tool_declare<|im_middle|>[{"function":{"name":"odd",')


def test_marker_text_that_is_not_the_model_token_stays_content(server, client):
    quoted = "«" + SB + CB + "f" + AB + "{}" + CE + SE + "»"
    r = client.chat.completions.create(
        model=MODEL, messages=say("</think>The format is " + quoted), tools=TOOLS
    )
    (choice,) = r.choices
    assert choice.message.tool_calls in (None, []) and choice.finish_reason == "stop"
    assert choice.message.content == "The format is " + quoted.strip("«»")


# ----------------------------------------------------------------------------- tool_choice forced


def test_named_function_is_called(server, client):
    history = [
        {"role": "user", "content": "Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18 C"},
    ]
    # the model writes only the arguments; generation ends at the call's end marker
    messages = say('{"query": "Oslo weather"}' + CE + call_text("x", "{}") + SE, history)
    choice = {"type": "function", "function": {"name": "search"}}
    r = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice
    )
    forced = "<think></think>" + SB + CB + "functions.search:1" + AB
    assert prompt_of_last_request(server) == oracle(messages, TOOLS) + forced[len("<think>") :]
    params = server.engine.requests[-1][2]
    assert params.stop_token_ids == (server.engine.tokenizer.encode(CE)[0],)
    (c,) = r.choices
    assert calls_of(c.message) == [("functions.search:1", "search", '{"query": "Oslo weather"}')]
    assert c.finish_reason == "stop" and c.message.content is None

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice, stream=True
        )
    )
    calls, pieces, _, content = stream_calls(chunks)
    assert calls == [("functions.search:1", "search", '{"query": "Oslo weather"}')]
    assert len(pieces) > 2 and content == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_required_makes_the_turn_a_call(server, client):
    messages = say("functions.search:0" + AB + '{"query": "x"}' + CE + SE)
    r = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required"
    )
    assert prompt_of_last_request(server).endswith(
        "<|im_assistant|>assistant<|im_middle|><think></think>" + SB + CB
    )
    assert prompt_of_last_request(server).startswith(oracle(messages, TOOLS)[: -len("<think>")])
    (c,) = r.choices
    assert calls_of(c.message) == [("functions.search:0", "search", '{"query": "x"}')]
    assert c.finish_reason == "tool_calls"
    assert server.engine.requests[-1][2].stop_token_ids == ()


def bad_request(client, **kw) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=say("x"), **kw)
    assert e.value.status_code == 400
    return e.value.response.json()["error"]


@pytest.mark.parametrize(
    "kw, param, words",
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
            "'nope' is not one of the functions in tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs at least one function"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "must be 'none', 'auto'"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
            "tool_choice.function.name",
            "must name a function",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "file_search"}},
            "tool_choice.type",
            "must be 'function'",
        ),
    ],
)
def test_bad_tool_choice_is_a_400_naming_the_field(client, kw, param, words):
    err = bad_request(client, **kw)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert words in err["message"] and err["message"].count(". ") == 0


def test_forcing_a_call_needs_a_tool_parser(tokenizer):
    _, thread = _serve(tokenizer, None)
    with thread as srv:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)
        err = bad_request(c, tools=TOOLS, tool_choice="required")
    assert err["param"] == "tool_choice" and "--tool-call-parser" in err["message"]
