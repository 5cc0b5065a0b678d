"""System checks: a misconfiguration is reported by `manage.py check` (and at startup),
never discovered by the first request.

    outbox.E001  settings.OUTBOX is unusable (unknown key, bad value, bad import path)
    outbox.E002  OUTBOX["DATABASE"] names no database in DATABASES
    outbox.E003  that database is not PostgreSQL
    outbox.E004  Django's PostgreSQL backend runs on psycopg2; the outbox needs psycopg 3
    outbox.E005  OUTBOX["MAX_BODY"] exceeds DATA_UPLOAD_MAX_MEMORY_SIZE (Django would
                 refuse those bodies first, with a 400 instead of our 413)
    outbox.E006  MODE "phased" with ATOMIC_REQUESTS: the claim must commit before the work
    outbox.E007  AUTOCOMMIT off: Django then neither commits nor runs on_commit doorbells
    outbox.E010  (database) Django recorded the outbox migrations as applied, but the
                 outbox schema is behind them (faked, restored or dropped): run
                 `manage.py outbox_migrate`
    outbox.W010  (database) the outbox schema is not migrated yet: run `manage.py migrate`
    outbox.W011  (database) the outbox schema is newer than this version of pg-outbox
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks
from django.core.checks import CheckMessage, Error, Warning

from outbox.contrib.django import conf


def register() -> None:
    checks.register(check_settings)
    checks.register(check_schema, checks.Tags.database)


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    found: list[CheckMessage] = [
        Error(p, hint="see docs/django.md for every OUTBOX key", id="outbox.E001")
        for p in conf.problems()]
    alias = conf.raw().get("DATABASE")
    databases = getattr(settings, "DATABASES", {}) or {}
    if not isinstance(alias, str) or alias not in databases:
        found.append(Error(f"OUTBOX['DATABASE'] is {alias!r}, which is not in DATABASES",
                           id="outbox.E002"))
        return found
    db = databases[alias]
    engine = str(db.get("ENGINE", ""))
    if engine != "django.db.backends.postgresql" and "postgresql" not in engine \
            and "postgis" not in engine:
        found.append(Error(f"database {alias!r} uses {engine or 'no ENGINE'}; the outbox "
                           "needs PostgreSQL", hint="ENGINE: django.db.backends.postgresql",
                           id="outbox.E003"))
        return found
    try:
        from django.db.backends.postgresql.psycopg_any import is_psycopg3
    except ImportError:  # pragma: no cover - no driver at all
        is_psycopg3 = False
    if not is_psycopg3:
        found.append(Error("Django's PostgreSQL backend is using psycopg2; the outbox runs "
                           "its statements on psycopg 3", hint="pip install 'psycopg[binary]'",
                           id="outbox.E004"))
    limit = getattr(settings, "DATA_UPLOAD_MAX_MEMORY_SIZE", None)
    max_body = conf.raw().get("MAX_BODY")
    if isinstance(limit, int) and isinstance(max_body, int) and max_body > limit:
        found.append(Error(f"OUTBOX['MAX_BODY'] ({max_body}) exceeds "
                           f"DATA_UPLOAD_MAX_MEMORY_SIZE ({limit}): Django refuses such "
                           "bodies before the view, with a 400", id="outbox.E005"))
    if conf.raw().get("MODE") == "phased" and db.get("ATOMIC_REQUESTS"):
        found.append(Error("OUTBOX['MODE'] is 'phased' but ATOMIC_REQUESTS is on: a phased "
                           "claim must commit before the view's transaction starts",
                           hint="use the atomic mode, or turn ATOMIC_REQUESTS off",
                           id="outbox.E006"))
    if db.get("AUTOCOMMIT") is False:
        found.append(Error(f"AUTOCOMMIT is off for {alias!r}: Django then never commits "
                           "by itself and never runs on_commit hooks (the doorbell)",
                           id="outbox.E007"))
    return found


def check_schema(app_configs: Any = None, databases: Any = None, **kwargs: Any
                 ) -> list[CheckMessage]:
    """Compare the outbox schema's Alembic revision with what Django recorded."""
    from django.db import DatabaseError, connections
    from django.db.migrations.recorder import MigrationRecorder

    from outbox.contrib.django.migrations_support import KNOWN_REVISIONS, target_revisions

    alias = conf.raw().get("DATABASE")
    if not databases or alias not in databases or check_settings():
        return []
    conn = connections[str(alias)]
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT to_regclass('outbox.alembic_version') IS NOT NULL")
            row = cur.fetchone()
            current = None
            if row and row[0]:
                cur.execute("SELECT version_num FROM outbox.alembic_version")
                found = cur.fetchone()
                current = found[0] if found else None
        applied = {name for app, name in MigrationRecorder(conn).applied_migrations()
                   if app == "outbox"}
    except DatabaseError as exc:
        return [Warning(f"cannot read the outbox schema's revision: {exc}", id="outbox.W010")]
    needed = [rev for name, rev in target_revisions() if name in applied]
    if current is not None and current not in KNOWN_REVISIONS:
        return [Warning(f"the outbox schema is at revision {current}, which this version of "
                        "pg-outbox does not know (a newer one migrated it)", id="outbox.W011")]
    if not needed:
        if current is None:
            return [Warning("the outbox schema is not migrated", hint="manage.py migrate",
                            id="outbox.W010")]
        return []
    want = needed[-1]
    if current is None or KNOWN_REVISIONS.index(current) < KNOWN_REVISIONS.index(want):
        return [Error(f"Django recorded the outbox migrations as applied, but the outbox "
                      f"schema is at revision {current or 'none'} (needs {want})",
                      hint="manage.py outbox_migrate (or migrate outbox zero --fake, then "
                           "migrate outbox)", id="outbox.E010")]
    return []
