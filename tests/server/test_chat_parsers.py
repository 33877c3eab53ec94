"""Reasoning and tool-call parsers on crafted text streams, split at every position."""

from __future__ import annotations

import json

import pytest

from moeserve.server.parsers import (
    REASONING_FORMATS,
    ChatDelta,
    KimiToolFormat,
    ReasoningParser,
    ToolCallParser,
    kimi_function_name,
    make_output_parser,
    merge_tool_deltas,
    reasoning_starts_open,
)

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def run_stream(parser, pieces: list[str]) -> tuple[str, str, list]:
    """Feed pieces, flush; return (reasoning, content, tool-call deltas) concatenated."""
    reasoning, content, deltas = [], [], []
    outs = [parser.feed(p) for p in pieces] + [parser.flush()]
    for d in outs:
        assert isinstance(d, ChatDelta)
        reasoning.append(d.reasoning)
        content.append(d.content)
        merge_tool_deltas(deltas, d.tool_calls)
    return "".join(reasoning), "".join(content), deltas


def splits(text: str):
    """The text whole, char by char, and cut in two at every position."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


def calls_of(deltas) -> list[tuple[str, str, str]]:
    """Rebuild (id, name, arguments) per call index from streamed deltas, checking the
    OpenAI streaming shape: id and name come first, then argument fragments only."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.index not in calls:
            assert d.id is not None and d.name is not None
            calls[d.index] = [d.id, d.name, d.arguments]
        else:
            assert d.id is None and d.name is None
            calls[d.index][2] += d.arguments
    return [tuple(calls[i]) for i in sorted(calls)]


REASONING_CASES = [
    # (parser name, starts open, text, reasoning, content)
    ("deepseek_r1", False, "<think>a < b</think>\n\nYes.", "a < b", "\n\nYes."),
    ("deepseek_r1", False, "  \n<think>x</think>y", "x", "y"),
    (
        "deepseek_r1",
        False,
        "Plain answer with <think> later",
        "",
        "Plain answer with <think> later",
    ),
    ("deepseek_r1", False, "<thinking is fun", "", "<thinking is fun"),
    ("deepseek_r1", True, "still thinking</think>done", "still thinking", "done"),
    ("deepseek_r1", True, "cut off while thinking </th", "cut off while thinking </th", ""),
    ("deepseek_r1", False, "<think>unfinished", "unfinished", ""),
    ("deepseek_r1", False, "", "", ""),
    ("kimi_k2", True, "ponder" + SB + "rest", "ponder", SB + "rest"),
    ("kimi_k2", False, "<think>r</think>c" + SB, "r", "c" + SB),
    ("kimi_k2", True, "</think>", "", ""),
]


@pytest.mark.parametrize(("name", "open_", "text", "reasoning", "content"), REASONING_CASES)
def test_reasoning_parser_every_split(name, open_, text, reasoning, content):
    for pieces in splits(text):
        p = make_output_parser(name, None, "<think>" if open_ else "", use_tools=False)
        r, c, deltas = run_stream(p, pieces)
        assert (r, c) == (reasoning, content), pieces
        assert deltas == []


def test_reasoning_holds_back_only_possible_markers():
    p = ReasoningParser(REASONING_FORMATS["deepseek_r1"], in_reasoning=True)
    assert p.feed("abc</") == ("abc", "")  # "</" may start "</think>"
    assert p.feed("b>") == ("</b>", "")  # it did not
    assert p.feed("x</think") == ("x", "")
    assert p.feed(">rest") == ("", "rest")
    assert p.feed("</think>") == ("", "</think>")  # after reasoning, markers are content


def test_reasoning_starts_open():
    fmt = REASONING_FORMATS["kimi_k2"]
    assert reasoning_starts_open(fmt, "<|im_assistant|>assistant<|im_middle|><think>")
    assert reasoning_starts_open(fmt, "...<think>\n")
    assert not reasoning_starts_open(fmt, "<|im_middle|><think></think>")
    assert not reasoning_starts_open(fmt, "<|im_middle|>")


TOOL_TEXT = (
    "Let me check."
    + SB
    + CB
    + "functions.get_weather:0"
    + AB
    + '{"city": "Paris", "unit": "<c>"}'
    + CE
    + "\n"
    + CB
    + "functions.lookup.v2:1"
    + AB
    + "{}"
    + CE
    + SE
)
TOOL_CALLS = [
    ("functions.get_weather:0", "get_weather", '{"city": "Paris", "unit": "<c>"}'),
    ("functions.lookup.v2:1", "lookup.v2", "{}"),
]


def test_tool_parser_every_split():
    for pieces in splits(TOOL_TEXT):
        p = make_output_parser(None, "kimi_k2", "", use_tools=True)
        r, c, deltas = run_stream(p, pieces)
        assert r == "" and c == "Let me check.", pieces
        assert calls_of(deltas) == TOOL_CALLS, pieces
        assert [(t.id, t.name, t.arguments) for t in p.tool_calls] == TOOL_CALLS
    for _, _, args in TOOL_CALLS:
        json.loads(args)


def test_reasoning_then_tools_kimi_every_split():
    text = "weigh options" + TOOL_TEXT[len("Let me check.") :]
    for pieces in splits(text):
        p = make_output_parser("kimi_k2", "kimi_k2", "...<think>", use_tools=True)
        r, c, deltas = run_stream(p, pieces)
        assert (r, c) == ("weigh options", ""), pieces
        assert calls_of(deltas) == TOOL_CALLS


def test_tool_arguments_stream_incrementally():
    p = ToolCallParser(KimiToolFormat())
    out = p.feed(SB + CB + "functions.f:0" + AB + '{"a":')
    assert [(d.index, d.id, d.name, d.arguments) for d in out.deltas] == [
        (0, "functions.f:0", "f", '{"a":')
    ]
    out = p.feed(" 1}<|tool_ca")  # partial end marker held back
    assert [(d.index, d.id, d.arguments) for d in out.deltas] == [(0, None, " 1}")]
    out = p.feed("ll_end|>" + SE + " bye")
    assert out.deltas == [] and out.content == " bye"


def test_text_after_section_and_unfinished_call():
    p = make_output_parser(None, "kimi_k2", "", use_tools=True)
    r, c, deltas = run_stream(p, ["pre", SB, CB, "functions.f:0", AB, '{"x": 1'])
    assert c == "pre" and calls_of(deltas) == [("functions.f:0", "f", '{"x": 1')]
    p = make_output_parser(None, "kimi_k2", "", use_tools=True)
    _, c, deltas = run_stream(p, ["a <|tool_calls_sec"])  # a partial marker at the end is text
    assert c == "a <|tool_calls_sec" and deltas == []


def test_without_tools_the_markers_are_content():
    p = make_output_parser(None, "kimi_k2", "", use_tools=False)
    _, c, deltas = run_stream(p, [TOOL_TEXT])
    assert c == TOOL_TEXT and deltas == []


def test_kimi_function_name():
    assert kimi_function_name("functions.get_weather:0") == "get_weather"
    assert kimi_function_name(" functions.a.b:12 ") == "a.b"
    assert kimi_function_name("search") == "search"
    assert kimi_function_name("ns:tool") == "ns:tool"
