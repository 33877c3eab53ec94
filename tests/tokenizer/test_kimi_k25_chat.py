"""Kimi-K2.5's chat format against its published chat template.

The oracle is the template itself (fixtures/kimi_k25_chat_template.jinja) rendered by jinja2
as transformers renders it through the checkpoint's tokenizer (tests/kimi_k25_oracle.py). The
TypeScript tool declarations are checked apart, against outputs of the checkpoint's own
encoder (tool_declaration_ts.py).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest
from kimi_k25_oracle import TEMPLATE, TEMPLATE_PATH, oracle, template_kwargs

from moeserve.testing.checkpoints import write_kimi_tokenizer
from moeserve.tokenizer.chat_template import render_chat_template
from moeserve.tokenizer.hf import load_hf_tokenizer
from moeserve.tokenizer.kimi import KIMI_K2, KIMI_K25, KimiTokenizer, render_kimi_k25_chat
from moeserve.tokenizer.kimi_tools import (
    ToolDeclarationError,
    sort_keys_deep,
    typescript_tool_declarations,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.\nUse it before answering.",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {
                    "type": "string",
                    "enum": ["celsius", "fahrenheit"],
                    "default": "celsius",
                    "description": "Temperature unit",
                },
                "city": {"type": "string", "description": "City name", "minLength": 1},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "$defs": {
                "Filter": {
                    "type": "object",
                    "description": "A filter.",
                    "properties": {"field": {"type": "string"}, "value": {"type": "string"}},
                    "required": ["field"],
                }
            },
            "properties": {
                "query": {"type": "string"},
                "filters": {"type": "array", "items": {"$ref": "#/$defs/Filter"}},
                "tags": {"type": "array", "items": {"type": "string", "description": "a tag"}},
                "extra": {"type": "object", "additionalProperties": {"type": "number"}},
            },
            "required": ["query"],
        },
    },
}
TOOLS = [WEATHER, SEARCH]


def call(cid: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


# a round of two parallel calls, their results, an answer, then a new question and a call
CONVERSATION = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Two cities: two calls.",
        "tool_calls": [
            call("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
            call("functions.get_weather:1", "get_weather", {"city": "Oslo", "unit": "celsius"}),
        ],
    },
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "9 C, rain"},
    {
        "role": "assistant",
        "content": "Paris: 18 C and sunny; Oslo: 9 C with rain.",
        "reasoning_content": "Both results are in.",
    },
    {
        "role": "user",
        "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "Rome?"}],
    },
    {
        "role": "assistant",
        "content": "Checking Rome.",
        "reasoning_content": "One more city.",
        "tool_calls": [call("functions.get_weather:2", "get_weather", '{"city": "Rome"}')],
    },
    {
        "role": "tool",
        "name": "get_weather",
        "tool_call_id": "functions.get_weather:2",
        "content": "25 C, clear",
    },
]

CASES = {
    "tools, parallel calls, results, reasoning": dict(messages=CONVERSATION, tools=TOOLS),
    "thinking off": dict(messages=CONVERSATION, tools=TOOLS, thinking=False),
    "thinking on, explicitly": dict(messages=CONVERSATION, tools=TOOLS, thinking=True),
    "first round, no system turn": dict(messages=CONVERSATION[1:5], tools=[WEATHER]),
    "no tools": dict(messages=CONVERSATION[:6]),
    "a finished answer, no generation prompt": dict(
        messages=CONVERSATION[:6], tools=TOOLS, add_generation_prompt=False
    ),
    "a schema the TypeScript form cannot hold: JSON": dict(
        messages=CONVERSATION[1:2],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "odd",
                    "description": "Ünïcode stays as is.",
                    "parameters": {"type": "object", "properties": {"x": {"format": "uuid"}}},
                },
            }
        ],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rendered_like_the_published_template(case):
    kw = dict(CASES[case])
    want = oracle(**kw)
    thinking = kw.pop("thinking", True)
    assert render_kimi_k25_chat(thinking=thinking, **kw) == want


def test_what_changed_from_k2_shows_in_the_prompt():
    text = oracle(messages=CONVERSATION, tools=TOOLS)
    assert text.startswith(
        "<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\nnamespace functions {\n"
        "// Current weather of a city.\n// Use it before answering.\ntype get_weather = (_: {\n"
        "  // City name\n  // minLength: 1\n  city: string,\n"
    )
    assert "You are Kimi" not in text  # no default system turn
    # the first round's reasoning is history; the current round keeps it
    assert "Two cities" not in text and "<think>One more city.</think>Checking Rome." in text
    assert (
        "<think></think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        "<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>"
        '{"city": "Oslo", "unit": "celsius"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    ) in text
    assert "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:2\n25 C" in text
    assert text.endswith("<|im_assistant|>assistant<|im_middle|><think>")


def test_moeserve_sandbox_renders_the_template_as_transformers_does():
    """The template rendered by moeserve's own sandbox (its `tojson` takes `separators`)."""
    for kw in CASES.values():
        kw = dict(kw)
        tools = kw.pop("tools", None)
        got = render_chat_template(TEMPLATE, **template_kwargs(tools), **kw)
        assert got == oracle(tools=tools, **kw)


