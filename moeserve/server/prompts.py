"""The prompt side of a request: chat-template rendering and tokenizing (the engine checks
what comes out: `ServerState.check_request`).

Rendering and tokenizing a long prompt takes a while: callers run these methods in a worker
thread, off the event loop.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moeserve.multimodal.images import ImageError, ImageLimits, load_image
from moeserve.multimodal.inputs import ImageInput
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
    field: str = "prompt"  # the request field that holds it ("messages", "prompt.1", ...)
    from_ids: bool = False  # sent as token ids: `text` is decoded once the engine took them
    images: list[ImageInput] = dataclasses.field(default_factory=list)  # prompt order


def count_prompts(prompt: PromptInput) -> int:
    """How many prompts a completion request's `prompt` holds, without tokenizing them."""
    if isinstance(prompt, str) or (prompt and all(isinstance(x, int) for x in prompt)):
        return 1
    return len(prompt)


class PromptBuilder:
    """Turns request prompts into token ids with the engine's tokenizer, refusing what the
    model cannot take with a 400 that names the offending parameter."""

    def __init__(
        self,
        tokenizer: Any,
        image_processor: Any = None,
        image_limits: ImageLimits | None = None,
        max_images: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor  # None: the model takes no images
        self.image_limits = image_limits
        self.max_images = max_images

    def images(self, messages: list[ChatMessage]) -> list[ImageInput]:
        """The messages' images, loaded and preprocessed in order; a 400 naming the part of
        the first one the server cannot use."""
        parts = [
            (f"messages.{i}.content.{j}.image_url", part)
            for i, m in enumerate(messages)
            for j, part in m.image_parts()
        ]
        if not parts:
            return []
        if self.image_processor is None:
            raise ApiError(
                "This model takes no images (it has no vision encoder).", param=parts[0][0]
            )
        if len(parts) > self.max_images:
            raise ApiError(
                f"This request holds {len(parts)} images; this server takes at most "
                f"{self.max_images} per request (--max-images-per-request).",
                param="messages",
            )
        out = []
        for param, part in parts:
            url = part.url
            if not url:
                raise ApiError("An image_url part needs a url.", param=param)
            assert self.image_limits is not None
            try:
                out.append(self.image_processor.preprocess(load_image(url, self.image_limits)))
            except ImageError as e:
                raise ApiError(f"Invalid image: {e}.", param=param) from e
        return out

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
        # the tools as the client wrote them: fields it left out are not null in the prompt
        tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
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
        """Ids sent to /detokenize must be the tokenizer's (prompts' ids are the engine's to
        check)."""
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(
                f"Token id {bad} in '{param}' is outside the vocabulary (0..{vocab - 1}).",
                param=param,
            )

    def chat(
        self, req: ChatCompletionRequest, suffix: Callable[[str], str] | None = None
    ) -> Prompt:
        """The rendered chat, tokenized; `suffix(text)`, if given, is what the server appends
        to the rendered text first (the start of a tool call it makes the model write)."""
        images = self.images(req.messages)
        text = self.render_chat(
            req.messages,
            req.tools,
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template_kwargs,
        )
        if suffix is not None:
            text += suffix(text)
        # the template wrote the special tokens the model expects
        ids = self.encode(text, add_special_tokens=False, param="messages")
        if self.image_processor is not None:
            ids = self.expand_images(ids, images)
        return Prompt(ids, text, "messages", images=images)

    def expand_images(self, ids: list[int], images: list[ImageInput]) -> list[int]:
        """`ids` with each image's placeholder repeated for its tokens (a 400 on a mismatch)."""
        try:
            return self.image_processor.expand(ids, images)
        except ImageError as e:
            raise ApiError(f"Invalid messages: {e}.", param="messages") from e

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
                prompts.append(Prompt(ids, item, param))
            else:
                prompts.append(Prompt(list(item), "", param, from_ids=True))
        return prompts

    def decode_echoes(self, prompts: list[Prompt]) -> None:
        """The text `echo` repeats of prompts sent as token ids (after the engine checked
        the ids)."""
        for p in prompts:
            if p.from_ids:
                p.text = self.tokenizer.decode(p.ids, skip_special_tokens=False)


def _cut_after_final_message(text: str, content: str) -> str:
    """Drop the end-of-turn the template put after the final message (HF's rule: cut right
    after the last occurrence of the stripped final content)."""
    tag = content.strip()
    pos = text.rfind(tag) if tag else -1
    if pos < 0:
        raise ApiError("continue_final_message: the final message is not in the rendered prompt.")
    return text[: pos + len(tag)]
