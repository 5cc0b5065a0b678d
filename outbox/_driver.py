"""The driver seam: one set of SQL, run on whatever connection holds the caller's transaction.

River's shape (riverpgxv5, riverdatabasesql): statements are plain SQL; a small driver
runs them on the DBAPI connection *underneath* the caller's handle, so our rows commit
or roll back with the caller's transaction and we never commit for it.

Handles (`sync_db` / `async_db` find the psycopg connection inside):

=====================================  ==========================================
psycopg 3 ``Connection``               itself
psycopg 3 ``AsyncConnection``          itself (async)
SQLAlchemy ``Connection``              ``conn.connection.driver_connection``
SQLAlchemy ``Session``/``scoped_session``  ``session.connection()`` then as above
SQLAlchemy ``AsyncConnection``         ``await conn.get_raw_connection()`` (async)
SQLAlchemy ``AsyncSession``/``async_scoped_session``  ``await session.connection()``
Django ``connection`` (psycopg 3)      ``connection.connection`` after ``ensure_connection()``
=====================================  ==========================================

Going under SQLAlchemy skips its statement compilation and Row building (most of an
enqueue's client CPU). Two things SQLAlchemy would have done are kept: a transaction is
begun on its handle first (so `conn.commit()` commits our rows), and a psycopg error is
re-raised as SQLAlchemy's `DBAPIError` subclass, so SQLAlchemy callers catch what they
always caught (and a broken connection is invalidated for the pool).

Statements are written with `:name` parameters (as before) and converted once, at
import, to psycopg's `%(name)s` style and to libpq's `$n` style.

A statement that opens a transaction, or runs in autocommit, runs *under* psycopg's
cursor (`_direct`): its parameters dumped and its rows loaded by psycopg's own
`Transformer` (the connection's adapters), sent with libpq's calls and waited for
through `Connection.wait` (so a `BoundedConnection`'s call timeout bounds it), as our
own server-side prepared statement, prepared in the same round trip as its first run,
and with the transaction's BEGIN (as psycopg would send it) in that round trip too
(libpq pipeline mode). A psycopg cursor costs ~40 µs of client CPU per statement more,
and the BEGIN a round trip of its own (issue 11).

Why only there: psycopg sends DEALLOCATE ALL when it sees a ROLLBACK (a savepoint's
too), DROP or ALTER go through a cursor, and our prepared statements go with its own.
Where our statement opens the transaction or runs alone, "prepared statement does not
exist" has cost nothing: it is prepared again and run at once. Inside a transaction
the caller's work would be lost with it, so a statement there goes through a psycopg
cursor, prepared by psycopg's own cache. Anything unusual (a closed connection, a
psycopg pipeline open) takes the cursor too; `prepare_threshold=None` (a transaction
pooler) runs ours unnamed.
"""

from __future__ import annotations

import functools
import os
import re
import weakref
from collections import namedtuple
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import psycopg
from psycopg import generators
from psycopg.abc import PQGen
from psycopg.adapt import AdaptersMap, PyFormat, Transformer
from psycopg.rows import namedtuple_row, tuple_row
from psycopg.types.json import JsonbLoader, JsonLoader

T = TypeVar("T")

_PARAM = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


@dataclass(frozen=True, slots=True)
class Statement:
    """One SQL statement in psycopg's parameter style.

    `tuples`: its rows come back as plain tuples, read by position (the dispatcher's hot
    statements): psycopg builds them in C, where a named tuple costs a row maker and a
    description per execute and a Python call per row.
    """

    sql: str
    tuples: bool = False
    #: The same statement in libpq's style (`$1`, ...), and the parameter behind each `$n`.
    dollar: bytes = b""
    names: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.sql


