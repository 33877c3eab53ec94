"""OpenAI-compatible HTTP front end (FastAPI).

The app only awaits the engine's async generators (`engine.generate`), so the HTTP event
loop and the engine loop stay decoupled. One OpenAI choice = one engine request; n > 1 and
lists of prompts run as several engine requests merged into one response or stream.
A request whose client goes away (stream or not) is aborted in the engine, which frees its
pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moeserve.config import ServerConfig
from moeserve.engine.errors import EngineDead, EngineInputError, RequestFailed
from moeserve.engine.outputs import RequestOutput, TokenLogprob
from moeserve.sampling import SEED_MAX, SEED_MIN, SamplingError, SamplingParams
from moeserve.server import chat as chat_parsers
from moeserve.server.metrics import HttpMetrics
from moeserve.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    ErrorInfo,
    ErrorResponse,
    FunctionCallOut,
    ModelCard,
    ModelList,
    TokenizeRequest,
    ToolCallOut,
    UsageInfo,
    now,
)

logger = logging.getLogger("moeserve.server")

# Paths reachable without an API key: liveness probes and Prometheus scrapers carry none.
OPEN_PATHS = frozenset({"/health", "/metrics"})


# ----------------------------------------------------------------------------- errors


REQUEST_FIELDS = frozenset(
    name
    for model in (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest)
    for name in model.model_fields
)


def _sentence(text: str) -> str:
    """One line, capitalised unless it starts with an identifier, ending in a full stop."""
    text = " ".join(text.split())
    first = text.split(" ", 1)[0]
    if "_" not in first and first[:1].islower():
        text = text[:1].upper() + text[1:]
    return text if text.endswith((".", "?", "!")) else text + "."


class ApiError(Exception):
    """A user-facing error: one clear sentence, an HTTP status and the OpenAI error type."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        err_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = _sentence(message)
        super().__init__(message)
        self.message, self.status, self.err_type = message, status, err_type
        self.param, self.code, self.headers = param, code, headers


