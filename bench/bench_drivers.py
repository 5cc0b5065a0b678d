#!/usr/bin/env python3
"""enqueue on every handle vs. the same INSERTs written by hand on bare psycopg (issue 9).

    uv run python bench/bench_drivers.py [--tx 2000] [--rounds 3]

One client, one business transaction per iteration: INSERT one business row, enqueue
1 (or 2) effects, COMMIT. Per handle: transactions/s and client CPU per transaction
(`time.process_time`), interleaved in rounds so drift hits all alike. The baseline
`hand_psycopg` writes the same rows with a hand-written multi-row INSERT ... VALUES on
a psycopg connection (no key derivation, no trace context, no NOTIFY);
`hand_sa_connection` the same rows by hand on an Engine's `begin()`, the stack of
`sa_connection`. Prints ONE JSON line; ratios are ours / hand-written (CPU: lower is
better; throughput: higher), and for `sa_connection` also against the same stack.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from sqlalchemy import make_url, text  # noqa: E402
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine  # noqa: E402
from sqlalchemy.orm import sessionmaker  # noqa: E402

from outbox import Effect, enqueue_many  # noqa: E402
from outbox._config import database_url, make_engine  # noqa: E402
from outbox._enqueue import aenqueue_many  # noqa: E402
from outbox._migrate import upgrade  # noqa: E402

BUSINESS = "CREATE TABLE IF NOT EXISTS public.bench_orders (id bigserial PRIMARY KEY, n int)"
HAND = ("INSERT INTO outbox.effects (effect_key, kind, payload, headers, queue) VALUES "
        "(%s, 'bench', %s::jsonb, '{}'::jsonb, %s)")


def effects(n: int, i: int, queue: str) -> list[Effect]:
    return [Effect("bench", {"i": i, "j": j}, key=f"{queue}:{i}:{j}", queue=queue)
            for j in range(n)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tx", type=int, default=2000, help="transactions per cell")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--effects", type=int, nargs="*", default=[1, 2])
    args = parser.parse_args()
    url = database_url()
    upgrade(url)
    engine = make_engine(url, application_name="bench-drivers")
    dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    aengine = create_async_engine(make_url(url).set(drivername="postgresql+psycopg"))
    with engine.begin() as conn:
        conn.execute(text(BUSINESS))
    run = uuid.uuid4().hex[:8]
    results: dict[str, dict[str, list[float]]] = {}

    rounds_done: dict[str, int] = {}

    def cell(name: str, n: int, loop: Callable[[int, str], None]) -> None:
        r = rounds_done[f"{name}/{n}"] = rounds_done.get(f"{name}/{n}", 0) + 1
        queue = f"bench-{run}-{name}-{n}-r{r}"  # fresh effect keys in every round
        t0, c0 = time.perf_counter(), time.process_time()
        loop(n, queue)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        got = results.setdefault(f"{name}/{n}", {"tx_per_s": [], "cpu_us_per_tx": []})
        got["tx_per_s"].append(args.tx / wall)
        got["cpu_us_per_tx"].append(cpu / args.tx * 1e6)

    def hand_psycopg(n: int, queue: str) -> None:
        with psycopg.connect(dsn) as conn:
            for i in range(args.tx):
                conn.execute("INSERT INTO public.bench_orders (n) VALUES (%s)", (i,))
                values = [(f"{queue}:{i}:{j}", json.dumps({"i": i, "j": j}), queue)
                          for j in range(n)]
                with conn.cursor() as cur:
                    cur.executemany(HAND, values)
                conn.commit()

    def ours_psycopg(n: int, queue: str) -> None:
        with psycopg.connect(dsn) as conn:
            for i in range(args.tx):
                conn.execute("INSERT INTO public.bench_orders (n) VALUES (%s)", (i,))
                enqueue_many(conn, effects(n, i, queue))
                conn.commit()

    hand_sa = text("INSERT INTO outbox.effects (effect_key, kind, payload, headers, queue)"
                   " VALUES (:k, 'bench', CAST(:p AS jsonb), '{}'::jsonb, :q)")

    def hand_sa_connection(n: int, queue: str) -> None:
        """The same rows by hand on the same stack as `sa_connection` (an Engine's
        `begin()`): what enqueue itself adds there."""
        insert = text("INSERT INTO public.bench_orders (n) VALUES (:n)")
        for i in range(args.tx):
            with engine.begin() as conn:
                conn.execute(insert, {"n": i})
                conn.execute(hand_sa, [{"k": f"{queue}:{i}:{j}", "p": json.dumps(
                    {"i": i, "j": j}), "q": queue} for j in range(n)])

    def ours_sa_connection(n: int, queue: str) -> None:
        insert = text("INSERT INTO public.bench_orders (n) VALUES (:n)")
        for i in range(args.tx):
            with engine.begin() as conn:
                conn.execute(insert, {"n": i})
                enqueue_many(conn, effects(n, i, queue))

    def ours_sa_session(n: int, queue: str) -> None:
        factory = sessionmaker(engine)
        insert = text("INSERT INTO public.bench_orders (n) VALUES (:n)")
        for i in range(args.tx):
            with factory.begin() as session:
                session.execute(insert, {"n": i})
                enqueue_many(session, effects(n, i, queue))

    def ours_psycopg_async(n: int, queue: str) -> None:
        async def go() -> None:
            async with await psycopg.AsyncConnection.connect(dsn) as conn:
                for i in range(args.tx):
                    await conn.execute("INSERT INTO public.bench_orders (n) VALUES (%s)", (i,))
                    await aenqueue_many(conn, effects(n, i, queue))
                    await conn.commit()
        asyncio.run(go())

    def ours_sa_async_session(n: int, queue: str) -> None:
        async def go() -> None:
            factory = async_sessionmaker(aengine)
            insert = text("INSERT INTO public.bench_orders (n) VALUES (:n)")
            for i in range(args.tx):
                async with factory.begin() as session:
                    await session.execute(insert, {"n": i})
                    await aenqueue_many(session, effects(n, i, queue))
        asyncio.run(go())

    loops: dict[str, Callable[[int, str], None]] = {
        "hand_psycopg": hand_psycopg, "psycopg": ours_psycopg,
        "hand_sa_connection": hand_sa_connection, "sa_connection": ours_sa_connection,
        "sa_session": ours_sa_session,
        "psycopg_async": ours_psycopg_async, "sa_async_session": ours_sa_async_session,
    }
    for r in range(args.rounds):
        for n in args.effects:
            for name, loop in loops.items():
                print(f"round {r + 1} {name}/{n}", file=sys.stderr)
                cell(name, n, loop)

    def median(values: list[float]) -> float:
        s = sorted(values)
        return s[len(s) // 2]

    summary: dict[str, Any] = {"tx_per_cell": args.tx, "rounds": args.rounds, "cells": {}}
    for key, got in results.items():
        name, n = key.split("/")
        base = results[f"hand_psycopg/{n}"]
        summary["cells"][key] = {
            "tx_per_s": round(median(got["tx_per_s"]), 1),
            "cpu_us_per_tx": round(median(got["cpu_us_per_tx"]), 1),
            "cpu_ratio_vs_hand": round(median(got["cpu_us_per_tx"])
                                       / median(base["cpu_us_per_tx"]), 2),
            "throughput_ratio_vs_hand": round(median(got["tx_per_s"])
                                              / median(base["tx_per_s"]), 2),
        }
        if name == "sa_connection":  # against the same rows by hand on the same stack
            same = results[f"hand_sa_connection/{n}"]
            summary["cells"][key]["cpu_ratio_vs_hand_same_stack"] = round(
                median(got["cpu_us_per_tx"]) / median(same["cpu_us_per_tx"]), 2)
            summary["cells"][key]["throughput_ratio_vs_hand_same_stack"] = round(
                median(got["tx_per_s"]) / median(same["tx_per_s"]), 2)
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM outbox.effects WHERE queue LIKE :q"),
                     {"q": f"bench-{run}-%"})
        conn.execute(text("DROP TABLE public.bench_orders"))
    engine.dispose()
    asyncio.run(aengine.dispose())
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
