"""A tiny OpenAI-compatible test double that streams chunks at a known pace.

It runs an aiohttp app on 127.0.0.1 (ephemeral port) in a background thread with its own
event loop. Each streamed response: a role-only chunk at once (no content, so it must not
count as the first token), then one token per chunk at start + ttft + i * itl (absolute
times, so sleep overshoot does not accumulate), a finish chunk, the usage chunk, [DONE].

It keeps a prefix cache of a kind: a prompt it has answered before counts its
`prompt_tokens` as prefix-cache hits (`moeserve_prefix_cache_hits_total` on /metrics).

Prompts containing these words change the behaviour, to test failure handling:
FAIL400 (HTTP 400 with an OpenAI error body), BADCHUNK (a non-JSON chunk mid-stream),
CUTOFF (the stream stops without [DONE]), NOUSAGE (no usage chunk), ERRCHUNK (an error
object in the stream).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

MODEL_ID = "pace-model"
COUNTER = "moeserve_generation_tokens_total"
HITS_COUNTER = "moeserve_prefix_cache_hits_total"


@dataclass(frozen=True)
class Pace:
    ttft_s: float = 0.08
    itl_s: float = 0.02
    prompt_tokens: int = 7  # reported in usage
    stop_after: int | None = None  # finish with "stop" after this many tokens (an EOS)


class PaceServer:
    """Context manager: `with PaceServer(Pace()) as srv: srv.base_url ...`."""

    def __init__(self, pace: Pace) -> None:
        self.pace = pace
        self.generated_tokens = 0  # what /metrics reports
        self.prefix_cache_hits = 0  # likewise
        self.requests = 0
        self._seen_prompts: set[str] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> PaceServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc: Any) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the ephemeral port

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # -- handlers --------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        text = (
            f"# HELP {COUNTER} Generated tokens.\n# TYPE {COUNTER} counter\n"
            f'{COUNTER}{{model="{MODEL_ID}"}} {float(self.generated_tokens)}\n'
            f"# TYPE {HITS_COUNTER} counter\n{HITS_COUNTER} {float(self.prefix_cache_hits)}\n"
        )
        return web.Response(text=text, content_type="text/plain")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = " ".join(str(m.get("content", "")) for m in body.get("messages", []))
        return await self._stream(request, body, prompt, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        return await self._stream(request, body, str(body.get("prompt", "")), chat=False)

    async def _stream(
        self, request: web.Request, body: dict[str, Any], prompt: str, chat: bool
    ) -> web.StreamResponse:
        self.requests += 1
        if prompt in self._seen_prompts:
            self.prefix_cache_hits += self.pace.prompt_tokens
        self._seen_prompts.add(prompt)
        if "FAIL400" in prompt:
            err = {"error": {"message": "bad request on purpose", "type": "invalid_request_error"}}
            return web.json_response(err, status=400)
        n = int(body.get("max_tokens", 16))
        finish = "length"
        if self.pace.stop_after is not None and self.pace.stop_after < n:
            n, finish = self.pace.stop_after, "stop"
        start = time.perf_counter()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj: Any) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            await resp.write(f"data: {data}\n\n".encode())

        def chunk(text: str | None, finish: str | None = None, role: bool = False) -> dict:
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish}
            return {
                "id": "x",
                "object": "chunk",
                "model": MODEL_ID,
                "choices": [choice],
                "usage": None,
            }

        if chat:
            await send(chunk(None, role=True))  # carries no content
        for i in range(n):
            await asyncio.sleep(
                max(0.0, start + self.pace.ttft_s + i * self.pace.itl_s - time.perf_counter())
            )
            if "BADCHUNK" in prompt and i == n // 2:
                await send("{not json")
                return resp
            if "ERRCHUNK" in prompt and i == n // 2:
                await send({"error": {"message": "engine failed on purpose"}})
                return resp
            if "CUTOFF" in prompt and i == n // 2:
                return resp
            await send(chunk(f"t{i} "))
            self.generated_tokens += 1
        await send(chunk("" if not chat else None, finish=finish))
        if "NOUSAGE" not in prompt and (body.get("stream_options") or {}).get("include_usage"):
            usage = {
                "prompt_tokens": self.pace.prompt_tokens,
                "completion_tokens": n,
                "total_tokens": self.pace.prompt_tokens + n,
            }
            await send(
                {"id": "x", "object": "chunk", "model": MODEL_ID, "choices": [], "usage": usage}
            )
        await send("[DONE]")
        await resp.write_eof()
        return resp
