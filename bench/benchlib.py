"""Helpers shared by the benchmark scripts (run as `python bench/bench_*.py`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any


def pct(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile with linear interpolation; None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    f = int(k)
    c = min(f + 1, len(s) - 1)
    return s[f] + (s[c] - s[f]) * (k - f)


def pgbench(url: Any, script: str, *, seconds: float, clients: int = 1,
            options: str | None = None) -> str:
    """pgbench's output for `script` (prepared statements, `clients` sessions for
    `seconds`) on the database of `url` (a SQLAlchemy URL); `options`: PGOPTIONS for
    its sessions. Needs pgbench (Debian's postgresql-contrib)."""
    binary = shutil.which("pgbench") or "/usr/lib/postgresql/15/bin/pgbench"
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as f:
        f.write(script)
    env = dict(os.environ)
    if options:
        env["PGOPTIONS"] = options
    if url.password:
        env["PGPASSWORD"] = url.password
    try:
        done = subprocess.run(
            [binary, "-n", "-M", "prepared", "-c", str(clients), "-j", str(min(clients, 2)),
             "-T", str(int(seconds)), "-f", f.name, "-h", url.host or "127.0.0.1",
             "-p", str(url.port or 5432), "-U", url.username or "postgres", url.database],
            capture_output=True, text=True, check=False, env=env)
    finally:
        os.unlink(f.name)
    if done.returncode != 0:
        raise SystemExit(f"pgbench failed: {done.stdout}\n{done.stderr}")
    return done.stdout


@contextmanager
def scratch_database(base: Any, name: str) -> Iterator[Any]:
    """A new, empty database `name` on `base`'s server (a SQLAlchemy URL; one left over
    by an interrupted run is dropped first), its URL for the block, dropped after it."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    url = base.set(database=name)
    admin = create_engine(base, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            yield url
        finally:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()