def sql(text: str, *, tuples: bool = False) -> Statement:
    """`:name` parameters -> `%(name)s`; literal `%` doubled; `::type` casts kept."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"
    dollar = _PARAM.sub(number, text)
    return Statement(_PARAM.sub(r"%(\1)s", text.replace("%", "%%")), tuples,
                     dollar.encode(), tuple(names))


class Result:
    """Rows (named tuples: `row.column`) and the rowcount of one execution."""

    __slots__ = ("rowcount", "rows")

    def __init__(self, rows: list[Any], rowcount: int) -> None:
        self.rows = rows
        self.rowcount = rowcount

    def __iter__(self) -> Iterator[Any]:
        return iter(self.rows)

    def first(self) -> Any | None:
        return self.rows[0] if self.rows else None

    def one(self) -> Any:
        if len(self.rows) != 1:
            raise LookupError(f"expected one row, got {len(self.rows)}")
        return self.rows[0]

    def scalar(self) -> Any:
        return self.rows[0][0] if self.rows else None


@dataclass(frozen=True, slots=True)
class Query(Generic[T]):
    """A statement, its parameters and how to read its result: runnable sync or async."""

    statement: Statement
    params: Mapping[str, Any]
    parse: Callable[[Result], T]
    #: Commit the transaction right after the statement, in its round trip where the
    #: connection allows (keys.then_commit): for a transaction we began ourselves.
    commit: bool = False

    def run(self, handle: Any) -> T:
        return self.parse(sync_db(handle).execute(self.statement, self.params,
                                                  commit=self.commit))

    async def arun(self, handle: Any) -> T:
        db = await async_db(handle)
        return self.parse(await db.execute(self.statement, self.params, commit=self.commit))


_TUPLES_OK = psycopg.pq.ExecStatus.TUPLES_OK


def _has_rows(cur: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any]) -> bool:
    result = cur.pgresult
    return result is not None and result.status == _TUPLES_OK


# -- under the cursor ------------------------------------------------------------------

_COMMAND_OK = psycopg.pq.ExecStatus.COMMAND_OK
_FATAL_ERROR = psycopg.pq.ExecStatus.FATAL_ERROR
_PIPELINE_SYNC = psycopg.pq.ExecStatus.PIPELINE_SYNC
_IDLE = psycopg.pq.TransactionStatus.IDLE
_INTRANS = psycopg.pq.TransactionStatus.INTRANS
_PIPELINE_OFF = psycopg.pq.PipelineStatus.OFF
_NO_STATEMENT = "26000"  # invalid_sql_statement_name: our prepared statement is gone

#: Server-side prepared statements of ours per psycopg connection: {(sql, parameter
#: types): name}, and the next name's number (never reused: a statement deallocated
#: behind our back must not collide with a new one of the same name).
_prepared: weakref.WeakKeyDictionary[Any, tuple[dict[tuple[bytes, tuple[int, ...]], bytes],
                                                list[int]]] = weakref.WeakKeyDictionary()
#: Past this many per connection, new statements run unnamed (parsed each time).
PREPARED_MAX = 200
#: False (OUTBOX_PSYCOPG_CURSOR=1): every statement through a psycopg cursor, as before
#: issue 11's change (the benchmarks' A/B; a way out should a psycopg release change
#: what this relies on).
DIRECT = os.environ.get("OUTBOX_PSYCOPG_CURSOR", "") not in ("1", "true", "yes")


def _statement_name(conn: Any, statement: Statement, types: Sequence[int]
                    ) -> tuple[bytes | None, bool]:
    """Our prepared statement's name for `statement` on `conn`, and whether it must be
    prepared first; (None, False): run it unnamed (`prepare_threshold=None`: a
    transaction pooler that does not keep prepared statements)."""
    if conn.prepare_threshold is None:
        return None, False
    try:
        names, counter = _prepared[conn]
    except KeyError:
        names, counter = _prepared.setdefault(conn, ({}, [0]))
    key = (statement.dollar, tuple(types))
    name = names.get(key)
    if name is not None:
        return name, False
    if len(names) >= PREPARED_MAX:
        return None, False
    counter[0] += 1
    return f"_outbox_{counter[0]}".encode(), True


def _begin_command(conn: Any) -> bytes:
    """The BEGIN psycopg itself would send (`Connection._get_tx_start_command`)."""
    if conn.isolation_level is None and conn.read_only is None and conn.deferrable is None:
        return b"BEGIN"
    parts = [b"BEGIN"]
    if conn.isolation_level is not None:
        level = psycopg.IsolationLevel(conn.isolation_level).name.replace("_", " ")
        parts += [b"ISOLATION LEVEL", level.encode()]
    if conn.read_only is not None:
        parts.append(b"READ ONLY" if conn.read_only else b"READ WRITE")
    if conn.deferrable is not None:
        parts.append(b"DEFERRABLE" if conn.deferrable else b"NOT DEFERRABLE")
    return b" ".join(parts)


def _exchange(pgconn: Any, begin: bytes | None, name: bytes | None, prepare: bool,
              statement: Statement, values: Sequence[Any], tx: Any, commit: bool
              ) -> PQGen[list[Any]]:
    """Send (BEGIN,) (PREPARE,) the statement (, COMMIT), in one round trip; the result
    of each command, in order.

    More than one command goes in libpq's pipeline mode: the server runs them in order
    and stops at the first error (the rest come back PIPELINE_ABORTED).
    """
    types, formats = tx.types, tx.formats
    if begin is None and not prepare and not commit:
        if name is None:
            pgconn.send_query_params(statement.dollar, values, types, formats)
        else:
            pgconn.send_query_prepared(name, values, formats)
        sent: list[Any] = yield from generators.execute(pgconn)
        return sent
    pgconn.enter_pipeline_mode()
    if begin is not None:
        pgconn.send_query_params(begin, None)
    if prepare:
        assert name is not None
        pgconn.send_prepare(name, statement.dollar, types)
    if name is None:
        pgconn.send_query_params(statement.dollar, values, types, formats)
    else:
        pgconn.send_query_prepared(name, values, formats)
    if commit:
        pgconn.send_query_params(b"COMMIT", None)
    pgconn.pipeline_sync()
    yield from generators.send(pgconn)
    results: list[Any] = []
    while True:
        got = yield from generators.fetch_many(pgconn)
        if got and got[0].status == _PIPELINE_SYNC:
            break
        results.extend(got)
    pgconn.exit_pipeline_mode()
    return results


@functools.lru_cache(512)
def _row_class(encoding: str, *names: bytes) -> Any:
    """psycopg's namedtuple_row class for these column names (same mangling)."""
    fields = []
    for raw in names:
        field = raw.decode(encoding)
        if not field.isidentifier():
            if field[0] in "1234567890":
                field = "f" + field
            if not field.isidentifier():
                field = re.sub(r"[^A-Za-z0-9_]", "_", field)
        if field[0] == "_":
            field = "f" + field
        fields.append(field)
    try:
        return namedtuple("Row", fields)
    except ValueError as exc:
        raise psycopg.DataError(f"can't create a namedtuple row: {exc}") from None


