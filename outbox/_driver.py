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

Our statements run *under* psycopg's cursor: their parameters dumped and their rows
loaded by psycopg's own `Transformer` (the connection's adapters), prepared through
psycopg's own prepared-statement cache (the connection's `_prepared`: the names, the
LRU and the DEALLOCATE ALL psycopg sends after a ROLLBACK stay psycopg's, so it never
holds a name the server dropped), sent with libpq's calls and waited for through
`Connection.wait` (a `BoundedConnection`'s call timeout bounds them). A statement that
opens the transaction carries its BEGIN (the one psycopg would send, isolation level
included) in the same round trip, and one sent with `commit=True` carries the COMMIT
(libpq pipeline mode). A psycopg cursor costs ~40 µs of client CPU per statement more,
and the BEGIN and COMMIT a round trip each (issue 11; docs/architecture.md, "Round
trips"). Anything unusual (a closed connection, a psycopg pipeline open, a transaction
in error, a libpq without pipeline mode) takes the cursor; `OUTBOX_PSYCOPG_CURSOR=1`
takes it always. A connection that prepares nothing of its own
(`prepare_threshold=None`, or client-side binding cursors: Django's default) runs
ours unnamed.
"""

from __future__ import annotations

import os
import re
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import psycopg
from psycopg import generators
from psycopg.abc import PQGen
from psycopg.adapt import AdaptersMap, PyFormat, Transformer
from psycopg.rows import namedtuple_row, tuple_row
from psycopg.types.json import JsonbLoader, JsonLoader

try:  # psycopg's insides we run on (see DIRECT): its prepared-statement cache, shared
    # with its cursors, and its named-tuple row classes
    from psycopg._preparing import Prepare as _Prepare
    from psycopg.rows import _make_nt

    _NO: Any = _Prepare.NO
    _SHOULD: Any = _Prepare.SHOULD
except ImportError:  # pragma: no cover - DIRECT is False then
    _NO = _SHOULD = object()
    _make_nt = None  # type: ignore[assignment]

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
_BAD = psycopg.pq.ConnStatus.BAD
_NO_STATEMENT = "26000"  # invalid_sql_statement_name: a prepared statement is gone


class _Key:
    """What psycopg's prepared-statement cache keys a query by (`PrepareManager.key`)."""

    __slots__ = ("query", "types")

    def __init__(self, query: bytes, types: Sequence[int]) -> None:
        self.query = query
        self.types = tuple(types)


def _psycopg_supports_it() -> bool:
    """libpq's pipeline mode, and psycopg's prepared-statement cache as we use it."""
    try:
        from psycopg._preparing import Prepare, PrepareManager

        manager = PrepareManager()
        return (psycopg.capabilities.has_pipeline() and hasattr(Prepare, "SHOULD")
                and callable(_make_nt)
                and hasattr(psycopg.Connection, "_get_tx_start_command")
                and all(hasattr(manager, n) for n in (
                    "get", "maybe_add_to_cache", "validate", "clear", "maintain_gen",
                    "_to_flush"))
                and manager.key(_Key(b"x", (25,))) == (b"x", (25,)))  # type: ignore[arg-type]
    except (ImportError, AttributeError, TypeError, psycopg.NotSupportedError):
        return False


#: False (OUTBOX_PSYCOPG_CURSOR=1, or a psycopg/libpq without what this needs): every
#: statement through a psycopg cursor, its BEGIN and COMMIT apart, as before issue 11's
#: change (the benchmarks' A/B; a way out should a psycopg release change its insides).
DIRECT = (os.environ.get("OUTBOX_PSYCOPG_CURSOR", "").strip().lower()
          not in ("1", "true", "yes", "on") and _psycopg_supports_it())


def _exchange(pgconn: Any, begin: bytes | None, name: bytes, prepare: bool,
              statement: Statement, values: Sequence[Any], tx: Any, commit: bool
              ) -> PQGen[list[Any]]:
    """Send (BEGIN,) (PREPARE,) the statement (, COMMIT), in one round trip; the result
    of each command, in order (name b"": the statement unnamed).

    More than one command goes in libpq's pipeline mode: the server runs them in order
    and skips the rest after an error (they come back PIPELINE_ABORTED).
    """
    types, formats = tx.types, tx.formats
    if begin is None and not prepare and not commit:
        if name:
            pgconn.send_query_prepared(name, values, formats)
        else:
            pgconn.send_query_params(statement.dollar, values, types, formats)
        sent: list[Any] = yield from generators.execute(pgconn)
        return sent
    pgconn.enter_pipeline_mode()
    if begin is not None:
        pgconn.send_query_params(begin, None)
    if prepare:
        pgconn.send_prepare(name, statement.dollar, types)
    if name:
        pgconn.send_query_prepared(name, values, formats)
    else:
        pgconn.send_query_params(statement.dollar, values, types, formats)
    if commit:
        pgconn.send_query_params(b"COMMIT", None)
    pgconn.pipeline_sync()
    yield from generators.send(pgconn)
    results: list[Any] = []
    while True:
        try:
            got = yield from generators.fetch_many(pgconn)
        except psycopg.OperationalError:
            # The server ended the session (pg_terminate_backend, a timeout): it said
            # why in a FATAL before it closed, and that is the error to raise, as
            # psycopg's own fetch does (the connection is closed now, BAD).
            if any(r.status == _FATAL_ERROR for r in results):
                return results
            raise
        if not got:
            raise psycopg.OperationalError("the server sent no result in pipeline mode")
        if got[0].status == _PIPELINE_SYNC:
            break
        results.extend(got)
    pgconn.exit_pipeline_mode()
    return results


def _first_error(conn: Any, results: list[Any]) -> psycopg.Error | None:
    """The first error among the commands' results (BEGIN's, the PREPARE's, the
    statement's or the COMMIT's), as psycopg raises it."""
    for res in results:
        if res.status == _FATAL_ERROR:
            return psycopg.errors.error_from_result(res, encoding=conn.info.encoding)
    return None


def _rows(conn: Any, statement: Statement, res: Any, tx: Any) -> Result:
    """The rows of our statement's result."""
    if res.status != _TUPLES_OK:
        nrows = res.command_tuples
        return Result([], nrows if nrows is not None else -1)
    count = res.ntuples
    if not count:
        return Result([], 0)
    tx.set_pgresult(res)
    if statement.tuples:
        return Result(tx.load_rows(0, count, tuple), count)
    # psycopg's namedtuple_row class for these columns (it needs a cursor to ask)
    row = _make_nt(conn.info.encoding, *(res.fname(i) for i in range(res.nfields)))
    return Result(tx.load_rows(0, count, row._make), count)


class _JsonContext:
    """The connection's adapters, but json/jsonb loaded as JSON (see SyncDB.own_json)."""

    __slots__ = ("adapters", "connection")

    def __init__(self, conn: Any, adapters: AdaptersMap) -> None:
        self.connection = conn
        self.adapters = adapters


#: The adapters for `own_json`, per connection (the map only: a value holding its key
#: would keep every closed connection alive).
_json_adapters: weakref.WeakKeyDictionary[Any, AdaptersMap] = weakref.WeakKeyDictionary()


def _context(conn: Any, own_json: bool) -> Any:
    if not own_json:
        return conn
    adapters = _json_adapters.get(conn)
    if adapters is None:
        adapters = AdaptersMap(conn.adapters)
        adapters.register_loader("json", JsonLoader)
        adapters.register_loader("jsonb", JsonbLoader)
        _json_adapters[conn] = adapters
    return _JsonContext(conn, adapters)


def _prepare_for(conn: Any, statement: Statement, params: Mapping[str, Any] | None,
                 own_json: bool) -> tuple[Any, Sequence[Any]] | None:
    """The transformer and dumped values for a run under the cursor; None: use one."""
    if not DIRECT or not statement.dollar or conn.closed or \
            getattr(conn, "_prepared", None) is None:
        return None
    params = params or {}
    try:
        values = [params[name] for name in statement.names]
    except KeyError as missing:
        raise psycopg.ProgrammingError(f"query parameter missing: {missing}") from None
    tx = Transformer(_context(conn, own_json))
    return tx, tx.dump_sequence(values, [PyFormat.AUTO] * len(values))


class _Plan:
    """One run under the cursor, decided under the connection's lock."""

    __slots__ = ("at", "begin", "commit", "key", "name", "prep", "retry")

    def __init__(self, conn: Any, statement: Statement, tx: Any, commit: bool) -> None:
        pgconn = conn.pgconn
        status = pgconn.transaction_status
        # The BEGIN psycopg itself would send (isolation level, read-only included).
        self.begin = None if conn.autocommit or status != _IDLE \
            else conn._get_tx_start_command()
        # A statement of ours whose prepared form is gone fails having run nothing:
        # where nothing else was in its transaction, it is prepared again and run.
        self.retry = status == _IDLE
        self.commit = commit and not conn.autocommit
        self.key = _Key(statement.dollar, tx.types)
        if _client_side(conn):
            self.prep, self.name = _NO, b""
        else:
            self.prep, self.name = conn._prepared.get(self.key, True)
        self.at = (self.begin is not None) + (self.prep is _SHOULD)


def _client_side(conn: Any) -> bool:
    """A connection whose cursors bind client-side (Django's default, `ClientCursor`)
    prepares nothing on the server, and may sit behind a transaction pooler that would
    lose prepared statements: ours run unnamed there too."""
    factory = getattr(conn, "cursor_factory", None)
    return isinstance(factory, type) and issubclass(
        factory, psycopg.ClientCursor | psycopg.AsyncClientCursor)


def _usable(conn: Any) -> bool:
    """Whether the connection can take a run under the cursor now (under its lock)."""
    pgconn = conn.pgconn
    return (not conn.closed and pgconn.pipeline_status == _PIPELINE_OFF
            and pgconn.transaction_status in (_IDLE, _INTRANS))


def _settle(conn: Any, statement: Statement, plan: _Plan, tx: Any, results: list[Any]
            ) -> Result | psycopg.Error:
    """Tell psycopg's cache what became of the statement; its rows, or its error."""
    manager = conn._prepared
    if len(results) <= plan.at:  # cut short: the session ended
        return _first_error(conn, results) or psycopg.OperationalError(
            "the connection ended before the statement's result")
    res = results[plan.at]
    if plan.prep is _SHOULD:
        # Cached only if the server prepared it (psycopg, outside pipeline mode, never
        # gets this far with a failed PREPARE); kept then, whatever became of the run.
        prepared = results[plan.at - 1]
        if prepared.status == _COMMAND_OK:
            key = manager.maybe_add_to_cache(plan.key, plan.prep, plan.name)
            if key is not None:
                manager.validate(key, plan.prep, plan.name, [prepared])
    elif plan.prep is not _NO:
        manager.maybe_add_to_cache(plan.key, plan.prep, plan.name)  # recently used
    error = _first_error(conn, results)
    if error is not None:
        if error.sqlstate == _NO_STATEMENT:
            manager.clear()  # dropped behind psycopg's back (a DEALLOCATE it missed)
        return error
    return _rows(conn, statement, res, tx)


def _cut_off(conn: Any) -> bool:
    """Whether an exchange cut off mid-way (a timeout, an interrupt, a lost server) left
    a pipeline open or the session ended: the connection must be closed (its protocol
    state is unknown; a closed one is finished at once, not at garbage collection)."""
    return bool(conn.pgconn.status == _BAD or conn.pgconn.pipeline_status != _PIPELINE_OFF)


def _rollback(pgconn: Any) -> PQGen[list[Any]]:
    """ROLLBACK of the transaction our own BEGIN opened (psycopg's rollback() would
    take the lock we hold)."""
    pgconn.send_query_params(b"ROLLBACK", None)
    done: list[Any] = yield from generators.execute(pgconn)
    return done


def _outcome(conn: Any, statement: Statement, plan: _Plan, tx: Any, results: list[Any],
             attempt: int) -> Result | None:
    """The statement's rows; None: its prepared form was gone and nothing else was in
    its transaction, so it is prepared again and run (after a ROLLBACK of the
    transaction its BEGIN opened); otherwise its error, raised."""
    done = _settle(conn, statement, plan, tx, results)
    if not isinstance(done, psycopg.Error):
        return done
    if attempt or not plan.retry or done.sqlstate != _NO_STATEMENT:
        raise done
    return None


def _flush_first(conn: Any) -> bool:
    """Whether psycopg's queued DEALLOCATEs go before our statement.

    A queued DEALLOCATE ALL (the `clear()` of `_outcome`'s 26000) must: psycopg sends
    it at its next cursor statement, which could come after we prepared again under
    its names. It cannot fail, in a transaction or out. The names its LRU evicted go
    only where no transaction of the caller's is open (a `DEALLOCATE name` of a
    statement already gone fails, libpq < 17): on a connection that runs only ours
    (a worker's) nothing else would send them, and the server's statements would grow.
    """
    queued = conn._prepared._to_flush
    if not queued or not _usable(conn):
        return False
    return None in queued or conn.pgconn.transaction_status == _IDLE


def _flush(conn: Any) -> PQGen[None]:
    """psycopg's queued DEALLOCATEs; one of a name already gone (26000, outside any
    transaction: nothing lost) clears psycopg's cache and sends DEALLOCATE ALL."""
    manager = conn._prepared
    try:
        yield from manager.maintain_gen(conn)
    except psycopg.errors.InvalidSqlStatementName:
        manager.clear()
        yield from manager.maintain_gen(conn)


def _send(conn: Any, statement: Statement, tx: Any, values: Sequence[Any], commit: bool
          ) -> tuple[_Plan, PQGen[list[Any]]] | None:
    """The plan and the exchange of one try; None: not now, use a cursor."""
    if not _usable(conn):
        return None
    plan = _Plan(conn, statement, tx, commit)
    return plan, _exchange(conn.pgconn, plan.begin, plan.name, plan.prep is _SHOULD,
                           statement, values, tx, plan.commit)


def _run_sync(conn: Any, statement: Statement, tx: Any, values: Sequence[Any],
              commit: bool) -> Result | None:
    """Our statement on a psycopg Connection, under its cursor (see the module's doc);
    None: the connection is not in a state for it (use a cursor)."""
    with conn.lock:
        for attempt in range(2):
            if _flush_first(conn):
                conn.wait(_flush(conn))
            sending = _send(conn, statement, tx, values, commit)
            if sending is None:
                return None
            plan, exchange = sending
            try:
                results = conn.wait(exchange)
            except BaseException:
                if _cut_off(conn):
                    conn.close()
                raise
            if conn.pgconn.status == _BAD:  # the server ended the session (its FATAL):
                conn.pgconn.finish()  # free it now (psycopg's close() skips a BAD one)
            done = _outcome(conn, statement, plan, tx, results, attempt)
            if done is not None:
                return done
            if plan.begin is not None:
                conn.wait(_rollback(conn.pgconn))
    raise AssertionError("unreachable")  # pragma: no cover


async def _run_async(conn: Any, statement: Statement, tx: Any, values: Sequence[Any],
                     commit: bool) -> Result | None:
    """`_run_sync` on a psycopg AsyncConnection."""
    async with conn.lock:
        for attempt in range(2):
            if _flush_first(conn):
                await conn.wait(_flush(conn))
            sending = _send(conn, statement, tx, values, commit)
            if sending is None:
                return None
            plan, exchange = sending
            try:
                results = await conn.wait(exchange)
            except BaseException:
                if _cut_off(conn):
                    await conn.close()
                raise
            if conn.pgconn.status == _BAD:
                conn.pgconn.finish()
            done = _outcome(conn, statement, plan, tx, results, attempt)
            if done is not None:
                return done
            if plan.begin is not None:
                await conn.wait(_rollback(conn.pgconn))
    raise AssertionError("unreachable")  # pragma: no cover


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
            direct = _prepare_for(self.conn, statement, params, self.own_json)
            if direct is not None:
                done = _run_sync(self.conn, statement, *direct, commit)
                if done is not None:
                    return done
            # Through a cursor, `commit` is left to the transaction's owner.
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
            direct = _prepare_for(self.conn, statement, params, False)
            if direct is not None:
                done = await _run_async(self.conn, statement, *direct, commit)
                if done is not None:
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

