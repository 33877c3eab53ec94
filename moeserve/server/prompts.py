"""The prompt side of a request: chat-template rendering, tokenizing, and the token budget
that the context length leaves for the completion.

Rendering and tokenizing a long prompt takes a while: callers run these methods in a worker
thread, off the event loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from moeserve.server.errors import ApiError
from moeserve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    CompletionRequest,
    PromptInput,
)

logger = logging.getLogger("moeserve.server")


@dataclass
class Prompt:
    ids: list[int]
    text: str  # the rendered chat, or what `echo` repeats of a completion prompt


def count_prompts(prompt: PromptInput) -> int:
    """How many prompts a completion request's `prompt` holds, without tokenizing them."""
    if isinstance(prompt, str) or (prompt and all(isinstance(x, int) for x in prompt)):
        return 1
    return len(prompt)


class PromptBuilder:
    """Turns request prompts into token ids with the engine's tokenizer, refusing what the
    model cannot take with a 400 that names the offending parameter."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def render_chat(
        self,
        messages: list[ChatMessage],
        tools: list[ChatTool] | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        kwargs: dict[str, Any] | None,
    ) -> str:
        try:
            dicts = [m.to_template() for m in messages]
        except ValueError as e:
            raise ApiError(f"Invalid messages: {e}.", param="messages") from e
        tool_dicts = [t.model_dump() for t in tools] if tools else None
        try:
            text = self.tokenizer.apply_chat_template(
                dicts,
                tools=tool_dicts,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                **(kwargs or {}),
            )
        except Exception as e:  # a template's raise_exception or a bad kwarg: user input
            logger.debug("chat template failed", exc_info=True)
            raise ApiError(f"The chat template could not render these messages: {e}") from e
        if continue_final_message:
            text = _cut_after_final_message(text, dicts[-1].get("content") or "")
        return text

    def encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except (TypeError, ValueError, UnicodeError) as e:  # text the tokenizer cannot take
            logger.debug("tokenizing failed", exc_info=True)
            raise ApiError(f"The text in '{param}' could not be tokenized: {e}", param=param) from e

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """Client-sent ids must be decodable; the engine checks them too, but cannot name
        which prompt of a list is at fault, and `echo` decodes them before it sees them."""
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(
                f"Token id {bad} in '{param}' is outside the vocabulary (0..{vocab - 1}).",
                param=param,
            )

    def chat(self, req: ChatCompletionRequest) -> Prompt:
        text = self.render_chat(
            req.messages,
            req.tools,
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template_kwargs,
        )
        # the template wrote the special tokens the model expects
        return Prompt(self.encode(text, add_special_tokens=False, param="messages"), text)

    def completion(self, req: CompletionRequest) -> list[Prompt]:
        p = req.prompt
        if isinstance(p, str):
            items: list[str | list[int]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            items = [p]  # type: ignore[list-item]
        else:
            items = list(p)  # type: ignore[arg-type]
        prompts = []
        for k, item in enumerate(items):
            param = "prompt" if len(items) == 1 else f"prompt.{k}"
            if isinstance(item, str):
                ids = self.encode(item, add_special_tokens=req.add_special_tokens, param=param)
                text = item
            else:
                ids = list(item)
                self.check_token_ids(ids, param)
                text = self.tokenizer.decode(ids, skip_special_tokens=False) if req.echo else ""
            if not ids:  # the engine refuses it too, but cannot say which prompt of a list
                raise ApiError(f"The prompt '{param}' is empty.", param=param)
            prompts.append(Prompt(ids, text))
        return prompts

    def output_budget(self, num_prompt: int, requested: int | None, where: str) -> int:
        """max_tokens after the context-length check; None asks for the rest of the context.

        The engine checks the context length too, but only the endpoint can name the
        parameter to shorten (`where`: "messages" or "prompt") and the error code OpenAI
        clients look for."""
        limit = self.max_model_len
        if requested is None:
            if num_prompt >= limit:
                raise ApiError(
                    f"This model's maximum context length is {limit} tokens. However, your "
                    f"request has {num_prompt} input tokens. Please reduce the length of the "
                    f"{where}.",
                    param=where,
                    code="context_length_exceeded",
                )
            return limit - num_prompt
        if num_prompt + requested > limit:
            raise ApiError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt + requested} tokens ({num_prompt} in the {where}, "
                f"{requested} in the completion). Please reduce the length of the {where} "
                "or completion.",
                param=where,
                code="context_length_exceeded",
            )
        return requested


def _cut_after_final_message(text: str, content: str) -> str:
    """Drop the end-of-turn the template put after the final message (HF's rule: cut right
    after the last occurrence of the stripped final content)."""
    tag = content.strip()
    pos = text.rfind(tag) if tag else -1
    if pos < 0:
        raise ApiError("continue_final_message: the final message is not in the rendered prompt.")
    return text[: pos + len(tag)]
