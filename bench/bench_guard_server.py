#!/usr/bin/env python3
"""What a guarded request's effects cost PostgreSQL, part by part: prints ONE JSON line.

    uv run python bench/bench_guard_server.py [--requests 800] [--blocks 5]

Why: a guarded request (atomic, two effects deferred to the key's write) costs the
server about 180 µs more than the guard a user hand-rolls with a plain outbox table
(bench_guard.py's g_raw). This says where those µs go.

How: one psycopg connection runs whole transactions, each the guarded request's own
statements, captured from a real `guard.run` (so they are the library's, as they are
today): BEGIN; the key's lock and read; a business INSERT; the key's write, in one of
these forms; COMMIT.

    key_only        the completed key alone, no effect
    key_plain_rows  + 2 rows in a plain outbox table (pgbench_outbox.py's)
    effect_rows     + our 2 effect rows (`outbox.effects`), without their
                    `outbox.effect_keys` rows and without the doorbell
    ..._no_check    effect_rows into a copy of the table without its row rules (0013)
    ..._few_indexes effect_rows into a copy with only the primary key and the
                    pending index, no row rules
    effect_keys     effect_rows + their `effect_keys` rows (uniqueness, migration 0007)
    full            + the doorbell (`outbox.ring`: the watcher check and the NOTIFY);
                    what `guard.run` sends

Each form runs in --blocks interleaved blocks of --requests transactions (after a
warm-up of half as many per form, at least 300); per form, the median over blocks of the
server backend's CPU time per transaction, read from /proc/<backend pid>/schedstat
(nanoseconds, that one process only, so the server must run on this host: the WAL
writer, checkpointer and background writer's share of the extra rows is not in it),
and per step the difference of two forms within each block (paired), its median and
range. No dispatcher listens, so every NOTIFY goes out (as when
every worker is idle); a worker that keeps watch over the queue makes `outbox.ring`
skip it. A scratch database (`<database>_guard_server`) is created on $DATABASE_URL's
server, migrated, used and dropped.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg
from benchlib import scratch_database
from sqlalchemy import make_url, text

from outbox import (
    Effect,
    IdempotencyGuard,
    StoredResponse,
    _driver,
    fingerprint,
    make_engine,
)
from outbox._config import database_url
from outbox._migrate import upgrade

FORMS = ("key_only", "key_plain_rows", "effect_rows", "effect_rows_no_check",
         "effect_rows_few_indexes", "effect_keys", "full")


def log(msg: str) -> None:
    print(f"[bench-guard-server {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr,
          flush=True)


def captured_request(url: str) -> list[tuple[str, dict[str, Any]]]:
    """The statements (psycopg style) and parameters of one real guarded request."""
    seen: list[tuple[str, dict[str, Any]]] = []
    execute = _driver.SyncDB.execute

    def spy(self: Any, statement: Any, params: Any = None, **kw: Any) -> Any:
        seen.append((statement.sql, dict(params or {})))
        return execute(self, statement, params, **kw)

    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE orders (id bigserial PRIMARY KEY, key text,"
                          " amount int)"))

    def work(conn: Any, claim: Any) -> StoredResponse:
        order = conn.execute(text("INSERT INTO orders (key, amount) VALUES ('k', 42)"
                                  " RETURNING id")).scalar_one()
        claim.enqueue_many([Effect("bench.charge", {"order_id": order, "amount": 42}),
                            Effect("bench.receipt", {"order_id": order})])
        return StoredResponse(201, (("content-type", "application/json"),), b'{"id": 1}')

    _driver.SyncDB.execute = spy  # type: ignore[method-assign]
    try:
        IdempotencyGuard().run(engine, "bench", uuid.uuid4().hex,
                               fingerprint("POST", "/orders", {"amount": 42}), work)
    finally:
        _driver.SyncDB.execute = execute  # type: ignore[method-assign]
        engine.dispose()
    if len(seen) != 2:
        raise SystemExit(f"expected the lock-and-read and the key's write, saw {len(seen)}"
                         " statements: the guard changed, and so must this script")
    return seen


def cut(pattern: str, sql: str, replacement: str = "") -> str:
    """`sql` with `pattern` (a regex, DOTALL) replaced; loud if it is not there."""
    done, n = re.subn(pattern, replacement, sql, count=1, flags=re.S)
    if n != 1:
        raise SystemExit(f"the key's write no longer has {pattern!r}: update this script")
    return done


def forms(write: str) -> dict[str, str]:
    """The key's write in each form of the module's docstring."""
    no_bell = cut(r",\s*\(SELECT count\(\*\) FROM bell\) AS rang",
                  cut(r", bell AS \(.*?AS d\s*\)", write))
    rows = cut(r"keyed AS \(.*?RETURNING effect_key, effect_id\s*\), ", no_bell)
    rows = cut(r"SELECT keyed\.effect_id, t\.k", rows,
               "SELECT nextval('outbox.effects_id_seq'), t.k")
    rows = cut(r"FROM t JOIN keyed ON keyed\.effect_key = t\.k", rows, "FROM t")
    key = cut(r"^WITH written AS \((.*?)\n\), .*$", write, r"\1")
    plain = (f"WITH written AS ({key}) INSERT INTO plain_outbox (topic, payload)"
             " SELECT r.kind, r.p FROM jsonb_to_recordset(CAST(%(rows)s AS jsonb))"
             " AS r(kind text, p jsonb) WHERE EXISTS (SELECT 1 FROM written)")
    return {
        "key_only": key, "key_plain_rows": plain, "effect_rows": rows,
        "effect_rows_no_check": rows.replace("INSERT INTO outbox.effects",
                                             "INSERT INTO no_check.effects"),
        "effect_rows_few_indexes": rows.replace("INSERT INTO outbox.effects",
                                                "INSERT INTO few_indexes.effects"),
        "effect_keys": no_bell, "full": write}


SCRATCH_TABLES = """
CREATE TABLE plain_outbox (id bigserial PRIMARY KEY, topic text NOT NULL,
    payload jsonb NOT NULL, status text NOT NULL DEFAULT 'pending',
    attempts int NOT NULL DEFAULT 0, created_at timestamptz NOT NULL DEFAULT now(),
    claimed_at timestamptz, delivered_at timestamptz);
