#!/usr/bin/env python3
"""Client CPU per guarded request, one thread, against any checkout: prints ONE JSON line.

    uv run python bench/bench_guard_cpu.py [--tree PATH] [--requests 300] [--blocks 8]
                                           [--cursor] [--against URL]

`--tree` is a checkout (a `git worktree` of an older commit, say) whose `outbox` package
is imported instead of this one, so two trees can be compared in one sitting; give each
tree its own database (DATABASE_URL), as each migrates it to its own head. Variants, in
interleaved blocks of --requests each: `bare` (BEGIN; INSERT; COMMIT on a make_engine()
Engine), `guarded` (guard.run, atomic, the order row and 2 effects by enqueue_many) and,
where the tree has Claim.enqueue_many, `deferred` (the same 2 effects deferred to the
key's write). `--cursor` adds `deferred_cursor`: `deferred` with every statement
through a psycopg cursor and the BEGIN and COMMIT apart (`outbox._driver.DIRECT =
False`, as `OUTBOX_PSYCOPG_CURSOR=1`; session 11's A/B), in the same blocks. Per
variant the median over the blocks of process time per request (this process:
Python, psycopg, the kernel's socket work), of PostgreSQL's CPU per request (every
`postgres` process on this host, from /proc) and of wall time per request, and bare
/ variant for each. `--against URL` runs each variant a second time, in the same
blocks, on another database left at whatever schema revision it is (`<variant>@b`):
two revisions of the schema with the same code (session 12: the row rules, migration
0013, against 0012). This database is migrated to head; that one is not touched.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--cursor", action="store_true",
                        help="add `deferred_cursor`: statements through psycopg's cursor")
    parser.add_argument("--against", metavar="URL",
                        help="run each variant on this database too (not migrated)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(args.tree).resolve()))

    from sqlalchemy import text

    from outbox import (
        Claim,
        Effect,
        IdempotencyGuard,
        StoredResponse,
        enqueue_many,
        fingerprint,
        make_engine,
    )
    from outbox._config import database_url
    from outbox._migrate import upgrade

    upgrade(database_url())
    table = f"bench_guard_cpu_{uuid.uuid4().hex[:8]}"
    scope = f"bench-cpu:{table}"
    guard = IdempotencyGuard()
    body = {"amount": 42, "currency": "EUR", "customer": "bench"}
    engines = [make_engine()] + ([make_engine(url=args.against)] if args.against else [])
    for engine in engines:
        with engine.begin() as conn:
            conn.execute(text(f"CREATE TABLE {table} (id bigserial PRIMARY KEY,"
                              " key text NOT NULL, amount int NOT NULL)"))
    insert = text(f"INSERT INTO {table} (key, amount) VALUES (:k, :a) RETURNING id")

    def work(key: str, deferred: bool) -> Callable[[Any, Any], StoredResponse]:
        def run(conn: Any, claim: Any) -> StoredResponse:
            order_id = conn.execute(insert, {"k": key, "a": 42}).scalar_one()
            pair = [Effect("bench.charge", {"order_id": order_id, "amount": 42}, queue=scope),
                    Effect("bench.receipt", {"order_id": order_id}, queue=scope)]
            if deferred:
                claim.enqueue_many(pair)
            else:
                enqueue_many(conn, pair, claim=claim)
            return StoredResponse(201, (("content-type", "application/json"),),
                                  json.dumps({"id": order_id}).encode())
        return run

    def on(engine: Any) -> dict[str, Callable[[], None]]:
        def bare() -> None:
            with engine.begin() as conn:
                conn.execute(insert, {"k": uuid.uuid4().hex, "a": 42}).scalar_one()

        def guarded(deferred: bool = False) -> None:
            key = uuid.uuid4().hex
            guard.run(engine, scope, key, fingerprint("POST", "/orders", body),
                      work(key, deferred))

        found: dict[str, Callable[[], None]] = {"bare": bare, "guarded": guarded}
        if hasattr(Claim, "enqueue_many"):
            found["deferred"] = lambda: guarded(True)
        return found

    variants = on(engines[0])
    if args.against:
        variants.update({f"{name}@b": fn for name, fn in on(engines[1]).items()})
    direct = {name: True for name in variants}
    if args.cursor:
        from outbox import _driver

        variants["deferred_cursor"] = variants["deferred"]
        direct["deferred_cursor"] = False

        def switch(name: str) -> None:
            _driver.DIRECT = direct[name]
    else:
        def switch(name: str) -> None:
            pass
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_guard_steps import postgres_cpu_seconds

    per: dict[str, list[float]] = {name: [] for name in variants}
    server: dict[str, list[float]] = {name: [] for name in variants}
    wall: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for name, fn in variants.items():  # warm plans, prepared statements and caches
            switch(name)
            for _ in range(200):
                fn()
        for _ in range(args.blocks):
            for name, fn in variants.items():
                switch(name)
                pg0, w0 = postgres_cpu_seconds(), time.perf_counter()
                started = time.process_time()
                for _ in range(args.requests):
                    fn()
                per[name].append((time.process_time() - started) / args.requests)
                server[name].append((postgres_cpu_seconds() - pg0) / args.requests)
                wall[name].append((time.perf_counter() - w0) / args.requests)
    finally:
        for engine in engines:
            with engine.begin() as conn:
                conn.execute(text(f"DROP TABLE IF EXISTS {table}"))
                conn.execute(text("DELETE FROM outbox.effects WHERE queue = :q"),
                             {"q": scope})
                conn.execute(text("DELETE FROM outbox.idempotency_keys WHERE scope = :s"),
                             {"s": scope})
            engine.dispose()
    medians = {name: statistics.median(values) for name, values in per.items()}
    pg = {name: statistics.median(values) for name, values in server.items()}
    walls = {name: statistics.median(values) for name, values in wall.items()}
    report: dict[str, Any] = {"bench": "guard_cpu", "tree": args.tree,
                              "requests_per_block": args.requests, "blocks": args.blocks}
    for name, value in medians.items():
        report[f"{name}_cpu_ms"] = round(value * 1000, 3)
        report[f"{name}_postgres_ms"] = round(pg[name] * 1000, 3)
        report[f"{name}_wall_ms"] = round(walls[name] * 1000, 3)
        bare = "bare@b" if name.endswith("@b") else "bare"
        if name != bare:
            report[f"{bare}_over_{name}"] = round(medians[bare] / value, 3)
            both = value + pg[name]
            report[f"{bare}_over_{name}_box"] = round(
                (medians[bare] + pg[bare]) / both, 3) if both else None
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
