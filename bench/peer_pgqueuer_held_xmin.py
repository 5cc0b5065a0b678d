#!/usr/bin/env python3
"""pgqueuer beside bench/bench_held_xmin.py: one QueueManager while the xmin horizon is held.

Run by bench_held_xmin.py (`--variants ...,pgqueuer`) with the peer benchmark's venv
and working directory (a copy of ../shared/bench, default /tmp/peer-bench: its
benchcommon and pgqueuer==1.6.0 + asyncpg); not part of the project's environment.

    /tmp/peer-bench/.venv/bin/python bench/peer_pgqueuer_held_xmin.py --n 2600000

Same timeline and JSON lines as bench_held_xmin.py: unheld intervals, a REPEATABLE
READ transaction that ran a SELECT left idle for `--hold` seconds, release + VACUUM,
recovery. One QueueManager (asyncpg), batch_size = `--batch`, no concurrency limit, a
no-op entrypoint, jobs prefilled with pgqueuer's own `Queries.enqueue`. Rate: jobs the
entrypoint ran per second (counted in-process; pgqueuer records completions behind
it). Claim time: `Queries.dequeue` (pgqueuer's claim statement and round trip), timed
in-process. Dead tuples: n_dead_tup of the `pgqueuer` table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.getcwd())  # the peer bench folder: benchcommon

import benchcommon as bc
import pgqueuer
import psycopg
from pgqueuer import Job, Queries, QueueManager

DB = "bench_pgqueuer_held"


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def table(c: Any, holder_pid: int | None) -> dict[str, Any]:
    dead, live = c.execute("SELECT n_dead_tup, n_live_tup FROM pg_stat_user_tables"
                           " WHERE relname = 'pgqueuer'").fetchone()
    age = None
    if holder_pid is not None:
        age = c.execute("SELECT age(backend_xmin) FROM pg_stat_activity WHERE pid = %s",
                        (holder_pid,)).fetchone()[0]
    return {"n_dead_tup": int(dead), "n_live_tup": int(live), "holder_xmin_age": age}


async def main_async(args: argparse.Namespace) -> None:
    import asyncpg

    bc.recreate_db(DB)
    conn = await asyncpg.connect(bc.dsn(DB))
    drv = pgqueuer.AsyncpgDriver(conn)
    await Queries(drv).install()
    t = time.monotonic()
    q = Queries(drv)
    for i in range(0, args.n, 10_000):
        k = min(args.n, i + 10_000) - i
        await q.enqueue(["noop"] * k, [None] * k, [0] * k)
    await conn.close()
    admin = psycopg.connect(bc.conninfo(DB), autocommit=True)
    admin.execute("VACUUM ANALYZE")
    admin.execute("CHECKPOINT")
    print(f"[pgqueuer] prefilled {args.n} in {time.monotonic() - t:.0f}s",
          file=sys.stderr, flush=True)

    conn = await asyncpg.connect(bc.dsn(DB))
    drv = pgqueuer.AsyncpgDriver(conn)
    qm = QueueManager(Queries(drv))
    done = [0]
    claims: list[tuple[float, int]] = []

    @qm.entrypoint("noop", concurrency_limit=0)
    async def noop(job: Job) -> None:
        done[0] += 1

    real = qm.queries.dequeue

    async def timed_dequeue(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        jobs = await real(*a, **kw)
        claims.append(((time.perf_counter() - t0) * 1000, len(jobs)))
        return jobs

    qm.queries.dequeue = timed_dequeue  # type: ignore[method-assign]
    runner = asyncio.create_task(qm.run(
        batch_size=args.batch, dequeue_timeout=timedelta(seconds=1),
        log_aggregation_interval=timedelta(seconds=args.log_aggregation_interval)))
    holder: Any = None
    holder_pid: int | None = None
    rows: list[dict[str, Any]] = []
    await asyncio.sleep(args.warmup)
    last, t0 = done[0], time.monotonic()
    start = t0
    claims.clear()

    async def interval(phase: str, seconds: float, held_at: float | None = None,
                       **extra: Any) -> None:
        nonlocal last, t0
        await asyncio.sleep(max(0.0, t0 + seconds - time.monotonic()))
        t1 = time.monotonic()
        got, claims[:] = list(claims), []
        ms = [c[0] for c in got]
        row = {"bench": "held_xmin", "variant": "pgqueuer", "phase": phase,
               "t_s": round(t1 - start, 1),
               "rate": round((done[0] - last) / (t1 - t0), 1),
               **({"held_s": round(t1 - held_at, 1)} if held_at is not None else {}),
               "claims": len(ms),
               "claim_ms_median": _r(statistics.median(ms)) if ms else None,
               "claim_ms_p90": _r(bc.pct(ms, 90)) if ms else None,
               "claim_ms_max": _r(max(ms)) if ms else None,
               "rows_per_claim": _r(statistics.mean(c[1] for c in got)) if got else None,
               **table(admin, holder_pid), **extra,
               "pending_left": args.n - done[0],
               "load": [round(x, 2) for x in os.getloadavg()]}
        last, t0 = done[0], t1
        bc.emit(row)
        rows.append(row)

    try:
        for _ in range(args.baseline):
            await interval("unheld", args.interval)
        holder = psycopg.connect(bc.conninfo(DB))
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM pgqueuer WHERE id < 100").fetchone()
        holder_pid = holder.info.backend_pid
        held_at = time.monotonic()
        for _ in range(max(1, round(args.hold / args.interval))):
            await interval("held", args.interval, held_at)
        holder.rollback()
        holder.close()
        holder, holder_pid = None, None
        tv = time.monotonic()
        await asyncio.to_thread(admin.execute, "VACUUM pgqueuer")
        vacuum_s = round(time.monotonic() - tv, 1)
        await interval("vacuum", max(0.1, time.monotonic() - t0), vacuum_s=vacuum_s)
        for _ in range(args.recovery):
            await interval("recovered", args.interval)
    finally:
        if holder is not None:
            holder.rollback()
            holder.close()
        qm.shutdown.set()
        await asyncio.wait_for(runner, 60)
        await conn.close()
    unheld = statistics.median(r["rate"] for r in rows if r["phase"] == "unheld")
    held = [r for r in rows if r["phase"] == "held"]
    recovered = [r["rate"] for r in rows if r["phase"] == "recovered"]
    bc.emit({"bench": "held_xmin", "section": "summary", "variant": "pgqueuer",
             "version": pgqueuer.__version__, "batch": args.batch,
             "log_aggregation_interval": args.log_aggregation_interval, "unheld_rate": unheld,
             "held_rates": [r["rate"] for r in held],
             "held_claim_ms_median": [r["claim_ms_median"] for r in held],
             "held_s": round(args.interval * len(held), 1),
             "last_held_rate": held[-1]["rate"],
             "last_held_vs_unheld": round(held[-1]["rate"] / unheld, 2) if unheld else None,
             "recovered_rate": statistics.median(recovered) if recovered else None,
             "n_dead_tup_at_release": held[-1]["n_dead_tup"],
             "ran_dry": any(r["pending_left"] <= 0 for r in rows)})
    admin.close()
    with psycopg.connect(bc.conninfo("postgres"), autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2_600_000)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--interval", type=float, default=15.0)
    ap.add_argument("--baseline", type=int, default=2)
    ap.add_argument("--hold", type=float, default=180.0)
    ap.add_argument("--recovery", type=int, default=2)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--log-aggregation-interval", type=float, default=30.0,
                    help="QueueManager.run's (seconds; pgqueuer's default 30, 0 = off): "
                         "folding pgqueuer_log runs on the worker's one connection")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
