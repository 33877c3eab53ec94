"""schemathesis against the app's own /openapi.json (in process, fake engine): a few
hundred generated requests, including malformed ones, and not one server error."""

from __future__ import annotations

import pytest
from fake_engine import MODEL, FakeEngine
from hypothesis import HealthCheck, settings

from moeserve.config import ServerConfig
from moeserve.server.api import create_app

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402

APP = create_app(FakeEngine(model_name=MODEL), ServerConfig(served_model_name=MODEL))
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)

CASES_PER_OPERATION = 40  # x 11 operations: a few hundred requests per run


@schema.parametrize()
@settings(
    max_examples=CASES_PER_OPERATION,
    deadline=None,
    derandomize=True,  # the same cases on every run: a failure reproduces
    suppress_health_check=list(HealthCheck),
)
def test_no_server_errors(case):
    response = case.call()
    assert response.status_code < 500, (case.as_curl_command(), response.text)
    case.validate_response(response, checks=[not_a_server_error])