def error_json(
    status: int,
    message: str,
    err_type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def error_sse(message: str, err_type: str, code: int) -> str:
    """An error inside an already started stream (vLLM's convention)."""
    return _sse({"error": {"message": message, "type": err_type, "param": None, "code": code}})


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _param_of(loc: tuple[Any, ...]) -> str | None:
    """`('body', 'messages', 0, 'role')` -> `messages.0.role`; pydantic's union-branch tags
    (`list[int]`, `function-after[...]`) are dropped."""
    parts = []
    for p in loc[1:] if loc and loc[0] == "body" else loc:
        s = str(p)
        if "[" in s or "(" in s or s in _TYPE_TAGS:
            break
        parts.append(s)
    return ".".join(parts) or None


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One sentence and the offending parameter for the first validation error."""
    errors = exc.errors()
    if not errors:
        return "The request is invalid.", None
    err = errors[0]
    kind, loc = err.get("type", ""), tuple(err.get("loc", ()))
    if kind == "json_invalid":
        return "The request body is not valid JSON.", None
    param = _param_of(loc)
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ").rstrip(".")
    if param is None:
        if kind == "missing":
            return "The request body is missing; send a JSON object.", None
        if kind in ("model_attributes_type", "dict_type", "model_type"):
            return "The request body must be a JSON object.", None
        # a check across fields; its message starts with the field it blames, if any
        first = msg.split(" ", 1)[0]
        return _sentence(msg), first if first.split(".")[0] in REQUEST_FIELDS else None
    if kind == "missing":
        return f"Missing required parameter '{param}'.", param
    return f"Invalid value for '{param}': {msg[:1].lower() + msg[1:]}.", param


# ----------------------------------------------------------------------------- middleware


class AuthAndMetricsMiddleware:
    """Pure ASGI middleware (BaseHTTPMiddleware would buffer streams and hide disconnects):
    checks `Authorization: Bearer KEY` in constant time, bounds the request body before
    anything parses it, counts requests, and answers an unexpected exception with a 500
    OpenAI error object itself (Starlette's last-resort handler re-raises it, and the server
    then drops the keep-alive connection)."""

    def __init__(
        self, app: ASGIApp, api_key: str | None, metrics: HttpMetrics, max_body: int
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.metrics = metrics
        self.max_body = max_body

    async def _bounded_body(self, scope: Scope, receive: Receive) -> Receive | None:
        """A `receive` that replays the whole body, or None when it is larger than allowed
        (Content-Length is trusted only to refuse early; the bytes are counted)."""
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    if int(value) > self.max_body:
                        return None
                except ValueError:
                    pass
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                pending: Message | None = message  # a disconnect: hand it on
                break
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body:
                return None
            chunks.append(body)
            if not message.get("more_body", False):
                pending = None
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed, pending
            if not replayed:
                replayed = True
                if pending is not None and not chunks:
                    msg, pending = pending, None
                    return msg
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            if pending is not None:
                msg, pending = pending, None
                return msg
            return await receive()

        return replay

    def _authorized(self, scope: Scope) -> bool:
        if self.api_key is None or scope["path"] in OPEN_PATHS:
            return True
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    token.strip(), self.api_key
                )
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        started = ended = False

        async def send_tracked(message: Message) -> None:
            nonlocal started, ended
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                ended = True
            await send_status(message)

        try:
            if not self._authorized(scope):
                resp = error_json(
                    401,
                    "Invalid or missing API key; send 'Authorization: Bearer <key>'.",
                    "authentication_error",
                    code="invalid_api_key",
                )
                await resp(scope, receive, send_status)
                return
            bounded = await self._bounded_body(scope, receive)
            if bounded is None:
                resp = error_json(
                    413,
                    f"The request body is larger than this server's limit of {self.max_body} "
                    "bytes (--max-request-body).",
                    "invalid_request_error",
                    code="request_too_large",
                )
                await resp(scope, receive, send_status)
                return
            await self.app(scope, bounded, send_tracked)
        except Exception as exc:  # a bug: one 500 for this request, the connection lives on
            logger.error("internal error", exc_info=exc)
            if not started:
                resp = error_json(
                    500, f"Internal server error ({type(exc).__name__}).", "internal_server_error"
                )
                await resp(scope, receive, send_status)
            elif not ended:  # mid-response: end the body cleanly
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.observe(scope["method"], path, status, time.perf_counter() - start)


# ----------------------------------------------------------------------------- generation


@dataclass
class SubRequest:
    """One engine request: one choice of one prompt."""

    index: int  # OpenAI choice index
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class _Done:
    index: int


class QueueCounter:
    """Engine requests admitted by the front end that have not produced their first output
    (waiting for a batch slot, or in prefill). Updated on the event loop only."""

    def __init__(self) -> None:
        self.value = 0

    def admit(self, n: int, limit: int) -> None:
        if self.value + n > limit:
            raise ApiError(
                f"The server is busy: {self.value} requests are waiting and this one would add "
                f"{n} (--max-queue-len {limit}); retry later.",
                429,
                "rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        self.value += n

    def release(self, n: int) -> None:
        self.value = max(0, self.value - n)


class GenerationGroup:
    """Runs several engine requests concurrently and yields their outputs as they come.

    Closing the iterator early (client gone, error, deadline) cancels the consumers and
    aborts every request that has not finished, so the engine frees its pages. Each engine
    request counts as queued (`ServerState.queued`) until its first output or its end.
    """

    def __init__(
        self,
        engine: Any,
        subs: list[SubRequest],
        timeout: float | None = None,
        queue: QueueCounter | None = None,
        queue_limit: int | None = None,
    ) -> None:
        self.engine = engine
        self.subs = subs
        self.timeout = timeout
        self.counter = queue or QueueCounter()
        self.queue_limit = queue_limit
        self.finished: set[str] = set()
        self._queue: asyncio.Queue[tuple[int, RequestOutput] | _Done | BaseException] = (
            asyncio.Queue()
        )

    async def _pump(self, sub: SubRequest) -> None:
        queued = True
        try:
            async for out in self.engine.generate(sub.prompt_ids, sub.params, sub.request_id):
                if queued:
                    queued = False
                    self.counter.release(1)
                if out.finished:
                    self.finished.add(sub.request_id)
                self._queue.put_nowait((sub.index, out))
            self._queue.put_nowait(_Done(sub.index))
        except Exception as e:  # handed to the consumer, which re-raises it
            self._queue.put_nowait(e)
        finally:
            if queued:
                self.counter.release(1)

    async def _next(self, deadline: float | None) -> Any:
        if deadline is None:
            return await self._queue.get()
        left = deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(self._queue.get(), max(left, 0.0))
        except TimeoutError:
            raise ApiError(
                f"The request did not finish within this server's deadline of "
                f"{self.timeout:g} s (--request-timeout).",
                408,
                "timeout_error",
                code="request_timeout",
            ) from None

    async def stream(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if self.queue_limit is not None:  # no await before the pumps take over the count
            self.counter.admit(len(self.subs), self.queue_limit)
        else:
            self.counter.value += len(self.subs)
        tasks = [asyncio.create_task(self._pump(s)) for s in self.subs]
        running = len(tasks)
        loop = asyncio.get_running_loop()
        deadline = None if self.timeout is None else loop.time() + self.timeout
        try:
            while running:
                item = await self._next(deadline)
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, _Done):
                    running -= 1
                    continue
                yield item
        finally:
            for t in tasks:
                t.cancel()
            # shielded: this runs while the enclosing scope is being cancelled (disconnect)
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*tasks, return_exceptions=True)
                for s in self.subs:
                    if s.request_id not in self.finished:
                        try:
                            await self.engine.abort(s.request_id)
                        except Exception:
                            logger.exception("abort of %s failed", s.request_id)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(request: Request, coro: Any) -> Any:
    """Await coro, cancelling it if the client disconnects first (then returns None)."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(task, return_exceptions=True)
    if task in done:
        return task.result()
    logger.info("client disconnected; request aborted")
    return None


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


# ----------------------------------------------------------------------------- server state


@dataclass
class ServerState:
    engine: Any
    config: ServerConfig
    reasoning_parser: str | None
    tool_parser: str | None
    metrics: HttpMetrics = field(default_factory=HttpMetrics)
    queue: QueueCounter = field(default_factory=QueueCounter)
    draining: bool = False  # SIGTERM received: running requests finish, new ones get 503

    def group(self, subs: list[SubRequest]) -> GenerationGroup:
        """Admit a request's engine requests (caps, queue bound) and group them."""
        if self.draining:
            raise ApiError(
                "The server is shutting down; retry on another instance.",
                503,
                "service_unavailable",
                code="shutting_down",
            )
        cap = self.config.max_choices_per_request
        if len(subs) > cap:
            raise ApiError(
                f"This request asks for {len(subs)} completions (prompts x n); this server "
                f"allows at most {cap} per request (--max-choices-per-request).",
                param="n",
            )
        return GenerationGroup(
            self.engine, subs, self.config.request_timeout, self.queue, self.config.max_queue_len
        )

    def eos_ids(self) -> tuple[int, ...]:
        eos = self.tokenizer.eos_token_id
        return () if eos is None else (eos,)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        """The configured served name, else (config left at its default) the engine's."""
        configured = self.config.served_model_name
        if configured == ServerConfig().served_model_name:
            return getattr(self.engine, "model_name", None) or configured
        return configured

    def check_model(self, model: str | None) -> None:
        if model is None:
            return
        known = (
            self.model_name,
            self.config.served_model_name,
            getattr(self.engine, "model_name", None),
        )
        if model not in known:
            raise ApiError(
                f"The model '{model}' does not exist; this server serves '{self.model_name}'.",
                404,
                "NotFoundError",
                "model",
                "model_not_found",
            )

    # -- prompts

    def render_chat(
        self,
        messages: list[Any],
        tools: list[Any] | None,
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
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(
                f"Token id {bad} in '{param}' is outside the vocabulary (0..{vocab - 1}).",
                param=param,
            )

    def output_budget(self, num_prompt: int, requested: int | None, where: str) -> int:
        """max_tokens after the context-length check (None: up to the context)."""
        limit = self.engine.max_model_len
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

    # -- logprobs

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def chat_logprobs(self, lps: list[TokenLogprob], top_n: int) -> list[dict[str, Any]]:
        out = []
        for lp in lps:
            tok = self.token_str(lp.token_id)
            top = [
                {"token": (s := self.token_str(t)), "logprob": v, "bytes": list(s.encode())}
                for t, v in lp.top[:top_n]
            ]
            out.append(
                {
                    "token": tok,
                    "logprob": lp.logprob,
                    "bytes": list(tok.encode()),
                    "top_logprobs": top,
                }
            )
        return out

    def completion_logprobs(
        self, entries: list[tuple[int, TokenLogprob | None]], top_n: int, offset: int
    ) -> tuple[CompletionLogprobs, int]:
        """Legacy logprobs of consecutive tokens (id, logprob or None for the first prompt
        token) whose text starts at `offset`. The token itself is always among its
        top_logprobs (vLLM's convention; lm-eval's greedy check relies on it)."""
        res = CompletionLogprobs()
        for token_id, lp in entries:
            tok = self.token_str(token_id)
            res.tokens.append(tok)
            res.text_offset.append(offset)
            offset += len(tok)
            if lp is None:  # the first prompt token has nothing to condition on
                res.token_logprobs.append(None)
                res.top_logprobs.append(None)
                continue
            res.token_logprobs.append(lp.logprob)
            top = {self.token_str(t): v for t, v in lp.top[:top_n]}
            top.setdefault(tok, lp.logprob)
            res.top_logprobs.append(top)
        return res, offset


def _cut_after_final_message(text: str, content: str) -> str:
    """Drop the end-of-turn the template put after the final message (HF's rule: cut right
    after the last occurrence of the stripped final content)."""
    tag = content.strip()
    pos = text.rfind(tag) if tag else -1
    if pos < 0:
        raise ApiError("continue_final_message: the final message is not in the rendered prompt.")
    return text[: pos + len(tag)]


def _sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    seed: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    skip_special_tokens: bool | None = None,
    vocab_size: int = 0,
    eos_ids: tuple[int, ...] = (),
) -> SamplingParams:
    """The engine's parameters of one choice, checked against the model's vocabulary."""
    optional = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
    }
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            seed=seed,
            logit_bias=req.logit_bias_ids,
            stop=tuple(req.stop or ()),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=(
                req.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
            ),
            **{k: v for k, v in optional.items() if v is not None},
        )
        params.check_vocab(vocab_size, eos_ids)
        return params
    except SamplingError as e:
        name = str(e).split(" ", 1)[0].rstrip(":")
        raise ApiError(str(e), param=name if name in type(req).model_fields else None) from e


