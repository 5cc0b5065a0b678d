"""Our statements under psycopg's cursor (outbox/_driver.py, issue 11).

They run on libpq directly, with psycopg's own adapters and prepared-statement cache,
and the transaction's BEGIN in the same round trip when ours is its first statement.
What must hold: the same rows as through a cursor; one round trip where two were; the
caller's BEGIN options; psycopg's own DEALLOCATE ALL (after any ROLLBACK) costs
nothing, and one it did not see costs nothing where nothing else was in the
transaction; `prepare_threshold=None` (a transaction pooler) prepares nothing; an error
leaves the connection usable; Django's JSON loaders keep no connection alive.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, make_url
from sqlalchemy.exc import DBAPIError

from outbox import _driver
from outbox._driver import SyncDB, sql, sync_db
from outbox.sql import keys as sql_keys
from tests.wire_support import counting_round_trips

# Every type our statements read back, NULLs included, named and by position.
_TYPES = """
    SELECT CAST(:u AS uuid) AS u, CAST(:j AS jsonb) AS j, CAST(:b AS bytea) AS b,
           CAST(:t AS timestamptz) AS t, interval '90 seconds' AS age, 42 AS n,
           CAST(NULL AS text) AS nothing, :s AS s, CAST(:ints AS int[]) AS ints,
           CAST(:u AS uuid) = CAST(:u AS uuid) AS same
"""
NAMED, TUPLES = sql(_TYPES), sql(_TYPES, tuples=True)


def _params() -> dict[str, Any]:
    return {"u": uuid.uuid4(), "j": '{"a": [1, "x"]}', "b": b"\x00\xffbody",
            "t": dt.datetime(2026, 12, 5, 9, 0, tzinfo=dt.UTC), "s": "é'\\%",
            "ints": [1, 2, 3]}


@pytest.fixture
def conn(db_url: str) -> Iterator[psycopg.Connection[Any]]:
    dsn = make_url(db_url).set(drivername="postgresql").render_as_string(
        hide_password=False)
    with psycopg.connect(dsn) as c:
        yield c


def _ours(conn: psycopg.Connection[Any]) -> list[str]:
    """Prepared statements with parameters (ours; psycopg's `SELECT 1 + 1` has none)."""
    with conn.cursor() as cur:
        cur.execute("SELECT name FROM pg_prepared_statements WHERE statement LIKE '%$1%'")
        return [r[0] for r in cur.fetchall()]


def _deallocate_unseen(conn: psycopg.Connection[Any]) -> None:
    """DEALLOCATE ALL where psycopg cannot see it (as another library on the session)."""
    assert conn.pgconn.exec_(b"DEALLOCATE ALL").status == psycopg.pq.ExecStatus.COMMAND_OK


def _cursor_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_driver, "DIRECT", False)