CREATE INDEX ON plain_outbox (id) WHERE status = 'pending';
CREATE INDEX ON plain_outbox (claimed_at) WHERE status = 'in_flight';
CREATE SCHEMA no_check;
CREATE TABLE no_check.effects (LIKE outbox.effects INCLUDING ALL);
ALTER TABLE no_check.effects DROP CONSTRAINT effects_row_check;
CREATE SCHEMA few_indexes;
CREATE TABLE few_indexes.effects (LIKE outbox.effects INCLUDING DEFAULTS);
ALTER TABLE few_indexes.effects ADD PRIMARY KEY (id);
CREATE INDEX ON few_indexes.effects (queue, available_at, id) WHERE status = 'pending';
"""


def measure(url: str, requests: int, blocks: int) -> dict[str, Any]:
    (read_sql, read_params), (write_sql, write_params) = captured_request(url)
    shapes = forms(write_sql)
    conn = psycopg.connect(url, prepare_threshold=0)
    for ddl in filter(str.strip, SCRATCH_TABLES.split(";")):
        conn.execute(ddl)
    conn.commit()
    pid = conn.info.backend_pid

    def backend_seconds() -> float:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9

    def request(write: str) -> None:
        key = uuid.uuid4().hex
        params = {**write_params, "key": key, "generation": uuid.uuid4()}
        rows = json.loads(params["rows"])
        for row in rows:  # fresh effect keys each time
            row["k"] = f"{row['kind']}:{uuid.uuid4().hex}"
        params["rows"] = json.dumps(rows)
        with conn.transaction():
            conn.execute(read_sql, {**read_params, "key": key,
                                    "lock_id": hash(key) & 0x7FFFFFFFFFFFFFFF}).fetchall()
            conn.execute("INSERT INTO orders (key, amount) VALUES (%s, 42)", (key,))
            conn.execute(write, {k: v for k, v in params.items() if f"%({k})s" in write})

    runs: dict[str, Callable[[], None]] = {
        name: (lambda sql=sql: request(sql)) for name, sql in shapes.items()}
    for run in runs.values():  # plans, prepared statements, caches, index growth
        for _ in range(max(300, requests // 2)):
            run()
    per: dict[str, list[float]] = {name: [] for name in runs}
    for b in range(blocks):
        for name in FORMS[b % len(FORMS):] + FORMS[:b % len(FORMS)]:
            t0 = backend_seconds()
            for _ in range(requests):
                runs[name]()
            per[name].append((backend_seconds() - t0) / requests * 1e6)
        log(f"block {b + 1}/{blocks} done")
    conn.close()
    medians = {name: round(statistics.median(v), 1) for name, v in per.items()}
    # Each step's cost as the difference of two forms in the same block (paired: the
    # box's drift between blocks cancels), its median and range over the blocks.
    pairs = {
        "plain_rows_us": ("key_plain_rows", "key_only"),
        "effect_rows_us": ("effect_rows", "key_only"),
        "row_rules_us": ("effect_rows", "effect_rows_no_check"),
        "indexes_and_rules_us": ("effect_rows", "effect_rows_few_indexes"),
        "effect_keys_us": ("effect_keys", "effect_rows"),
        "doorbell_us": ("full", "effect_keys"),
        "full_over_plain_us": ("full", "key_plain_rows"),
    }
    added: dict[str, dict[str, float]] = {}
    for step, (a, b) in pairs.items():
        diffs = [x - y for x, y in zip(per[a], per[b], strict=True)]
        added[step] = {"median": round(statistics.median(diffs), 1),
                       "min": round(min(diffs), 1), "max": round(max(diffs), 1)}
    return {"backend_us_per_transaction": medians,
            "blocks_us": {k: [round(x, 1) for x in v] for k, v in per.items()},
            "added_us": added}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--requests", type=int, default=800)
    parser.add_argument("--blocks", type=int, default=5)
    args = parser.parse_args(argv)
    base = make_url(database_url())
    with scratch_database(base, f"{base.database}_guard_server") as url:
        plain = url.render_as_string(hide_password=False)
        upgrade(plain)
        log(f"{len(FORMS)} forms x {args.blocks} blocks x {args.requests} transactions")
        report = {"bench": "guard_server", "requests_per_block": args.requests,
                  "blocks": args.blocks, **measure(
                      plain.replace("postgresql+psycopg://", "postgresql://"),
                      args.requests, args.blocks)}
    print(json.dumps(report, separators=(",", ":")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
