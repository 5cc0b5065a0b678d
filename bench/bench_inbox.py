#!/usr/bin/env python3
"""Inbox hot-key benchmark: prints ONE JSON line.

    .venv/bin/python bench/bench_inbox.py                  # 5 phases x 8 s, about 50 s
    .venv/bin/python bench/bench_inbox.py --seconds 3      # quick look

Phases, run back to back on the same database with the same W writer threads (default
100, spread over P client processes, default 2: think API workers, each with its own
connections, handed out first come first served), each writer looping
`BEGIN; ingest(...); COMMIT`:

  a_new_distributed    every write is a new event id
  b_retry_distributed  every write re-sends a random event from phase a (same payload)
  c_hot_key            every writer sends the same event id (new when the phase starts)
  c_single_flight      as c, but concurrent identical deliveries in this process are
                       coalesced before the database: one runs its transaction, the
                       others wait for its *committed* result and answer "duplicate"
  c_hot_key_counted    as c, with ingest(count_duplicates=True): the exact in-row tally

Per phase: input rate (writes/s), outcomes and `on_conflict_share` (share of writes
whose key already existed), write latency p50/p95/p99/max (ms, waiting for a
connection included, to COMMIT), lock waits sampled every 20 ms in pg_stat_activity
(our backends with wait_event_type = 'Lock', and the other waits of our active
backends), database transactions actually run, and CPU seconds of the client
processes, of our backends and of every postgres process (psutil, if installed).
`busy_backends_elsewhere_mean` counts other active backends: other people's work on
the same server skews the numbers. The writers are closed loops: each sends its next
copy as soon as the previous one is answered.

Database: $DATABASE_URL or the embedded server (outbox._config.database_url()),
migrated with outbox._migrate.upgrade. Rows use sources `bench-<run id>-*` and are
deleted at the end; nothing else is touched.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchlib import pct  # noqa: E402
from sqlalchemy import Connection, Engine, text  # noqa: E402
from sqlalchemy.exc import OperationalError  # noqa: E402

from outbox import IngestResult, ingest, make_engine  # noqa: E402
from outbox._config import database_url  # noqa: E402
from outbox._migrate import upgrade  # noqa: E402

T = TypeVar("T")


def log(msg: str) -> None:
    print(f"[bench-inbox {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class _Call(Generic[T]):
    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None


class SingleFlight(Generic[T]):
    """Coalesce concurrent calls with one key: the first runs, the rest share its result.

    The shared result is that of a *committed* transaction (fn includes the COMMIT), so
    a follower never acknowledges an event that could still roll back. If the leader
    fails, each follower runs its own call (a sender must not get a 2xx for nothing).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[Any, _Call[T]] = {}

    def do(self, key: Any, fn: Callable[[], T]) -> tuple[T, bool]:
        with self._lock:
            call = self._calls.get(key)
            leader = call is None
            if call is None:
                call = self._calls[key] = _Call()
        if not leader:
            call.done.wait()
            if call.error is None:
                assert call.result is not None
                return call.result, True
            return fn(), False
        try:
            call.result = fn()
            return call.result, False
        except BaseException as exc:
            call.error = exc
            raise
        finally:
            with self._lock:
                del self._calls[key]
            call.done.set()


class FairPool:
    """Connections handed to waiting writers first come, first served.

    SQLAlchemy's QueuePool lets a thread that just returned a connection take it back
    at once; with more writers than connections, most writers then starve for a whole
    phase and the latencies describe the pool, not the database.
    """

    def __init__(self, conns: list[Connection]) -> None:
        self._free: deque[Connection] = deque(conns)
        self._waiters: deque[list[Any]] = deque()
        self._lock = threading.Lock()

    def acquire(self) -> Connection:
        with self._lock:
            if self._free and not self._waiters:
                return self._free.popleft()
            slot: list[Any] = [None, threading.Event()]
            self._waiters.append(slot)
        slot[1].wait()
        conn: Connection = slot[0]
        return conn

    def release(self, conn: Connection) -> None:
        with self._lock:
            if self._waiters:
                slot = self._waiters.popleft()
                slot[0] = conn
                slot[1].set()
            else:
                self._free.append(conn)


