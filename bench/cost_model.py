#!/usr/bin/env python3
"""What one effect costs the database: prints ONE JSON line (progress on stderr).

    DATABASE_URL=postgresql://root@127.0.0.1:5432/test uv run python bench/cost_model.py

Counts, not timings, so the numbers hold on a busy machine: for N effects (--effects,
default 5000) written one per business transaction by `enqueue`, then delivered by a
real Dispatcher (no-op handler, batch --batch, default 100), per effect:

* statements (round trips) the client sent, counted by wrapping psycopg's
  `execute` / `commit` / `rollback` (BEGIN is sent by psycopg itself and is added per
  transaction);
* WAL bytes, records and full-page images (`pg_current_wal_lsn()` and
  `pg_stat_wal` before and after, a CHECKPOINT before each phase, so every page's
  first change writes its full image: the worst case, see docs/benchmarks.md). These
  counters are server-wide: run it on a server nothing else writes to (the embedded
  one: `OUTBOX_EMBEDDED=1`, no `DATABASE_URL`); the smallest of `--repeat` runs is kept;
* heap rows inserted / updated / HOT-updated and dead tuples left, from
  `pg_stat_user_tables` (flushed with `pg_stat_force_next_flush()`);
* bytes of heap and of each index grown, from `pg_relation_size`.

Phases: `enqueue` (the business transactions) and `dispatch` (claim, deliver,
record). The scratch database `bench_cost` is created and dropped; autovacuum is off
on its tables for the run, so dead tuples are counted, not removed.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from sqlalchemy import make_url  # noqa: E402

from outbox._config import database_url, libpq_dsn  # noqa: E402

DB = "bench_cost"
TABLES = ("effects", "attempts")


def log(msg: str) -> None:
    print(f"[cost-model {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class StatementCounter:
    """Counts what psycopg sends: execute, commit, rollback (per thread, summed)."""

    def __init__(self) -> None:
        self.count = 0
        self.transactions = 0
        self._lock = threading.Lock()
        self._patched: list[tuple[type, str, Callable[..., Any]]] = []

    def _bump(self, n: int = 1, tx: int = 0) -> None:
        with self._lock:
            self.count += n
            self.transactions += tx

    @contextmanager
    def active(self) -> Iterator[StatementCounter]:
        counter = self

        def wrap(cls: type, name: str, tx: int) -> None:
            original = getattr(cls, name)

            def counted(self: Any, *a: Any, **k: Any) -> Any:
                counter._bump(1, tx)
                return original(self, *a, **k)

            self._patched.append((cls, name, original))
            setattr(cls, name, counted)

        wrap(psycopg.Cursor, "execute", 0)
        # BEGIN, COMMIT and ROLLBACK, whether from commit() or a transaction() block
        wrap(psycopg.Connection, "_exec_command", 1)
        try:
            yield self
        finally:
            for cls, name, original in reversed(self._patched):
                setattr(cls, name, original)
            self._patched.clear()


def snapshot(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """Call after the measured connections closed: a backend flushes its table counts
    at exit (or about once a second), not when asked by another session."""
    time.sleep(0.3)
    conn.execute("SELECT pg_stat_clear_snapshot()")
    lsn = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]  # type: ignore[index]
    wal = conn.execute("SELECT wal_records, wal_fpi, wal_bytes FROM pg_stat_wal").fetchone()
    stats = {r[0]: {"ins": r[1], "upd": r[2], "hot": r[3], "dead": r[4]} for r in conn.execute(
        "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_dead_tup"
        " FROM pg_stat_user_tables WHERE schemaname = 'outbox'"
        " AND relname = ANY(%s)", (list(TABLES),))}
    sizes = {r[0]: r[1] for r in conn.execute(
        "SELECT c.relname, pg_relation_size(c.oid) FROM pg_class c"
        " JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = 'outbox' AND c.relkind IN ('r', 'i')"
        " AND (c.relname = ANY(%s) OR c.oid IN (SELECT indexrelid FROM pg_index"
        "      WHERE indrelid = ANY(SELECT oid FROM pg_class WHERE relname = ANY(%s)"
        "      AND relnamespace = n.oid)))", (list(TABLES), list(TABLES)))}
    return {"lsn": lsn, "wal": wal, "stats": stats, "sizes": sizes}


def delta(conn: psycopg.Connection[Any], before: dict[str, Any], after: dict[str, Any],
          n: int, statements: int, transactions: int) -> dict[str, Any]:
    wal = conn.execute("SELECT pg_wal_lsn_diff(%s, %s)",
                       (after["lsn"], before["lsn"])).fetchone()[0]  # type: ignore[index]
    rows = {t: {k: round((after["stats"].get(t, {}).get(k, 0)
                          - before["stats"].get(t, {}).get(k, 0)) / n, 3)
                for k in ("ins", "upd", "hot", "dead")} for t in TABLES}
    grown = {name: round((after["sizes"].get(name, 0) - before["sizes"].get(name, 0)) / n, 1)
             for name in sorted(after["sizes"])}
    records = after["wal"][0] - before["wal"][0]
    fpi = after["wal"][1] - before["wal"][1]
    return {"statements_per_effect": round(statements / n, 3),
            "begin_commit_per_effect": round(transactions / n, 3),
            "wal_bytes_per_effect": round(float(wal) / n, 1),
            "wal_records_per_effect": round(records / n, 2),
            "wal_full_page_images_per_effect": round(fpi / n, 3),
            "rows_per_effect": rows, "bytes_grown_per_effect": grown}


def run_once(url: str, n: int, batch: int) -> dict[str, Any]:
    from dispatcher._core import Dispatcher
    from dispatcher.handlers import EffectContext, Registry
    from outbox import enqueue
    from outbox._migrate import upgrade

    dsn = libpq_dsn(url)
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{DB}"')
    scratch = make_url(url).set(database=DB).render_as_string(hide_password=False)
    upgrade(scratch)
    sdsn = libpq_dsn(scratch)
    out: dict[str, Any] = {}
    try:
        with psycopg.connect(sdsn, autocommit=True) as obs:
            for t in TABLES:
                obs.execute(f"ALTER TABLE outbox.{t} SET (autovacuum_enabled = off)")
            obs.execute("CREATE TABLE public.orders (id bigserial PRIMARY KEY, n int)")
            # enqueue: one business row and one effect per transaction, as an API would
            counter = StatementCounter()
            with psycopg.connect(sdsn) as app:
                for i in range(50):  # warm the plans and prepared statements
                    with app.transaction():
                        enqueue(app, "bench.cost", {"i": i}, queue="warm")
            obs.execute("DELETE FROM outbox.effects WHERE queue = 'warm'")
            obs.execute("VACUUM outbox.effects")
            obs.execute("CHECKPOINT")  # full-page images: see the docs (steady state)
            before = snapshot(obs)
            with psycopg.connect(sdsn) as app, counter.active():
                for i in range(n):
                    with app.transaction():
                        app.execute("INSERT INTO public.orders (n) VALUES (%s)", (i,))
                        enqueue(app, "bench.cost", {"order": i, "amount": 1200},
                                key=f"cost-{uuid.uuid4().hex}")
            after = snapshot(obs)
            out["enqueue"] = delta(obs, before, after, n, counter.count,
                                   counter.transactions)
            out["enqueue"]["note"] = ("includes the business INSERT (1 statement, 1 orders "
                                      "row) the effect rides with")
            # dispatch: a real Dispatcher, no-op handler
            from outbox._config import make_engine

            engine = make_engine(scratch, pool_size=4, pool_pre_ping=False)
            registry = Registry()

            def noop(effect: EffectContext) -> None:
                return None

            registry.register("bench.cost", noop)
            counter = StatementCounter()
            obs.execute("CHECKPOINT")
            before = snapshot(obs)
            with counter.active():
                d = Dispatcher(engine, registry, concurrency=batch, max_batch=batch,
                               lease=30.0)
                try:
                    deadline = time.monotonic() + 300
                    while time.monotonic() < deadline:
                        d.drain(budget=30)
                        left = obs.execute("SELECT count(*) FROM outbox.effects"
                                           " WHERE status <> 'delivered'").fetchone()
                        if left is not None and left[0] == 0:
                            break
                finally:
                    d.shutdown(0)
            engine.dispose()
            after = snapshot(obs)
            out["dispatch"] = delta(obs, before, after, n, counter.count,
                                    counter.transactions)
            out["dispatch"]["note"] = (f"batch {batch}: claim and record are one statement "
                                       "per batch each (autocommit)")
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--effects", type=int, default=5000)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=2,
                    help="runs; the smallest WAL figure is kept (other databases write too)")
    args = ap.parse_args(argv)
    url = database_url()
    runs = []
    for r in range(args.repeat):
        log(f"run {r + 1}/{args.repeat}: {args.effects} effects, batch {args.batch}")
        runs.append(run_once(url, args.effects, args.batch))
    best = min(runs, key=lambda x: x["enqueue"]["wal_bytes_per_effect"]
               + x["dispatch"]["wal_bytes_per_effect"])
    # The server's own counters are server-wide: run against a server nothing else
    # uses (the embedded one: OUTBOX_EMBEDDED=1 and no DATABASE_URL) for clean WAL.
    with psycopg.connect(libpq_dsn(url)) as c:
        server = c.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
    print(json.dumps({"bench": "cost_model", "effects": args.effects, "batch": args.batch,
                      "server": server, **best,
                      "wal_runs": [[x["enqueue"]["wal_bytes_per_effect"],
                                    x["dispatch"]["wal_bytes_per_effect"]] for x in runs]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
