"""A guarded request costs the round trips of a bare one (issue 11, "fewer round trips").

On a SQLAlchemy Engine, `guard.run` sends the transaction's BEGIN with its key's lock
and read, and its COMMIT with the key's write and the deferred effects (libpq pipeline
mode, outbox/_driver.py; migration 0012's `outbox.require`). Counted on the wire: the
ReadyForQuery messages PostgreSQL sends, one per round trip. Also: what the COMMIT
must not take with it (a key that was not written, an effect key that existed, our
prepared statement dropped under the request) is answered as with the two apart.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import Connection, Engine, text

from outbox import Claim, IdempotencyGuard, StoredResponse, _driver, enqueue, make_engine
from tests.wire_support import counting_round_trips


@pytest.fixture
def one_connection(db_url: str) -> Iterator[Engine]:
    """An Engine of one pooled connection: every request below runs on it."""
    engine = make_engine(db_url, application_name="tests-round-trips", pool_size=1,
                         max_overflow=0)
    yield engine
    engine.dispose()


def round_trips(engine: Engine, run: Callable[[], Any], tmp: Path) -> int:
    """The round trips `run()` took on the engine's one connection."""
    raw = engine.raw_connection()
    pgconn = raw.driver_connection.pgconn  # type: ignore[union-attr]
    raw.close()  # back to the pool: `run` checks it out again
    with counting_round_trips(pgconn, tmp) as counted:
        run()
    return counted[0]


def work(conn: Connection, claim: Claim) -> StoredResponse:
    order_id = conn.execute(text("INSERT INTO test_orders (key, amount) VALUES (:k, 42)"
                                 " RETURNING id"), {"k": claim.key}).scalar_one()
    claim.enqueue("psp.charge", {"order_id": order_id})
    claim.enqueue("email.receipt", {"order_id": order_id})
    return StoredResponse(201, (), b"{}")


def test_a_guarded_request_costs_the_round_trips_of_a_bare_one(
        one_connection: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    guard = IdempotencyGuard()

    def bare() -> None:
        with one_connection.begin() as conn:
            conn.execute(text("INSERT INTO test_orders (key, amount) VALUES ('bare', 1)"))

    def guarded() -> None:
        assert not guard.run(one_connection, "rt", uuid.uuid4().hex, "fp", work).replayed

    guarded()  # prepared statements, the pool's first checkout
    bare()
    assert round_trips(one_connection, bare, tmp_path) == 3      # BEGIN, INSERT, COMMIT
    assert round_trips(one_connection, guarded, tmp_path) == 3   # lock+read, INSERT, write
    monkeypatch.setattr(_driver, "DIRECT", False)  # through psycopg's cursor, as before
    assert round_trips(one_connection, guarded, tmp_path) == 5
    with one_connection.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM outbox.effects")).scalar_one() == 6
        assert conn.execute(text("SELECT count(*) FROM outbox.idempotency_keys"
                                 " WHERE status = 'completed'")).scalar_one() == 3


def test_psycopgs_deallocate_during_the_request_costs_nothing(
        one_connection: Engine) -> None:
    """psycopg sends DEALLOCATE ALL when a ROLLBACK (a savepoint's too) passes through it
    while it holds prepared statements: ours are in its cache, so it knows they are
    gone and the write that carries the COMMIT is prepared again in its round trip."""
    guard = IdempotencyGuard()
    calls: list[int] = []

    def deallocating(conn: Connection, claim: Claim) -> StoredResponse:
        calls.append(1)
        response = work(conn, claim)
        savepoint = conn.begin_nested()
        savepoint.rollback()  # ROLLBACK TO SAVEPOINT, first seen: psycopg clears ...
        conn.exec_driver_sql("SELECT 3")  # ... and sends DEALLOCATE ALL before this
        return response

    guard.run(one_connection, "rt", "warm", "fp", work)  # our write is prepared
    assert not guard.run(one_connection, "rt", "dropped", "fp", deallocating).replayed
    assert len(calls) == 1
    with one_connection.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM outbox.effects")).scalar_one() == 4


def test_our_statement_dropped_unseen_under_the_request_costs_one_more_try(
        one_connection: Engine) -> None:
    """A DEALLOCATE ALL psycopg did not see drops the prepared write the COMMIT rides
    with: the write fails (26000) and nothing commits; run() tries the request again
    with the write and the COMMIT apart. The work runs twice, its rows commit once."""
    guard = IdempotencyGuard()
    calls: list[int] = []

    def deallocating(conn: Connection, claim: Claim) -> StoredResponse:
        calls.append(1)
        response = work(conn, claim)
        if len(calls) == 1:
            raw = conn.connection.driver_connection
            assert raw is not None
            assert raw.pgconn.exec_(b"DEALLOCATE ALL").status == \
                psycopg.pq.ExecStatus.COMMAND_OK
        return response

    guard.run(one_connection, "rt", "warm", "fp", work)
    result = guard.run(one_connection, "rt", "dropped", "fp", deallocating)
    assert not result.replayed and len(calls) == 2
    with one_connection.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM test_orders WHERE key = 'dropped'"
                                 )).scalar_one() == 1
        assert conn.execute(text("SELECT count(*) FROM outbox.effects")).scalar_one() == 4
    assert not guard.run(one_connection, "rt", "after", "fp", work).replayed