def _result(conn: Any, statement: Statement, results: list[Any], tx: Any, at: int
             ) -> Result:
    """The rows of our statement's result (`results[at]`), or the first error raised
    (BEGIN's, the PREPARE's, the statement's or the COMMIT's)."""
    for res in results:
        if res.status == _FATAL_ERROR:
            raise psycopg.errors.error_from_result(res, encoding=conn.info.encoding)
    res = results[at]
    if res.status != _TUPLES_OK:
        nrows = res.command_tuples
        return Result([], nrows if nrows is not None else -1)
    count = res.ntuples
    if not count:
        return Result([], 0)
    tx.set_pgresult(res)
    if statement.tuples:
        return Result(tx.load_rows(0, count, tuple), count)
    row = _row_class(conn.info.encoding, *(res.fname(i) for i in range(res.nfields)))
    return Result(tx.load_rows(0, count, row._make), count)


class _JsonContext:
    """The connection's adapters, but json/jsonb loaded as JSON (see SyncDB.own_json)."""

    __slots__ = ("adapters", "connection")

    def __init__(self, conn: Any) -> None:
        self.connection = conn
        self.adapters = AdaptersMap(conn.adapters)
        self.adapters.register_loader("json", JsonLoader)
        self.adapters.register_loader("jsonb", JsonbLoader)


_json_contexts: weakref.WeakKeyDictionary[Any, _JsonContext] = weakref.WeakKeyDictionary()


def _context(conn: Any, own_json: bool) -> Any:
    if not own_json:
        return conn
    try:
        return _json_contexts[conn]
    except KeyError:
        return _json_contexts.setdefault(conn, _JsonContext(conn))


