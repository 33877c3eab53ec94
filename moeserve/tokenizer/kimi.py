"""The Kimi (Moonshot) tokenizer on tiktoken, and the Kimi-K2/K2.5 chat format.

Files: `tiktoken.model` (one `base64(token bytes) rank` per line) and tokenizer_config.json
(`added_tokens_decoder` gives the special tokens and their ids, `bos_token`/`eos_token`).
Pre-tokenizer: the published `pat_str` of tokenization_kimi.py (Han runs, letter runs with
case classes and English contractions, 1-3 digits, punctuation runs, newlines, spaces).
Special tokens in the text are encoded as single ids (the reference allows all of them).
Nothing from the checkpoint folder is executed.

Chat formats (rendered here, never by the folder's Jinja template). Kimi-K2's:
    [<|im_system|>tool_declare<|im_middle|>{tools json}<|im_end|>]
    <|im_system|>system<|im_middle|>{system or the default}<|im_end|>
    <|im_user|>user<|im_middle|>{content}<|im_end|>
    <|im_assistant|>assistant<|im_middle|><think>{reasoning}</think>{content}
        [<|tool_calls_section_begin|><|tool_call_begin|>{id}<|tool_call_argument_begin|>{args}
         <|tool_call_end|>...<|tool_calls_section_end|>]<|im_end|>
    <|im_system|>tool<|im_middle|>## Return of {tool_call_id}\n{content}<|im_end|>
    generation prompt: <|im_assistant|>assistant<|im_middle|> then `<think>` (thinking on)
    or `<think></think>` (off).
Assistant turns before the last user turn keep an empty `<think></think>`; later ones (the
current tool-calling round) keep their reasoning. Tool call ids default to
`functions.NAME:IDX`.

Kimi-K2.5's (`render_kimi_k25_chat`), exactly what its published chat_template.jinja renders;
a checkpoint gets it when its chat template takes `tools_ts_str`. It differs from K2's in:
tools declared as a TypeScript namespace (`kimi_tools.py`), compact sorted JSON only when a
schema cannot be written so; no default system turn; every turn's role name is the
message's `name` when it has one (tool results too); turns up to the last assistant answer
without tool calls lose their reasoning, later ones (the current tool-calling round) keep
it; with `thinking=False` no turn keeps its reasoning and the generation prompt ends
`<think></think>`; tool-call ids and contents are written as given (content holding
`<think>` is not split).
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import tiktoken

from moeserve.tokenizer.kimi_tools import (
    ToolDeclarationError,
    sort_keys_deep,
    typescript_tool_declarations,
)

PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
# what Kimi-K2.5's chat template writes for an image part (its processor then repeats the
# <|media_pad|> token once per image token)
KIMI_IMAGE_PART = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>\n"
NUM_RESERVED_SPECIAL_TOKENS = 256
KIMI_K2 = "kimi-k2"
KIMI_K25 = "kimi-k2.5"
# what Kimi-K2.5's template reads its TypeScript tool declarations from
K25_TEMPLATE_MARK = "tools_ts_str"


def load_tiktoken_ranks(path: str) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def _content_text(content: Any) -> str:
    """OpenAI content: a string, None, or a list of parts (text parts joined; an image part is
    written as Kimi-K2.5's template writes it)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for p in content:
        if not isinstance(p, dict):
            continue
        if p.get("type") == "text":
            out.append(p.get("text", ""))
        elif p.get("type") in ("image", "image_url"):
            out.append(KIMI_IMAGE_PART)
    return "".join(out)


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class KimiTokenizer:
    """Implements `moeserve.tokenizer.base.Tokenizer` for Kimi-K2 / K2.5 / Moonlight."""

    def __init__(self, folder: str) -> None:
        ranks = load_tiktoken_ranks(os.path.join(folder, "tiktoken.model"))
        cfg_path = os.path.join(folder, "tokenizer_config.json")
        cfg: dict[str, Any] = {}
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                cfg = json.load(f)
        specials: dict[str, int] = {}
        for sid, info in (cfg.get("added_tokens_decoder") or {}).items():
            specials[info["content"] if isinstance(info, dict) else str(info)] = int(sid)
        if not specials:  # no config: the published layout of reserved tokens after the ranks
            base = len(ranks)
            specials = {
                f"<|reserved_token_{k}|>": base + k for k in range(NUM_RESERVED_SPECIAL_TOKENS)
            }
        self._enc = tiktoken.Encoding(
            name=os.path.basename(os.path.abspath(folder)) or "kimi",
            pat_str=PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=specials,
        )
        self.special_tokens = specials
        self.all_special_ids = set(specials.values())
        self._id_to_special = {i: t for t, i in specials.items()}
        self.vocab_size = max(len(ranks), max(specials.values(), default=0) + 1)
        self._num_ranks = len(ranks)
        self.bos_token = _token_str(cfg.get("bos_token")) or "[BOS]"
        self.eos_token = _token_str(cfg.get("eos_token")) or "<|im_end|>"
        self.pad_token = _token_str(cfg.get("pad_token"))
        self.bos_token_id = specials.get(self.bos_token)
        self.eos_token_id = specials.get(self.eos_token)
        templates = _folder_templates(cfg.get("chat_template"), folder)
        self.chat_template = next(iter(templates), "kimi")
        # the checkpoint's own template says which format its model was trained on
        k25 = any(K25_TEMPLATE_MARK in t for t in templates)
        self.chat_format = KIMI_K25 if k25 else KIMI_K2

    # ---- text <-> ids ----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # the reference tokenizer adds no BOS; special tokens in the text are single ids
        del add_special_tokens
        return self._enc.encode(text, allowed_special="all", disallowed_special=())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # ids past the vocabulary (a model whose embedding is padded beyond the tokenizer)
        # decode to nothing, as HF tokenizers do, rather than failing the request
        ids = [i for i in ids if self._known(i)]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.all_special_ids]
        return self._enc.decode(ids, errors="replace")

    def _known(self, token_id: int) -> bool:
        return 0 <= token_id < self._num_ranks or token_id in self._id_to_special

    def id_to_token(self, token_id: int) -> str:
        if token_id in self._id_to_special:
            return self._id_to_special[token_id]
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        if not self._known(token_id):
            return b""  # an id of the model's padded vocabulary: no text
        return self._enc.decode_single_token_bytes(token_id)

    # ---- chat ----------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        thinking = bool(kwargs.get("thinking", kwargs.get("enable_thinking", True)))
        if self.chat_format == KIMI_K25:
            return render_kimi_k25_chat(messages, tools, add_generation_prompt, thinking)
        return render_kimi_chat(messages, tools, add_generation_prompt, thinking)