def test_a_commit_listener_keeps_the_commit_apart(one_connection: Engine) -> None:
    """SQL a `commit` listener runs must run in the request's transaction, as before:
    with a listener on the engine, run() leaves the COMMIT to SQLAlchemy."""
    from sqlalchemy import event

    seen: list[tuple[Any, Any]] = []

    def audit(conn: Connection) -> None:
        seen.append((conn.exec_driver_sql("SELECT txid_current_if_assigned()").scalar(),
                     conn.exec_driver_sql("SELECT count(*) FROM test_orders WHERE key ="
                                          " 'listened'").scalar()))

    def work_and_txid(conn: Connection, claim: Claim) -> StoredResponse:
        response = work(conn, claim)
        seen.append((conn.exec_driver_sql("SELECT txid_current()").scalar(), None))
        return response

    event.listen(one_connection, "commit", audit)
    try:
        IdempotencyGuard().run(one_connection, "rt", "listened", "fp", work_and_txid)
    finally:
        event.remove(one_connection, "commit", audit)
    (in_work, _), (at_commit, rows) = seen
    assert at_commit == in_work and rows == 1


def test_an_effect_key_that_existed_is_answered_as_with_the_two_apart(
        one_connection: Engine) -> None:
    """The same effect under an explicit key already there: a duplicate, the request
    commits; another effect under it: EffectKeyConflict, nothing of the request
    commits. The write refused to commit with its COMMIT (OB002) and the second try
    decided."""
    from outbox.errors import EffectKeyConflict

    with one_connection.begin() as conn:
        enqueue(conn, "psp.charge", {"n": 1}, key="explicit-1")
    guard = IdempotencyGuard()

    def with_key(n: int) -> Callable[[Connection, Claim], StoredResponse]:
        def run(conn: Connection, claim: Claim) -> StoredResponse:
            conn.execute(text("INSERT INTO test_orders (key, amount) VALUES (:k, 1)"),
                         {"k": claim.key})
            claim.enqueue("psp.charge", {"n": n}, key="explicit-1")
            return StoredResponse(201)
        return run

    with pytest.raises(EffectKeyConflict):
        guard.run(one_connection, "rt", "conflict", "fp", with_key(2))
    assert not guard.run(one_connection, "rt", "duplicate", "fp", with_key(1)).replayed
    with one_connection.connect() as conn:
        assert conn.execute(text("SELECT key FROM test_orders ORDER BY id")
                            ).scalars().all() == ["duplicate"]
        assert conn.execute(text("SELECT key FROM outbox.idempotency_keys")
                            ).scalars().all() == ["duplicate"]
        assert conn.execute(text("SELECT count(*) FROM outbox.effects")).scalar_one() == 1


def test_the_refusal_is_a_sqlstate_of_its_own(one_connection: Engine) -> None:
    with one_connection.connect() as conn, pytest.raises(Exception) as caught:
        conn.execute(text("SELECT outbox.require(false, 'OB002', 'an effect key existed')"))
    orig = caught.value.orig  # type: ignore[attr-defined]
    assert isinstance(orig, psycopg.Error) and orig.sqlstate == "OB002"
    assert "not committed: an effect key existed" in str(orig)
    with one_connection.connect() as conn:
        assert conn.execute(text("SELECT outbox.require(true, 'OB001', 'x')")).scalar_one()


def test_the_doorbells_listener_keeps_the_commit_with_the_write(
        one_connection: Engine, tmp_path: Path) -> None:
    """With an in-process doorbell (Celery's, Django's), `enqueue` on a Connection rings
    at its `commit` event: a listener of ours that runs no SQL, so the COMMIT still
    rides with the key's write, and the bell still rings after it."""
    from outbox._enqueue import add_doorbell, remove_doorbell

    rang: list[str] = []
    guard = IdempotencyGuard()

    def enqueue_now(conn: Connection, claim: Claim) -> StoredResponse:
        conn.execute(text("INSERT INTO test_orders (key, amount) VALUES (:k, 1)"),
                     {"k": claim.key})
        enqueue(conn, "psp.charge", {"n": 1}, claim=claim, queue="bells")
        return StoredResponse(201)

    def guarded() -> None:
        guard.run(one_connection, "rt", uuid.uuid4().hex, "fp", enqueue_now)

    add_doorbell(rang.append)
    try:
        guarded()
        # BEGIN + lock and read, INSERT, the enqueue, the key's write + COMMIT
        assert round_trips(one_connection, guarded, tmp_path) == 4
    finally:
        remove_doorbell(rang.append)
    assert rang == ["bells", "bells"]
