"""The tokenizer interface the engine and server use, whatever the backend."""

from __future__ import annotations

from typing import Any, Protocol


class Tokenizer(Protocol):
    """Text <-> token ids, special tokens and the chat template of one model.

    `decode` of a prefix may end inside a multi-byte character; the engine's incremental
    detokenizer handles that (it never emits U+FFFD for a character still being completed).
    """

    eos_token_id: int | None
    bos_token_id: int | None
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    chat_template: str | None
    vocab_size: int
    all_special_ids: set[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def id_to_token(self, token_id: int) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str: ...
