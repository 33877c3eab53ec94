"""Limits of the front end (fake engine): body size before parsing, prompts x n, a bounded
queue with 429 + Retry-After, the per-request deadline, keep-alive after a 500, draining."""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
from fake_engine import MODEL, FakeEngine, make_client
from server_thread import ServerThread

from moeserve.config import ServerConfig
from moeserve.server.api import create_app


def completion(**kw) -> dict:
    return {"model": MODEL, "prompt": "SAY:ok", "max_tokens": 4, **kw}


def test_body_over_the_limit_is_refused_before_parsing():
    engine = FakeEngine(model_name=MODEL)
    app = create_app(engine, ServerConfig(served_model_name=MODEL, max_request_body=1000))
    from fastapi.testclient import TestClient

    with TestClient(app) as c:
        big = {"model": MODEL, "prompt": "x" * 5000}
        r = c.post("/v1/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        # no length header (chunked): counted as it arrives
        r = c.post("/v1/completions", content=iter([b'{"prompt": "', b"x" * 2000, b'"}']))
        assert r.status_code == 413
        assert engine.requests == []  # nothing reached the engine
        ok = c.post("/v1/completions", json=completion())
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "ok"


def test_prompts_times_n_is_capped():
    engine = FakeEngine(model_name=MODEL)
    cfg = ServerConfig(served_model_name=MODEL, max_choices_per_request=8)
    from fastapi.testclient import TestClient

    with TestClient(create_app(engine, cfg)) as c:
        r = c.post("/v1/completions", json=completion(prompt=["a", "b", "c"], n=3))
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        assert "at most 8" in r.json()["error"]["message"]
        assert c.post("/v1/completions", json=completion(prompt=["a", "b"], n=4)).status_code == 200
        assert engine.requests  # the allowed one ran


def test_full_queue_gives_429_with_retry_after_then_recovers():
    engine = FakeEngine(model_name=MODEL, delay=0.05)  # each token takes 50 ms
    cfg = ServerConfig(served_model_name=MODEL, max_queue_len=4)
    app = create_app(engine, cfg)

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            # 3 requests x n=1 are admitted; a request of n=2 then finds 3 + 2 > 4
            first = [
                asyncio.create_task(c.post("/v1/completions", json=completion(max_tokens=8)))
                for _ in range(3)
            ]
            await asyncio.sleep(0.01)
            over = await c.post("/v1/completions", json=completion(n=2))
            done = await asyncio.gather(*first)
            after = await c.post("/v1/completions", json=completion(n=2))
            return [over, *done, after]

    over, *done, after = asyncio.run(main())
    assert over.status_code == 429 and over.headers["retry-after"] == "1"
    assert over.json()["error"]["code"] == "queue_full"
    assert all(r.status_code == 200 for r in done)
    assert after.status_code == 200  # the queue drained


def test_request_deadline_aborts_with_408():
    engine = FakeEngine(model_name=MODEL, delay=0.05)
    cfg = ServerConfig(served_model_name=MODEL, request_timeout=0.3)
    from fastapi.testclient import TestClient

    with TestClient(create_app(engine, cfg)) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 100})
        assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
        s = c.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 100, "stream": True},
        )
        assert '"request_timeout"' not in s.text  # (an error event carries the status code)
        assert '"code": 408' in s.text and s.text.rstrip().endswith("data: [DONE]")
        assert len(engine.aborted) == 2  # both were aborted in the engine
        assert c.post("/v1/completions", json=completion()).status_code == 200


class ExplodingMetrics(FakeEngine):
    def metrics_text(self) -> str:
        raise RuntimeError("a bug in the engine's metrics")


def _http(sock: socket.socket, path: str) -> tuple[int, bytes]:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(ln.split(b":")[1])
        for ln in head.split(b"\r\n")
        if ln.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), body


def test_keep_alive_connection_survives_a_500():
    app = create_app(ExplodingMetrics(model_name=MODEL), ServerConfig(served_model_name=MODEL))
    with ServerThread(app) as srv, socket.create_connection(("127.0.0.1", srv.port)) as sock:
        sock.settimeout(10)
        status, body = _http(sock, "/metrics")
        assert status == 500 and b'"internal_server_error"' in body
        status, _ = _http(sock, "/health")  # same connection
        assert status == 200


def test_draining_server_refuses_new_work_with_503():
    client, _ = make_client()
    with client:
        client.app.state.server.draining = True
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json=completion())
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"


def test_tokenizing_runs_off_the_event_loop():
    """A slow tokenizer does not stall /health (it runs in a worker thread)."""
    started, release = threading.Event(), threading.Event()
    engine = FakeEngine(model_name=MODEL)
    real = engine.tokenizer.encode

    def slow_encode(text, add_special_tokens=True):
        if "SLOW" in text:
            started.set()
            release.wait(10)
        return real(text, add_special_tokens)

    engine.tokenizer.encode = slow_encode
    app = create_app(engine, ServerConfig(served_model_name=MODEL))

    async def main() -> tuple[int, int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            slow = asyncio.create_task(c.post("/v1/completions", json=completion(prompt="SLOW")))
            while not started.is_set():
                await asyncio.sleep(0.01)
            health = await c.get("/health")  # answered while the tokenizer is busy
            release.set()
            return health.status_code, (await slow).status_code

    assert asyncio.run(main()) == (200, 200)
