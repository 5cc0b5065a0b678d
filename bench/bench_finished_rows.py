#!/usr/bin/env python3
"""Finished rows: what a history of delivered effects costs the hot path (issue 17).

    uv run python bench/bench_finished_rows.py                         # 0, 1M, 5M; ~12 min
    uv run python bench/bench_finished_rows.py --finished 0,1000000 --intervals 2

One worker (bench_held_xmin's child: `run_worker` + `Dispatcher`, the engine `outbox
worker` makes, concurrency = max_batch = 100, a no-op handler) drains a backlog of
`--pending` due effects while the tables already hold `--finished` delivered effects,
as the dispatcher leaves them after days of traffic (the delivered attempt on the
effect row, the key in effect_keys; written by SQL, untimed, then VACUUM ANALYZE and
CHECKPOINT: the state autovacuum keeps a live system in).

Per cell, `--intervals` lines of `--interval` seconds: effects/s, the server's CPU per
delivered effect (postgres processes of the scratch database plus the server's own
background processes, bench_dispatch.CpuMonitor), the claim's time in the worker
(median, p99) and the worker's CPU. The `retention` cell starts from `--retained`
finished rows older than the horizon and runs `outbox purge --older-than 1h` (the CLI,
a subprocess) while the worker drains: the claim's p99 then vs. without the purge is
the "retention without moving the claim's p99" target; one retention cell per
`--duties` value (`outbox purge --duty`: the share of time it spends deleting). A purge
still running when the cell's last interval ends (`--max-intervals`) is stopped there;
the summary says how many rows it had purged (`purged`, `purge_complete`).

Runs on the machine's PostgreSQL (autovacuum off there: nothing here needs it; the
tables are vacuumed once after the fill) or any `DATABASE_URL`. Summary line: server
µs per effect at each size and its ratio to the empty cell (target <= 1.1 at 5M).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import bench_dispatch as bd  # noqa: E402
import bench_held_xmin as bh  # noqa: E402
from benchlib import pct  # noqa: E402

DB = "bench_finished_rows"
bd.DB = DB
bh.DB = DB
NOOP = bd.NOOP
emit, log = bd.emit, bd.log


def fill_finished(scratch: bd.Scratch, n: int, age_hours: float) -> float:
    """Add `n` delivered effects (finished `age_hours` ago) as the dispatcher leaves them:
    the delivered attempt on the row (migration 0006), the key in effect_keys (0007)."""
    if n <= 0:
        return 0.0
    t = time.monotonic()
    step = 500_000
    with scratch.conn() as c:
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            # Keys as an application makes them (random: scope, key, generation, name).
            c.execute(
                "WITH ins AS (INSERT INTO outbox.effects (effect_key, kind, payload, status,"
                " attempts, available_at, created_at, delivered_at, finished_at,"
                " delivered_by, delivered_started_at, delivered_http_status)"
                " SELECT 'pay:' || md5(g::text || %s) || ':charge', %s,"
                " jsonb_build_object('order_id', g, 'amount', 1000 + g %% 500,"
                " 'currency', 'EUR'), 'delivered', 1, t, t, t, t, 'fill', t, 200"
                " FROM generate_series(%s, %s) g,"
                " LATERAL (SELECT now() - make_interval(secs => %s * 3600)) AS x(t)"
                " RETURNING id, effect_key)"
                " INSERT INTO outbox.effect_keys (effect_key, effect_id)"
                " SELECT effect_key, id FROM ins",
                (str(time.time_ns()), NOOP, lo + 1, hi, age_hours))
            log(f"  filled {hi}/{n} finished rows ({time.monotonic() - t:.0f}s)")
    return time.monotonic() - t


def reset(scratch: bd.Scratch, pending: int, finished: int, age_hours: float) -> float:
    with scratch.conn() as c:
        c.execute("TRUNCATE outbox.attempts, outbox.effect_keys, outbox.effects,"
                  " public.bench_orders"
                  " RESTART IDENTITY")
    took = fill_finished(scratch, finished, age_hours)
    with scratch.conn() as c:
        c.execute(
            "INSERT INTO outbox.effects (effect_key, kind, payload)"
            " SELECT 'pay:' || md5(g::text || %s) || ':charge', %s,"
            " jsonb_build_object('order_id', g, 'amount', 1000 + g %% 500,"
            " 'currency', 'EUR') FROM generate_series(1, %s) g",
            (f"p{time.time_ns()}", NOOP, pending))
        for t in ("outbox.effects", "outbox.effect_keys", "outbox.attempts"):
            c.execute(f"VACUUM ANALYZE {t}")
        c.execute("CHECKPOINT")
    return took


def sizes(scratch: bd.Scratch) -> dict[str, Any]:
    with scratch.conn() as c:
        out = {}
        for r in ("outbox.effects", "outbox.effect_keys", "outbox.attempts"):
            mb = c.execute("SELECT pg_total_relation_size(%s)", (r,)).fetchone()[0]
            out[r.split(".")[1] + "_mb"] = round(int(mb) / 2**20)
        return out


def run_cell(args: argparse.Namespace, scratch: bd.Scratch, finished: int,
             duty: float | None) -> dict[str, Any]:
    purge = duty is not None
    name = f"retention_{finished}_duty_{duty:g}" if purge else f"finished_{finished}"
    log(f"{name}: filling ({finished} finished, {args.pending} pending)")
    fill_s = reset(scratch, args.pending, finished, 48.0 if purge else 1.0)
    size = sizes(scratch)
    worker = bh.Worker(scratch.url, args.full_scan_every, args.batch)
    assert worker.recv(60).get("ready")
    roles = {worker.pid: "worker"}
    purger: subprocess.Popen[str] | None = None
    lines: list[dict[str, Any]] = []
    all_claims: list[list[Any]] = []
    try:
        worker.send({"cmd": "go"})
        time.sleep(args.warmup)
        worker.send({"cmd": "sample"})
        last = worker.recv(60)["delivered"]
        if purge:
            env = dict(os.environ, DATABASE_URL=scratch.url, PYTHONPATH=str(ROOT))
            purger = subprocess.Popen(
                [sys.executable, "-m", "dispatcher.cli", "purge", "--older-than", "1h",
                 "--duty", str(duty)],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            roles[purger.pid] = "purge"
            purge_t0 = time.monotonic()
            ended: list[float] = []
            waiter = threading.Thread(
                target=lambda p=purger: (p.wait(), ended.append(time.monotonic())),
                daemon=True)
            waiter.start()
        t0 = time.monotonic()
        i = -1
        # Retention cells: intervals until the purge has ended (at most --max-intervals);
        # the others: --intervals.
        while True:
            i += 1
            if purger is None and i >= args.intervals:
                break
            if purger is not None and (ended or i >= args.max_intervals):
                break
            mon = bd.CpuMonitor(DB, roles).start()
            time.sleep(max(0.0, t0 + args.interval - time.monotonic()))
            worker.send({"cmd": "sample"})
            s = worker.recv(60)
            t1 = time.monotonic()
            cpu = mon.stop()
            n = s["delivered"] - last
            ms = [c[0] for c in s["claims"]]
            all_claims += s["claims"]
            pg = cpu.get("postgres")  # % of one core over the interval
            row = {"bench": "finished_rows", "cell": name, "finished": finished,
                   "interval": i, "rate": round(n / (t1 - t0), 1),
                   "claim_ms_median": bh._r(statistics.median(ms)) if ms else None,
                   "claim_ms_p99": bh._r(pct(ms, 99)) if ms else None,
                   "purge_running": purger is not None and not ended,
                   "cpu": {k: v for k, v in cpu.items() if k != "other_top"},
                   "load": bd.load()}
            if pg is not None and n:
                row["server_us_per_effect"] = round(pg / 100 * (t1 - t0) / n * 1e6, 1)
                row["worker_us_per_effect"] = round(
                    cpu.get("worker", 0.0) / 100 * (t1 - t0) / n * 1e6, 1)
            emit(row)
            lines.append({**row, "_claims": s["claims"]})
            last, t0 = s["delivered"], t1
        worker.send({"cmd": "stop"})
        worker.recv(60)
    finally:
        worker.close()
        purge_rc = purge_s = None
        if purger is not None:
            # A purge still running when the measured window ends (a low duty) is
            # stopped: what it deleted by then is reported (`purged`), not awaited.
            if purger.poll() is None:
                purger.send_signal(signal.SIGTERM)
            try:
                purger.wait(60)
            except subprocess.TimeoutExpired:
                purger.kill()
            waiter.join(5)
            purge_rc = purger.returncode
            purge_s = round((ended[0] if ended else time.monotonic()) - purge_t0, 1)
    if purge:  # only the intervals the purge ran through, start to end
        lines = [r for r in lines if r["purge_running"]] or lines
        all_claims = [c for r in lines for c in r.pop("_claims")]
    us = [r["server_us_per_effect"] for r in lines if "server_us_per_effect" in r]
    ms = [c[0] for c in all_claims]
    summary = {"bench": "finished_rows", "section": "cell", "cell": name,
               "finished": finished, "fill_s": round(fill_s), **size,
               "rate_median": statistics.median(r["rate"] for r in lines),
               "server_us_per_effect_median": statistics.median(us) if us else None,
               "claim_ms_median": bh._r(statistics.median(ms)) if ms else None,
               "claim_ms_p99": bh._r(pct(ms, 99)) if ms else None}
    if purge:
        summary["purge_rc"] = purge_rc
        summary["purge_s"] = purge_s
        summary["duty"] = duty
        with scratch.conn() as c:
            summary["finished_left"] = int(c.execute(
                "SELECT count(*) FROM outbox.effects WHERE status = 'delivered'"
                " AND finished_at < now() - interval '1 hour'").fetchone()[0])
        summary["purged"] = finished - summary["finished_left"]
        summary["purge_complete"] = summary["finished_left"] == 0
    emit(summary)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_worker":
        return bh.worker_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--finished", default="0,1000000,5000000",
                    help="finished rows per cell, comma-separated")
    ap.add_argument("--retained", type=int, default=1_000_000,
                    help="the retention cells' purged rows (0: no retention cell)")
    ap.add_argument("--duties", default="1,0.25",
                    help="`outbox purge --duty` of each retention cell")
    ap.add_argument("--pending", type=int, default=800_000)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--interval", type=float, default=10.0)
    ap.add_argument("--intervals", type=int, default=3)
    ap.add_argument("--max-intervals", type=int, default=30,
                    help="retention cells: intervals until the purge ends, at most this")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--full-scan-every", type=float, default=2.0)
    ap.add_argument("--keep-db", action="store_true")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from outbox._config import database_url

    scratch = bd.Scratch(database_url())
    scratch.create()
    with scratch.conn() as c:
        server = str(c.execute("SHOW server_version").fetchone()[0])
        buffers = str(c.execute("SHOW shared_buffers").fetchone()[0])
    cells: list[dict[str, Any]] = []
    try:
        for f in (int(x) for x in args.finished.split(",") if x):
            cells.append(run_cell(args, scratch, f, duty=None))
        if args.retained:
            for d in (float(x) for x in args.duties.split(",") if x):
                cells.append(run_cell(args, scratch, args.retained, duty=d))
    finally:
        if not args.keep_db:
            scratch.drop()
    base = next((c for c in cells if c["cell"] == "finished_0"), None)
    ratios = {}
    if base and base["server_us_per_effect_median"]:
        for c in cells:
            if c["server_us_per_effect_median"]:
                ratios[c["cell"]] = round(c["server_us_per_effect_median"]
                                          / base["server_us_per_effect_median"], 2)
    git = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                         capture_output=True, text=True).stdout.strip()
    emit({"bench": "finished_rows", "section": "summary", "server": server,
          "shared_buffers": buffers, "git": git, "cores": os.cpu_count(),
          "server_cpu_vs_empty": ratios,
          "claim_p99_ms": {c["cell"]: c["claim_ms_p99"] for c in cells},
          "load_end": bd.load()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
