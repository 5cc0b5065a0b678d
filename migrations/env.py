"""Alembic environment: works from `alembic upgrade head` and from `outbox migrate`."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine, pool, text

from outbox._config import database_url, normalize_url
from outbox._schema import SCHEMA, metadata

config = context.config


def _run(connection: Connection) -> None:
    connection.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{SCHEMA}"'))
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table_schema=SCHEMA,
        include_schemas=True,
        include_name=lambda name, type_, _parent: type_ != "schema" or name == SCHEMA,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    given = config.attributes.get("connection")
    if given is not None:
        _run(given)
        return
    url = config.get_main_option("sqlalchemy.url") or database_url()
    engine = create_engine(normalize_url(url), poolclass=pool.NullPool)
    with engine.begin() as connection:
        _run(connection)


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=metadata,
                      literal_binds=True, version_table_schema=SCHEMA)
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
