"""The databases a worker serves: `--database [NAME=]URL` flags and OUTBOX_DATABASES.

Parsing only, and light (no dispatcher machinery imported): `outbox status --database`
and the Celery tasks use it as well as the fleet (dispatcher/fleet.py), and `outbox
status` must work on a bare install, without the HTTP extras the dispatcher needs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sqlalchemy import make_url

from outbox._config import normalize_url
from outbox._redact import redact_secrets
from outbox.errors import ConfigurationError

#: The environment variable listing the databases (whitespace- or comma-separated
#: URLs, each optionally `name=URL`); `--database` flags, when given, replace it.
DATABASES_ENV = "OUTBOX_DATABASES"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_SCHEMES = ("postgres", "postgresql", "postgresql+psycopg", "postgresql+psycopg2")


@dataclass(frozen=True, slots=True)
class DatabaseSpec:
    """One database of the fleet: a short `name` (logs, the `db` metric label) and its
    URL (normalized; it may hold a password: print `shown`, never `url`)."""

    name: str
    url: str

    @property
    def shown(self) -> str:
        """The URL with its password (and any secret-looking parameter) masked; the
        user name stays (it says which role the worker connects as)."""
        shown = make_url(self.url).set(drivername="postgresql").render_as_string(
            hide_password=True)
        head, sep, query = shown.partition("?")
        return head + (redact_secrets(sep + query) if sep else "")

    @property
    def target(self) -> tuple[str, int, str]:
        """(host, port, database): two entries naming the same one are refused."""
        u = make_url(self.url)
        return ((u.host or "").lower(), u.port or 5432, u.database or u.username or "")


def parse_database(entry: str, where: str) -> DatabaseSpec:
    """`URL` or `name=URL` -> DatabaseSpec; ConfigurationError (one line, no password)
    when it is not a PostgreSQL URL or the name is not a usable label."""
    value = entry.strip()
    name: str | None = None
    head, sep, rest = value.partition("=")
    if sep and "://" not in head:  # a URL's own `=` only comes after its `://`
        name, value = head.strip(), rest.strip()
        if not _NAME.match(name):
            raise ConfigurationError(
                f"{where}: {name[:40]!r} is not a usable database name (letters, digits, "
                "'_', '.', '-'; at most 63)")
    if not value:
        raise ConfigurationError(f"{where}: no URL")
    try:
        parsed = make_url(value)
        parsed.port  # noqa: B018 - a port that is not a number fails here
    except Exception:  # ArgumentError, ValueError: say where, never echo (a password?)
        raise ConfigurationError(
            f"{where}: not a database URL (expected postgresql://user@host:port/dbname"
            + (f", or {name}=URL" if name else " or name=URL") + ")") from None
    if parsed.drivername not in _SCHEMES:
        raise ConfigurationError(
            f"{where}: only PostgreSQL is served (got {parsed.drivername!r})")
    url = normalize_url(value)
    if name is None:
        name = parsed.database or ""
        if not _NAME.match(name):
            raise ConfigurationError(
                f"{where}: cannot name the database from its URL; give it a name: "
                "NAME=URL")
    return DatabaseSpec(name, url)


def parse_databases(entries: Sequence[tuple[str, str]]) -> list[DatabaseSpec]:
    """(where, entry) pairs -> specs; duplicate names or databases are refused."""
    specs: list[DatabaseSpec] = []
    seen_names: dict[str, str] = {}
    seen_targets: dict[tuple[str, int, str], str] = {}
    for where, entry in entries:
        spec = parse_database(entry, where)
        if spec.name in seen_names:
            raise ConfigurationError(
                f"{where}: a second database named {spec.name!r} (the first: "
                f"{seen_names[spec.name]}); give one another name with NAME=URL")
        if spec.target in seen_targets:
            raise ConfigurationError(
                f"{where}: {spec.shown} is already served ({seen_targets[spec.target]})")
        seen_names[spec.name] = where
        seen_targets[spec.target] = where
        specs.append(spec)
    return specs


# Entries are separated by whitespace, or by a comma that starts the next entry (its
# `NAME=` or its scheme): a comma inside a URL (libpq's `host=h1,h2`, an `options` value)
# stays in it.
_ENTRY_SEPARATOR = re.compile(
    r"\s+|,\s*(?=(?:[A-Za-z0-9_.-]{1,63}=)?postgres(?:ql)?(?:\+\w+)?://)")


def databases_from(flags: Sequence[str] | None,
                   environ: Mapping[str, str]) -> list[DatabaseSpec] | None:
    """The databases to serve: `--database` flags if any, else `OUTBOX_DATABASES`;
    None when neither is given (`outbox worker` then serves DATABASE_URL, as always).

    The flags replace the variable rather than add to it: a command line states what
    this process serves, whatever the environment it runs in says.
    """
    if flags:
        return parse_databases([(f"--database #{i}", v) for i, v in enumerate(flags, 1)])
    raw = environ.get(DATABASES_ENV, "").strip()
    if not raw:
        return None
    # A trailing comma (`a=postgresql://h/x,`, `x,,b=...`) ends an entry; it is not part
    # of a URL.
    items = [v for v in (e.rstrip(",") for e in _ENTRY_SEPARATOR.split(raw)) if v]
    return parse_databases([(f"{DATABASES_ENV} entry {i}", v)
                            for i, v in enumerate(items, 1)])
