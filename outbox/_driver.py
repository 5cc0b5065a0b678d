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
import, to psycopg's `%(name)s` style.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import psycopg
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

    def __str__(self) -> str:
        return self.sql


def sql(text: str, *, tuples: bool = False) -> Statement:
    """`:name` parameters -> `%(name)s`; literal `%` doubled; `::type` casts kept."""
    return Statement(_PARAM.sub(r"%(\1)s", text.replace("%", "%%")), tuples)


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

    def run(self, handle: Any) -> T:
        return self.parse(sync_db(handle).execute(self.statement, self.params))

    async def arun(self, handle: Any) -> T:
        db = await async_db(handle)
        return self.parse(await db.execute(self.statement, self.params))


_TUPLES_OK = psycopg.pq.ExecStatus.TUPLES_OK


def _has_rows(cur: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any]) -> bool:
    result = cur.pgresult
    return result is not None and result.status == _TUPLES_OK


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

    def execute(self, statement: Statement, params: Mapping[str, Any] | None = None) -> Result:
        try:
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

    async def execute(self, statement: Statement, params: Mapping[str, Any] | None = None
                      ) -> Result:
        try:
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
                result = query.parse(db.execute(query.statement, query.params))
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
                result = query.parse(await db.execute(query.statement, query.params))
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

