"""Setup shared by the HTTP tests (test_http, test_webhook_security, test_faults):
Starlette's TestClient, and the example's payments schema for one test."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

from sqlalchemy import Engine, text

from dispatcher.examples.payments.schema import ensure_schema

with warnings.catch_warnings():  # starlette would rather have `httpx2`; httpx works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

__all__ = ["TestClient", "payments_schema"]


def payments_schema(engine: Engine) -> Iterator[Engine]:
    """The body of a `payments_db` fixture (`yield from` it): the example's schema on
    `engine`, its payments table emptied after the test."""
    ensure_schema(engine)
    yield engine
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE payments.payments RESTART IDENTITY"))
