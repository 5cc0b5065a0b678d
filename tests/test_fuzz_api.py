"""Schemathesis over the payments service's own OpenAPI document: never a 5xx.

Each operation gets at most 50 generated requests per generation mode (valid data, and
data that violates the schema). Besides "no server error" every response must match
the document: a status it lists, its media type, its schema. That keeps /openapi.json
honest for external tools.

The operations are driven through `as_strategy` rather than `schema.parametrize`:
schemathesis' lazy pytest fixture loader does not work with pytest 9.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from sqlalchemy import Engine, text

with warnings.catch_warnings():  # starlette would rather have `httpx2`; httpx works
    warnings.simplefilter("ignore")
    import schemathesis
    import starlette.testclient  # noqa: F401
    from schemathesis.checks import (
        content_type_conformance,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

from dispatcher.examples.payments.app import create_app
from dispatcher.examples.payments.schema import ensure_schema

OPERATIONS = [
    ("POST", "/payments"),
    ("GET", "/payments/{payment_id}"),
    ("POST", "/webhooks/{source}"),
    ("POST", "/webhooks/{source}/batch"),
    ("GET", "/healthz"),
]
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


@pytest.fixture
def api_schema(engine: Engine) -> Iterator[schemathesis.BaseSchema]:
    ensure_schema(engine)
    yield schemathesis.openapi.from_asgi("/openapi.json", create_app(engine))
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE payments.payments RESTART IDENTITY"))


def test_every_operation_is_fuzzed(api_schema: schemathesis.BaseSchema) -> None:
    found = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert found == set(OPERATIONS)


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE,
                                  schemathesis.GenerationMode.NEGATIVE], ids=str)
@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[" ".join(o) for o in OPERATIONS])
def test_no_server_errors(api_schema: schemathesis.BaseSchema, method: str, path: str,
                          mode: schemathesis.GenerationMode) -> None:
    if path == "/healthz" and mode == schemathesis.GenerationMode.NEGATIVE:
        pytest.skip("no inputs to make invalid")
    operation = api_schema[path][method]
    seen: list[int] = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=50, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case: schemathesis.Case) -> None:
        response = case.call(headers={"Authorization": "Bearer fuzzer"})
        seen.append(response.status_code)
        assert response.status_code < 500, (case.method, case.path, response.text[:500])
        case.validate_response(response, checks=CHECKS)

    run()
    assert seen
