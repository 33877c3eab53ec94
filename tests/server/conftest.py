from __future__ import annotations

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from moeserve.config import ServerConfig
from moeserve.server.api import create_app

MODEL = "fake-model"


def make_client(engine=None, api_key=None, reasoning_parser=None, tool_parser=None):
    engine = engine or FakeEngine()
    app = create_app(
        engine,
        ServerConfig(api_key=api_key, served_model_name=MODEL),
        reasoning_parser=reasoning_parser,
        tool_parser=tool_parser,
    )
    return TestClient(app), engine


@pytest.fixture
def client():
    c, engine = make_client()
    with c:
        c.engine = engine
        yield c
