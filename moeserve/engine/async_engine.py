"""The engine for an asyncio front end: `AsyncEngine` runs an `LLMEngine` on its own thread
and talks to the front end through queues, so neither blocks the other.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import gc
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from moeserve.config import EngineConfig
from moeserve.engine.core import LLMEngine, build_engine
from moeserve.engine.errors import EngineDead, EngineInputError, RequestFailed, failure_message
from moeserve.engine.outputs import RequestOutput
from moeserve.loader.source import GGUF_SUFFIX
from moeserve.sampling import SamplingParams, is_device_error

log = logging.getLogger(__name__)

EXIT_ENGINE_FAILED = 70  # EX_SOFTWARE
_POISON_GRACE_S = 0.5  # time for the front end to send the failed streams their error
# the engine trims the host heap once it has been idle this long (a full collection takes
# milliseconds to tens of them: only when no request is waiting for the engine)
_IDLE_TRIM_AFTER_S = 1.0


def exit_process(error: BaseException) -> None:
    """What a poisoned engine does by default: one line on stderr, then the process exits so
    that a supervisor restarts it (a live process that answers 500 forever helps no one)."""
    first = (str(error).strip().splitlines() or [""])[0][:300]
    print(
        f"moeserve: fatal: the engine failed ({type(error).__name__}: {first}); exiting",
        file=sys.stderr,
        flush=True,
    )
    os._exit(EXIT_ENGINE_FAILED)


class AsyncEngine:
    """Runs an `LLMEngine` on a background thread; `generate` is an async generator.

    A request that fails alone (sampling, detokenizing, stop checks) gets `RequestFailed`
    while the others go on. An error outside per-request code (a CUDA error, a dead worker,
    a bug in the step) poisons the engine: every stream gets `EngineDead`, `is_healthy`
    turns false and `on_poison` runs (default: exit the process with one line).
    """

    def __init__(
        self,
        engine: LLMEngine,
        model_name: str,
        on_poison: Callable[[BaseException], None] | None = exit_process,
    ) -> None:
        self.engine = engine
        self._on_poison = on_poison
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # outputs waiting for their event loop's next hand-off (see _deliver)
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="moeserve-engine", daemon=True)
        self._thread.start()

    # ---- front end side --------------------------------------------------------------------
    def validate(
        self, prompt_token_ids: list[int], params: SamplingParams, images: list | None = None
    ) -> int:
        """The engine's checks of a request, without submitting it (the front end calls this
        for each of a request's prompts before admitting any); returns max_tokens, resolved."""
        return self.engine.validate(prompt_token_ids, params, images)

    @property
    def image_processor(self) -> Any:
        """The model's image preprocessing (None: the model takes no images)."""
        return self.engine.image_processor

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        images: list | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if self._error is not None:
            raise EngineDead(f"The engine stopped after an error ({type(self._error).__name__}).")
        self.engine.validate(prompt_token_ids, params, images)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise EngineInputError(f"request id {request_id!r} is already in use.")
            self._streams[request_id] = (loop, q)
        self._inbox.put(("add", request_id, list(prompt_token_ids), params, images))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._inbox.put(("abort", request_id))
            with self._lock:
                self._streams.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def metrics_text(self) -> str:
        return self.engine.metrics_text()

    def is_healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def shutdown(self) -> None:
        self._inbox.put(("stop",))
        self._thread.join(timeout=10)
        self.engine.shutdown()

    # ---- engine thread ---------------------------------------------------------------------
    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        """Queue an output for its stream's event loop: one wake-up of the loop takes all
        that piled up since its last one (a step's outputs of every request, or several
        steps' when the loop is busy), instead of one thread hand-off per output."""
        with self._lock:
            target = self._streams.get(request_id)
            if target is None:
                return
            loop, q = target
            pending = self._pending.setdefault(loop, [])
            pending.append((q, item))
            if len(pending) > 1:  # a hand-off of this batch is on its way
                return
        loop.call_soon_threadsafe(self._hand_over, loop)

    def _hand_over(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the event loop: every pending output into its stream's queue."""
        with self._lock:
            items = self._pending.pop(loop, [])
        for q, item in items:
            q.put_nowait(item)

    def _handle(self, msg: tuple) -> bool:
        kind = msg[0]
        if kind == "stop":
            return False
        if kind == "add":
            _, rid, ids, params, images = msg
            try:
                self.engine.add_request(rid, ids, params, images)
            except ValueError as e:
                self._deliver(rid, EngineInputError(str(e)))
            except Exception as e:  # this request's own set-up: it fails alone
                if is_device_error(e):
                    raise
                log.error("request %s could not start: %s: %s", rid, type(e).__name__, e)
                self.engine.abort(rid)
                self._deliver(rid, RequestFailed(failure_message(e)))
        elif kind == "abort":
            self.engine.abort(msg[1])
        return True

    def _loop(self) -> None:
        worked = False  # since the last heap trim
        try:
            while True:
                block = not self.engine.has_unfinished()
                worked = worked or not block
                try:
                    if block and worked:  # idle: trim once nothing arrives for a moment
                        try:
                            msg = self._inbox.get(timeout=_IDLE_TRIM_AFTER_S)
                        except queue.Empty:
                            trim_host_heap()
                            worked = False
                            continue
                    else:
                        msg = self._inbox.get(block=block, timeout=None if block else 0)
                    if not self._handle(msg):
                        return
                    while True:  # drain everything that arrived
                        if not self._handle(self._inbox.get_nowait()):
                            return
                except queue.Empty:
                    pass
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
                for rid, e in self.engine.take_failures():
                    self._deliver(rid, RequestFailed(failure_message(e)))
        except BaseException as e:  # a device failure or a bug outside one request: poison
            log.debug("engine loop failed", exc_info=True)
            self._error = e
            with self._lock:
                ids = list(self._streams)
            dead = EngineDead(f"The engine failed ({type(e).__name__}); the server is restarting.")
            for rid in ids:
                self._deliver(rid, dead)
            if self._on_poison is not None:
                time.sleep(_POISON_GRACE_S if ids else 0.0)
                self._on_poison(e)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def trim_host_heap() -> None:
    """Collect cyclic garbage (it can hold native buffers until a full collection) and
    return the C heap's free memory to the system (glibc keeps what requests freed).
    Measured on the CPU server: ~150 MB per 200 requests of varied lengths retained, nearly
    all of it given back by the two together, none by malloc_trim alone."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def build_async_engine(
    model: str | None = None,
    *,
    config: EngineConfig | None = None,
    served_model_name: str | None = None,
    **settings,
) -> AsyncEngine:
    """An `AsyncEngine` over `build_engine(model, config=config, **settings)`, serving the
    model under `served_model_name` (default: the checkpoint's name)."""
    engine = build_engine(model, config=config, **settings)
    return AsyncEngine(engine, served_model_name or served_name(engine.config.model))


def served_name(model: str | None) -> str:
    """The name a model is served under: its checkpoint's file or folder name."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    path = Path(os.path.normpath(model))
    return path.stem if path.suffix == GGUF_SUFFIX else path.name
