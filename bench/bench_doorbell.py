#!/usr/bin/env python3
"""What the enqueue's doorbell costs the database, and what a watching worker saves.

    uv run python bench/bench_doorbell.py [--clients 1,4,8] [--seconds 6] [--rounds 2]
        [--parts pgbench,stack]

Prints ONE JSON line per cell and a summary line. Needs pgbench (Debian's
postgresql-client) for the first part; uses $DATABASE_URL's server (default
127.0.0.1:5432) and a scratch database of its own, `bench_doorbell`.

`pgbench`: the raw-SQL ceiling's enqueue transaction (../shared/bench/pgbench_outbox.py:
BEGIN; INSERT business; INSERT outbox; COMMIT, prepared) with the doorbell fused into
the outbox INSERT, as our enqueue statement carries it, in four forms, interleaved
round by round: `none` (no doorbell), `notify` (`pg_notify`, the enqueue before
migration 0010), `ring` (`outbox.ring`, nobody watching: it NOTIFYs) and
`ring_watched` (`outbox.ring` while a session holds a watch slot of the queue, as a
busy worker does: no NOTIFY). A NOTIFY holds the cluster's notify-queue lock from
before the commit record until after its flush, so notifying commits do not share a
WAL flush: the gap between `none` and `notify` grows with the clients.

`stack`: our own enqueue (`outbox.enqueue` on a psycopg connection, one effect per
business transaction) from 4 processes for --seconds while one standalone worker
(`run_worker`, no-op handler) delivers, with and without its watch (`watch=False`):
enqueue transactions/s and effects delivered/s. On a 2-core box the Python clients
and the worker share the cores with PostgreSQL, so this part shows what the watch
saves where the box is not already full.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import make_url

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchlib import pgbench  # noqa: E402

DB = "bench_doorbell"

SCHEMA = """
DROP TABLE IF EXISTS business, outbox_raw;
CREATE TABLE business (id bigserial PRIMARY KEY, customer int NOT NULL,
                       amount numeric(12,2) NOT NULL,
                       created_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE outbox_raw (id bigserial PRIMARY KEY, topic text NOT NULL, payload jsonb NOT NULL,
                         status text NOT NULL DEFAULT 'pending', attempts int NOT NULL DEFAULT 0,
                         created_at timestamptz NOT NULL DEFAULT now(), claimed_at timestamptz,
                         delivered_at timestamptz);
CREATE INDEX ON outbox_raw (id) WHERE status = 'pending';
CREATE INDEX ON outbox_raw (claimed_at) WHERE status = 'in_flight';
"""

BELLS = {
    "none": "SELECT 1 FROM i",
    "notify": "SELECT pg_notify('outbox_due', 'default') FROM i",
    "ring": "SELECT outbox.ring('outbox_due', 'default') FROM i",
    "ring_watched": "SELECT outbox.ring('outbox_due', 'default') FROM i",
}

SCRIPT = """\\set cust random(1, 100000)
BEGIN;
INSERT INTO business (customer, amount) VALUES (:cust, 10.00);
WITH i AS (INSERT INTO outbox_raw (topic, payload) VALUES ('order.created',
  jsonb_build_object('order_id', currval('business_id_seq'), 'customer', :cust::int))
  RETURNING 1) {bell};
COMMIT;
"""


def server_url() -> str:
    return os.environ.get("DATABASE_URL", "postgresql://root@127.0.0.1:5432/test")


def scratch_url() -> str:
    return make_url(server_url()).set(drivername="postgresql", database=DB) \
        .render_as_string(hide_password=False)


def prepare() -> None:
    admin = make_url(server_url()).set(drivername="postgresql") \
        .render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DB,)).fetchone():
            conn.execute(f"CREATE DATABASE {DB}")
    from outbox._migrate import upgrade
    upgrade(scratch_url())
    with psycopg.connect(scratch_url(), autocommit=True) as conn:
        conn.execute(SCHEMA)


def pgbench_cell(bell: str, clients: int, seconds: float) -> dict[str, Any]:
    from outbox.sql.watch import SLOTS
    url = make_url(scratch_url())
    watcher = None
    try:
        if bell == "ring_watched":  # a busy worker's slot, held for the whole run
            watcher = psycopg.connect(scratch_url(), autocommit=True)
            assert watcher.execute("SELECT pg_try_advisory_lock(%s, hashtext('default'))",
                                   (SLOTS[0],)).fetchone() == (True,)
        with psycopg.connect(scratch_url(), autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE business, outbox_raw")
            conn.execute("CHECKPOINT")
        out = pgbench(url, SCRIPT.format(bell=BELLS[bell]), seconds=seconds,
                      clients=clients)
        tps = next(float(line.split()[2]) for line in out.splitlines()
                   if line.startswith("tps"))
    finally:
        if watcher is not None:
            watcher.close()
    return {"bench": "doorbell", "part": "pgbench", "bell": bell, "clients": clients,
            "seconds": seconds, "tps": round(tps, 1)}


# -- the stack part -------------------------------------------------------------------


def _enqueuer(url: str, seconds: float, start: Any, counts: Any, index: int) -> None:
    from outbox import enqueue
    with psycopg.connect(url) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS bench_orders"
                     " (id bigserial PRIMARY KEY, amount int NOT NULL)")
        conn.commit()
        start.wait()
        end = time.monotonic() + seconds
        n = 0
        while time.monotonic() < end:
            with conn.transaction():
                oid = conn.execute("INSERT INTO bench_orders (amount) VALUES (42)"
                                   " RETURNING id").fetchone()
                enqueue(conn, "noop", {"order": oid[0] if oid else None},
                        queue="doorbell-bench")
            n += 1
        counts[index] = n


def stack_cell(watch: bool, clients: int, seconds: float) -> dict[str, Any]:
    from sqlalchemy import text

    from dispatcher import Dispatcher, Registry
    from dispatcher.worker import run_worker
    from outbox import make_engine

    url = scratch_url()
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM outbox.effects WHERE queue = 'doorbell-bench'"))
    registry = Registry()
    registry.register("noop", lambda e: {"ok": True})
    dispatcher = Dispatcher(engine, registry, queue="doorbell-bench", concurrency=16)
    stop = threading.Event()
    worker = threading.Thread(target=run_worker, args=(dispatcher,), kwargs={
        "poll_interval": 1.0, "stop": stop, "install_signals": False, "watch": watch})
    worker.start()
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    counts = ctx.Array("l", clients)
    procs = [ctx.Process(target=_enqueuer, args=(url, seconds, start, counts, i))
             for i in range(clients)]
    for p in procs:
        p.start()
    time.sleep(2.0)  # imports and connections
    delivered0 = dispatcher.stats.recorded.get("delivered", 0)
    start.set()
    t0 = time.monotonic()
    for p in procs:
        p.join()
    took = time.monotonic() - t0
    delivered = dispatcher.stats.recorded.get("delivered", 0) - delivered0
    stop.set()
    dispatcher.wake.set()
    worker.join(30)
    kept = dispatcher.watch.watches if dispatcher.watch is not None else 0
    engine.dispose()
    return {"bench": "doorbell", "part": "stack", "watch": watch, "clients": clients,
            "seconds": seconds, "enqueue_tps": round(sum(counts) / seconds, 1),
            "delivered_per_s": round(delivered / took, 1), "watches_kept": kept}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--clients", default="1,4,8")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--parts", default="pgbench,stack")
    parser.add_argument("--stack-clients", type=int, default=4)
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    prepare()
    cells: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        if "pgbench" in parts:
            for clients in [int(c) for c in args.clients.split(",")]:
                for bell in BELLS:
                    cells.append(pgbench_cell(bell, clients, args.seconds))
                    print(json.dumps(cells[-1]), flush=True)
        if "stack" in parts:
            for watch in (False, True):
                cells.append(stack_cell(watch, args.stack_clients, args.seconds))
                print(json.dumps(cells[-1]), flush=True)
    summary: dict[str, Any] = {"bench": "doorbell", "summary": True}
    for cell in cells:
        if cell["part"] == "pgbench":
            summary.setdefault(f"pgbench_{cell['bell']}_{cell['clients']}c", []).append(
                cell["tps"])
        else:
            name = "watch" if cell["watch"] else "nowatch"
            summary.setdefault(f"stack_{name}_enqueue_tps", []).append(cell["enqueue_tps"])
            summary.setdefault(f"stack_{name}_delivered_per_s", []).append(
                cell["delivered_per_s"])
    for key, values in list(summary.items()):
        if isinstance(values, list):
            summary[key] = round(statistics.median(values), 1)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
