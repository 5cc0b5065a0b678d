"""Where the database is: `DATABASE_URL`, or an embedded PostgreSQL when it is unset."""

from __future__ import annotations

import os
from typing import Any

from sqlalchemy import Engine, create_engine, event, make_url
from sqlalchemy.engine import URL

from outbox._connections import DEFAULT_CALL_TIMEOUT, KEEPALIVE_ARGS, BoundedConnection
from outbox.errors import ConfigurationError

NOTIFY_CHANNEL = "outbox_due"


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


def database_url(*, embedded: bool = True) -> str:
    """`DATABASE_URL` if set; else start (or attach to) the embedded server."""
    url = os.environ.get("DATABASE_URL")
    if url:
        return normalize_url(url)
    if not embedded:
        raise ConfigurationError("DATABASE_URL is not set")
    from outbox import _embedded

    return _embedded.start()


def libpq_dsn(url: str | None = None) -> str:
    """`DATABASE_URL` (or the embedded server) as a libpq URL for `psycopg.connect`."""
    parsed = make_url(normalize_url(url or database_url())).set(drivername="postgresql")
    return parsed.render_as_string(hide_password=False)


def make_engine(url: str | None = None, *, application_name: str = "outbox",
                call_timeout: float | None = DEFAULT_CALL_TIMEOUT, **kwargs: Any) -> Engine:
    """A psycopg 3 engine whose sessions say who they are in `pg_stat_activity`.

    No call on it can hang on a silent peer (outbox/_connections.py): TCP keepalives
    and `tcp_user_timeout`, and every wait for the server bounded by `call_timeout`
    seconds (None: unbounded), after which the connection is dropped from the pool and
    the call fails with an OperationalError. Keep it above your longest statement.
    """
    target = make_url(normalize_url(url or database_url()))
    connect_args = dict(kwargs.pop("connect_args", {}))
    connect_args.setdefault("application_name", application_name)
    # A server that accepts the TCP connection but never answers must not hang a
    # request or a worker's claim on the kernel's TCP timeouts.
    connect_args.setdefault("connect_timeout", 10)
    for name, value in KEEPALIVE_ARGS.items():
        connect_args.setdefault(name, value)
    # The pre-ping is itself a bounded call: a pooled connection that went silent while
    # it was idle is found out at checkout, within `call_timeout`.
    kwargs.setdefault("pool_pre_ping", True)
    engine = create_engine(target, connect_args=connect_args, **kwargs)
    bound_calls(engine, call_timeout)
    return engine


def bound_calls(engine: Engine, call_timeout: float | None = DEFAULT_CALL_TIMEOUT) -> None:
    """Make `engine` open `BoundedConnection`s: every wait ends within `call_timeout`.

    For an engine you built yourself (psycopg 3 driver only).
    """

    @event.listens_for(engine, "do_connect")
    def _connect(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]
                 ) -> BoundedConnection:
        conn = BoundedConnection.connect(*cargs, **cparams)
        conn.call_timeout = call_timeout
        return conn
