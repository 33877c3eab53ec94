"""Engine outputs -> OpenAI choices, streamed as server-sent events or collected whole.

A `ChoiceStream` is one choice: it takes the outputs of the engine request behind it and
keeps the running state (tokens, finish, and in subclasses text and logprobs) from which
it produces both a stream's per-output pieces and the non-streamed choice, so the two
kinds of response agree by construction. `Answer` holds a response's choices and writes the
event stream; `respond` drives it from a `GenerationGroup` for chat and completions alike.
"""

from __future__ import annotations

import contextlib
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from moeserve.engine.outputs import RequestOutput
from moeserve.server.errors import (
    ENGINE_ERRORS,
    ApiError,
    engine_errors_as_api_errors,
    from_engine,
)
from moeserve.server.generation import GenerationGroup, run_unless_disconnected
from moeserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    StreamOptions,
    UsageInfo,
    now,
)

logger = logging.getLogger("moeserve.server")

SSE_DONE = "data: [DONE]\n\n"


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class ChoiceStream(ABC):
    """One OpenAI choice, fed the outputs of its engine request in order."""

    def __init__(self, index: int, prompt_index: int = 0) -> None:
        self.index = index
        self.prompt_index = prompt_index  # which of the request's prompts it continues
        self.num_tokens = 0
        self.num_cached_tokens = 0  # its prompt's tokens the prefix cache served
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.started = False

    def opening(self) -> dict[str, Any] | None:
        """A streamed choice to send before the one of the first output, if the format has
        one."""
        return None

    def add(self, out: RequestOutput) -> dict[str, Any] | None:
        """Take the next output; return the streamed choice it makes, or None when it adds
        nothing a client could see."""
        first, self.started = not self.started, True
        self.num_tokens += len(out.token_ids)
        self.num_cached_tokens = out.num_cached_tokens  # a preempted request matches again
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        return self._piece(out, first)

    @abstractmethod
    def _piece(self, out: RequestOutput, first: bool) -> dict[str, Any] | None:
        """Fold `out` into this choice's text and logprobs; its streamed choice, if any."""

    @abstractmethod
    def final(self) -> BaseModel:
        """The whole choice of a non-streamed response."""


@dataclass
class Answer:
    """One response's choices and what each of its chunks repeats."""

    id: str
    chunk_object: str  # the `object` of a streamed chunk
    model: str
    choices: list[ChoiceStream]
    prompt_tokens: int  # each prompt once, however many choices share it

    def usage(self) -> UsageInfo:
        return UsageInfo.of(
            self.prompt_tokens, sum(c.num_tokens for c in self.choices), self.cached_tokens()
        )

    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, each prompt counted once as in
        `prompt_tokens`: for a prompt shared by n choices, what all of them found cached (so
        a prompt new to the server counts 0 even when one choice reused another's pages)."""
        per_prompt: dict[int, int] = {}
        for c in self.choices:
            if c.started:
                seen = per_prompt.get(c.prompt_index, c.num_cached_tokens)
                per_prompt[c.prompt_index] = min(seen, c.num_cached_tokens)
        return sum(per_prompt.values())

    async def events(
        self, outputs: AsyncIterator[tuple[int, RequestOutput]], options: StreamOptions | None
    ) -> AsyncIterator[str]:
        """The event stream: one chunk per visible piece, the usage chunk if asked, [DONE]."""
        created = now()
        include_usage = bool(options and options.include_usage)
        continuous = bool(include_usage and options and options.continuous_usage_stats)

        def chunk(choices: list[dict[str, Any]], usage: UsageInfo | None) -> str:
            return sse(
                {
                    "id": self.id,
                    "object": self.chunk_object,
                    "created": created,
                    "model": self.model,
                    "choices": choices,
                    "usage": usage.model_dump() if usage is not None else None,
                }
            )

        async for i, out in outputs:
            choice = self.choices[i]
            # the opening goes out before `add` counts this output's tokens
            if not choice.started and (opening := choice.opening()) is not None:
                yield chunk([opening], self.usage() if continuous else None)
            piece = choice.add(out)
            if piece is not None:
                yield chunk([piece], self.usage() if continuous else None)
        if include_usage:
            yield chunk([], self.usage())
        yield SSE_DONE


async def respond(
    raw: Request,
    group: GenerationGroup,
    answer: Answer,
    request: ChatCompletionRequest | CompletionRequest,
    response_type: type[ChatCompletionResponse] | type[CompletionResponse],
) -> Response:
    """Run the answer's engine requests; stream them if the request asks to, else answer
    with one `response_type` object. An engine error before the first event is an HTTP
    error naming the request field it blames."""
    with engine_errors_as_api_errors(type(request).model_fields):
        if request.stream:
            return await _stream_response(raw, group, answer, request.stream_options)
        await _collect(raw, group, answer)
    body = response_type(
        id=answer.id,
        model=answer.model,
        choices=[c.final() for c in answer.choices],
        usage=answer.usage(),
    )
    return JSONResponse(body.model_dump())


async def _collect(raw: Request, group: GenerationGroup, answer: Answer) -> None:
    """Run the group to its end into the answer's choices (cut short, and aborted in the
    engine, if the client goes away). Engine errors propagate as the engine raised them."""

    async def run() -> None:
        async with contextlib.aclosing(group.stream()) as outputs:
            async for i, out in outputs:
                answer.choices[i].add(out)

    await run_unless_disconnected(raw, run())


async def _stream_response(
    raw: Request, group: GenerationGroup, answer: Answer, options: StreamOptions | None
) -> Response:
    """Start the engine requests and wait for their first output, so that an input the
    engine rejects still gets an HTTP error status (its error propagates from here); then
    stream the rest. A failure after that can only be told in the stream: an error event,
    then [DONE]."""
    gen = group.stream()

    async def first_output() -> tuple[int, RequestOutput]:
        return await gen.__anext__()

    try:
        first = await run_unless_disconnected(raw, first_output())
    except StopAsyncIteration:
        first = None
    except BaseException:
        await gen.aclose()
        raise
    if first is None and await raw.is_disconnected():
        await gen.aclose()
        return Response(status_code=499)

    async def outputs() -> AsyncIterator[tuple[int, RequestOutput]]:
        if first is not None:
            yield first
            async for item in gen:
                yield item

    async def body() -> AsyncIterator[str]:
        try:
            async for event in answer.events(outputs(), options):
                yield event
        except Exception as e:
            if isinstance(e, ApiError):
                err = e
            elif isinstance(e, ENGINE_ERRORS):
                err = from_engine(e)
            else:
                logger.exception("stream failed")
                err = ApiError(f"Internal error: {type(e).__name__}.", 500, "internal_server_error")
            yield sse(err.stream_event())
            yield SSE_DONE
        finally:
            with anyio.CancelScope(shield=True):
                await gen.aclose()

    return StreamingResponse(body(), media_type="text/event-stream")