def _choice_seed(seed: int | None, i: int) -> int | None:
    """Choice i's seed: seed + i, wrapped into the generator's range."""
    if seed is None:
        return None
    return (seed + i - SEED_MIN) % (SEED_MAX - SEED_MIN) + SEED_MIN


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _engine_error(e: EngineInputError) -> ApiError:
    return ApiError(str(e) or "The engine rejected the request.")


def _failure_error(e: RequestFailed | EngineDead) -> ApiError:
    """A 500 for this request alone (or a 503 when the engine itself stopped)."""
    if isinstance(e, EngineDead):
        return ApiError(str(e), 503, "service_unavailable", code="engine_dead")
    return ApiError(str(e), 500, "internal_server_error")


# ----------------------------------------------------------------------------- chat


@dataclass
class _ChatChoiceState:
    parser: chat_parsers.ChatOutputParser
    text: str = ""
    reasoning: str = ""
    content: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False


def _finish_reason(reason: str | None, parser: chat_parsers.ChatOutputParser) -> str | None:
    if reason == "stop" and parser.tool_calls:
        return "tool_calls"
    return reason


def _delta_dict(d: chat_parsers.ChatDelta) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if d.reasoning:
        delta["reasoning_content"] = d.reasoning
        delta["reasoning"] = d.reasoning
    if d.content:
        delta["content"] = d.content
    if d.tool_calls:
        calls = []
        for tc in d.tool_calls:
            item: dict[str, Any] = {"index": tc.index}
            if tc.id is not None:
                item.update(id=tc.id, type="function")
                item["function"] = {"name": tc.name, "arguments": tc.arguments}
            else:
                item["function"] = {"arguments": tc.arguments}
            calls.append(item)
        delta["tool_calls"] = calls
    return delta


