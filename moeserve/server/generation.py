"""The engine requests behind one HTTP request: admission, concurrent generation, and
aborting whatever is unfinished when the client, a deadline or an error ends it early.

One OpenAI choice is one engine request; n > 1 and lists of prompts run as several engine
requests whose outputs are merged into one response or stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from fastapi import Request

from moeserve.engine.outputs import RequestOutput
from moeserve.sampling import SamplingParams
from moeserve.server.errors import ApiError

logger = logging.getLogger("moeserve.server")

T = TypeVar("T")


@dataclass
class SubRequest:
    """One engine request: one choice of one prompt."""

    index: int  # OpenAI choice index
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    images: list | None = None  # `ImageInput`s of the prompt's placeholders


@dataclass
class _Done:
    index: int


class QueueCounter:
    """Engine requests admitted by the front end that have not produced their first output
    (waiting for a batch slot, or in prefill). Updated on the event loop only."""

    def __init__(self) -> None:
        self.value = 0

    def admit(self, n: int, limit: int | None) -> None:
        """Count n more; with a limit, refuse (429) the whole request rather than part of it."""
        if limit is not None and self.value + n > limit:
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
    """Runs several engine requests concurrently and yields (choice index, output) as they
    come.

    Closing the iterator early (client gone, error, deadline) cancels the consumers and
    aborts every request that has not finished, so the engine frees its pages. Each engine
    request counts as queued until its first output or its end.
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
            extra = {"images": sub.images} if sub.images else {}
            async for out in self.engine.generate(
                sub.prompt_ids, sub.params, sub.request_id, **extra
            ):
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
        # no await before the pumps take over the count, so admission cannot race
        self.counter.admit(len(self.subs), self.queue_limit)
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


async def run_unless_disconnected(request: Request, coro: Coroutine[Any, Any, T]) -> T | None:
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
