"""The per-choice streaming state shared by chat and completions, fed hand-made engine
outputs: the streamed pieces, the non-streamed choice and the usage each chunk carries."""

from __future__ import annotations

import asyncio
import json

from fake_engine import BOS, EOS, OFFSET, FakeTokenizer, fake_logprob

from moeserve.engine.outputs import RequestOutput, TokenLogprob
from moeserve.server import parsers
from moeserve.server.chat import ChatChoiceStream
from moeserve.server.completions import CompletionChoiceStream
from moeserve.server.logprobs import LogprobFormatter
from moeserve.server.prompts import Prompt
from moeserve.server.protocol import StreamOptions
from moeserve.server.streaming import Answer

TOK = FakeTokenizer()
FMT = LogprobFormatter(TOK)


def out(text: str, n_tokens: int = 1, finish: str | None = None, **kw) -> RequestOutput:
    ids = kw.pop("token_ids", [OFFSET + ord("x")] * n_tokens)
    return RequestOutput(
        "r", text, ids, kw.pop("logprobs", None), finish is not None, finish, 3, 0, **kw
    )


def chat_choice(index: int = 0, reasoning: str | None = None, tools: bool = False):
    parser = parsers.make_output_parser(reasoning, "kimi_k2" if tools else None, "", tools)
    return ChatChoiceStream(index, parser, FMT, None)


def test_chat_pieces_and_final_choice():
    c = chat_choice(reasoning="deepseek_r1")
    assert c.opening() == {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    pieces = [
        c.add(o) for o in [out("<think>"), out("pl"), out("an</think>"), out("Hi", 2, "stop")]
    ]
    assert pieces[0] is None  # only a marker so far: nothing to show
    assert [p["delta"] for p in pieces[1:]] == [
        {"reasoning_content": "pl", "reasoning": "pl"},
        {"reasoning_content": "an", "reasoning": "an"},
        {"content": "Hi"},
    ]
    assert [p["finish_reason"] for p in pieces[1:]] == [None, None, "stop"]
    assert "stop_reason" not in pieces[2] and pieces[3]["stop_reason"] is None
    final = c.final().model_dump()
    assert final["message"]["content"] == "Hi" and final["message"]["reasoning"] == "plan"
    assert final["finish_reason"] == "stop" and final["logprobs"] is None
    assert c.num_tokens == 5


def test_chat_turn_of_tool_calls_finishes_with_tool_calls_and_null_content():
    call = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"
    )
    c = chat_choice(tools=True)
    piece = c.add(out(call, finish="stop", stop_reason=None))
    assert piece["finish_reason"] == "tool_calls"
    final = c.final()
    assert final.finish_reason == "tool_calls" and final.message.content is None
    assert [(t.id, t.function.name) for t in final.message.tool_calls] == [("functions.f:0", "f")]


def test_chat_logprobs_in_pieces_and_in_the_choice():
    c = ChatChoiceStream(0, parsers.ChatOutputParser(), FMT, 1)
    a = OFFSET + ord("a")
    piece = c.add(out("a", token_ids=[a], logprobs=[TokenLogprob(a, -0.5, [(a, -0.5)])]))
    entry = {
        "token": "a",
        "logprob": -0.5,
        "bytes": [97],
        "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]}],
    }
    assert piece["logprobs"] == {"content": [entry]}
    assert c.final().logprobs.model_dump() == {"content": [entry]}


def test_completion_echo_with_logprobs():
    ids = [BOS, OFFSET + ord("a"), OFFSET + ord("b")]
    prompt_lps = [None] + [
        TokenLogprob(t, fake_logprob(t), [(t, fake_logprob(t))]) for t in ids[1:]
    ]
    c = CompletionChoiceStream(0, Prompt(ids, "ab"), True, FMT, 0)
    zero = OFFSET + ord("0")
    first = c.add(
        out("0", token_ids=[zero], logprobs=[TokenLogprob(zero, -1.0)], prompt_logprobs=prompt_lps)
    )
    last = c.add(out("", token_ids=[EOS], logprobs=[TokenLogprob(EOS, -2.0)], finish="stop"))
    assert first["text"] == "ab0" and first["finish_reason"] is None
    assert first["logprobs"]["tokens"] == ["<s>", "a", "b", "0"]
    # generated tokens' offsets index the text returned, which starts with the prompt as sent
    assert first["logprobs"]["text_offset"][3] == 2 and first["text"][2] == "0"
    assert first["logprobs"]["token_logprobs"] == [
        None,
        fake_logprob(ids[1]),
        fake_logprob(ids[2]),
        -1.0,
    ]
    # top_logprobs=0 lists the token itself only
    assert first["logprobs"]["top_logprobs"][3] == {"0": -1.0}
    # no text, but logprobs were asked for: the piece is sent
    assert last == {
        "index": 0,
        "text": "",
        "logprobs": {
            "text_offset": [3],
            "token_logprobs": [-2.0],
            "tokens": ["</s>"],
            "top_logprobs": [{"</s>": -2.0}],
        },
        "finish_reason": "stop",
        "stop_reason": None,
    }
    final = c.final()
    assert final.text == "ab0" and final.finish_reason == "stop"
    assert final.logprobs.tokens == ["<s>", "a", "b", "0", "</s>"]
    assert final.logprobs.text_offset[3:] == [2, 3]


def test_completion_without_logprobs_skips_empty_pieces():
    c = CompletionChoiceStream(0, Prompt([BOS], ""), False, FMT, None)
    assert c.add(out("")) is None
    assert c.add(out("", finish="length"))["finish_reason"] == "length"
    assert c.final().logprobs is None


def events(answer: Answer, outputs: list[tuple[int, RequestOutput]], options) -> list:
    async def feed():
        for item in outputs:
            yield item

    async def run() -> list[str]:
        return [e async for e in answer.events(feed(), options)]

    raw = asyncio.run(run())
    assert raw[-1] == "data: [DONE]\n\n"
    return [json.loads(e.removeprefix("data: ")) for e in raw[:-1]]


def test_answer_events_with_continuous_usage():
    choices = [chat_choice(0), chat_choice(1)]
    answer = Answer("id-1", "chat.completion.chunk", "m", choices, prompt_tokens=7)
    outputs = [
        (0, out("a", 2)),
        (1, out("b", 1)),
        (0, out("c", 1, "length")),
        (1, out("", 1, "stop")),
    ]
    opts = StreamOptions(include_usage=True, continuous_usage_stats=True)
    chunks = events(answer, outputs, opts)
    assert {(c["id"], c["object"], c["model"]) for c in chunks} == {
        ("id-1", "chat.completion.chunk", "m")
    }
    got = [([ch["index"] for ch in c["choices"]], c["usage"]["completion_tokens"]) for c in chunks]
    # a choice's role chunk carries the count before its first output; then totals so far
    assert got == [([0], 0), ([0], 2), ([1], 2), ([1], 3), ([0], 4), ([1], 5), ([], 5)]
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 5,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_answer_events_without_usage():
    answer = Answer("id-2", "text_completion", "m", [chat_choice(0)], prompt_tokens=1)
    chunks = events(answer, [(0, out("a", 1, "stop"))], None)
    assert len(chunks) == 2 and all(c["usage"] is None for c in chunks)