def test_rows_are_what_a_psycopg_cursor_returns(conn: psycopg.Connection[Any],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    params = _params()
    db = SyncDB(conn)
    direct_named, direct_tuples = db.execute(NAMED, params), db.execute(TUPLES, params)
    conn.rollback()
    _cursor_only(monkeypatch)
    cursor_named, cursor_tuples = db.execute(NAMED, params), db.execute(TUPLES, params)
    assert direct_named.rows == cursor_named.rows
    assert direct_named.rows[0]._fields == cursor_named.rows[0]._fields
    assert direct_tuples.rows == cursor_tuples.rows
    assert type(direct_tuples.rows[0]) is tuple
    row = direct_named.rows[0]
    assert (row.u, row.j, row.b, row.age, row.n, row.nothing, row.s, row.ints, row.same) == (
        params["u"], {"a": [1, "x"]}, params["b"], dt.timedelta(seconds=90), 42, None,
        params["s"], [1, 2, 3], True)
    assert row.t == params["t"]
    assert direct_named.rowcount == cursor_named.rowcount == 1


def test_rowcount_of_a_statement_without_rows(conn: psycopg.Connection[Any]) -> None:
    conn.execute("CREATE TEMP TABLE t_direct (x int)")
    db = SyncDB(conn)
    assert db.execute(sql("INSERT INTO t_direct SELECT g FROM generate_series(1, :n) g"),
                      {"n": 3}).rowcount == 3
    assert db.execute(sql("SELECT x FROM t_direct WHERE x > :n"), {"n": 9}).rows == []


def _round_trips(conn: psycopg.Connection[Any], run: Any, tmp: Path) -> int:
    """The round trips `run()` took on `conn` (tests/wire_support.py)."""
    with counting_round_trips(conn.pgconn, tmp) as counted:
        run()
    return counted[0]


def test_the_first_statement_of_a_transaction_carries_its_begin(
        conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    db = SyncDB(conn)
    read = sql_keys.lock_and_read_key(7, "scope", "k")

    def execute() -> None:
        db.execute(read.statement, read.params)
    execute()  # prepares it
    conn.rollback()
    assert _round_trips(conn, execute, tmp_path) == 1  # BEGIN and the statement
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    assert _round_trips(conn, execute, tmp_path) == 1  # the statement alone
    conn.rollback()
    _cursor_only(monkeypatch)
    assert _round_trips(conn, execute, tmp_path) == 2  # a cursor: BEGIN, then it
    conn.rollback()


def test_the_begin_keeps_the_connections_isolation_and_read_only(
        conn: psycopg.Connection[Any], tmp_path: Path) -> None:
    conn.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
    conn.read_only = True
    db = SyncDB(conn)
    settings = sql("SELECT current_setting('transaction_isolation') AS i,"
                   " current_setting('transaction_read_only') AS r")
    got: list[Any] = []
    assert _round_trips(conn, lambda: got.append(db.execute(settings).one()), tmp_path) == 1
    assert (got[0].i, got[0].r) == ("serializable", "on")
    with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
        db.execute(sql("CREATE TABLE t_never (x int)"))
    conn.rollback()


def test_autocommit_sends_no_begin(conn: psycopg.Connection[Any], tmp_path: Path) -> None:
    conn.autocommit = True
    one = sql("SELECT CAST(:x AS int) AS one")
    SyncDB(conn).execute(one, {"x": 1})
    assert _round_trips(conn, lambda: SyncDB(conn).execute(one, {"x": 1}), tmp_path) == 1
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert len(_ours(conn)) == 1


def test_a_statement_deallocated_behind_psycopgs_back(
        conn: psycopg.Connection[Any], tmp_path: Path) -> None:
    db = SyncDB(conn)
    one = sql("SELECT CAST(:x AS int) + 1 AS y")
    assert db.execute(one, {"x": 1}).one().y == 2
    conn.commit()
    assert len(_ours(conn)) == 1
    # psycopg's own DEALLOCATE ALL (every ROLLBACK, once it holds statements): seen.
    conn.execute("SELECT 1")
    conn.rollback()
    assert _ours(conn) == []
    assert _round_trips(conn, lambda: db.execute(one, {"x": 2}), tmp_path) == 1
    conn.commit()
    # One psycopg did not see, and ours opens the transaction: nothing else to lose,
    # so it is prepared again and run at once.
    _deallocate_unseen(conn)
    assert db.execute(one, {"x": 2}).one().y == 3
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    conn.commit()
    # Inside a transaction the caller's work is gone with it, as through psycopg's
    # own cursor; the retry prepares it again.
    conn.execute("SELECT 1")
    _deallocate_unseen(conn)
    with pytest.raises(psycopg.errors.InvalidSqlStatementName):
        db.execute(one, {"x": 3})
    conn.rollback()
    assert db.execute(one, {"x": 3}).one().y == 4
    conn.commit()
    # In autocommit, nothing ran: prepared again and run.
    conn.autocommit = True
    _deallocate_unseen(conn)
    assert db.execute(one, {"x": 4}).one().y == 5
    assert len(_ours(conn)) == 1


def test_autocommit_inside_an_explicit_transaction_loses_nothing(
        conn: psycopg.Connection[Any]) -> None:
    """An autocommit connection inside `conn.transaction()`: ours is not the first
    statement there, so a prepared statement gone is not run again inside the
    transaction (it would fail there); the caller's rows stay."""
    from outbox import enqueue

    conn.autocommit = True
    enqueue(conn, "direct.test", {"n": 0})  # prepared
    with conn.transaction():
        conn.execute("INSERT INTO test_orders (key, amount) VALUES ('ac', 1)")
        _deallocate_unseen(conn)
        with pytest.raises(psycopg.errors.InvalidSqlStatementName):
            enqueue(conn, "direct.test", {"n": 1})
        raise psycopg.Rollback()
    with conn.transaction():
        conn.execute("INSERT INTO test_orders (key, amount) VALUES ('ac', 1)")
        enqueue(conn, "direct.test", {"n": 1})
    assert conn.execute("SELECT count(*) FROM test_orders WHERE key = 'ac'"
                        ).fetchone() == (1,)
    assert conn.execute("SELECT count(*) FROM outbox.effects").fetchone() == (2,)


def test_json_loaders_keep_no_connection_alive(db_url: str) -> None:
    import gc
    import weakref

    dsn = make_url(db_url).set(drivername="postgresql").render_as_string(
        hide_password=False)
    refs = []
    for _ in range(3):
        with psycopg.connect(dsn) as c:
            SyncDB(c, own_json=True).execute(sql("SELECT CAST(:j AS jsonb) AS j"),
                                             {"j": "{}"})
            refs.append(weakref.ref(c))
    del c
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_psycopgs_own_deallocate_after_a_savepoint_rollback_costs_no_request(
        conn: psycopg.Connection[Any]) -> None:
    """psycopg sends DEALLOCATE ALL when a ROLLBACK (TO SAVEPOINT, as SQLAlchemy's and
    Django's nested transactions send it) first passes through its cursor while it
    holds prepared statements of its own. The guard's requests must not notice."""
    from outbox import IdempotencyGuard, StoredResponse, enqueue

    guard = IdempotencyGuard()

    def work(c: Any, claim: Any) -> StoredResponse:
        enqueue(c, "direct.test", {"n": 1}, claim=claim)
        psycopg_deallocates_all(c)  # between our statements of one transaction
        return StoredResponse(201, (), b"{}")

    def psycopg_deallocates_all(c: Any) -> None:
        for _ in range(6):  # psycopg prepares a statement of its own after 5 runs
            c.execute("SELECT 1 + 1")
        savepoint = f"s_{uuid.uuid4().hex}"  # a text psycopg has not seen yet
        c.execute(f"SAVEPOINT {savepoint}")
        c.execute(f"ROLLBACK TO SAVEPOINT {savepoint}")
        c.execute("SELECT 3")  # psycopg's DEALLOCATE ALL goes before this one
        assert _ours(c) == []

    for n in range(3):
        assert not guard.run(conn, "direct", f"k{n}", "fp", work).replayed
        assert not guard.run(conn, "direct", f"j{n}", "fp", work).replayed
    count = conn.execute("SELECT count(*) FROM outbox.effects WHERE kind = 'direct.test'")
    assert count.fetchone() == (6,)
    conn.rollback()


def test_prepare_threshold_none_prepares_nothing(conn: psycopg.Connection[Any]) -> None:
    conn.prepare_threshold = None  # what a transaction pooler (PgBouncer) needs
    db = SyncDB(conn)
    for x in range(3):
        assert db.execute(sql("SELECT CAST(:x AS int) AS x"), {"x": x}).one().x == x
    assert _ours(conn) == []
    conn.rollback()


def test_client_side_binding_prepares_nothing(db_url: str) -> None:
    """Django's default cursors bind client-side, so its users behind PgBouncer never
    needed `prepare_threshold=None`: ours must not start preparing on them."""
    dsn = make_url(db_url).set(drivername="postgresql").render_as_string(
        hide_password=False)
    with psycopg.connect(dsn, cursor_factory=psycopg.ClientCursor) as c:
        db = SyncDB(c, own_json=True)
        for x in range(3):
            assert db.execute(sql("SELECT CAST(:x AS int) AS x"), {"x": x}).one().x == x
        assert _ours(c) == []
        c.rollback()


def test_an_error_in_the_first_statement_leaves_the_connection_usable(
        conn: psycopg.Connection[Any]) -> None:
    db = SyncDB(conn)
    with pytest.raises(psycopg.errors.DivisionByZero):
        db.execute(sql("SELECT 1 / CAST(:z AS int) AS x"), {"z": 0})
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
    assert conn.pgconn.pipeline_status == psycopg.pq.PipelineStatus.OFF
    conn.rollback()
    with pytest.raises(psycopg.errors.UndefinedTable):  # the prepare itself fails
        db.execute(sql("SELECT x FROM no_such_table WHERE x = :x"), {"x": 1})
    conn.rollback()
    assert db.execute(sql("SELECT 1 / CAST(:z AS int) AS x"), {"z": 1}).one().x == 1
    assert not conn.closed


def test_sqlalchemy_callers_still_get_dbapi_errors(engine: Engine) -> None:
    with engine.connect() as conn, pytest.raises(DBAPIError) as caught:
        sync_db(conn).execute(sql("SELECT 1 / CAST(:z AS int) AS x"), {"z": 0})
    assert isinstance(caught.value.orig, psycopg.errors.DivisionByZero)


def test_json_loaded_by_us_where_the_owner_loads_it_as_text(
        conn: psycopg.Connection[Any]) -> None:
    # Django registers text loaders for json/jsonb on its connections.
    from psycopg.types.string import TextLoader

    conn.adapters.register_loader("jsonb", TextLoader)
    assert SyncDB(conn).execute(sql("SELECT CAST(:j AS jsonb) AS j"),
                                {"j": '{"a": 1}'}).one().j == '{"a": 1}'
    assert SyncDB(conn, own_json=True).execute(sql("SELECT CAST(:j AS jsonb) AS j"),
                                               {"j": '{"a": 1}'}).one().j == {"a": 1}
    conn.rollback()


def test_the_dollar_form_numbers_each_name_once() -> None:
    st = sql("SELECT :a, :b, :a, x::text, '%' FROM t WHERE y = :b")
    assert st.dollar == b"SELECT $1, $2, $1, x::text, '%' FROM t WHERE y = $2"
    assert st.names == ("a", "b")
    assert st.sql == "SELECT %(a)s, %(b)s, %(a)s, x::text, '%%' FROM t WHERE y = %(b)s"


def test_async_the_same_rows_one_round_trip_and_a_deallocated_statement(
        db_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from outbox._driver import AsyncDB

    dsn = make_url(db_url).set(drivername="postgresql").render_as_string(
        hide_password=False)
    params = _params()

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            db = AsyncDB(conn)
            direct = await db.execute(NAMED, params)
            await conn.rollback()
            monkeypatch.setattr(_driver, "DIRECT", False)
            assert (await db.execute(NAMED, params)).rows == direct.rows
            await conn.rollback()
            monkeypatch.setattr(_driver, "DIRECT", True)
            with counting_round_trips(conn.pgconn, tmp_path) as counted:
                await db.execute(NAMED, params)
            assert counted == [1]
            await conn.commit()
            assert conn.pgconn.exec_(b"DEALLOCATE ALL").status == \
                psycopg.pq.ExecStatus.COMMAND_OK  # unseen by psycopg
            assert (await db.execute(NAMED, params)).rows == direct.rows
            await conn.rollback()

    asyncio.run(scenario())


def test_the_retry_after_an_unseen_deallocate_leaves_psycopgs_cache_true(
        conn: psycopg.Connection[Any]) -> None:
    """The retry clears psycopg's cache, which queues a DEALLOCATE ALL psycopg sends at
    its next statement: it must go before ours prepare again, not after (it would drop
    them, and a statement inside the caller's transaction would then fail)."""
    db = SyncDB(conn)
    one = sql("SELECT CAST(:x AS int) + 1 AS y")
    two = sql("SELECT CAST(:x AS int) + 2 AS y")
    assert db.execute(one, {"x": 1}).one().y == 2
    conn.commit()
    _deallocate_unseen(conn)
    assert db.execute(one, {"x": 1}).one().y == 2  # 26000, cleared, prepared again
    conn.commit()
    for _ in range(2):  # psycopg's own statements, and ours inside a transaction
        conn.execute("SELECT 1")
        assert db.execute(two, {"x": 1}).one().y == 3
        assert db.execute(one, {"x": 1}).one().y == 2
        conn.commit()
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_prepared_statements")
        on_server = cur.fetchone()
    assert on_server is not None and on_server[0] == len(conn._prepared._names)


def test_a_prepare_that_failed_is_not_taken_for_prepared(
        conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """psycopg counts a query's runs before it prepares it: our PREPARE of a query its
    cursor ran, failing, must not leave the name in its cache."""
    conn.autocommit = True
    conn.execute("CREATE TABLE t_gone (x int)")
    db = SyncDB(conn)
    read = sql("SELECT x FROM t_gone WHERE x = :x")
    monkeypatch.setattr(_driver, "DIRECT", False)
    db.execute(read, {"x": 1})  # counted by psycopg, not prepared
    monkeypatch.setattr(_driver, "DIRECT", True)
    conn.execute("DROP TABLE t_gone")
    with pytest.raises(psycopg.errors.UndefinedTable):
        db.execute(read, {"x": 1})
    conn.execute("CREATE TABLE t_gone (x int)")
    try:
        with conn.transaction():
            assert db.execute(read, {"x": 1}).rows == []
    finally:
        conn.execute("DROP TABLE t_gone")


def test_a_session_the_server_ends_raises_its_reason(
        conn: psycopg.Connection[Any]) -> None:
    """A FATAL in the middle of a pipelined exchange is the error raised (psycopg's own
    cursor raises it too), and the connection is closed, not left half-way."""
    conn.execute("SET idle_in_transaction_session_timeout = '100ms'")
    conn.execute("SELECT 1")  # in a transaction, idle
    import time

    time.sleep(0.5)  # the server ends the session, with a FATAL on the socket
    with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):
        SyncDB(conn).execute(sql("SELECT CAST(:x AS int) AS fresh_statement"), {"x": 1})
    assert conn.closed and getattr(conn.pgconn, "pgconn_ptr", None) is None  # freed


def test_async_flush_and_a_session_the_server_ends(db_url: str) -> None:
    """The async path sends psycopg's queued DEALLOCATE ALL first too, and raises the
    reason a server gave for ending the session, the connection finished."""
    from outbox._driver import AsyncDB

    dsn = make_url(db_url).set(drivername="postgresql").render_as_string(
        hide_password=False)
    one = sql("SELECT CAST(:x AS int) + 1 AS y")
    two = sql("SELECT CAST(:x AS int) + 2 AS y")

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            db = AsyncDB(conn)
            assert (await db.execute(one, {"x": 1})).one().y == 2
            await conn.commit()
            _deallocate_unseen(conn)  # type: ignore[arg-type]
            assert (await db.execute(one, {"x": 1})).one().y == 2  # 26000, again
            await conn.commit()
            for _ in range(2):
                await conn.execute("SELECT 1")
                assert (await db.execute(two, {"x": 1})).one().y == 3
                assert (await db.execute(one, {"x": 1})).one().y == 2
                await conn.commit()
            await conn.execute("SET idle_in_transaction_session_timeout = '100ms'")
            await conn.execute("SELECT 1")
            await asyncio.sleep(0.5)
            with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):
                await db.execute(sql("SELECT CAST(:x AS int) AS fresh_async"), {"x": 1})
            assert conn.closed and getattr(conn.pgconn, "pgconn_ptr", None) is None

    asyncio.run(scenario())


@pytest.mark.parametrize("close_message", [True, False], ids=["libpq17", "older_libpq"])
def test_evicted_names_are_sent_outside_transactions_only(
        conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch,
        close_message: bool) -> None:
    """psycopg's LRU evictions on a connection that runs only ours (a worker's) are
    sent, so the server's statements stay at `prepared_max`; a DEALLOCATE of a name
    already gone (as libpq < 17 sends it: SQL, an error where the Close message is
    none) costs nothing outside a transaction."""
    import psycopg._connection_base as base

    monkeypatch.setattr(base, "_HAS_SEND_CLOSE",
                        close_message and base._HAS_SEND_CLOSE)
    conn.prepared_max = 2
    conn.autocommit = True
    db = SyncDB(conn)
    for n in range(8):
        assert db.execute(sql(f"SELECT CAST(:x AS int) + {n} AS y"), {"x": 1}).one().y \
            == 1 + n
    assert len(_ours(conn)) <= 3  # at most one eviction queued, not yet sent
    _deallocate_unseen(conn)  # what psycopg believes prepared is gone, queued names too
    for n in range(8, 12):
        assert db.execute(sql(f"SELECT CAST(:x AS int) + {n} AS y"), {"x": 1}).one().y \
            == 1 + n
    assert len(_ours(conn)) <= 3