async def chat_completions(st: ServerState, req: ChatCompletionRequest, raw: Request) -> Response:
    st.check_model(req.model)

    def prompt() -> tuple[str, list[int]]:
        text = st.render_chat(
            req.messages,
            req.tools,
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template_kwargs,
        )
        return text, st.encode(text, add_special_tokens=False, param="messages")

    # rendering and tokenizing a long prompt takes time: off the event loop
    prompt_text, prompt_ids = await anyio.to_thread.run_sync(prompt)
    max_tokens = st.output_budget(len(prompt_ids), req.output_limit, "messages")
    parsers_on = bool(
        (st.reasoning_parser and st.reasoning_parser != chat_parsers.NONE_PARSER)
        or (req.uses_tools and st.tool_parser and st.tool_parser != chat_parsers.NONE_PARSER)
    )
    top_n = req.top_logprobs or 0
    request_id = _new_id("chatcmpl")
    subs = [
        SubRequest(
            i,
            f"{request_id}-{i}",
            prompt_ids,
            _sampling_params(
                req,
                max_tokens,
                _choice_seed(req.seed, i),
                top_n if req.logprobs else None,
                skip_special_tokens=False if parsers_on else None,
                vocab_size=st.tokenizer.vocab_size,
                eos_ids=st.eos_ids(),
            ),
        )
        for i in range(req.n)
    ]
    states = [
        _ChatChoiceState(
            chat_parsers.make_output_parser(
                st.reasoning_parser, st.tool_parser, prompt_text, req.uses_tools
            )
        )
        for _ in range(req.n)
    ]
    group = st.group(subs)
    if req.stream:
        return await _stream_response(
            raw, group, lambda first: _chat_sse(st, req, request_id, states, group, first)
        )

    async def collect() -> None:
        async with contextlib.aclosing(group.stream()) as it:
            async for i, out in it:
                _chat_accumulate(st, states[i], out, top_n)

    try:
        await run_unless_disconnected(raw, collect())
    except EngineInputError as e:
        raise _engine_error(e) from e
    except (RequestFailed, EngineDead) as e:
        raise _failure_error(e) from e
    choices = []
    for i, s in enumerate(states):
        calls = [
            ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
            for c in s.parser.tool_calls
        ]
        content: str | None = s.content
        if not content and (calls or s.reasoning):
            content = None
        msg = ChatMessageOut(
            content=content,
            reasoning_content=s.reasoning or None,
            reasoning=s.reasoning or None,
            tool_calls=calls,
        )
        logprobs = ChatLogprobs(content=[ChatTokenLogprob(**d) for d in s.logprobs])
        choices.append(
            ChatChoice(
                index=i,
                message=msg,
                logprobs=logprobs if req.logprobs else None,
                finish_reason=_finish_reason(s.finish_reason, s.parser),
                stop_reason=s.stop_reason,
            )
        )
    usage = UsageInfo.of(len(prompt_ids), sum(s.num_tokens for s in states))
    resp = ChatCompletionResponse(id=request_id, model=st.model_name, choices=choices, usage=usage)
    return JSONResponse(resp.model_dump())


