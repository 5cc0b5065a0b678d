"""Where the database is: `DATABASE_URL`, or an embedded PostgreSQL when it is unset."""

from __future__ import annotations

import math
import os
import select
import time
import weakref
from collections.abc import Mapping
from typing import Any

import psycopg
from sqlalchemy import Engine, create_engine, event, make_url
from sqlalchemy.engine import URL
from sqlalchemy.exc import InvalidatePoolError

from outbox._connections import (
    DEFAULT_CALL_TIMEOUT,
    KEEPALIVE_ARGS,
    BoundedConnection,
)
from outbox._connections import (
    idle_in_transaction_timeout as default_idle_in_transaction,
)
from outbox.errors import ConfigurationError

NOTIFY_CHANNEL = "outbox_due"
#: An effect's attempts cap unless it says otherwise (`enqueue`, `Claim.enqueue`).
DEFAULT_MAX_ATTEMPTS = 25


def normalize_url(url: str) -> str:
    """Accept `postgres://`, `postgresql://` and `postgresql+psycopg://` alike."""
    try:
        parsed: URL = make_url(url)
    except Exception as exc:  # ArgumentError: not a URL at all
        raise ConfigurationError(f"DATABASE_URL is not a database URL: {exc}") from None
    if parsed.drivername in ("postgres", "postgresql", "postgresql+psycopg2"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.drivername != "postgresql+psycopg":
        raise ConfigurationError(
            f"only PostgreSQL is supported (got {parsed.drivername!r} in DATABASE_URL)")
    return parsed.render_as_string(hide_password=False)


EMBEDDED_ENV = "OUTBOX_EMBEDDED"


def seconds_setting(environ: Mapping[str, str], name: str, default: float, *,
                    low: float, high: float) -> float:
    """A duration in seconds from `environ[name]` (unset or blank: `default`); a value
    that is not a number in [low, high] is a ConfigurationError naming the variable."""
    raw = (environ.get(name) or "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not low <= value <= high:
        raise ConfigurationError(f"{name} must be seconds between {low:g} and {high:g}, "
                                 f"not {raw[:20]!r}")
    return value


def embedded_opted_in() -> bool:
    return os.environ.get(EMBEDDED_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def database_url(*, embedded: bool | None = None) -> str:
    """`DATABASE_URL` if set; else the embedded server, only when opted in.

    A library must not start a database (and install a SIGTERM handler) in a user's
    process because a variable is missing: the embedded server starts for the demo and
    the test suite (they opt in) or with `OUTBOX_EMBEDDED=1` / `embedded=True`.
    """
    url = os.environ.get("DATABASE_URL")
    if url:
        return normalize_url(url)
    if not (embedded if embedded is not None else embedded_opted_in()):
        raise ConfigurationError(
            "DATABASE_URL is not set: point it at your PostgreSQL (for a throwaway "
            f"embedded server, as the demo and the tests use, set {EMBEDDED_ENV}=1 and "
            "install pg-outbox[embedded])")
    from outbox import _embedded

    return _embedded.start()


def libpq_dsn(url: str | None = None) -> str:
    """`DATABASE_URL` (or the embedded server) as a libpq URL for `psycopg.connect`."""
    parsed = make_url(normalize_url(url or database_url())).set(drivername="postgresql")
    return parsed.render_as_string(hide_password=False)


def make_engine(url: str | None = None, *, application_name: str = "outbox",
                call_timeout: float | None = DEFAULT_CALL_TIMEOUT,
                idle_in_transaction_timeout: float | None = None, **kwargs: Any) -> Engine:
    """A psycopg 3 engine whose sessions say who they are in `pg_stat_activity`.

    No call on it can hang on a silent peer (outbox/_connections.py, docs/network.md):
    TCP keepalives and `tcp_user_timeout`, and every wait for the server bounded by
    `call_timeout` seconds (None: unbounded), after which the connection is dropped from
    the pool and the call fails with an OperationalError. Keep it above your longest
    statement, lock waits included.

    The server ends a session left idle inside a transaction for longer than
    `idle_in_transaction_timeout` seconds (libpq `options`, so it costs no round trip):
    the backend of a client whose connection went silent holds its locks (the atomic
    guard's advisory lock on the key, row locks) until then. None: the call timeout +
    5 s, or `OUTBOX_DB_IDLE_IN_TRANSACTION_TIMEOUT`; 0: leave the server's setting. The
    library never leaves a transaction idle; raise it if your own request code computes
    (or calls out) between statements for longer.
    """
    target = make_url(normalize_url(url or database_url()))
    connect_args = dict(kwargs.pop("connect_args", {}))
    connect_args.setdefault("application_name", application_name)
    # A server that accepts the TCP connection but never answers must not hang a
    # request or a worker's claim on the kernel's TCP timeouts.
    connect_args.setdefault("connect_timeout", 10)
    for name, value in KEEPALIVE_ARGS.items():
        connect_args.setdefault(name, value)
    idle = (default_idle_in_transaction(call_timeout) if idle_in_transaction_timeout is None
            else idle_in_transaction_timeout if idle_in_transaction_timeout > 0 else None)
    if idle is not None:
        options = _with_idle_in_transaction_timeout(
            connect_args.get("options", target.query.get("options")), idle)
        if options is not None:
            connect_args["options"] = options
    # The pool checks a connection at checkout only when it may be dead: idle for a
    # second or more, or the server wrote to it while it sat in the pool (a restart,
    # pg_terminate_backend: the close is readable at once). A connection in steady use
    # costs no round trip (SQLAlchemy's pool_pre_ping=True pings every checkout: a
    # fifth of a one-INSERT transaction's client CPU). pool_pre_ping=False (the
    # workers, whose statements retry on a dead connection) checks only past the call
    # timeout. Each ping is a bounded call.
    explicit = kwargs.pop("pool_pre_ping", None)
    engine = create_engine(target, connect_args=connect_args,
                           pool_pre_ping=bool(explicit), **kwargs)
    bound_calls(engine, call_timeout)
    if explicit is None:
        ping_when_idle(engine, PING_AFTER)
    elif not explicit and call_timeout is not None:
        ping_when_idle(engine, call_timeout)
    return engine



def _with_idle_in_transaction_timeout(options: Any, seconds: float) -> str | None:
    """libpq `options` with `-c idle_in_transaction_session_timeout=...` added, unless
    the caller (connect_args or the URL's query) set it already (then None)."""
    existing = options if isinstance(options, str) else ""
    if "idle_in_transaction_session_timeout" in existing:
        return None
    ours = f"-c idle_in_transaction_session_timeout={max(1, round(seconds * 1000))}"
    return f"{existing} {ours}".strip()


def bound_calls(engine: Engine, call_timeout: float | None = DEFAULT_CALL_TIMEOUT) -> None:
    """Make `engine` open `BoundedConnection`s: every wait ends within `call_timeout`.

    For an engine you built yourself (psycopg 3 driver only).
    """
    _call_timeouts[engine] = call_timeout

    @event.listens_for(engine, "do_connect")
    def _connect(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]
                 ) -> BoundedConnection:
        conn = BoundedConnection.connect(*cargs, **cparams)
        conn.call_timeout = call_timeout
        return conn


_call_timeouts: weakref.WeakKeyDictionary[Engine, float | None] = weakref.WeakKeyDictionary()


def call_timeout_of(engine: Engine) -> float | None:
    """The call timeout `bound_calls` gave `engine` (the default if it gave none)."""
    return _call_timeouts.get(engine, DEFAULT_CALL_TIMEOUT)


#: A pooled connection idle this long is pinged at checkout (make_engine's default).
PING_AFTER = 1.0


def ping_when_idle(engine: Engine, after: float) -> None:
    """Ping, at checkout, a pooled connection idle for `after` seconds or that the
    server wrote to while it was idle.

    A pool must not hand out a connection it has not heard from for long without
    checking it, nor one the server has closed. A connection in steady use is never
    pinged; one idle longer than `after`, or readable (at rest a connection hears
    nothing: what is there is a FATAL and the close of a restart or a terminated
    backend), costs one bounded round trip, and a dead one is replaced (with every
    older pooled connection) before the caller sees it.
    """

    @event.listens_for(engine, "checkin")
    def _checkin(dbapi_connection: Any, record: Any) -> None:
        record.info["outbox_idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        since = record.info.pop("outbox_idle_since", None)
        if since is None or (time.monotonic() - since < after
                             and not _heard_from(dbapi_connection)):
            return
        try:
            engine.dialect.do_ping(dbapi_connection)
        except psycopg.Error as exc:
            raise InvalidatePoolError(f"pooled connection idle for "
                                      f"{time.monotonic() - since:.0f} s failed its ping: "
                                      f"{exc}") from exc


def _heard_from(conn: Any) -> bool:
    """Whether an idle pooled connection is closed, or has something to read."""
    if not isinstance(conn, psycopg.Connection):
        return True  # not ours to inspect: ping it
    if conn.closed or conn.broken:
        return True
    try:
        fd = conn.pgconn.socket
        if hasattr(select, "poll"):  # select() refuses descriptors past FD_SETSIZE
            poller = select.poll()
            poller.register(fd, select.POLLIN | select.POLLPRI)
            return bool(poller.poll(0))
        readable, _, _ = select.select([fd], [], [], 0)
    except (OSError, ValueError, psycopg.Error):
        return True
    return bool(readable)