def _prepare_for(conn: Any, statement: Statement, params: Mapping[str, Any] | None,
                 own_json: bool, commit: bool) -> tuple[Any, Sequence[Any]] | None:
    """The transformer and dumped values for a direct run; None: use a cursor (inside
    a transaction, or anything unusual: see the module's doc). A statement that
    commits (`commit`) may end a transaction: its caller retries the whole transaction
    if our prepared statement is gone."""
    if not DIRECT or not statement.dollar or conn.closed:
        return None
    pgconn = conn.pgconn
    if pgconn.pipeline_status != _PIPELINE_OFF:
        return None
    status = pgconn.transaction_status
    if status != _IDLE and not conn.autocommit and not (commit and status == _INTRANS):
        return None
    params = params or {}
    tx = Transformer(_context(conn, own_json))
    values = [params[name] for name in statement.names]
    return tx, tx.dump_sequence(values, [PyFormat.AUTO] * len(values))


def _forget(conn: Any, name: bytes | None, exc: BaseException) -> bool:
    """After an error: drop what we knew of prepared statements if the server lost ours
    (DEALLOCATE/DISCARD ALL behind our back). True: it was that."""
    if name is None or getattr(exc, "sqlstate", None) != _NO_STATEMENT:
        return False
    _prepared.pop(conn, None)
    return True


def _run_sync(conn: Any, statement: Statement, tx: Any, values: Sequence[Any],
              commit: bool) -> Result:
    """Our statement on a psycopg Connection, under its cursor (see the module's doc)."""
    for attempt in range(2):
        with conn.lock:
            pgconn = conn.pgconn
            begin = None if conn.autocommit or pgconn.transaction_status != _IDLE \
                else _begin_command(conn)
            name, prepare = _statement_name(conn, statement, tx.types)
            try:
                results = conn.wait(_exchange(pgconn, begin, name, prepare, statement,
                                              values, tx, commit))
            except BaseException:
                _abandon(conn)
                raise
            at = (begin is not None) + prepare
            if prepare:
                _prepared_now(conn, statement, tx, name, results[at - 1])
        try:
            return _result(conn, statement, results, tx, at)
        except psycopg.Error as exc:
            # Nothing ran, and nothing of the caller's was lost: prepare it, run it.
            if not attempt and _forget(conn, name, exc) and (
                    begin is not None or conn.autocommit):
                if begin is not None:
                    conn.rollback()  # the transaction we began holds nothing else
                continue
            raise
    raise AssertionError("unreachable")  # pragma: no cover


async def _run_async(conn: Any, statement: Statement, tx: Any, values: Sequence[Any],
                     commit: bool) -> Result:
    """`_run_sync` on a psycopg AsyncConnection."""
    for attempt in range(2):
        async with conn.lock:
            pgconn = conn.pgconn
            begin = None if conn.autocommit or pgconn.transaction_status != _IDLE \
                else _begin_command(conn)
            name, prepare = _statement_name(conn, statement, tx.types)
            try:
                results = await conn.wait(_exchange(pgconn, begin, name, prepare,
                                                    statement, values, tx, commit))
            except BaseException:
                if not conn.closed and pgconn.pipeline_status != _PIPELINE_OFF:
                    await conn.close()
                raise
            at = (begin is not None) + prepare
            if prepare:
                _prepared_now(conn, statement, tx, name, results[at - 1])
        try:
            return _result(conn, statement, results, tx, at)
        except psycopg.Error as exc:
            if not attempt and _forget(conn, name, exc) and (
                    begin is not None or conn.autocommit):
                if begin is not None:
                    await conn.rollback()
                continue
            raise
    raise AssertionError("unreachable")  # pragma: no cover


def _prepared_now(conn: Any, statement: Statement, tx: Any, name: bytes | None,
                  prepared: Any) -> None:
    """Remember a statement the server prepared (it stays prepared whatever became of
    the transaction: prepared statements are not transactional)."""
    if name is not None and prepared.status == _COMMAND_OK:
        _prepared[conn][0][(statement.dollar, tuple(tx.types))] = name


def _abandon(conn: Any) -> None:
    """An exchange cut off mid-way (a timeout, an interrupt, a lost server) leaves the
    protocol in an unknown state: a pipeline still open cannot be reused."""
    if not conn.closed and conn.pgconn.pipeline_status != _PIPELINE_OFF:
        conn.close()


# -- sync ------------------------------------------------------------------------------