def _chat_accumulate(st: ServerState, s: _ChatChoiceState, out: RequestOutput, top_n: int) -> None:
    s.num_tokens += len(out.token_ids)
    if out.logprobs:
        s.logprobs += st.chat_logprobs(out.logprobs, top_n)
    d = s.parser.feed(out.text)
    if out.finished:
        tail = s.parser.flush()
        d.reasoning += tail.reasoning
        d.content += tail.content
        s.finish_reason, s.stop_reason = out.finish_reason, out.stop_reason
    s.reasoning += d.reasoning
    s.content += d.content


async def _chat_sse(
    st: ServerState,
    req: ChatCompletionRequest,
    request_id: str,
    states: list[_ChatChoiceState],
    group: GenerationGroup,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[str]:
    created = now()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(include_usage and req.stream_options.continuous_usage_stats)
    num_prompt = len(group.subs[0].prompt_ids)
    top_n = req.top_logprobs or 0

    def chunk(choices: list[dict[str, Any]], usage: UsageInfo | None = None) -> str:
        return _sse(
            {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": st.model_name,
                "choices": choices,
                "usage": usage.model_dump() if usage is not None else None,
            }
        )

    def running_usage() -> UsageInfo | None:
        if not continuous:
            return None
        return UsageInfo.of(num_prompt, sum(s.num_tokens for s in states))

    async for i, out in outputs:
        s = states[i]
        if not s.started:  # the role comes first, in a chunk of its own (OpenAI does this)
            s.started = True
            yield chunk(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
                running_usage(),
            )
        s.num_tokens += len(out.token_ids)
        d = s.parser.feed(out.text)
        finish = None
        if out.finished:
            tail = s.parser.flush()
            d.reasoning += tail.reasoning
            d.content += tail.content
            chat_parsers.merge_tool_deltas(d.tool_calls, tail.tool_calls)
            finish = _finish_reason(out.finish_reason, s.parser)
        logprobs = None
        if req.logprobs and out.logprobs:
            logprobs = {"content": st.chat_logprobs(out.logprobs, top_n)}
        if d.empty() and finish is None and logprobs is None:
            continue
        choice: dict[str, Any] = {
            "index": i,
            "delta": _delta_dict(d),
            "logprobs": logprobs,
            "finish_reason": finish,
        }
        if finish is not None:
            choice["stop_reason"] = out.stop_reason
        yield chunk([choice], running_usage())
    if include_usage:
        total = sum(s.num_tokens for s in states)
        yield chunk([], UsageInfo.of(num_prompt, total))
    yield SSE_DONE


async def _stream_response(raw: Request, group: GenerationGroup, make_sse: Any) -> Response:
    """Start the engine requests, wait for their first output (so an input the engine
    rejects still gets an HTTP 400), then stream server-sent events."""
    gen = group.stream()

    async def first_output() -> tuple[int, RequestOutput]:
        return await gen.__anext__()

    try:
        first = await run_unless_disconnected(raw, first_output())
    except StopAsyncIteration:
        first = None
    except EngineInputError as e:
        await gen.aclose()
        raise _engine_error(e) from e
    except (RequestFailed, EngineDead) as e:
        await gen.aclose()
        raise _failure_error(e) from e
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
            async for piece in make_sse(outputs()):
                yield piece
        except ApiError as e:
            yield error_sse(e.message, e.err_type, e.status)
            yield SSE_DONE
        except EngineInputError as e:
            yield error_sse(str(e), "invalid_request_error", 400)
            yield SSE_DONE
        except RequestFailed as e:
            yield error_sse(_sentence(str(e)), "internal_server_error", 500)
            yield SSE_DONE
        except EngineDead as e:
            yield error_sse(_sentence(str(e)), "service_unavailable", 503)
            yield SSE_DONE
        except Exception as e:
            logger.exception("stream failed")
            yield error_sse(f"Internal error: {type(e).__name__}.", "internal_server_error", 500)
            yield SSE_DONE
        finally:
            with anyio.CancelScope(shield=True):
                await gen.aclose()

    return StreamingResponse(body(), media_type="text/event-stream")


# ----------------------------------------------------------------------------- completions


@dataclass
class _Prompt:
    ids: list[int]
    text: str


def _count_prompts(p: Any) -> int:
    if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)):
        return 1
    return len(p)