class LockSampler(threading.Thread):
    """Samples pg_stat_activity: how many of our backends wait on a heavyweight lock."""

    SQL = text(
        """
        SELECT count(*) FILTER (WHERE application_name = :app
                                AND wait_event_type = 'Lock') AS waiting,
               count(*) FILTER (WHERE application_name = :app
                                AND state = 'active') AS active,
               count(*) FILTER (WHERE application_name <> :app AND state = 'active'
                                AND pid <> pg_backend_pid()) AS elsewhere,
               array_remove(array_agg(wait_event_type || ':' || wait_event) FILTER (
                   WHERE application_name = :app AND state = 'active'), NULL) AS events
          FROM pg_stat_activity
         WHERE backend_type = 'client backend'
        """
    )

    def __init__(self, engine: Engine, app: str, interval: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.engine, self.app, self.interval = engine, app, interval
        self.stop = threading.Event()
        self.waiting: list[int] = []
        self.active: list[int] = []
        self.elsewhere: list[int] = []
        self.events: Counter[str] = Counter()

    def run(self) -> None:
        with self.engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            while not self.stop.is_set():
                row = conn.execute(self.SQL, {"app": self.app}).one()
                self.waiting.append(row.waiting)
                self.active.append(row.active)
                self.elsewhere.append(row.elsewhere)
                self.events.update(row.events or [])
                time.sleep(self.interval)

    def summary(self) -> dict[str, Any]:
        n = len(self.waiting) or 1
        return {
            "samples": len(self.waiting),
            "share_of_samples_with_waiters": round(sum(w > 0 for w in self.waiting) / n, 3),
            "mean_waiting_backends": round(sum(self.waiting) / n, 2),
            "max_waiting_backends": max(self.waiting, default=0),
            "mean_active_backends": round(sum(self.active) / n, 2),
            # every wait of our active backends, in backend-samples: Lock (heavyweight
            # row/transaction locks), LWLock (buffers, WAL insert), IO (WAL fsync), ...
            "wait_events_backend_samples": dict(self.events.most_common(8)),
            "busy_backends_elsewhere_mean": round(sum(self.elsewhere) / n, 2),
        }


def postgres_cpu() -> dict[int, float]:
    """CPU seconds so far of every `postgres` process on this machine, by pid."""
    try:
        import psutil
    except ImportError:  # a test extra; the benchmark runs without it
        return {}
    out: dict[int, float] = {}
    for proc in psutil.process_iter(["name", "cpu_times"]):
        times = proc.info.get("cpu_times")
        if proc.info.get("name") == "postgres" and times is not None:
            out[proc.pid] = times.user + times.system
    return out


def our_backend_pids(engine: Engine, app: str) -> set[int]:
    with engine.connect() as conn:
        return {r.pid for r in conn.execute(text(
            "SELECT pid FROM pg_stat_activity WHERE application_name = :app"), {"app": app})}


def payload_for(event_id: str) -> dict[str, Any]:
    """Deterministic, so a re-send is a duplicate and not a conflict."""
    return {"type": "charge.succeeded", "data": {"id": event_id, "amount": 1999,
                                                 "currency": "EUR", "customer": "cus_42"}}


PHASES = {
    "a": "a_new_distributed",
    "b": "b_retry_distributed",
    "c": "c_hot_key",
    "c1": "c_single_flight",
    "c2": "c_hot_key_counted",
}


@dataclass(frozen=True)
class ChildConfig:
    url: str
    app: str
    run_id: str
    index: int
    writers: int
    connections: int
    seconds: float
    phases: tuple[str, ...]


def drive(writers: int, seconds: float, op: Callable[[int, int], tuple[IngestResult, bool]]
          ) -> dict[str, Any]:
    """W threads call op(writer, i) in a closed loop until the deadline."""
    barrier = threading.Barrier(writers + 1)
    latencies: list[list[float]] = [[] for _ in range(writers)]
    outcomes: list[Counter[str]] = [Counter() for _ in range(writers)]
    errors: list[str] = []
    deadline = [0.0]

    def writer(k: int) -> None:
        lat, out = latencies[k], outcomes[k]
        barrier.wait()
        i = 0
        while time.perf_counter() < deadline[0]:
            t0 = time.perf_counter()
            try:
                result, shared = op(k, i)
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {str(exc)[:120]}")
                continue
            lat.append(time.perf_counter() - t0)
            out[result.outcome.value if not shared else "duplicate_coalesced"] += 1
            i += 1

    threads = [threading.Thread(target=writer, args=(k,), daemon=True)
               for k in range(writers)]
    for t in threads:
        t.start()
    cpu0 = time.process_time()
    started = time.perf_counter()
    deadline[0] = started + seconds
    barrier.wait()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    total: Counter[str] = Counter()
    for c in outcomes:
        total.update(c)
    return {
        "latencies": [x for lst in latencies for x in lst],
        "outcomes": dict(total),
        "errors": errors,
        "client_cpu": time.process_time() - cpu0,
        "elapsed": elapsed,
    }


def open_connections(engine: Engine, wanted: int, patience: float = 20.0) -> list[Connection]:
    """Up to `wanted` connections; when other clients hold the server's slots, fewer."""
    held: list[Connection] = []
    deadline = time.monotonic() + patience
    while len(held) < wanted:
        try:
            held.append(engine.connect())
        except OperationalError as exc:
            if "too many clients" not in str(exc):
                raise
            if time.monotonic() > deadline and held:
                break
            time.sleep(0.2)
    return held


def child_main(cfg: ChildConfig, barrier: Any, results: Any) -> None:
    """One client process (think: one API worker) with its own pool and single-flight."""
    engine = make_engine(cfg.url, application_name=cfg.app, pool_size=cfg.connections,
                         max_overflow=0, pool_pre_ping=False)
    held = open_connections(engine, cfg.connections)
    pool = FairPool(held)
    src = {p: f"bench-{cfg.run_id}-{p}" for p in ("a", "c", "c1", "c2")}
    written: list[list[str]] = [[] for _ in range(cfg.writers)]
    resend: list[str] = []
    flight: SingleFlight[IngestResult] = SingleFlight()

    def txn(source: str, event_id: str, count: bool = False) -> IngestResult:
        conn = pool.acquire()
        try:
            with conn.begin():
                return ingest(conn, source, event_id, payload_for(event_id),
                              count_duplicates=count)
        finally:
            pool.release(conn)

    def op_a(k: int, i: int) -> tuple[IngestResult, bool]:
        event_id = f"evt_{cfg.index}_{k}_{i}"
        r = txn(src["a"], event_id)
        written[k].append(event_id)
        return r, False

    def op_b(k: int, i: int) -> tuple[IngestResult, bool]:
        return txn(src["a"], random.choice(resend)), False

    def op_c(k: int, i: int) -> tuple[IngestResult, bool]:
        return txn(src["c"], "evt_hot"), False

    def op_c1(k: int, i: int) -> tuple[IngestResult, bool]:
        # The key includes the payload: only identical deliveries may share an answer.
        key = (src["c1"], "evt_hot", json.dumps(payload_for("evt_hot"), sort_keys=True))
        return flight.do(key, lambda: txn(src["c1"], "evt_hot"))

    def op_c2(k: int, i: int) -> tuple[IngestResult, bool]:
        return txn(src["c2"], "evt_hot", count=True), False

    ops = {"a": op_a, "b": op_b, "c": op_c, "c1": op_c1, "c2": op_c2}
    try:
        for phase in cfg.phases:
            if phase == "b":
                resend.extend(e for lst in written for e in lst)
            barrier.wait()
            part = drive(cfg.writers, cfg.seconds, ops[phase])
            part["connections"] = len(held)
            results.put((cfg.index, phase, part))
        barrier.wait()  # the parent reads our backends' CPU before we disconnect
    finally:
        for conn in held:
            conn.close()
        engine.dispose()


def child_entry(cfg: ChildConfig, barrier: Any, results: Any) -> None:
    """Report a failure (no free connection slot, ...) instead of hanging the parent."""
    try:
        child_main(cfg, barrier, results)
    except BaseException as exc:
        results.put((cfg.index, "error", f"{type(exc).__name__}: {str(exc)[:300]}"))
        barrier.abort()


def summarize(name: str, parts: list[dict[str, Any]], sampler: LockSampler,
              pg_ours: float, pg_total: float) -> dict[str, Any]:
    elapsed = max(p["elapsed"] for p in parts)
    lat = [x * 1000 for p in parts for x in p["latencies"]]
    total: Counter[str] = Counter()
    for p in parts:
        total.update(p["outcomes"])
    errors = [e for p in parts for e in p["errors"]]
    writes = sum(total.values())
    existing = writes - total.get("inserted", 0)
    db_txns = writes - total.get("duplicate_coalesced", 0)
    log(f"{name}: {writes} writes in {elapsed:.1f}s ({writes / elapsed:.0f}/s), "
        f"p99 {pct(lat, 99) or 0:.1f} ms, errors {len(errors)}")
    return {
        "db_connections": sum(p["connections"] for p in parts),
        "writes": writes,
        "seconds": round(elapsed, 2),
        "input_rate_per_s": round(writes / elapsed, 1),
        "outcomes": dict(total),
        "on_conflict_share": round(existing / writes, 4) if writes else None,
        "latency_ms": {k: round(v, 2) if v is not None else None for k, v in (
            ("p50", pct(lat, 50)), ("p95", pct(lat, 95)), ("p99", pct(lat, 99)),
            ("max", max(lat, default=None)))},
        "lock_waits": sampler.summary(),
        "db_transactions": db_txns,
        "cpu_s": {
            "clients": round(sum(p["client_cpu"] for p in parts), 2),
            "our_backends": round(pg_ours, 2),
            "all_postgres": round(pg_total, 2),
            "our_backends_ms_per_db_transaction": (
                round(pg_ours * 1000 / db_txns, 3) if db_txns else None),
        },
        "errors": len(errors),
        "first_errors": errors[:3],
    }


def free_connections(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT current_setting('max_connections')::int"
            " - current_setting('superuser_reserved_connections')::int"
            " - (SELECT count(*) FROM pg_stat_activity)")).scalar_one())