class SyncDB:
    """Runs statements on one psycopg connection, in whatever transaction it is in.

    `own_json`: the connection's owner registered its own json/jsonb loaders (Django
    loads them as text and decodes in its fields): our cursors load JSON themselves.
    """

    __slots__ = ("conn", "own_json", "wrap")

    def __init__(self, conn: psycopg.Connection[Any], wrap: Callable[[Exception], Exception]
                 | None = None, *, own_json: bool = False) -> None:
        self.conn = conn
        self.wrap = wrap
        self.own_json = own_json

    def execute(self, statement: Statement, params: Mapping[str, Any] | None = None, *,
                commit: bool = False) -> Result:
        try:
            direct = _prepare_for(self.conn, statement, params, self.own_json, commit)
            if direct is not None:
                return _run_sync(self.conn, statement, *direct, commit)
            if commit:
                done = self.execute(statement, params)
                self.conn.commit()
                return done
            with self.conn.cursor(row_factory=tuple_row if statement.tuples
                                  else namedtuple_row) as cur:
                if self.own_json:
                    cur.adapters.register_loader("json", JsonLoader)
                    cur.adapters.register_loader("jsonb", JsonbLoader)
                cur.execute(statement.sql, params)
                # Whether rows came back, without `cur.description` (a Column object per
                # column, built in Python on every execute).
                rows = cur.fetchall() if _has_rows(cur) else []
                return Result(rows, cur.rowcount)
        except psycopg.Error as exc:
            if self.wrap is None:
                raise
            raise self.wrap(exc) from exc


def _sqlalchemy_sync(conn: Any) -> SyncDB:
    """A SQLAlchemy Connection: begin its transaction, then run on the DBAPI connection."""
    if not conn.in_transaction():
        conn.begin()  # "commit as you go": conn.commit() must commit our rows too
    raw = conn.connection.driver_connection
    if not isinstance(raw, psycopg.Connection):
        raise TypeError("outbox needs the psycopg 3 driver (postgresql+psycopg://)")
    return SyncDB(raw, _sqlalchemy_error(conn))


def dbapi_error(exc: Exception, *, invalidated: bool) -> Exception:
    """A psycopg error as SQLAlchemy's DBAPIError subclass, as SQLAlchemy callers catch
    it (`connection_invalidated`: the error broke the connection)."""
    from sqlalchemy.exc import DBAPIError

    return DBAPIError.instance(None, None, exc, psycopg.Error,
                               connection_invalidated=invalidated)


def _sqlalchemy_error(conn: Any) -> Callable[[Exception], Exception]:
    def wrap(exc: Exception) -> Exception:
        raw = conn.connection.driver_connection
        disconnect = bool(raw.closed or raw.broken)
        if disconnect:
            conn.invalidate(exc)
        return dbapi_error(exc, invalidated=disconnect)
    return wrap


def sync_db(handle: Any) -> SyncDB:
    """The psycopg connection under `handle`, ready to run statements."""
    if isinstance(handle, SyncDB):
        return handle
    if isinstance(handle, psycopg.Connection):
        return SyncDB(handle)
    module = type(handle).__module__
    if module.startswith("sqlalchemy"):
        from sqlalchemy import Connection
        from sqlalchemy.orm import Session, scoped_session

        if isinstance(handle, Connection):
            return _sqlalchemy_sync(handle)
        if isinstance(handle, scoped_session):
            handle = handle()
        if isinstance(handle, Session):
            return _sqlalchemy_sync(handle.connection())
    if module.startswith("django.") and getattr(handle, "vendor", None) == "postgresql":
        handle.ensure_connection()
        raw = handle.connection
        if not isinstance(raw, psycopg.Connection):
            raise TypeError("outbox needs Django's psycopg 3 backend")
        django_conn = handle

        def to_django(exc: Exception) -> Exception:
            # Django's own error classes, and its "errors occurred" flag set, so a broken
            # persistent connection (CONN_MAX_AGE) is closed rather than reused.
            try:
                with django_conn.wrap_database_errors:
                    raise exc
            except Exception as mapped:  # the mapped Django error
                return mapped
            return exc  # pragma: no cover
        return SyncDB(raw, to_django, own_json=True)
    if isinstance(handle, psycopg.AsyncConnection) or module.startswith(
            "sqlalchemy.ext.asyncio"):
        raise TypeError(f"{type(handle).__name__} is async: use the a-prefixed function "
                        "(aenqueue, guard.arun, ...) and await it")
    raise TypeError(f"cannot run outbox statements on a {type(handle).__name__}: pass a "
                    "psycopg 3 connection, a SQLAlchemy Connection or Session, or "
                    "Django's connection")


