"""Programmatic Alembic: `outbox migrate` works from a wheel, in any folder."""

from __future__ import annotations

from importlib import resources

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection


def alembic_config(url: str | None = None, connection: Connection | None = None) -> Config:
    cfg = Config()
    location = resources.files("outbox._migrations")
    cfg.set_main_option("script_location", str(location))
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def upgrade(url: str | None = None, revision: str = "head",
            connection: Connection | None = None) -> None:
    """Apply migrations up to `revision` (idempotent: a migrated database is left as is)."""
    command.upgrade(alembic_config(url, connection), revision)


def current(connection: Connection) -> str | None:
    from alembic.runtime.migration import MigrationContext

    ctx = MigrationContext.configure(connection, opts={"version_table_schema": "outbox"})
    return ctx.get_current_revision()