def _folder_templates(value: Any, folder: str) -> list[str]:
    """The checkpoint's chat templates: tokenizer_config.json's, then chat_template.jinja."""
    found = []
    if isinstance(value, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default") or next(iter(named.values()), None)
    if isinstance(value, str) and value:
        found.append(value)
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            found.append(f.read())
    return found


def _tool_calls(calls: list[dict[str, Any]]) -> str:
    out = ["<|tool_calls_section_begin|>"]
    for i, call in enumerate(calls):
        fn = call.get("function") or {}
        cid = call.get("id") or f"functions.{fn.get('name', '')}:{i}"
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        out.append(f"<|tool_call_begin|>{cid}<|tool_call_argument_begin|>{args}<|tool_call_end|>")
    out.append("<|tool_calls_section_end|>")
    return "".join(out)


def render_kimi_chat(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    thinking: bool = True,
) -> str:
    parts: list[str] = []
    if tools:
        parts.append(
            "<|im_system|>tool_declare<|im_middle|>"
            + json.dumps(tools, ensure_ascii=False, separators=(",", ":"))
            + "<|im_end|>"
        )
    if not messages or messages[0].get("role") != "system":
        parts.append(f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM}<|im_end|>")
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    for i, m in enumerate(messages):
        role = m.get("role")
        content = _content_text(m.get("content"))
        if role == "system":
            parts.append(
                f"<|im_system|>{m.get('name') or 'system'}<|im_middle|>{content}<|im_end|>"
            )
        elif role == "user":
            parts.append(f"<|im_user|>{m.get('name') or 'user'}<|im_middle|>{content}<|im_end|>")
        elif role == "assistant":
            reasoning = m.get("reasoning_content") or m.get("reasoning") or ""
            if "</think>" in content:  # reasoning given inline
                head, content = content.split("</think>", 1)
                reasoning = reasoning or head.replace("<think>", "").strip()
            if i < last_user:
                reasoning = ""
            text = f"<think>{reasoning}</think>{content}"
            if m.get("tool_calls"):
                text += _tool_calls(m["tool_calls"])
            parts.append(
                f"<|im_assistant|>{m.get('name') or 'assistant'}<|im_middle|>{text}<|im_end|>"
            )
        elif role == "tool":
            cid = m.get("tool_call_id", "")
            parts.append(f"<|im_system|>tool<|im_middle|>## Return of {cid}\n{content}<|im_end|>")
        else:
            raise ValueError(f"unsupported chat role {role!r}")
    if add_generation_prompt:
        parts.append("<|im_assistant|>assistant<|im_middle|>")
        parts.append("<think>" if thinking else "<think></think>")
    return "".join(parts)


# ----------------------------------------------------------------------------- Kimi-K2.5


def kimi_k25_tool_declaration(tools: list[dict[str, Any]]) -> str:
    """The body of K2.5's `tool_declare` turn: the TypeScript namespace, or the tools as
    compact JSON when a schema cannot be written as TypeScript (both of the tools with their
    keys sorted, as the checkpoint's tokenizer hands them to the template)."""
    tools = sort_keys_deep(tools)
    try:
        declared = typescript_tool_declarations(tools)
    except ToolDeclarationError:
        declared = ""
    return declared or json.dumps(tools, ensure_ascii=False, separators=(",", ":"))


def _k25_tool_calls(calls: list[dict[str, Any]]) -> str:
    out = ["<|tool_calls_section_begin|>"]
    for call in calls:
        fn = call.get("function") or {}
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        cid = call.get("id") or ""
        out.append(f"<|tool_call_begin|>{cid}<|tool_call_argument_begin|>{args}<|tool_call_end|>")
    out.append("<|tool_calls_section_end|>")
    return "".join(out)


def render_kimi_k25_chat(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    thinking: bool = True,
) -> str:
    """Kimi-K2.5's prompt, as its published chat template renders it (see the module's
    docstring for what differs from K2's)."""
    parts: list[str] = []
    if tools:
        parts.append(
            f"<|im_system|>tool_declare<|im_middle|>{kimi_k25_tool_declaration(tools)}<|im_end|>"
        )
    # the last finished answer: reasoning before it is history, after it the current round
    answered = max(
        (
            i
            for i, m in enumerate(messages)
            if m.get("role") == "assistant" and not m.get("tool_calls")
        ),
        default=-1,
    )
    for i, m in enumerate(messages):
        role = m.get("role")
        name = m.get("name") or role
        content = _content_text(m.get("content"))
        if role == "user":
            head = f"<|im_user|>{name}<|im_middle|>"
        elif role == "assistant":
            head = f"<|im_assistant|>{name}<|im_middle|>"
        else:
            head = f"<|im_system|>{name}<|im_middle|>"
        if role == "assistant":
            kept = thinking and i > answered
            reasoning = (m.get("reasoning_content") or "") if kept else ""
            body = f"<think>{reasoning}</think>{content}"
            if m.get("tool_calls"):
                body += _k25_tool_calls(m["tool_calls"])
        elif role == "tool":
            body = f"## Return of {m.get('tool_call_id') or ''}\n{content}"
        else:
            body = content
        parts.append(f"{head}{body}<|im_end|>")
    if add_generation_prompt:
        parts.append("<|im_assistant|>assistant<|im_middle|>")
        parts.append("<think>" if thinking else "<think></think>")
    return "".join(parts)
