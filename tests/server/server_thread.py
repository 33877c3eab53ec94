"""Run an ASGI app with uvicorn on 127.0.0.1 (ephemeral port) in a background thread."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


class ServerThread:
    def __init__(self, app, startup_timeout: float = 30.0) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._timeout = startup_timeout

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + self._timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
