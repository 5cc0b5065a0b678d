"""Migrations produce exactly the models; the state machines are enforced by CHECKs."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import Engine, text
from sqlalchemy.exc import IntegrityError

from outbox import EffectStatus, KeyStatus
from outbox._migrate import alembic_config, current

ROOT = Path(__file__).resolve().parents[1]


def test_migrations_match_models(db_url: str) -> None:
    # `alembic check` raises if autogenerate still finds a difference.
    command.check(alembic_config(db_url))


def _head() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def test_migrated_to_head(engine: Engine) -> None:
    with engine.connect() as conn:
        assert current(conn) == _head()


def test_alembic_cli_from_checkout(db_url: str) -> None:
    done = subprocess.run([str(Path(sys.executable).parent / "alembic"), "current"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"DATABASE_URL": db_url, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert f"{_head()} (head)" in done.stdout


def test_queue_table_storage_settings(engine: Engine) -> None:
    with engine.connect() as conn:
        opts = conn.execute(text(
            "SELECT reloptions FROM pg_class WHERE oid = 'outbox.effects'::regclass")
        ).scalar_one()
    assert "fillfactor=80" in opts
    assert "autovacuum_vacuum_scale_factor=0.01" in opts


def _insert_effect(engine: Engine, **cols: object) -> None:
    base: dict[str, object] = {"effect_key": uuid.uuid4().hex, "kind": "k", "payload": "{}"}
    base.update(cols)
    names = ", ".join(base)
    values = ", ".join(f":{k}" for k in base)
    with engine.begin() as conn:
        conn.execute(text(f"INSERT INTO outbox.effects ({names}) VALUES ({values})"), base)


@pytest.mark.parametrize("cols", [
    {"status": "sent"},                                      # not a state
    {"status": "in_flight"},                                 # in flight without a lease
    {"status": "pending", "lease_token": uuid.uuid4()},      # a lease while pending
    {"status": "delivered"},                                 # delivered without a time
    {"status": "failed"},                                    # finished without a time
    {"effect_key": ""},                                      # empty key
    {"effect_key": "x" * 256},                               # over the receivers' limit
    {"max_attempts": 0},
    # the delivered attempt kept on the row (0006): only on a delivered row, with its start
    {"delivered_by": "w", "delivered_started_at": "2030-01-01T00:00:00Z"},
    {"status": "delivered", "delivered_at": "2030-01-01T00:00:00Z",
     "finished_at": "2030-01-01T00:00:00Z", "delivered_by": "w"},
])
def test_effect_state_machine_checks(engine: Engine, cols: dict[str, object]) -> None:
    with pytest.raises(IntegrityError):
        _insert_effect(engine, **cols)


def test_effect_valid_states_accepted(engine: Engine) -> None:
    _insert_effect(engine)
    _insert_effect(engine, status="in_flight", lease_token=uuid.uuid4(),
                   lease_owner="w", lease_expires_at="2030-01-01T00:00:00Z")
    _insert_effect(engine, status="delivered", delivered_at="2030-01-01T00:00:00Z",
                   finished_at="2030-01-01T00:00:00Z")
    with engine.connect() as conn:
        statuses = set(conn.execute(text("SELECT status FROM outbox.effects")).scalars())
    assert statuses == {"pending", "in_flight", "delivered"}
    assert statuses <= {s.value for s in EffectStatus}


@pytest.mark.parametrize("sql", [
    # processing without a token, completed without a response
    "INSERT INTO outbox.idempotency_keys (scope, key, fingerprint, status, expires_at)"
    " VALUES ('s', 'k', 'f', 'processing', now())",
    "INSERT INTO outbox.idempotency_keys (scope, key, fingerprint, status, expires_at)"
    " VALUES ('s', 'k', 'f', 'completed', now())",
    "INSERT INTO outbox.idempotency_keys (scope, key, fingerprint, status, expires_at)"
    " VALUES ('s', 'k', 'f', 'unknown', now())",
])
def test_key_state_machine_checks(engine: Engine, sql: str) -> None:
    assert {s.value for s in KeyStatus} == {"processing", "completed"}
    with pytest.raises(IntegrityError), engine.begin() as conn:
        conn.execute(text(sql))
