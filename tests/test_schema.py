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


def test_0008_triggers_and_its_downgrade_round_trip(db_url: str) -> None:
    """`alembic check` cannot see triggers: here, on a scratch database, head has the two
    cascade triggers and no foreign key to effects; downgrading to 0007 brings the
    foreign keys back (after deleting rows a missing effect orphaned) and removes the
    triggers; upgrading again restores head, which still matches the models."""
    from sqlalchemy import create_engine, make_url
    from sqlalchemy.pool import NullPool

    from outbox._migrate import upgrade

    base = make_url(db_url)
    name = f"outbox_rt_{uuid.uuid4().hex[:8]}"
    admin = create_engine(base.set(database="postgres"), isolation_level="AUTOCOMMIT",
                          poolclass=NullPool)
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = base.set(database=name).render_as_string(hide_password=False)
    scratch = create_engine(url, poolclass=NullPool)

    def state() -> tuple[list[str], list[str]]:
        with scratch.connect() as conn:
            triggers = conn.execute(text(
                "SELECT tgname FROM pg_trigger WHERE tgrelid = 'outbox.effects'::regclass"
                " AND NOT tgisinternal ORDER BY tgname")).scalars().all()
            fks = conn.execute(text(
                "SELECT conname FROM pg_constraint WHERE contype = 'f'"
                " AND confrelid = 'outbox.effects'::regclass ORDER BY conname")
            ).scalars().all()
        return list(triggers), list(fks)

    try:
        upgrade(url)
        assert state() == (["effects_deleted", "effects_truncated"], [])
        with scratch.begin() as conn:  # a key whose effect is gone (written by hand)
            conn.execute(text("INSERT INTO outbox.effect_keys VALUES ('orphan', 999)"))
        command.downgrade(alembic_config(url), "0007")
        assert state() == ([], ["attempts_effect_id_fkey", "effect_keys_effect_id_fkey"])
        upgrade(url)
        assert state() == (["effects_deleted", "effects_truncated"], [])
        command.check(alembic_config(url))
    finally:
        scratch.dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