def split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--seconds", type=float, default=8.0, help="per phase (default 8)")
    ap.add_argument("--writers", type=int, default=100, help="writer threads (default 100)")
    ap.add_argument("--processes", type=int, default=2,
                    help="client processes sharing the writers (default 2)")
    ap.add_argument("--connections", type=int, default=0,
                    help="total pool size (default: writers, capped by free server slots)")
    ap.add_argument("--phases", default="a,b,c,c1,c2",
                    help="a,b,c,c1 (single-flight),c2 (counted); default all")
    args = ap.parse_args(argv)
    phases = tuple(p for p in args.phases.split(",") if p)
    if not set(phases) <= set(PHASES) or ("b" in phases and "a" not in phases):
        ap.error("phases are a,b,c,c1,c2 (b re-sends a's events, so it needs a)")
    procs_n = max(1, min(args.processes, args.writers))

    url = database_url()
    log("migrating")
    upgrade(url)
    run_id = uuid.uuid4().hex[:8]
    app = f"bench-inbox-{run_id}"
    monitor = make_engine(url, application_name=f"{app}-monitor", pool_size=2)
    free = free_connections(monitor)
    conns = args.connections or max(procs_n, min(args.writers, free - 10))
    with monitor.connect() as conn:
        server_version = conn.execute(text("SHOW server_version")).scalar_one()
        settings = {r[0]: r[1] for r in conn.execute(text(
            "SELECT name, setting FROM pg_settings WHERE name IN"
            " ('synchronous_commit', 'fsync', 'max_connections', 'shared_buffers')"))}
    log(f"run {run_id}: {args.writers} writers in {procs_n} processes on {conns} "
        f"connections ({free} free on the server), {args.seconds:g}s per phase")

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(procs_n + 1)
    queue = ctx.Queue()
    children = [
        ctx.Process(target=child_entry, daemon=True, args=(ChildConfig(
            url=url, app=app, run_id=run_id, index=i, writers=w, connections=max(1, c),
            seconds=args.seconds, phases=phases), barrier, queue))
        for i, (w, c) in enumerate(zip(split(args.writers, procs_n), split(conns, procs_n),
                                       strict=True))
    ]
    src = [f"bench-{run_id}-{p}" for p in ("a", "c", "c1", "c2")]
    out_phases: dict[str, Any] = {}
    t_start = time.perf_counter()
    try:
        for child in children:
            child.start()
        for phase in phases:
            pg0 = postgres_cpu()  # before the start: our backends idle until the barrier
            try:
                barrier.wait(timeout=120)
            except threading.BrokenBarrierError:
                failures = []
                while not queue.empty():
                    item = queue.get()
                    if item[1] == "error":
                        failures.append(item[2])
                raise SystemExit(f"bench_inbox: a client process failed: {failures}") from None
            sampler = LockSampler(monitor, app)
            sampler.start()
            parts = []
            for _ in children:
                item = queue.get(timeout=args.seconds + 180)
                if item[1] == "error":
                    raise SystemExit(f"bench_inbox: a client process failed: {item[2]}")
                parts.append(item[2])
            pg1 = postgres_cpu()
            sampler.stop.set()
            sampler.join()
            ours = our_backend_pids(monitor, app)
            pg_total = sum(v - pg0.get(pid, 0.0) for pid, v in pg1.items())
            pg_ours = sum(v - pg0.get(pid, 0.0) for pid, v in pg1.items() if pid in ours)
            out_phases[PHASES[phase]] = summarize(PHASES[phase], parts, sampler, pg_ours,
                                                  pg_total)
        barrier.wait(timeout=120)
        for child in children:
            child.join(timeout=60)
        with monitor.connect() as conn:
            rows = {s.rsplit("-", 1)[1]: conn.execute(text(
                "SELECT count(*) FROM outbox.inbox WHERE source = :s"), {"s": s}).scalar_one()
                for s in src}
            counted = conn.execute(text(
                "SELECT duplicates FROM outbox.inbox WHERE source = :s"),
                {"s": src[3]}).scalar_one_or_none()
        if "c_hot_key_counted" in out_phases:
            out_phases["c_hot_key_counted"]["in_row_duplicates"] = counted
    finally:
        for child in children:
            if child.is_alive():
                child.terminate()
        with monitor.begin() as conn:
            conn.execute(text("DELETE FROM outbox.inbox WHERE source = ANY(:s)"), {"s": src})
        monitor.dispose()

    verdict: dict[str, Any] = {}
    c, c1 = out_phases.get("c_hot_key"), out_phases.get("c_single_flight")
    if c and c1 and c["writes"] and c1["writes"]:
        rate = c1["input_rate_per_s"] / c["input_rate_per_s"]
        p99 = (c1["latency_ms"]["p99"] or 0) / (c["latency_ms"]["p99"] or 1)
        verdict = {
            "rate_ratio_single_flight_vs_c": round(rate, 2),
            "p99_ratio_single_flight_vs_c": round(p99, 2),
            "db_transactions_saved_share": round(1 - c1["db_transactions"] / c1["writes"], 3),
            "helps": rate > 1.1 and p99 < 1.0,
        }
    result = {
        "bench": "inbox_hot_key",
        "run_id": run_id,
        "server_version": server_version,
        "settings": settings,
        "cores": os.cpu_count(),
        "writers": args.writers,
        "client_processes": procs_n,
        "db_connections_wanted": conns,
        "seconds_per_phase": args.seconds,
        "phases": out_phases,
        "inbox_rows_per_source": rows,
        "single_flight": verdict,
        "total_seconds": round(time.perf_counter() - t_start, 1),
    }
    sys.stdout.write(json.dumps(result, default=str) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