# -- async -----------------------------------------------------------------------------


class AsyncDB:
    """Runs statements on one psycopg AsyncConnection, in its current transaction."""

    __slots__ = ("conn", "wrap")

    def __init__(self, conn: psycopg.AsyncConnection[Any],
                 wrap: Callable[[Exception], Exception] | None = None) -> None:
        self.conn = conn
        self.wrap = wrap

    async def execute(self, statement: Statement, params: Mapping[str, Any] | None = None,
                      *, commit: bool = False) -> Result:
        try:
            direct = _prepare_for(self.conn, statement, params, False, commit)
            if direct is not None:
                return await _run_async(self.conn, statement, *direct, commit)
            if commit:
                done = await self.execute(statement, params)
                await self.conn.commit()
                return done
            async with self.conn.cursor(row_factory=tuple_row if statement.tuples
                                        else namedtuple_row) as cur:
                await cur.execute(statement.sql, params)
                rows = await cur.fetchall() if _has_rows(cur) else []
                return Result(rows, cur.rowcount)
        except psycopg.Error as exc:
            if self.wrap is None:
                raise
            raise self.wrap(exc) from exc


async def async_db(handle: Any) -> AsyncDB:
    """The psycopg AsyncConnection under `handle` (SQLAlchemy async handles included)."""
    if isinstance(handle, AsyncDB):
        return handle
    if isinstance(handle, psycopg.AsyncConnection):
        return AsyncDB(handle)
    if type(handle).__module__.startswith("sqlalchemy"):
        from sqlalchemy.exc import DBAPIError
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_scoped_session

        if isinstance(handle, async_scoped_session):
            handle = handle()
        if isinstance(handle, AsyncSession):
            handle = await handle.connection()
        if isinstance(handle, AsyncConnection):
            if not handle.in_transaction():
                await handle.begin()
            raw = (await handle.get_raw_connection()).driver_connection
            if not isinstance(raw, psycopg.AsyncConnection):
                raise TypeError("outbox needs the psycopg 3 driver (postgresql+psycopg://)")

            sa_conn = handle

            def wrap(exc: Exception) -> Exception:
                # Invalidated like the sync path: the pool must not reuse a broken one.
                # (`invalidate` is a coroutine here; the connection is marked at close.)
                broken = bool(raw.closed or raw.broken)
                if broken:
                    sa_conn.sync_connection.invalidate(exc)  # type: ignore[union-attr]
                return DBAPIError.instance(None, None, exc, psycopg.Error,
                                           connection_invalidated=broken)
            return AsyncDB(raw, wrap)
    raise TypeError(f"cannot run outbox statements on a {type(handle).__name__} from async "
                    "code: pass a psycopg AsyncConnection, or a SQLAlchemy AsyncConnection "
                    "or AsyncSession")


# -- running a protocol written once for both ---------------------------------------------

Flow = Any  # Generator[Query[Any], Any, T]: yields queries, receives their results


def drive(handle: Any, flow: Flow) -> Any:
    """Run a sans-IO flow (a generator of Query) synchronously on `handle`."""
    db = sync_db(handle)
    try:
        query = next(flow)
        while True:
            try:
                result = query.parse(db.execute(query.statement, query.params,
                                                commit=query.commit))
            except BaseException as exc:
                query = flow.throw(exc)
                continue
            query = flow.send(result)
    except StopIteration as done:
        return done.value


async def adrive(handle: Any, flow: Flow) -> Any:
    """Run the same flow on an async handle."""
    db = await async_db(handle)
    try:
        query = next(flow)
        while True:
            try:
                result = query.parse(await db.execute(query.statement, query.params,
                                                      commit=query.commit))
            except BaseException as exc:
                query = flow.throw(exc)
                continue
            query = flow.send(result)
    except StopIteration as done:
        return done.value


def rows(result: Result) -> list[Any]:
    return result.rows


def rowcount(result: Result) -> int:
    return result.rowcount


def first(result: Result) -> Any | None:
    return result.first()


def scalar(result: Result) -> Any:
    return result.scalar()


def nothing(result: Result) -> None:
    return None

