#!/usr/bin/env python3
"""A guarded request's cost, step by step, client and server: prints ONE JSON line.

    uv run python bench/bench_guard_steps.py [--requests 1000] [--blocks 5] [--pre-ping]

One thread, one request at a time, on a make_engine() Engine, so nothing is measured
but the work itself. Each step adds one part of the guarded request (atomic mode, two
effects deferred to the key's write) to the one before, written out by hand with the
guard's own statements; `guarded` is `guard.run` itself:

    bare        BEGIN; INSERT one order row; COMMIT (engine.begin(); with --pre-ping, a
                ping at its checkout too)
    lock_read   + the key's advisory lock and read (sql.keys.lock_and_read_key)
    key_write   + the completed key's write (sql.keys.insert_completed_key)
    effects     + two effects deferred to that write (Claim.enqueue_many, write_deferred)
    guarded     guard.run(engine, ...) doing all of the above, with its fingerprint

Per step, the median over --blocks interleaved blocks of --requests each of:
  client_us    this process's CPU time per request (Python, psycopg, its syscalls)
  postgres_us  CPU time of every `postgres` process on this host per request (/proc):
               the server's side, so the server must run on this host, otherwise 0
and each step's increment over the one before. `box_ratio` is bare's client + postgres
over guarded's: what the 8-thread benchmark's ratio tends to when the box's cores, not
one of the two sides, are the limit (bench_guard.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_HZ = os.sysconf("SC_CLK_TCK")


def postgres_cpu_seconds() -> float:
    """User + system CPU of every process named `postgres` on this host, so far."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if "(postgres)" not in stat:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / _HZ


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--pre-ping", action="store_true",
                        help="SQLAlchemy's ping at every checkout (pool_pre_ping=True), "
                        "as make_engine did before session 10, instead of its default")
    args = parser.parse_args(argv)

    from sqlalchemy import text

    from outbox import Effect, IdempotencyGuard, StoredResponse, fingerprint, make_engine
    from outbox._config import database_url
    from outbox._driver import drive, sync_db
    from outbox._enqueue import write_deferred
    from outbox._idempotency import Claim, advisory_lock_id
    from outbox._migrate import upgrade
    from outbox.sql import keys as sql_keys

    upgrade(database_url())
    engine = make_engine(pool_pre_ping=True) if args.pre_ping else make_engine()
    run_id = uuid.uuid4().hex[:8]
    table, scope = f"bench_steps_{run_id}", f"bench-steps:{run_id}"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {table} (id bigserial PRIMARY KEY, key text NOT NULL,"
                          " amount int NOT NULL)"))
    insert = text(f"INSERT INTO {table} (key, amount) VALUES (:k, :a) RETURNING id")
    guard = IdempotencyGuard()
    body = {"amount": 42, "currency": "EUR", "customer": "bench"}
    headers = (("content-type", "application/json"),)

    def effects(order_id: int) -> list[Effect]:
        return [Effect("bench.charge", {"order_id": order_id, "amount": 42}, queue=scope),
                Effect("bench.receipt", {"order_id": order_id}, queue=scope)]

    def by_hand(level: int) -> Callable[[], None]:
        def request() -> None:
            key = uuid.uuid4().hex
            with engine.begin() as conn:
                db = sync_db(conn)
                if level >= 1:
                    read = sql_keys.lock_and_read_key(advisory_lock_id(scope, key), scope, key)
                    read.parse(db.execute(read.statement, read.params))
                order_id = conn.execute(insert, {"k": key, "a": 42}).scalar_one()
                if level < 2:
                    return
                claim = Claim(scope, key, "f" * 64, "atomic", uuid.uuid4(),
                              generation=uuid.uuid4())
                if level >= 3:
                    claim.enqueue_many(effects(order_id))
                response = StoredResponse(201, headers, json.dumps({"id": order_id}).encode())
                write = sql_keys.insert_completed_key(
                    scope=scope, key=key, fingerprint=claim.fingerprint,
                    status=response.status, headers=response.header_list(),
                    body=response.body, retention_seconds=guard.retention,
                    generation=claim.generation)
                if level >= 3:
                    drive(db, write_deferred(claim, write))
                else:
                    write.parse(db.execute(write.statement, write.params))
        return request

    def guarded() -> None:
        key = uuid.uuid4().hex

        def work(conn: Any, claim: Claim) -> StoredResponse:
            order_id = conn.execute(insert, {"k": key, "a": 42}).scalar_one()
            claim.enqueue_many(effects(order_id))
            return StoredResponse(201, headers, json.dumps({"id": order_id}).encode())
        guard.run(engine, scope, key, fingerprint("POST", "/orders", body), work)

    steps: dict[str, Callable[[], None]] = {
        "bare": by_hand(0), "lock_read": by_hand(1), "key_write": by_hand(2),
        "effects": by_hand(3), "guarded": guarded}
    client: dict[str, list[float]] = {name: [] for name in steps}
    server: dict[str, list[float]] = {name: [] for name in steps}
    try:
        for step in steps.values():  # warm plans, prepared statements and caches
            for _ in range(300):
                step()
        for _ in range(args.blocks):
            for name, step in steps.items():
                pg0, cpu0 = postgres_cpu_seconds(), time.process_time()
                for _ in range(args.requests):
                    step()
                client[name].append((time.process_time() - cpu0) / args.requests * 1e6)
                server[name].append((postgres_cpu_seconds() - pg0) / args.requests * 1e6)
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP TABLE IF EXISTS {table}"))
            # Their effect_keys rows go with them (the effects_deleted trigger).
            conn.execute(text("DELETE FROM outbox.effects WHERE queue = :q"), {"q": scope})
            conn.execute(text("DELETE FROM outbox.idempotency_keys WHERE scope = :s"),
                         {"s": scope})
        engine.dispose()
    report: dict[str, Any] = {"bench": "guard_steps", "requests_per_block": args.requests,
                              "blocks": args.blocks, "pre_ping": args.pre_ping, "steps": {}}
    before: tuple[float, float] | None = None
    for name in steps:
        c, s = statistics.median(client[name]), statistics.median(server[name])
        row = {"client_us": round(c, 1), "postgres_us": round(s, 1)}
        if before is not None and name != "guarded":
            row.update(client_added_us=round(c - before[0], 1),
                       postgres_added_us=round(s - before[1], 1))
        report["steps"][name] = row
        if name != "guarded":
            before = (c, s)
    bare, full = report["steps"]["bare"], report["steps"]["guarded"]
    report["client_ratio"] = round(bare["client_us"] / full["client_us"], 3)
    both = full["client_us"] + full["postgres_us"]
    report["box_ratio"] = round((bare["client_us"] + bare["postgres_us"]) / both, 3) \
        if both else None
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
