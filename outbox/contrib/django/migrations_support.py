"""How `manage.py migrate` creates the outbox schema: Django migrations that run ours.

Each Django migration of this app pins one Alembic revision (`MIGRATIONS`) and runs
`outbox migrate`'s programmatic Alembic up to it, on the database Django is migrating
(test databases included), in a connection of its own: the same revisions, the same
`outbox.alembic_version` table, so a database migrated by `outbox migrate` and one
migrated by `manage.py migrate` are the same, and either tool may follow the other.
Migrating the app backwards (`migrate outbox zero`) downgrades to the revision the
previous migration pinned (zero: drops the outbox tables, like any app's zero).

A release that adds an Alembic revision adds a Django migration pinning it;
tests/test_django.py fails while the newest pin is not Alembic's head.
"""

from __future__ import annotations

import functools
from typing import Any

MIGRATIONS: tuple[tuple[str, str], ...] = (
    ("0001_outbox_schema", "0004"),
    ("0002_business_hash", "0005"),
    ("0003_delivered_attempt", "0006"),
    ("0004_effect_keys", "0007"),
    ("0005_set_based_cascade", "0008"),
    ("0006_lock_and_read_key", "0009"),
    ("0007_watched_doorbell", "0010"),
    ("0008_first_claimed_at", "0011"),
    ("0009_require", "0012"),
    ("0010_row_checks", "0013"),
)


def target_revisions() -> tuple[tuple[str, str], ...]:
    return MIGRATIONS


@functools.cache
def _revisions() -> tuple[str, ...]:
    from alembic.script import ScriptDirectory

    from outbox import _migrate

    script = ScriptDirectory.from_config(_migrate.alembic_config())
    return tuple(reversed([r.revision for r in script.walk_revisions()]))


class _Revisions:
    """Alembic's revisions, base first (read lazily from the shipped migrations)."""

    def __contains__(self, revision: object) -> bool:
        return revision in _revisions()

    def index(self, revision: str) -> int:
        return _revisions().index(revision)

    def head(self) -> str:
        return _revisions()[-1]


KNOWN_REVISIONS = _Revisions()


def _url(schema_editor: Any) -> str:
    from outbox.contrib.django.db import database_url

    return database_url(schema_editor.connection.alias)


def upgrade_to(revision: str) -> Any:
    """A RunPython function: Alembic upgrade to `revision` on the migrated database."""

    def forwards(apps: Any, schema_editor: Any) -> None:
        from outbox import _migrate

        _migrate.upgrade(_url(schema_editor), revision)

    return forwards


def downgrade_to(revision: str) -> Any:
    """The reverse: Alembic downgrade to `revision` ("base" drops the outbox tables)."""

    def backwards(apps: Any, schema_editor: Any) -> None:
        from alembic import command

        from outbox import _migrate

        command.downgrade(_migrate.alembic_config(_url(schema_editor)), revision)

    return backwards
