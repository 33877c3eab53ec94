"""A `Tokenizer` over a HF `tokenizers.Tokenizer` (GGUF vocabularies and tokenizer.json)."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer as FastTokenizer

from moeserve.tokenizer.chat_template import render_chat_template


class FastTokenizerWrapper:
    def __init__(
        self,
        tok: FastTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        pad_token_id: int | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
        special_ids: set[int] | None = None,
    ) -> None:
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.all_special_ids = set(special_ids or ())
        self.bos_token = self._name(bos_token_id)
        self.eos_token = self._name(eos_token_id)
        self.pad_token = self._name(pad_token_id)

    def _name(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # tokenizer.json post-processors may add specials themselves; GGUF ones have none
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
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
            raise ValueError("this model has no chat template; use /v1/completions instead.")
        return render_chat_template(
            self.chat_template,
            messages,
            tools,
            add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **kwargs,
        )
