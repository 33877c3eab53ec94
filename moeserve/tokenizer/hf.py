"""HF `tokenizer.json` (the `tokenizers` library) + tokenizer_config.json chat template.

`load_hf_tokenizer(folder)` picks the backend: a folder with `tiktoken.model` is a Kimi /
Moonshot tokenizer (`moeserve.tokenizer.kimi`), otherwise `tokenizer.json` is loaded here.
Chat templates are Jinja from tokenizer_config.json (or a `chat_template.jinja` file),
rendered in a sandbox; nothing from the folder is executed.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import Tokenizer as RawTokenizer

from moeserve.errors import LoadError
from moeserve.tokenizer.fast import FastTokenizerWrapper


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _pick_template(value: Any, folder: str) -> str | None:
    if isinstance(value, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    if value:
        return value
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(path):
        with open(path) as f:
            return f.read()
    return None


def hf_tokenizer(folder: str) -> FastTokenizerWrapper:
    """`tokenizer.json` + tokenizer_config.json (special tokens, BOS rule, chat template)."""
    tok = RawTokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    cfg: dict[str, Any] = {}
    cfg_path = os.path.join(folder, "tokenizer_config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            cfg = json.load(f)

    def token_id(key: str) -> int | None:
        name = _token_str(cfg.get(key))
        return tok.token_to_id(name) if name else None

    added = tok.get_added_tokens_decoder()
    return FastTokenizerWrapper(
        tok,
        bos_token_id=token_id("bos_token"),
        eos_token_id=token_id("eos_token"),
        pad_token_id=token_id("pad_token"),
        add_bos_token=bool(cfg.get("add_bos_token", False)),
        chat_template=_pick_template(cfg.get("chat_template"), folder),
        special_ids={i for i, t in added.items() if t.special},
    )


def load_hf_tokenizer(folder: str):
    """The tokenizer of a checkpoint folder (Kimi tiktoken or HF tokenizer.json)."""
    if os.path.exists(os.path.join(folder, "tiktoken.model")):
        from moeserve.tokenizer.kimi import KimiTokenizer

        return KimiTokenizer(folder)
    if os.path.exists(os.path.join(folder, "tokenizer.json")):
        return hf_tokenizer(folder)
    raise LoadError(f"{folder} has no tokenizer (tokenizer.json or tiktoken.model)")
