#!/usr/bin/env python3
"""The web console's queries on a million effects: EXPLAIN ANALYZE, one JSON line each.

    uv run python bench/bench_console.py                 # 1M effects, about 2 minutes
    uv run python bench/bench_console.py --rows 200000   # quicker
    uv run python bench/bench_console.py --keep          # keep the database afterwards

Builds a database of its own (`outbox_console_bench` on the server of $DATABASE_URL, or
the embedded one), migrates it, fills it with generate_series and runs VACUUM ANALYZE
(the service PostgreSQL on our machines runs with autovacuum off). The rows, by id
(= time) order over the last 7 days:

  kinds      psp.charge 50 %, email.receipt 40 %, webhook.crm 10 %, `rare.kind` 1 in 10,000
  queues     default 80 %, mail 15 %, crm 5 %
  statuses   delivered, except: failed = one outage burst (every other row of ids 15-17 %
             of the table: 1 %, all old); needs_review 0.1 % and cancelled 0.2 % spread
             evenly; pending = half of the newest 2 % plus 1 in 50,000 old ones (stuck
             behind an ordering key); in_flight = 50 of the newest rows
  ordering   10 % of rows carry one of 10,007 ordering keys
  attempts   one per finished effect (delivered, failed, needs_review)

Each case prints {"case", "ms_median", "ms_max", "rows", "plan"} where the times are
the server's Execution Time of EXPLAIN (ANALYZE, BUFFERS) over 5 runs after one warm-up
and `plan` names the scan nodes and indexes. Then whole pages over HTTP (Starlette's
TestClient, no network), median of 5. Record results in docs/console.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import Connection, TextClause, create_engine, make_url, text
from sqlalchemy.pool import NullPool

from outbox import _migrate
from outbox._config import database_url, make_engine
from outbox.sql import console as cq
from outbox.sql import effects as fx
from outbox.sql.console import EffectFilter

DB = "outbox_console_bench"

SEED = """
INSERT INTO outbox.effects (effect_key, kind, payload, headers, ordering_key, queue, status,
   attempts, max_attempts, available_at, created_at, delivered_at, finished_at, last_error,
   lease_owner, lease_token, lease_expires_at, delivered_by, delivered_started_at,
   delivered_http_status)
SELECT kind || ':' || md5(i::text), kind,
       jsonb_build_object('payment_id', i, 'amount', i % 1000,
                          'card', jsonb_build_object('number', '4242424242424242')),
       '{}'::jsonb,
       CASE WHEN i % 10 = 0 THEN 'cust-' || (i % 10007) END,
       queue, status,
       CASE WHEN status IN ('pending', 'in_flight') THEN 0 ELSE 1 END, 25,
       ts, ts,
       CASE WHEN status = 'delivered' THEN ts + interval '1 s' END,
       CASE WHEN status IN ('delivered', 'failed', 'cancelled', 'needs_review')
            THEN ts + interval '1 s' END,
       CASE WHEN status = 'failed' THEN 'HTTP 503 from PSP' END,
       CASE WHEN status = 'in_flight' THEN 'bench-worker' END,
       CASE WHEN status = 'in_flight' THEN gen_random_uuid() END,
       CASE WHEN status = 'in_flight' THEN now() + interval '30 s' END,
       CASE WHEN status = 'delivered' THEN 'bench-worker' END,
       CASE WHEN status = 'delivered' THEN ts END,
       CASE WHEN status = 'delivered' THEN 200 END
FROM (
  SELECT i,
    CASE WHEN i % 10000 = 7 THEN 'rare.kind' WHEN i % 100 < 50 THEN 'psp.charge'
         WHEN i % 100 < 90 THEN 'email.receipt' ELSE 'webhook.crm' END AS kind,
    CASE WHEN i % 100 < 80 THEN 'default' WHEN i % 100 < 95 THEN 'mail' ELSE 'crm' END
      AS queue,
    CASE WHEN i > :n - 100 AND i % 2 = 1 THEN 'in_flight'
         WHEN i > :n * 0.98 AND i % 2 = 0 THEN 'pending'
         WHEN i % 50000 = 21 THEN 'pending'
         WHEN i >= :n * 0.15 AND i < :n * 0.17 AND i % 2 = 0 THEN 'failed'
         WHEN i % 1000 = 15 THEN 'needs_review'
         WHEN i % 500 = 14 THEN 'cancelled'
         ELSE 'delivered' END AS status,
    now() - interval '7 days' + (i * (interval '7 days' / :n)) AS ts
  FROM generate_series(1, :n) AS i) AS s
"""

# As the dispatcher leaves them since migration 0006: a delivery on the effect row, the
# other outcomes as attempts rows; every key in outbox.effect_keys (0007).
SEED_ATTEMPTS = """
INSERT INTO outbox.attempts (effect_id, attempt, worker, started_at, finished_at, outcome,
                             http_status, error)
