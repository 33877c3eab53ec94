"""Pure ASGI middleware, one concern each (BaseHTTPMiddleware would buffer streams and hide
disconnects). Every one passes non-HTTP traffic (lifespan) straight through.

`create_app` stacks them, outermost first: metrics (so it sees every answer, 500s
included), errors, auth, body limit.
"""

from __future__ import annotations

import hmac
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moeserve.server.errors import error_json
from moeserve.server.metrics import HttpMetrics

logger = logging.getLogger("moeserve.server")

# Paths reachable without an API key: liveness probes and Prometheus scrapers carry none.
OPEN_PATHS = frozenset({"/health", "/metrics"})


class MetricsMiddleware:
    """Counts requests and their latency by method, route template and status."""

    def __init__(self, app: ASGIApp, metrics: HttpMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # what the client gets if nothing inside answers

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            # the router stores the matched route in the shared scope; templates, not raw
            # paths, keep the label set bounded
            path = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.observe(scope["method"], path, status, time.perf_counter() - start)


class ErrorMiddleware:
    """Answers an unexpected exception with a 500 OpenAI error object. Left to Starlette's
    last-resort handler, the exception would be re-raised and the server would drop the
    keep-alive connection; here the connection lives on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = ended = False

        async def send_tracked(message: Message) -> None:
            nonlocal started, ended
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:  # a bug: one 500 for this request
            logger.error("internal error", exc_info=exc)
            if not started:
                resp = error_json(
                    500, f"Internal server error ({type(exc).__name__}).", "internal_server_error"
                )
                await resp(scope, receive, send)
            elif not ended:  # mid-response: the status is out already; end the body cleanly
                await send({"type": "http.response.body", "body": b"", "more_body": False})


class AuthMiddleware:
    """Requires `Authorization: Bearer KEY` outside OPEN_PATHS, compared in constant time so
    the answer's timing does not reveal how much of a guess was right."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    def _authorized(self, scope: Scope) -> bool:
        if scope["path"] in OPEN_PATHS:
            return True
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    token.strip(), self.api_key
                )
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        resp = error_json(
            401,
            "Invalid or missing API key; send 'Authorization: Bearer <key>'.",
            "authentication_error",
            code="invalid_api_key",
        )
        await resp(scope, receive, send)


class BodyLimitMiddleware:
    """Refuses (413) a request body larger than `max_body` bytes before anything parses it.
    Content-Length is trusted only to refuse early; the bytes themselves are counted, so a
    chunked body cannot slip past."""

    def __init__(self, app: ASGIApp, max_body: int) -> None:
        self.app = app
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
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
            await resp(scope, receive, send)
            return
        await self.app(scope, bounded, send)

    async def _bounded_body(self, scope: Scope, receive: Receive) -> Receive | None:
        """A `receive` that replays the whole body, or None when it is over the limit."""
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
