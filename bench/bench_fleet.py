#!/usr/bin/env python3
"""Fleet benchmark (issue 17): `outbox worker` processes serving one or two databases.

    uv run python bench/bench_fleet.py                 # 3 interleaved rounds, ~2.5 min
    uv run python bench/bench_fleet.py --rounds 1 --duration 3

Prints one JSON line per cell and round, then a `"section": "summary"` line with the
median of the rounds. Cells (no-op handler, a prefilled backlog in each database
served, `--concurrency 100`, so claims of up to 100 = the dispatcher's max batch):

  1proc_1db         one `outbox worker --database a` (the single-database baseline)
  1proc_2db         one `outbox worker --database a --database b`, both backlogged:
                    the 100 slots shared, 50 guaranteed to each
  1proc_2db_1idle   the same process, only a backlogged (b idle): a borrows b's slots
  2proc_2db         two processes, each `--database a --database b`, both backlogged

Each cell starts its worker processes (the real command, `python -m dispatcher.cli
worker`), waits until every one holds a session on every database it serves and
`--warmup` seconds more, then counts `delivered` attempts in each database over
`--duration` seconds: effects/s per database and in total. A cell whose backlog ran
dry is marked `"ran_dry": true` (its rate is then a lower bound).

Database: $DATABASE_URL's server. Two scratch databases, `bench_fleet_a` and
`bench_fleet_b`, are created and migrated at the start and dropped at the end.
CPU: % of one core used by the worker processes over the window, and the 1-minute
load average at the start of each cell (the box is shared: read the ratios).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

NOOP = "bench.noop"
DBS = ("bench_fleet_a", "bench_fleet_b")
CELLS = ("1proc_1db", "1proc_2db", "1proc_2db_1idle", "2proc_2db")


def registry() -> Any:
    """`--handlers bench_fleet:registry`: the no-op handler the workers run."""
    from dispatcher.handlers import Registry

    reg = Registry()
    reg.register(NOOP, lambda effect: None)
    return reg


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Scratch:
    """The two scratch databases: create + migrate, prefill, count, drop."""

    def __init__(self, server_url: str) -> None:
        from sqlalchemy import make_url

        self.server = make_url(server_url).set(drivername="postgresql+psycopg")
        self.urls = {name[-1]: self.server.set(database=name).render_as_string(
            hide_password=False) for name in DBS}
        self.conns: dict[str, Any] = {}

    def _dsn(self, database: str) -> str:
        return self.server.set(drivername="postgresql", database=database) \
            .render_as_string(hide_password=False)

    def create(self) -> None:
        import psycopg

        from outbox import _migrate

        with psycopg.connect(self._dsn("postgres"), autocommit=True) as c:
            for name in DBS:
                c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                c.execute(f'CREATE DATABASE "{name}"')
        for short, url in self.urls.items():
            _migrate.upgrade(url)
            self.conns[short] = psycopg.connect(self._dsn(f"bench_fleet_{short}"),
                                                autocommit=True)

    def drop(self) -> None:
        import psycopg

        for c in self.conns.values():
            c.close()
        with psycopg.connect(self._dsn("postgres"), autocommit=True) as c:
            for name in DBS:
                c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def reset(self, prefill: dict[str, int]) -> None:
        """Empty both; prefill due no-op effects (untimed); VACUUM ANALYZE; CHECKPOINT."""
        for short, c in self.conns.items():
            c.execute("TRUNCATE outbox.attempts, outbox.effect_keys, outbox.effects"
                      " RESTART IDENTITY")
            n = prefill.get(short, 0)
            if n:
                c.execute("INSERT INTO outbox.effects (effect_key, kind, payload)"
                          " SELECT %s || g, %s, jsonb_build_object('n', g)"
                          " FROM generate_series(1, %s) g",
                          (f"{short}:{time.time_ns()}:", NOOP, n))
            c.execute("VACUUM ANALYZE outbox.effects")
        next(iter(self.conns.values())).execute("CHECKPOINT")

    def delivered(self, short: str) -> int:
        row = self.conns[short].execute(
            "SELECT count(*) FROM outbox.attempt_history WHERE outcome = 'delivered'").fetchone()
        return int(row[0])

    def pending(self, short: str) -> int:
        row = self.conns[short].execute(
            "SELECT count(*) FROM outbox.effects WHERE status = 'pending'").fetchone()
        return int(row[0])

    def sessions(self, short: str, names: Sequence[str]) -> set[str]:
        rows = self.conns[short].execute(
            "SELECT DISTINCT application_name FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name = ANY(%s)",
            (list(names),)).fetchall()
        return {r[0] for r in rows}


@contextlib.contextmanager
def workers(scratch: Scratch, n: int, served: Sequence[str],
            concurrency: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`n` real `outbox worker` processes, each serving `served`; SIGTERM after."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "bench"), str(ROOT)]),
               OTEL_METRICS_EXPORTER="none", OTEL_TRACES_EXPORTER="none")
    env.pop("OUTBOX_DATABASES", None)
    procs = []
    for i in range(n):
        cmd = [sys.executable, "-m", "dispatcher.cli", "worker", "--concurrency",
               str(concurrency), "--handlers", "bench_fleet:registry",
               "--name", f"bench-fleet-{i}", "--poll", "1"]
        for short in served:
            cmd += ["--database", f"{short}={scratch.urls[short]}"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
    try:
        yield procs
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def cpu_seconds(pids: Sequence[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
    return total


def run_cell(scratch: Scratch, cell: str, args: argparse.Namespace) -> dict[str, Any]:
    n_procs = 2 if cell.startswith("2proc") else 1
    served = ["a"] if cell == "1proc_1db" else ["a", "b"]
    loaded = ["a"] if cell in ("1proc_1db", "1proc_2db_1idle") else ["a", "b"]
    scratch.reset({short: args.prefill for short in loaded})
    load0 = round(os.getloadavg()[0], 2)
    names = [f"bench-fleet-{i}" for i in range(n_procs)]
    with workers(scratch, n_procs, served, args.concurrency) as procs:
        deadline = time.monotonic() + 60
        while any(scratch.sessions(s, names) != set(names) for s in served):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"{cell}: the workers did not start")
            time.sleep(0.05)
        time.sleep(args.warmup)
        n0 = {s: scratch.delivered(s) for s in loaded}
        c0, t0 = cpu_seconds([p.pid for p in procs]), time.monotonic()
        time.sleep(args.duration)
        n1 = {s: scratch.delivered(s) for s in loaded}
        c1, t1 = cpu_seconds([p.pid for p in procs]), time.monotonic()
        left = {s: scratch.pending(s) for s in loaded}
    window = t1 - t0
    rates = {s: round((n1[s] - n0[s]) / window, 1) for s in loaded}
    return {"bench": "outbox_fleet", "cell": cell, "processes": n_procs,
            "databases_served": len(served), "databases_backlogged": len(loaded),
            "concurrency": args.concurrency, "rate": rates,
            "total": round(sum(rates.values()), 1), "window_s": round(window, 2),
            "prefill_per_db": args.prefill, "ran_dry": any(v == 0 for v in left.values()),
            "worker_cpu_pct": round(100 * (c1 - c0) / window, 1), "load1": load0}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=4.0, help="timed window (s)")
    p.add_argument("--warmup", type=float, default=1.0, help="after the workers connect")
    p.add_argument("--prefill", type=int, default=60_000, help="effects per database")
    p.add_argument("--concurrency", type=int, default=100)
    p.add_argument("--cells", default=",".join(CELLS))
    args = p.parse_args(argv)
    from outbox._config import database_url

    cells = [c for c in args.cells.split(",") if c]
    if unknown := set(cells) - set(CELLS):
        p.error(f"unknown cells {sorted(unknown)}; choose from {CELLS}")
    scratch = Scratch(database_url())
    scratch.create()
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in cells}
    try:
        for r in range(args.rounds):
            for cell in cells:
                out = run_cell(scratch, cell, args)
                out["round"] = r + 1
                results[cell].append(out)
                log(f"round {r + 1} {cell}: {out['rate']} total {out['total']}/s "
                    f"(cpu {out['worker_cpu_pct']} %, load {out['load1']})")
                emit(out)
    finally:
        scratch.drop()
    summary: dict[str, Any] = {}
    for cell, runs in results.items():
        dbs = runs[0]["rate"].keys() if runs else []
        summary[cell] = {
            **{db: statistics.median(r["rate"][db] for r in runs) for db in dbs},
            "total": statistics.median(r["total"] for r in runs),
            "ran_dry": any(r["ran_dry"] for r in runs)}
    emit({"bench": "outbox_fleet", "section": "summary", "rounds": args.rounds,
          "median_effects_per_s": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