SELECT id, 1, 'bench-worker', created_at, created_at + interval '80 ms',
       CASE status WHEN 'failed' THEN 'failed' ELSE 'ambiguous' END,
       CASE status WHEN 'failed' THEN 503 END,
       CASE status WHEN 'failed' THEN 'HTTP 503 from PSP' END
  FROM outbox.effects WHERE status IN ('failed', 'needs_review') ORDER BY id
"""

SEED_KEYS = "INSERT INTO outbox.effect_keys (effect_key, effect_id) SELECT effect_key, id" \
    " FROM outbox.effects"


def _scans(node: dict[str, Any], out: list[str]) -> list[str]:
    kind = node.get("Node Type", "")
    if "Scan" in kind or kind in ("Sort", "Limit", "Merge Append", "Append"):
        label = kind
        if node.get("Index Name"):
            label += f" {node['Index Name']}"
        if node.get("Scan Direction") == "Backward":
            label += " (backward)"
        if "Rows Removed by Filter" in node:
            label += f" [filter removed {node['Rows Removed by Filter']}]"
        if kind not in ("Limit",):
            out.append(label)
    for child in node.get("Plans", []):
        _scans(child, out)
    return out


def explain(conn: Connection, case: str, stmt: TextClause, params: dict[str, Any],
            runs: int = 5) -> dict[str, Any]:
    query = text("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + stmt.text)
    times: list[float] = []
    plan: dict[str, Any] = {}
    for i in range(runs + 1):
        doc = conn.execute(query, params).scalar_one()
        top = doc[0]
        if i:
            times.append(float(top["Execution Time"]))
        plan = top["Plan"]
    out = {"case": case, "ms_median": round(statistics.median(times), 3),
           "ms_max": round(max(times), 3), "rows": plan.get("Actual Rows"),
           "plan": " > ".join(_scans(plan, []))}
    print(json.dumps(out), flush=True)
    return out


def seed(url: str, rows: int) -> None:
    engine = make_engine(url, application_name="bench-console", call_timeout=None)
    with engine.begin() as conn:
        conn.execute(text("SET LOCAL synchronous_commit = off"))
        if conn.execute(text("SELECT count(*) FROM outbox.effects")).scalar_one() == rows:
            print(json.dumps({"seed": "reused", "rows": rows}), file=sys.stderr)
            return
        conn.execute(text("TRUNCATE outbox.effect_keys, outbox.effects, outbox.attempts"
                          " RESTART IDENTITY CASCADE"))
        started = time.perf_counter()
        conn.execute(text(SEED), {"n": rows})
        conn.execute(text(SEED_ATTEMPTS))
        conn.execute(text(SEED_KEYS))
        seeded = time.perf_counter() - started
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE outbox.effects"))
        conn.execute(text("VACUUM ANALYZE outbox.attempts"))
        counts = {r.status: r.n for r in conn.execute(text(
            "SELECT status, count(*) AS n FROM outbox.effects GROUP BY status"))}
        size = conn.execute(text(
            "SELECT pg_size_pretty(pg_total_relation_size('outbox.effects')) AS total,"
            " pg_size_pretty(pg_relation_size('outbox.effects_console_idx')) AS idx")).one()
    print(json.dumps({"seeded_s": round(seeded, 1), "counts": counts, "effects_total": size.total,
                      "effects_console_idx": size.idx}), flush=True)
    engine.dispose()


def list_case(conn: Connection, case: str, f: EffectFilter, bytewise: bool,
              **page: Any) -> None:
    stmt, params = cq.list_statement(f, limit=51, bytewise_keys=bytewise, **page)
    explain(conn, f"list: {case}", stmt, params)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--keep", action="store_true", help="keep the database")
    args = parser.parse_args()

    server = make_url(database_url())
    admin = create_engine(server, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as conn:
        if not conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :d"),
                            {"d": DB}).first():
            conn.execute(text(f'CREATE DATABASE "{DB}"'))
    url = server.set(database=DB).render_as_string(hide_password=False)
    try:
        _migrate.upgrade(url)
        seed(url, args.rows)
        engine = make_engine(url, application_name="bench-console", call_timeout=None)
        n = args.rows
        with engine.connect() as conn:
            conn.execute(text("SET max_parallel_workers_per_gather = 0"))  # as under load
            bytewise = cq.effect_keys_sort_bytewise(conn)
            print(json.dumps({"effect_keys_sort_bytewise": bytewise,
                              "server": conn.execute(text("SHOW server_version")).scalar()}))
            list_case(conn, "newest page, no filter", EffectFilter(), bytewise)
            list_case(conn, "page at the middle (before = n/2)", EffectFilter(), bytewise,
                      before=n // 2)
            list_case(conn, "newer page (after = n/2)", EffectFilter(), bytewise, after=n // 2)
            list_case(conn, "status=failed (an old burst)", EffectFilter(("failed",)), bytewise)
            list_case(conn, "status=failed, deep page", EffectFilter(("failed",)), bytewise,
                      before=int(n * 0.155))
            list_case(conn, "failed + needs_review (dead letters)",
                      EffectFilter(("failed", "needs_review")), bytewise)
            list_case(conn, "status=failed, queue=crm",
                      EffectFilter(("failed",), queue="crm"), bytewise)
            list_case(conn, "status=pending", EffectFilter(("pending",)), bytewise)
            list_case(conn, "status=pending, older=1d (the stuck ones)",
                      EffectFilter(("pending",), older_than=86400), bytewise)
            list_case(conn, "status=in_flight", EffectFilter(("in_flight",)), bytewise)
            list_case(conn, "status=cancelled, kind=webhook.crm",
                      EffectFilter(("cancelled",), kind="webhook.crm"), bytewise)
            list_case(conn, "status=delivered, kind=webhook.crm",
                      EffectFilter(("delivered",), kind="webhook.crm"), bytewise)
            list_case(conn, "queue=crm", EffectFilter(queue="crm"), bytewise)
            list_case(conn, "kind=rare.kind (1 in 10,000, no status)",
                      EffectFilter(kind="rare.kind"), bytewise)
            list_case(conn, "ordering_key=cust-42", EffectFilter(ordering_key="cust-42"),
                      bytewise)
            list_case(conn, "ordering_key=cust-42, status=failed",
                      EffectFilter(("failed",), ordering_key="cust-42"), bytewise)
            list_case(conn, "key prefix psp.charge:abc",
                      EffectFilter(key_prefix="psp.charge:abc"), bytewise)
            list_case(conn, "key prefix psp.charge:abc (linguistic-collation fallback)",
                      EffectFilter(key_prefix="psp.charge:abc"), False)
            list_case(conn, "key prefix psp. (half the table)",
                      EffectFilter(key_prefix="psp."), bytewise)
            list_case(conn, "newer=1h", EffectFilter(newer_than=3600), bytewise)
            list_case(conn, "older=6d (worst: the matches are the oldest rows)",
                      EffectFilter(older_than=6 * 86400), bytewise)
            list_case(conn, "status=failed, older=6d",
                      EffectFilter(("failed",), older_than=6 * 86400), bytewise)

            explain(conn, "overview: counts of unfinished by queue/status",
                    cq._UNFINISHED_COUNTS, {})
            explain(conn, "overview: pending due/later/oldest by queue", cq._PENDING_BY_QUEUE,
                    {"now": None})
            explain(conn, "overview: expired leases", cq._EXPIRED_LEASES, {"now": None})
            explain(conn, "overview: attempts per minute, last 60 min",
                    cq._ATTEMPTS_PER_MINUTE, {"minutes": 60, "now": None})
            explain(conn, "overview: processing/stale keys", cq._PROCESSING_KEYS, {"now": None})
            explain(conn, "overview: blocked ordering keys (effects.py)", fx._BLOCKED_KEYS, {})
            explain(conn, "overview: delivered by queue, exact (skipped above 200k rows)",
                    cq._DELIVERED_COUNTS, {}, runs=2)
            explain(conn, "redrive: count failed, queue=crm (cap 10,000)",
                    cq._redrivable_statement(("queue",)),
                    EffectFilter(queue="crm").params() | {"cap": 10_000, "now": None})
            effect = conn.execute(text(
                "SELECT id, created_at FROM outbox.effects WHERE status = 'failed' LIMIT 1")
            ).one()
            explain(conn, "effect page: the row", cq._EFFECT, {"id": effect.id})
            explain(conn, "effect page: its attempts", fx._ATTEMPTS, {"effect_id": effect.id})
        pages(engine)
        engine.dispose()
    finally:
        if not args.keep:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)'))
        admin.dispose()
    return 0


def pages(engine: Any) -> None:
    """Whole pages through the ASGI app: the queries plus rendering."""
    from outbox.console import create_console_app

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient

    with engine.connect() as conn:
        failed = conn.execute(text(
            "SELECT id FROM outbox.effects WHERE status = 'failed' LIMIT 1")).scalar_one()
    app = create_console_app(engine)
    with TestClient(app, base_url="http://127.0.0.1", client=("127.0.0.1", 1)) as client:
        for path in ("/", "/effects", "/effects?status=failed",
                     "/effects?status=failed&status=needs_review&queue=crm",
                     "/effects?kind=rare.kind", "/effects?key=psp.charge%3Aab",
                     f"/effects/{failed}", "/redrive?queue=crm"):
            times = []
            status = 0
            for _ in range(6):
                started = time.perf_counter()
                got = client.get(path)
                times.append((time.perf_counter() - started) * 1000)
                status = got.status_code
            print(json.dumps({"page": path, "status": status,
                              "ms_median": round(statistics.median(times[1:]), 1)}),
                  flush=True)


if __name__ == "__main__":
    sys.exit(main())
