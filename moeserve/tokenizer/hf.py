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

from moeserve.loader.base import LoadError
from moeserve.tokenizer.chat_template import render_chat_template


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


class HFTokenizer:
    """Implements `moeserve.tokenizer.base.Tokenizer` over a `tokenizers.Tokenizer`."""

    def __init__(self, folder: str) -> None:
        self._tok = RawTokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        cfg: dict[str, Any] = {}
        cfg_path = os.path.join(folder, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path) as f:
                cfg = json.load(f)
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.pad_token = _token_str(cfg.get("pad_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        self.chat_template = _pick_template(cfg.get("chat_template"), folder)
        added = self._tok.get_added_tokens_decoder()
        self.all_special_ids = {i for i, t in added.items() if t.special}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if (
            add_special_tokens
            and self.add_bos_token
            and self.bos_token_id is not None
            and (not ids or ids[0] != self.bos_token_id)
        ):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id) or ""

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        return render_chat_template(
            self.chat_template,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **kwargs,
        )


def load_hf_tokenizer(folder: str):
    """The tokenizer of a checkpoint folder (Kimi tiktoken or HF tokenizer.json)."""
    if os.path.exists(os.path.join(folder, "tiktoken.model")):
        from moeserve.tokenizer.kimi import KimiTokenizer

        return KimiTokenizer(folder)
    if os.path.exists(os.path.join(folder, "tokenizer.json")):
        return HFTokenizer(folder)
    raise LoadError(f"{folder} has no tokenizer (tokenizer.json or tiktoken.model)")
