"""OpenAI-compatible HTTP front end (FastAPI): assembles the app and runs it.

The app only awaits the engine's async generators (`engine.generate`), so the HTTP event
loop and the engine loop stay decoupled. A request whose client goes away (stream or not)
is aborted in the engine, which frees its pages.
"""

from __future__ import annotations

import logging
import os
import sys
from importlib import metadata
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeserve.config import ServerConfig
from moeserve.server import parsers
from moeserve.server.chat import chat_completions
from moeserve.server.completions import completions
from moeserve.server.errors import ApiError, error_json, validation_message
from moeserve.server.middleware import (
    AuthMiddleware,
    BodyLimitMiddleware,
    ErrorMiddleware,
    MetricsMiddleware,
)
from moeserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from moeserve.server.state import ServerState
from moeserve.server.tokenization import detokenize, tokenize, tokenizer_info

logger = logging.getLogger("moeserve.server")


def _version() -> str:
    try:
        return metadata.version("moeserve")
    except metadata.PackageNotFoundError:
        return "unknown"


def _add_middleware(app: FastAPI, st: ServerState) -> None:
    # Starlette puts the last one added outermost: metrics sees every answer, the error
    # middleware's 500s included; auth refuses before the body is even read
    config = st.config
    app.add_middleware(BodyLimitMiddleware, max_body=config.max_request_body)
    if config.api_key:
        app.add_middleware(AuthMiddleware, api_key=config.api_key)
    app.add_middleware(ErrorMiddleware)
    app.add_middleware(MetricsMiddleware, metrics=st.metrics)


def _add_error_handlers(app: FastAPI) -> None:
    # other exceptions: ErrorMiddleware answers them (a 500, connection kept)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

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


def _add_routes(app: FastAPI, st: ServerState) -> None:
    engine = st.engine

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


def create_app(
    engine: Any,
    server_config: ServerConfig,
    reasoning_parser: str | None = None,
    tool_parser: str | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over an AsyncEngine. Parser names: see
    moeserve.server.parsers ("kimi_k2", "deepseek_r1" / "kimi_k2", or "none")."""
    parsers.check_parser_names(reasoning_parser, tool_parser)
    st = ServerState(engine, server_config, reasoning_parser, tool_parser)
    app = FastAPI(title="moeserve", version=_version())
    app.state.server = st
    _add_middleware(app, st)
    _add_error_handlers(app)
    _add_routes(app, st)
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
