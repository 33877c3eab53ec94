"""User-facing errors: `ApiError`, the OpenAI error object, and the translation of request
validation failures and engine errors into them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from moeserve.engine.errors import (
    ContextLengthExceeded,
    EngineDead,
    EngineInputError,
    RequestFailed,
)
from moeserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorInfo,
    ErrorResponse,
    TokenizeRequest,
)

REQUEST_FIELDS = frozenset(
    name
    for model in (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest)
    for name in model.model_fields
)


def sentence(text: str) -> str:
    """One line, capitalised unless it starts with an identifier, ending in a full stop."""
    text = " ".join(text.split())
    first = text.split(" ", 1)[0]
    if "_" not in first and first[:1].islower():
        text = text[:1].upper() + text[1:]
    return text if text.endswith((".", "?", "!")) else text + "."


def param_named(message: str, fields: Iterable[str]) -> str | None:
    """The request field a message blames: sampling and engine messages start with it
    (`min_tokens: ...`, `prompt token ids ...`)."""
    first = message.split(" ", 1)[0].rstrip(":")
    return first if first in fields else None


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
        message = sentence(message)
        super().__init__(message)
        self.message, self.status, self.err_type = message, status, err_type
        self.param, self.code, self.headers = param, code, headers

    def response(self) -> JSONResponse:
        return error_json(
            self.status, self.message, self.err_type, self.param, self.code, self.headers
        )

    def stream_event(self) -> dict[str, Any]:
        """The error event that ends an already started stream (vLLM's convention: the
        HTTP status goes in `code`)."""
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": None,
                "code": self.status,
            }
        }


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


# what the engine raises for one request (moeserve.engine.errors)
ENGINE_ERRORS = (EngineInputError, RequestFailed, EngineDead)


def from_engine(
    exc: EngineInputError | RequestFailed | EngineDead,
    fields: Iterable[str] = (),
    prompt_param: str = "prompt",
) -> ApiError:
    """A rejected input is the client's 400; a failure of this request alone a 500; a
    stopped engine a 503. `prompt_param`: the request field that holds the prompt the
    engine refused ("messages", "prompt", "prompt.2")."""
    if isinstance(exc, ContextLengthExceeded):
        where = prompt_param.split(".", 1)[0]
        return ApiError(exc.describe(where), param=where, code="context_length_exceeded")
    if isinstance(exc, EngineInputError):
        message = str(exc) or "The engine rejected the request."
        if exc.in_prompt:
            named = f"prompt '{prompt_param}'"
            message = message.replace("the prompt", f"the {named}")
            return ApiError(message.replace("The prompt", f"The {named}"), param=prompt_param)
        return ApiError(message, param=param_named(message, fields))
    if isinstance(exc, EngineDead):
        return ApiError(str(exc), 503, "service_unavailable", code="engine_dead")
    return ApiError(str(exc), 500, "internal_server_error")


@contextmanager
def engine_errors_as_api_errors(fields: Iterable[str]) -> Iterator[None]:
    """Around code that waits on the engine for a request whose fields are `fields`."""
    try:
        yield
    except ENGINE_ERRORS as e:
        raise from_engine(e, fields) from e


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
        return sentence(msg), first if first.split(".")[0] in REQUEST_FIELDS else None
    if kind == "missing":
        return f"Missing required parameter '{param}'.", param
    return f"Invalid value for '{param}': {msg[:1].lower() + msg[1:]}.", param
