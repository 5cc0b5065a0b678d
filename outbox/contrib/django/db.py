"""Django's database connection as the outbox sees it.

* `outbox_db(using)`: a handle for the guard's statements on Django's own connection,
  in Django's transaction. Django makes its psycopg connections load `jsonb` as text
  (its JSONField decodes it); the guard reads a stored response's headers from jsonb,
  so this handle loads jsonb as JSON on its own cursors only, and Django's JSONFields
  keep working. `outbox.enqueue(connection, ...)` needs no such handle (it reads no
  jsonb) and must get Django's `connection` itself: that is how the after-commit
  doorbell finds `connection.on_commit`.
* `database_url(using)`: the same database as a URL, for what opens connections of its
  own: Alembic migrations, the worker, `outbox_status`.
* `DjangoStatements`: runs the CLI's repair statements (outbox/sql/effects.py
  `requeue`, `cancel`) unchanged on Django's connection, so the admin's retry and
  cancel are the same fenced UPDATEs as `outbox retry` / `outbox cancel`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from sqlalchemy.engine import URL

from outbox._driver import Result, SyncDB, sql
from outbox.errors import ConfigurationError

# Connection parameters Django passes to psycopg.connect that are not libpq's.
_NOT_LIBPQ = frozenset({"context", "cursor_factory", "prepare_threshold", "options_extra"})


def alias(using: str | None = None) -> str:
    """`using`, else OUTBOX["DATABASE"], else "default"."""
    if using is not None:
        return using
    from outbox.contrib.django import conf

    return conf.raw().get("DATABASE") or DEFAULT_DB_ALIAS


def connection_for(using: str | None = None) -> BaseDatabaseWrapper:
    conn = connections[alias(using)]
    if conn.vendor != "postgresql":
        raise ConfigurationError(f"the outbox needs PostgreSQL; database {conn.alias!r} is "
                                 f"{conn.vendor}")
    return conn


def raw_connection(using: str | None = None) -> psycopg.Connection[Any]:
    conn = connection_for(using)
    conn.ensure_connection()
    raw = conn.connection
    if not isinstance(raw, psycopg.Connection):
        raise ConfigurationError("the outbox needs Django's psycopg 3 backend (pip install "
                                 "'psycopg[binary]'; psycopg2 is not supported)")
    return raw


class DjangoDB(SyncDB):
    """SyncDB on Django's psycopg connection, loading jsonb as JSON on its own cursors."""

    __slots__ = ()

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        super().__init__(conn, own_json=True)


def outbox_db(using: str | None = None) -> DjangoDB:
    """The guard's handle on Django's connection (in whatever transaction it is in)."""
    return DjangoDB(raw_connection(using))


class DjangoStatements:
    """`conn.execute(text(...), params)` for outbox/sql functions written for SQLAlchemy.

    The statement text is the module's own constant, converted to psycopg's parameter
    style by the driver seam; it runs on Django's connection, in Django's transaction.
    """

    def __init__(self, using: str | None = None) -> None:
        self.db = outbox_db(using)

    def execute(self, clause: Any, params: Mapping[str, Any] | None = None) -> Result:
        return self.db.execute(sql(str(clause)), params)


def database_url(using: str | None = None) -> str:
    """Django's settings for `using` as a `postgresql+psycopg://` URL (password included).

    Built from `connection.get_connection_params()`, so OPTIONS (sslmode, service,
    options, ...) reach the other connections exactly as Django passes them to libpq.
    """
    conn = connection_for(using)
    params = dict(conn.get_connection_params())
    for name in _NOT_LIBPQ:
        params.pop(name, None)
    port = params.pop("port", None)
    host = params.get("host") or None
    if host is not None and (host.startswith("/") or "," in host):
        params["socket"] = host  # a socket folder or several hosts: libpq's own syntax
        host = None
    query = {k: str(v) for k, v in params.items()
             if k not in ("dbname", "user", "password", "host", "socket") and v is not None
             and isinstance(v, str | int) and not isinstance(v, bool)}
    if "socket" in params:
        query["host"] = str(params["socket"])
    url = URL.create(
        "postgresql+psycopg", username=params.get("user") or None,
        password=params.get("password") or None, host=host,
        port=int(port) if port not in (None, "") else None,
        database=params.get("dbname") or None, query=query)
    return url.render_as_string(hide_password=False)