@pytest.fixture(scope="module")
def k25_folder(tmp_path_factory) -> str:
    """A Kimi tokenizer folder whose chat template is K2.5's (chat_template.jinja)."""
    folder = tmp_path_factory.mktemp("k25")
    write_kimi_tokenizer(str(folder), 300)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template")
    cfg_path.write_text(json.dumps(cfg))
    shutil.copy(TEMPLATE_PATH, folder / "chat_template.jinja")
    return str(folder)


def test_a_checkpoint_with_the_k25_template_gets_the_k25_format(k25_folder, tmp_path):
    tok = load_hf_tokenizer(k25_folder)
    assert isinstance(tok, KimiTokenizer) and tok.chat_format == KIMI_K25
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS)
    assert text == oracle(messages=CONVERSATION, tools=TOOLS)
    off = tok.apply_chat_template(CONVERSATION, tools=TOOLS, enable_thinking=False)
    assert off == oracle(messages=CONVERSATION, tools=TOOLS, thinking=False)
    # the markers are the model's own tokens
    ids = tok.encode(text)
    for marker in ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<think>"):
        (mid,) = tok.encode(marker)
        assert mid in tok.all_special_ids and mid in ids
    # K2's folder (no tools_ts_str in its template) keeps K2's format
    k2 = tmp_path / "k2"
    os.makedirs(k2)
    write_kimi_tokenizer(str(k2), 300)
    assert load_hf_tokenizer(str(k2)).chat_format == KIMI_K2


# ----------------------------------------------------------------------------- TypeScript tools

# (tools, declaration) pairs written by the checkpoint's own encoder, tool_declaration_ts.py
# (kept as test data at github.com/lightseekorg/smg, crates/tokenizer/tests/fixtures/kimi_k25:
# schemas/*.json and expected/*.txt)
HEAD = "# Tools\n\n## functions\nnamespace functions {\n"
REFERENCE_DECLARATIONS = [
    (
        {
            "name": "delay",
            "description": "Sleep for some milliseconds.",
            "parameters": {
                "type": "object",
                "properties": {
                    "ms": {"type": "integer", "minimum": 0},
                    "reason": {"type": "string"},
                },
                "required": ["ms"],
            },
        },
        "// Sleep for some milliseconds.\ntype delay = (_: {\n  // minimum: 0\n  ms: number,\n"
        "  reason?: string\n}) => any;\n",
    ),
    (
        {
            "name": "create_user",
            "description": "Create a new user record.",
            "parameters": {
                "type": "object",
                "properties": {
                    "user": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                        "required": ["name"],
                    }
                },
                "required": ["user"],
            },
        },
        "// Create a new user record.\ntype create_user = (_: {\n  user: {\n    name: string,\n"
        "    age?: number\n  }\n}) => any;\n",
    ),
    (
        {
            "name": "set_status",
            "parameters": {
                "type": "object",
                "properties": {"status": {"enum": ["active", "paused", "done"]}},
                "required": ["status"],
            },
        },
        'type set_status = (_: {\n  status: "active" | "paused" | "done"\n}) => any;\n',
    ),
    (
        {
            "name": "create_node",
            "parameters": {
                "type": "object",
                "$defs": {
                    "Node": {
                        "type": "object",
                        "properties": {"id": {"type": "string"}, "label": {"type": "string"}},
                        "required": ["id"],
                    }
                },
                "properties": {"node": {"$ref": "#/$defs/Node"}},
                "required": ["node"],
            },
        },
        "interface Node {\n  id: string,\n  label?: string\n}\ntype create_node = (_: {\n"
        "  node: Node\n}) => any;\n",
    ),
    (
        {
            "name": "annotate",
            "description": "Annotate the input.\nSupports multiple\nlines.",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string", "description": "The text\nto annotate."}},
                "required": ["text"],
            },
        },
        "// Annotate the input.\n// Supports multiple\n// lines.\ntype annotate = (_: {\n"
        "  // The text\n  // to annotate.\n  text: string\n}) => any;\n",
    ),
    (
        {
            "name": "store",
            "parameters": {
                "type": "object",
                "properties": {
                    "x": {"type": ["string", "null"]},
                    "v": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["x", "v", "tags"],
            },
        },
        # three reference cases (type list, anyOf, array of strings) joined in one function
        "type store = (_: {\n  tags: Array<string>,\n  v: string | number,\n"
        "  x: string | null\n}) => any;\n",
    ),
]


@pytest.mark.parametrize("function, body", REFERENCE_DECLARATIONS)
def test_typescript_declarations_match_the_checkpoint_encoder(function, body):
    tools = sort_keys_deep([{"type": "function", "function": function}])
    assert typescript_tool_declarations(tools) == HEAD + body + "}\n"


def test_declaration_edge_cases():
    assert typescript_tool_declarations([]) == ""
    assert typescript_tool_declarations([{"type": "retrieval"}]) == ""
    ping = {"type": "function", "function": {"name": "ping"}}
    assert typescript_tool_declarations([ping]) == HEAD + "type ping = (_: {}) => any;\n}\n"
    for bad in ({"x": {"format": "uuid"}}, {"x": {"$ref": "#/$defs/Missing"}}):
        tool = {"type": "function", "function": {"name": "f", "parameters": {"properties": bad}}}
        with pytest.raises(ToolDeclarationError):
            typescript_tool_declarations([tool])
