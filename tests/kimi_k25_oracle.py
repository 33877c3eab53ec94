"""Kimi-K2.5's published chat template (tokenizer/fixtures/kimi_k25_chat_template.jinja)
rendered the way transformers renders it through the checkpoint's tokenizer: the oracle of
moeserve's Kimi-K2.5 chat format.

transformers compiles chat templates in jinja2's sandbox with trim_blocks, lstrip_blocks and
loopcontrols, and its own `tojson`; the checkpoint's tokenizer (tokenization_kimi.py) hands
the template the tools with their keys sorted and, when its encoder can write them,
`tools_ts_str`. The TypeScript text comes from moeserve's encoder here, which
tests/tokenizer/test_kimi_k25_chat.py checks against the checkpoint encoder's outputs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

from moeserve.tokenizer.kimi_tools import (
    ToolDeclarationError,
    sort_keys_deep,
    typescript_tool_declarations,
)

TEMPLATE_PATH = Path(__file__).parent / "tokenizer" / "fixtures" / "kimi_k25_chat_template.jinja"
TEMPLATE = TEMPLATE_PATH.read_text(encoding="utf-8")


def _hf_tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def template_kwargs(tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """What the checkpoint's tokenizer passes the template for these tools."""
    if tools is None:
        return {"tools": None}
    tools = sort_keys_deep(tools)
    try:
        return {"tools": tools, "tools_ts_str": typescript_tool_declarations(tools)}
    except ToolDeclarationError:
        return {"tools": tools}


def oracle(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> str:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _hf_tojson
    return env.from_string(TEMPLATE).render(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        **template_kwargs(tools),
        **kwargs,
    )
