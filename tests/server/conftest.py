from __future__ import annotations

import pytest
from fake_engine import make_client


@pytest.fixture
def client():
    c, engine = make_client()
    with c:
        c.engine = engine
        yield c
