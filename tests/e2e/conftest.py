import os
import socket
import subprocess
import sys
import time

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CliServer:
    """`moeserve serve ...` as a real subprocess, on an ephemeral loopback port."""

    def __init__(self, *args: str, timeout: float = 180.0) -> None:
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "moeserve.cli", "serve", *args, "--port", str(self.port)]
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()[-2000:]}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError("server did not come up")
            time.sleep(0.5)

    def close(self) -> str:
        self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return out or ""


@pytest.fixture
def cli_server():
    servers: list[CliServer] = []

    def start(*args: str) -> CliServer:
        servers.append(CliServer(*args))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def greedy_choice(base_url: str, prompt: list[int], max_tokens: int, timeout: float = 60, **extra):
    """The first choice of a greedy /v1/completions request for token ids `prompt` (special
    tokens kept in the text, EOS ignored); `extra` adds request fields (e.g. logprobs=5)."""
    r = httpx.post(
        f"{base_url}/v1/completions",
        json={
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "skip_special_tokens": False,
            **extra,
        },
        timeout=timeout,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]