def _completion_prompts(st: ServerState, req: CompletionRequest) -> list[_Prompt]:
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
            ids = st.encode(item, add_special_tokens=req.add_special_tokens, param=param)
            text = item
        else:
            ids = list(item)
            st.check_token_ids(ids, param)
            text = st.tokenizer.decode(ids, skip_special_tokens=False) if req.echo else ""
        if not ids:
            raise ApiError(f"The prompt '{param}' is empty.", param=param)
        prompts.append(_Prompt(ids, text))
    return prompts


@dataclass
class _CompletionChoiceState:
    prompt: int
    text: str = ""
    logprobs: CompletionLogprobs = field(default_factory=CompletionLogprobs)
    offset: int = 0
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False


class _CompletionRun:
    """Per-request settings and the per-output bookkeeping shared by stream and not."""

    def __init__(self, st: ServerState, req: CompletionRequest, prompts: list[_Prompt]) -> None:
        self.st, self.req, self.prompts = st, req, prompts
        self.states = [_CompletionChoiceState(k // req.n) for k in range(len(prompts) * req.n)]

    def step(self, index: int, out: RequestOutput) -> tuple[str, CompletionLogprobs | None]:
        """Text and logprobs this output adds to choice `index` (echo first)."""
        s, req = self.states[index], self.req
        text, lps = "", None
        want_lp = req.logprobs is not None
        if want_lp:
            lps = CompletionLogprobs()
        if not s.started:
            s.started = True
            if req.echo:
                prompt = self.prompts[s.prompt]
                text = prompt.text
                if want_lp:
                    plp = list(out.prompt_logprobs or [])
                    if len(plp) == len(prompt.ids) - 1:
                        plp = [None, *plp]
                    entries = list(zip(prompt.ids, plp, strict=True))
                    lps, _ = self.st.completion_logprobs(entries, req.logprobs or 0, 0)
                s.offset = len(text)
        s.num_tokens += len(out.token_ids)
        text += out.text
        if want_lp and out.logprobs:
            entries = [(lp.token_id, lp) for lp in out.logprobs]
            more, s.offset = self.st.completion_logprobs(entries, req.logprobs or 0, s.offset)
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(lps, name).extend(getattr(more, name))
        if out.finished:
            s.finish_reason, s.stop_reason = out.finish_reason, out.stop_reason
        s.text += text
        if lps is not None:
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(s.logprobs, name).extend(getattr(lps, name))
        return text, lps

    def usage(self) -> UsageInfo:
        return UsageInfo.of(
            sum(len(p.ids) for p in self.prompts), sum(s.num_tokens for s in self.states)
        )


async def completions(st: ServerState, req: CompletionRequest, raw: Request) -> Response:
    st.check_model(req.model)
    n_prompts = _count_prompts(req.prompt)
    cap = st.config.max_choices_per_request
    if n_prompts * req.n > cap:  # before tokenizing them all
        raise ApiError(
            f"This request asks for {n_prompts * req.n} completions (prompts x n); this server "
            f"allows at most {cap} per request (--max-choices-per-request).",
            param="prompt" if req.n == 1 else "n",
        )
    prompts = await anyio.to_thread.run_sync(_completion_prompts, st, req)
    request_id = _new_id("cmpl")
    subs = []
    for p_idx, prompt in enumerate(prompts):
        budget = st.output_budget(len(prompt.ids), req.max_tokens, "prompt")
        for i in range(req.n):
            index = p_idx * req.n + i
            params = _sampling_params(
                req,
                budget,
                _choice_seed(req.seed, i),
                req.logprobs,
                prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None,
                vocab_size=st.tokenizer.vocab_size,
                eos_ids=st.eos_ids(),
            )
            subs.append(SubRequest(index, f"{request_id}-{index}", prompt.ids, params))
    run = _CompletionRun(st, req, prompts)
    group = st.group(subs)
    if req.stream:
        return await _stream_response(
            raw, group, lambda first: _completion_sse(st, req, request_id, run, first)
        )

    async def collect() -> None:
        async with contextlib.aclosing(group.stream()) as it:
            async for i, out in it:
                run.step(i, out)

    try:
        await run_unless_disconnected(raw, collect())
    except EngineInputError as e:
        raise _engine_error(e) from e
    except (RequestFailed, EngineDead) as e:
        raise _failure_error(e) from e
    choices = [
        CompletionChoice(
            index=k,
            text=s.text,
            logprobs=s.logprobs if req.logprobs is not None else None,
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
        )
        for k, s in enumerate(run.states)
    ]
    resp = CompletionResponse(
        id=request_id, model=st.model_name, choices=choices, usage=run.usage()
    )
    return JSONResponse(resp.model_dump())


async def _completion_sse(
    st: ServerState,
    req: CompletionRequest,
    request_id: str,
    run: _CompletionRun,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[str]:
    created = now()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(include_usage and req.stream_options.continuous_usage_stats)

    def chunk(choices: list[dict[str, Any]], usage: UsageInfo | None = None) -> str:
        return _sse(
            {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": st.model_name,
                "choices": choices,
                "usage": usage.model_dump() if usage is not None else None,
            }
        )

    async for i, out in outputs:
        text, lps = run.step(i, out)
        s = run.states[i]
        finish = s.finish_reason if out.finished else None
        if not text and lps is None and finish is None:
            continue
        choice = {
            "index": i,
            "text": text,
            "logprobs": lps.model_dump() if lps is not None else None,
            "finish_reason": finish,
            "stop_reason": s.stop_reason if out.finished else None,
        }
        yield chunk([choice], run.usage() if continuous else None)
    if include_usage:
        yield chunk([], run.usage())
    yield SSE_DONE


# ----------------------------------------------------------------------------- tokenizer


def tokenize(st: ServerState, req: TokenizeRequest) -> dict[str, Any]:
    st.check_model(req.model)
    if req.messages is not None:
        if not req.messages:
            raise ApiError("messages must contain at least one message.", param="messages")
        text = st.render_chat(
            req.messages,
            req.tools,
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template_kwargs,
        )
        add_special = bool(req.add_special_tokens)  # the template already has them
    else:
        text = req.prompt or ""
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
    ids = st.encode(text, add_special_tokens=add_special)
    res: dict[str, Any] = {
        "tokens": ids,
        "count": len(ids),
        "max_model_len": st.engine.max_model_len,
    }
    if req.return_token_strs:
        res["token_strs"] = [st.tokenizer.id_to_token(t) for t in ids]
    return res


def detokenize(st: ServerState, req: DetokenizeRequest) -> dict[str, Any]:
    st.check_model(req.model)
    st.check_token_ids(req.tokens, "tokens")
    return {"prompt": st.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def tokenizer_info(st: ServerState) -> dict[str, Any]:
    tok = st.tokenizer
    return {
        "tokenizer_class": type(tok).__name__,
        "eos_token": tok.eos_token,
        "bos_token": tok.bos_token,
        "pad_token": tok.pad_token,
        "eos_token_id": tok.eos_token_id,
        "bos_token_id": tok.bos_token_id,
        "chat_template": tok.chat_template,
        "model_max_length": st.engine.max_model_len,
        "vocab_size": tok.vocab_size,
    }


# ----------------------------------------------------------------------------- app


def _version() -> str:
    try:
        return metadata.version("moeserve")
    except metadata.PackageNotFoundError:
        return "unknown"


def create_app(
    engine: Any,
    server_config: ServerConfig,
    reasoning_parser: str | None = None,
    tool_parser: str | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over an AsyncEngine. Parser names: see
    moeserve.server.chat ("kimi_k2", "deepseek_r1" / "kimi_k2", or "none")."""
    chat_parsers.check_parser_names(reasoning_parser, tool_parser)
    st = ServerState(engine, server_config, reasoning_parser, tool_parser)
    app = FastAPI(title="moeserve", version=_version())
    app.state.server = st
    app.add_middleware(
        AuthAndMetricsMiddleware,
        api_key=server_config.api_key,
        metrics=st.metrics,
        max_body=server_config.max_request_body,
    )

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_json(exc.status, exc.message, exc.err_type, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_json(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"There is no route {request.method} {request.url.path}."
            return error_json(404, message, "NotFoundError", code="not_found")
        if exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}."
            return error_json(405, message, "invalid_request_error")
        return error_json(exc.status_code, str(exc.detail), "invalid_request_error")

    # other exceptions: AuthAndMetricsMiddleware answers them (a 500, connection kept)

    @app.get("/health")
    async def health() -> Response:
        if st.draining:
            return error_json(503, "The server is shutting down.", "service_unavailable")
        if engine.is_healthy():
            return Response(status_code=200)
        return error_json(503, "The engine is not healthy.", "service_unavailable")

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = engine.metrics_text()
        if text and not text.endswith("\n"):
            text += "\n"
        return PlainTextResponse(text + st.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card() -> ModelCard:
        return ModelCard(
            id=st.model_name,
            root=getattr(engine, "model_name", st.model_name),
            max_model_len=engine.max_model_len,
        )

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return ModelList(data=[model_card()]).model_dump()

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        st.check_model(model)
        return model_card().model_dump()

    @app.post("/v1/chat/completions")
    async def chat_endpoint(body: ChatCompletionRequest, raw: Request) -> Response:
        return await chat_completions(st, body, raw)

    @app.post("/v1/completions")
    async def completions_endpoint(body: CompletionRequest, raw: Request) -> Response:
        return await completions(st, body, raw)

    @app.post("/tokenize")
    async def tokenize_endpoint(body: TokenizeRequest) -> dict[str, Any]:
        return await anyio.to_thread.run_sync(tokenize, st, body)

    @app.post("/detokenize")
    async def detokenize_endpoint(body: DetokenizeRequest) -> dict[str, Any]:
        return detokenize(st, body)

    @app.get("/tokenizer_info")
    async def tokenizer_info_endpoint() -> dict[str, Any]:
        return tokenizer_info(st)

    return app


class _Server:
    """uvicorn with this server's shutdown: the first SIGTERM/SIGINT stops accepting,
    answers new requests with 503 and lets running ones finish for up to
    `shutdown_timeout` seconds (then they are cancelled, which aborts them in the engine);
    a second signal exits at once."""

    def __init__(self, app: FastAPI, config: ServerConfig) -> None:
        import uvicorn

        state: ServerState = app.state.server

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:
                if self.should_exit:
                    print("moeserve: second signal, exiting now", file=sys.stderr, flush=True)
                    os._exit(128 + sig)
                state.draining = True
                logger.info(
                    "shutting down: running requests get up to %gs to finish",
                    config.shutdown_timeout,
                )
                super().handle_exit(sig, frame)

        self.server = Server(
            uvicorn.Config(
                app,
                host=config.host,
                port=config.port,
                log_level=config.log_level,
                timeout_graceful_shutdown=config.shutdown_timeout,
            )
        )

    def run(self) -> None:
        self.server.run()


def run_server(
    engine: Any,
    server_config: ServerConfig,
    reasoning_parser: str | None = None,
    tool_parser: str | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT (binds server_config.host, 127.0.0.1 by default)."""
    app = create_app(engine, server_config, reasoning_parser, tool_parser)
    _Server(app, server_config).run()
