#!/usr/bin/env python3
"""Dispatcher benchmark: our outbox + dispatcher on one PostgreSQL, in one sitting.

    .venv/bin/python bench/bench_dispatch.py            # full run, about 5.5 minutes
    .venv/bin/python bench/bench_dispatch.py --quick    # reduced matrix, about 65 s

Prints ONE JSON line per configuration and a final `"section": "summary"` line.

Sections
  work     effects/s drained by W worker processes (`run_worker`, the `outbox worker`
           loop) with concurrency = max_batch = B, for a no-op handler and for the
           built-in HttpHandler posting to the loopback receiver
           (dispatcher/examples/payments/psp.py, its own process). Effects are prefilled (untimed)
           with one INSERT ... SELECT; the rate is the growth of `attempts` rows with
           outcome `delivered` over a fixed window after a warm-up, like pgbench's
           "rows that reached delivered / duration".
  enqueue  business transactions per second from C client processes, each
           `BEGIN; INSERT INTO bench_orders ...; enqueue_many(conn, [Effect]); COMMIT`
           (one effect per transaction: the same unit as pgbench_outbox.py enqueue).
           In the same runs, interleaved, the same clients with a hand-rolled outbox
           instead (`by: "raw"`): the business INSERT and an INSERT into pgbench's own
           outbox table, both through SQLAlchemy as ours: what a user's own outbox costs
           in the same Python stack (ratio enqueue_Nc_vs_python_raw).
  latency  one worker (concurrency = max_batch = 10) already running; this process
           enqueues a steady R effects/s (one per business transaction) carrying
           time.time() taken just before enqueue_many. Reported: enqueue -> handler start
           (what the peer scripts call latency) and enqueue -> delivered_at (the fenced
           outcome write). With the LISTEN/NOTIFY doorbell, and polling only
           (run_worker(listen=False), poll interval 1 s).

  peers    the raw-SQL ceiling (pgbench_outbox.py dispatch, 1 and 4 clients) and
           pgqueuer (pgqueuer_bench.py work, asyncpg) at the same batch sizes, started
           from a copy of ../shared/bench with its venv ($PEER_BENCH, default
           /tmp/peer-bench; see its README), interleaved with ours in this run; the
           summary line then carries the ratios ours / ceiling and ours / pgqueuer.
           With `enqueue` too, the enqueue ceiling (pgbench_outbox.py enqueue, at each
           --clients) and the ratios enqueue_Nc_vs_ceiling.

Database: $DATABASE_URL's server, or the embedded one (outbox._config.database_url()).
A scratch database `bench_outbox` is created (migrated with the project's Alembic
migrations) and dropped at the end; tables are truncated between cells.

CPU per role, as in shared/bench/benchcommon.py's CpuMonitor (every process sampled
via /proc every 0.25 s, % of one core over the timed window): `postgres` (backends
of bench_outbox and the server's own processes), `worker`, `receiver`, `client`,
`driver` (this process: the producer in `latency`), `other` (everything else,
including `pg_other`: backends of other databases: other engineers' tests).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchlib import pct  # noqa: E402

DB = "bench_outbox"
NOOP, HTTP, LAT = "bench.noop", "bench.http", "bench.lat"
#: The same deliveries through AsyncHttpHandler (aiohttp, on the dispatcher's event loop).
HTTP_ASYNC = "bench.http_async"
#: A no-op `async def` handler: runs as a task of the dispatcher's event loop, as
#: pgqueuer runs its (async) jobs, with no thread hand-off.
NOOP_ASYNC = "bench.noop_async"
HANDLER_NAMES = {NOOP: "noop", NOOP_ASYNC: "noop_async", HTTP: "http",
                 HTTP_ASYNC: "http_async"}


# --------------------------------------------------------------------------- helpers


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def psycopg_dsn(url: str) -> str:
    from sqlalchemy import make_url

    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class CpuMonitor:
    """Per-role CPU seconds over a window, by polling every process (psutil).

    The approach of shared/bench/benchcommon.py, with roles for our processes: the
    caller registers child pids with a role; postgres backends are split by database
    (ours vs. other tenants') using their process title.
    """

    # "postgres: [cluster: ]user database host(port) state", e.g. Debian's
    # "postgres: 15/main: root bench_outbox 127.0.0.1(50312) idle"
    _BACKEND = re.compile(r"^postgres: (?:\S+: )?\S+ (\S+) (?:\S+\(\d+\)|\[local\])")

    def __init__(self, db: str, roles: dict[int, str], interval: float = 0.25) -> None:
        import psutil

        self.psutil = psutil
        self.db = db
        self.roles = roles
        self.interval = interval
        self.me = os.getpid()
        self._stop = threading.Event()
        self._last: dict[int, float] = {}
        self._role_cache: dict[int, str] = {}
        self._acc: dict[str, float] = {}
        self._others: dict[str, float] = {}  # CPU seconds of "other", by process name
        self._thread: threading.Thread | None = None

    def _role(self, p: Any) -> str:
        pid = p.pid
        if pid in self._role_cache:
            return self._role_cache[pid]
        role = "other"
        try:
            if pid == self.me:
                role = "driver"
            elif pid in self.roles:
                role = self.roles[pid]
            elif p.name() == "postgres":
                title = " ".join(p.cmdline())
                m = self._BACKEND.match(title)
                role = "postgres" if m is None or m.group(1) == self.db else "pg_other"
            else:
                parents = {q.pid for q in p.parents()}
                for ppid, r in self.roles.items():
                    if ppid in parents:
                        role = r
                        break
        except self.psutil.Error:
            role = "other"
        self._role_cache[pid] = role
        return role

    def _sample(self, first: bool = False) -> None:
        seen: set[int] = set()
        for p in self.psutil.process_iter():
            pid = p.pid
            seen.add(pid)
            try:
                t = p.cpu_times()
                tot = t.user + t.system
            except self.psutil.Error:
                continue
            prev = self._last.get(pid)
            self._last[pid] = tot
            if first:
                continue
            if prev is None:  # started during the window: count all of it
                try:
                    if p.create_time() < self._t0_wall:
                        continue
                except self.psutil.Error:
                    continue
                prev = 0.0
            d = tot - prev
            if d > 0:
                r = self._role(p)
                self._acc[r] = self._acc.get(r, 0.0) + d
                if r in ("other", "pg_other"):
                    try:
                        name = "postgres (other databases)" if r == "pg_other" else p.name()
                    except self.psutil.Error:
                        name = "?"
                    self._others[name] = self._others.get(name, 0.0) + d
        for pid in list(self._last):
            if pid not in seen:
                del self._last[pid]
                self._role_cache.pop(pid, None)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self) -> CpuMonitor:
        self._t0_wall = time.time()
        self._t0 = time.monotonic()
        self._sys0 = self.psutil.cpu_times()
        self._sample(first=True)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._sample()
        self._stop.set()
        if self._thread:
            self._thread.join()
        wall = time.monotonic() - self._t0
        s1, s0 = self.psutil.cpu_times(), self._sys0
        busy = sum(getattr(s1, f, 0) - getattr(s0, f, 0)
                   for f in ("user", "system", "nice", "irq", "softirq"))
        acc = dict(self._acc)
        acc["other"] = acc.get("other", 0.0) + acc.get("pg_other", 0.0)
        out: dict[str, Any] = {k: round(100 * v / wall, 1)
                               for k, v in sorted(acc.items(), key=lambda kv: -kv[1])}
        out["box"] = round(100 * busy / wall, 1)
        out["cores"] = self.psutil.cpu_count()
        top = sorted(self._others.items(), key=lambda kv: -kv[1])[:3]
        out["other_top"] = {k: round(100 * v / wall, 1) for k, v in top if v / wall >= 0.01}
        return out


def bottleneck(cpu: dict[str, Any]) -> str:
    roles = {k: v for k, v in cpu.items()
             if k not in ("box", "cores", "pg_other", "other_top")}
    if not roles:
        return "?"
    top = max(roles, key=lambda k: roles[k])
    full = cpu.get("box", 0) >= 0.85 * 100 * cpu.get("cores", 1)
    return top + (" (box CPU-saturated)" if full else "")


def wait_quiet(max_busy_pct: float = 30.0, timeout: float = 5.0) -> float:
    """Wait (bounded) until the box is mostly idle; return the last busy % (of all cores)."""
    import psutil

    deadline = time.monotonic() + timeout
    busy = psutil.cpu_percent(interval=0.5)
    while busy > max_busy_pct and time.monotonic() < deadline:
        busy = psutil.cpu_percent(interval=0.5)
    return float(busy)


# --------------------------------------------------------------------------- database


class Scratch:
    """The scratch database: create + migrate once, truncate between cells, drop at end."""

    def __init__(self, server_url: str) -> None:
        from sqlalchemy import make_url

        self.server = make_url(server_url)
        self.url = self.server.set(database=DB).render_as_string(hide_password=False)
        self.admin_dsn = psycopg_dsn(
            self.server.set(database="postgres").render_as_string(hide_password=False))
        self.dsn = psycopg_dsn(self.url)

    @staticmethod
    def _connect(dsn: str) -> Any:
        """Connect, waiting out "too many clients": the server is shared with test runs."""
        import psycopg

        deadline = time.monotonic() + 120
        while True:
            try:
                return psycopg.connect(dsn, autocommit=True)
            except psycopg.OperationalError as exc:
                if time.monotonic() > deadline or "too many clients" not in str(exc):
                    raise
                time.sleep(0.5)

    def create(self) -> None:
        from outbox import _migrate

        with self._connect(self.admin_dsn) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')
            c.execute(f'CREATE DATABASE "{DB}"')
        with self._connect(self.dsn) as c:
            c.execute("CREATE TABLE public.bench_orders (id bigserial PRIMARY KEY,"
                      " customer int NOT NULL, amount numeric(12,2) NOT NULL,"
                      " created_at timestamptz NOT NULL DEFAULT now())")
            c.execute(HAND_ROLLED_OUTBOX)
        _migrate.upgrade(self.url)
        self._held = self._connect(self.dsn)  # one connection for the whole run

    def drop(self) -> None:
        held = getattr(self, "_held", None)
        if held is not None:
            held.close()
        with self._connect(self.admin_dsn) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')

    @contextlib.contextmanager
    def conn(self) -> Iterator[Any]:
        """The held connection (reopened if it broke)."""
        if self._held.closed or self._held.broken:
            self._held = self._connect(self.dsn)
        yield self._held

    def reset(self, prefill: int = 0, kind: str = NOOP) -> None:
        """Empty tables, prefill due effects (untimed), VACUUM ANALYZE, CHECKPOINT."""
        with self.conn() as c:
            c.execute("TRUNCATE outbox.attempts, outbox.effect_keys, outbox.effects,"
                      " public.bench_orders, public.bench_outbox"
                      " RESTART IDENTITY")
            if prefill:
                c.execute(
                    "INSERT INTO outbox.effects (effect_key, kind, payload)"
                    " SELECT %s || g, %s, jsonb_build_object('order_id', g,"
                    " 'amount', 1000 + g %% 500, 'currency', 'EUR')"
                    " FROM generate_series(1, %s) g",
                    (f"{kind}:{time.time_ns()}:", kind, prefill))
            # Not ANALYZE on the emptied outbox.attempts: statistics saying "0 rows" would
            # make the planner pick (and the prepared statement keep) a sequential scan of
            # attempts inside record_outcomes, whose cost then grows with every row recorded
            # - a state a live system (analyzed, populated attempts) is not in. After
            # TRUNCATE the table counts as never analyzed, and the planner estimates it.
            c.execute("VACUUM ANALYZE outbox.effects")
            c.execute("CHECKPOINT")

    def delivered(self, c: Any) -> int:
        return int(c.execute("SELECT count(*) FROM outbox.attempt_history"
                             " WHERE outcome = 'delivered'").fetchone()[0])

    def counts(self) -> dict[str, int]:
        with self.conn() as c:
            return dict(c.execute("SELECT status, count(*) FROM outbox.effects"
                                  " GROUP BY status").fetchall())


# --------------------------------------------------------------------------- children


class Child:
    """A worker or client subprocess of this script, driven by JSON lines on stdin."""

    def __init__(self, mode: str, db_url: str, role: str, extra: Sequence[str] = (),
                 script: str | Path | None = None) -> None:
        """`script`: the benchmark whose `mode` the child runs (default: this one)."""
        env = dict(os.environ, DATABASE_URL=db_url, PYTHONPATH=str(ROOT))
        self.role = role
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(script or __file__).resolve()), mode, *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = 60.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        box: list[str] = []
        t = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()),  # type: ignore[union-attr]
                             daemon=True)
        t.start()
        t.join(timeout)
        if not box or not box[0]:
            raise RuntimeError(f"{self.role} child {self.pid} sent nothing (rc={self.proc.poll()})")
        return dict(json.loads(box[0]))

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.send({"cmd": "exit"})
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def spawn(n: int, mode: str, db_url: str, role: str, extra: Sequence[str] = ()) -> list[Child]:
    kids = [Child(mode, db_url, role, extra) for _ in range(n)]
    for k in kids:
        msg = k.recv(60)
        assert msg.get("ready"), msg
    return kids


def close_all(kids: Sequence[Child]) -> None:
    for k in kids:
        with contextlib.suppress(OSError, ValueError):
            k.send({"cmd": "exit"})
    for k in kids:
        k.close()


def _read_lines(stream: IO[str]) -> Iterator[dict[str, Any]]:
    for line in stream:
        if line.strip():
            yield dict(json.loads(line))


def _warm(engine: Any) -> None:
    """First connection (waiting out "too many clients" on the shared server)."""
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    deadline = time.monotonic() + 120
    while True:
        try:
            with engine.begin() as conn:
                conn.execute(text("SELECT 1"))
            return
        except DBAPIError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def worker_main(argv: Sequence[str]) -> int:
    """Child: one `outbox worker` process (run_worker + Dispatcher), rounds on command."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--receiver", default=None)
    args = ap.parse_args(argv)

    import logging

    from dispatcher._core import Dispatcher
    from dispatcher.handlers import EffectContext, HttpHandler, Registry
    from dispatcher.worker import run_worker
    from outbox._config import make_engine
    from outbox._connections import DEFAULT_WORKER_CALL_TIMEOUT

    logging.basicConfig(level=logging.WARNING)
    # The engine `outbox worker` makes (dispatcher/cli.py cmd_worker): no pre-ping,
    # the workers' call timeout.
    engine = make_engine(application_name="bench-worker", pool_size=3, max_overflow=2,
                         pool_pre_ping=False, call_timeout=DEFAULT_WORKER_CALL_TIMEOUT)
    _warm(engine)
    latencies: list[float] = []

    def noop(effect: EffectContext) -> None:
        return None

    def lat(effect: EffectContext) -> None:
        latencies.append(time.time() - float(effect.payload["t"]))

    async def noop_async(effect: EffectContext) -> None:
        return None

    registry = Registry()
    registry.register(NOOP, noop)
    registry.register(NOOP_ASYNC, noop_async)
    registry.register(LAT, lat)
    if args.receiver:
        from dispatcher.http_async import AsyncHttpHandler

        registry.register(HTTP, HttpHandler(f"{args.receiver}/charges", timeout=10.0))
        registry.register(HTTP_ASYNC,
                          AsyncHttpHandler(f"{args.receiver}/charges", timeout=10.0))
    emit({"ready": True, "pid": os.getpid()})
    for msg in _read_lines(sys.stdin):
        if msg["cmd"] == "exit":
            break
        latencies.clear()
        d = Dispatcher(engine, registry, concurrency=msg["concurrency"],
                       max_batch=msg["max_batch"], lease=30.0)
        stop = threading.Event()

        def wait_stop(d: Dispatcher = d, stop: threading.Event = stop) -> None:
            sys.stdin.readline()  # {"cmd": "stop"}
            stop.set()
            d.wake.set()

        threading.Thread(target=wait_stop, daemon=True).start()
        prof = None
        thread_profs: list[Any] = []
        if os.environ.get("BENCH_PROFILE"):
            import cProfile

            # BENCH_PROFILE_CPU=1: each thread's CPU time (time.thread_time), not the
            # wall clock, which charges a blocked wait to the function that waits.
            profiler: Callable[[], Any] = (
                functools.partial(cProfile.Profile, time.thread_time)
                if os.environ.get("BENCH_PROFILE_CPU") else cProfile.Profile)
            prof = profiler()
            prof.enable()

            # Every thread started from here on (delivery pool, completer) gets its own
            # profiler; all are merged into one file: the whole worker, not its loop only.
            def boot(frame: Any, event: str, arg: Any,
                     thread_profs: list[Any] = thread_profs,
                     profiler: Callable[[], Any] = profiler) -> None:
                sys.setprofile(None)
                p = profiler()
                thread_profs.append(p)
                p.enable()

            threading.setprofile(boot)
        run_worker(d, poll_interval=msg.get("poll", 1.0), grace=5.0, stop=stop,
                   install_signals=False, listen=msg.get("listen", True))
        if prof is not None:
            import pstats

            prof.disable()
            threading.setprofile(None)  # type: ignore[arg-type]
            merged = pstats.Stats(prof)
            for p in thread_profs:
                with contextlib.suppress(TypeError):  # a thread that recorded nothing
                    merged.add(p)
            merged.dump_stats(f"{os.environ['BENCH_PROFILE']}.{os.getpid()}.prof")
        emit({"claimed": d.stats.claimed, "recorded": d.stats.recorded,
              "latencies": list(latencies)})
    engine.dispose()
    return 0


# pgbench_outbox.py's outbox table (shared/bench), for the hand-rolled reference.
HAND_ROLLED_OUTBOX = """
CREATE TABLE public.bench_outbox (
  id bigserial PRIMARY KEY, topic text NOT NULL, payload jsonb NOT NULL,
  status text NOT NULL DEFAULT 'pending', attempts int NOT NULL DEFAULT 0,
  created_at timestamptz NOT NULL DEFAULT now(), claimed_at timestamptz,
  delivered_at timestamptz);
CREATE INDEX bench_outbox_pending_idx ON public.bench_outbox (id) WHERE status = 'pending';
CREATE INDEX bench_outbox_inflight_idx ON public.bench_outbox (claimed_at)
  WHERE status = 'in_flight';
"""


def enqueue_client_main(argv: Sequence[str]) -> int:
    """Child: business transactions with one enqueue_many each (`argv[0]` "raw": one
    INSERT into the hand-rolled outbox table instead), for `seconds` after go."""
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    from outbox import Effect, enqueue_many
    from outbox._config import make_engine

    engine = make_engine(application_name="bench-client", pool_size=1, max_overflow=0)
    insert = text("INSERT INTO public.bench_orders (customer, amount) VALUES (:c, 10.00)"
                  " RETURNING id")
    hand_rolled = text("INSERT INTO public.bench_outbox (topic, payload) VALUES"
                       " ('order.created', CAST(:p AS jsonb))")
    raw = bool(argv) and argv[0] == "raw"
    _warm(engine)
    emit({"ready": True, "pid": os.getpid()})
    for msg in _read_lines(sys.stdin):
        if msg["cmd"] == "exit":
            break
        n, i, errors = 0, 0, 0
        deadline = time.monotonic() + msg["seconds"]
        t0 = time.monotonic()
        while time.monotonic() < deadline:
            i += 1
            try:
                with engine.begin() as conn:
                    order_id = conn.execute(insert, {"c": i % 100000}).scalar_one()
                    payload = {"order_id": order_id, "customer": i % 100000}
                    if raw:
                        conn.execute(hand_rolled, {"p": json.dumps(payload)})
                    else:
                        enqueue_many(conn, [Effect(NOOP, payload)])
            except DBAPIError:  # a shared server: "too many clients" now and then
                errors += 1
                time.sleep(0.05)
                continue
            n += 1
        emit({"transactions": n, "errors": errors, "elapsed_s": time.monotonic() - t0})
    engine.dispose()
    return 0


# --------------------------------------------------------------------------- sections


class Bench:
    def __init__(self, args: argparse.Namespace, scratch: Scratch) -> None:
        self.args = args
        self.db = scratch
        self.results: list[dict[str, Any]] = []
        self.best_rate: dict[tuple[str, int], float] = {}

    # -- work -------------------------------------------------------------------------

    def _prefill_for(self, handler: str, workers: int, batch: int) -> int:
        guess = {NOOP: {1: 600, 10: 3000, 100: 7000}, NOOP_ASYNC: {1: 600, 10: 3000, 100: 7000},
                 HTTP: {1: 500, 10: 1500, 100: 2000},
                 HTTP_ASYNC: {1: 500, 10: 2500, 100: 4000}}
        seen = self.best_rate.get((handler, batch))
        est = seen * 1.8 if seen else guess[handler].get(batch, 5000) * min(workers, 2)
        window = self.args.warmup + self.args.duration + 1.5
        return int(min(400_000, max(2000, est * window * 1.3)))

    def work_cell(self, handler: str, workers: list[Child], batch: int,
                  roles: dict[int, str], prefill: int | None = None) -> dict[str, Any]:
        prefill = prefill or self._prefill_for(handler, len(workers), batch)
        self.db.reset(prefill, handler)
        pre_busy = wait_quiet(timeout=self.args.quiet_timeout)
        load0 = load()
        for w in workers:
            w.send({"cmd": "go", "concurrency": self.args.concurrency or batch,
                    "max_batch": batch, "listen": True,
                    "poll": 1.0})
        with self.db.conn() as c:
            time.sleep(self.args.warmup)
            mon = CpuMonitor(DB, roles).start()
            n0, t0 = self.db.delivered(c), time.monotonic()
            time.sleep(self.args.duration)
            n1, t1 = self.db.delivered(c), time.monotonic()
            cpu = mon.stop()
            pending = int(c.execute("SELECT count(*) FROM outbox.effects"
                                    " WHERE status = 'pending'").fetchone()[0])
        for w in workers:
            w.send({"cmd": "stop"})
        stats = [w.recv(60) for w in workers]
        rate = round((n1 - n0) / (t1 - t0), 1)
        out = {"rate": rate, "delivered_in_window": n1 - n0, "window_s": round(t1 - t0, 2),
               "prefill": prefill, "drained": pending == 0, "cpu": cpu,
               "lease_lost": sum(s["recorded"].get("lease_lost", 0) for s in stats),
               "pre_busy": pre_busy, "load": load0}
        if pending == 0 and prefill < 400_000:  # ran dry: the rate is a lower bound
            log(f"{handler} W={len(workers)} B={batch} ran dry; again with more rows")
            self.best_rate[(handler, batch)] = max(self.best_rate.get((handler, batch), 0),
                                                    rate * 2)
            return self.work_cell(handler, workers, batch, roles)
        self.best_rate[(handler, batch)] = max(self.best_rate.get((handler, batch), 0), rate)
        return out

    def work(self) -> None:
        receiver = None
        for handler in self.args.handlers:
            extra: list[str] = []
            roles: dict[int, str] = {}
            if handler in (HTTP, HTTP_ASYNC):
                from dispatcher.examples.payments.psp import ReceiverProcess

                receiver = ReceiverProcess().start()
                roles[receiver.pid] = "receiver"
                extra = ["--receiver", receiver.url]
            try:
                for nw in self.args.workers:
                    workers = spawn(nw, "_worker", self.db.url, "worker", extra)
                    roles.update({w.pid: "worker" for w in workers})
                    try:
                        for batch in self.args.batches:
                            runs = [self.work_cell(handler, workers, batch, roles)
                                    for _ in range(self.repeats(handler, nw, batch))]
                            self.report_work(handler, nw, batch, runs)
                    finally:
                        close_all(workers)
                        for w in workers:
                            roles.pop(w.pid, None)
            finally:
                if receiver is not None:
                    receiver.stop()
                    receiver = None

    def repeats(self, handler: str, workers: int, batch: int) -> int:
        key = (handler in (NOOP, NOOP_ASYNC) and batch in (10, 100)
               and workers in (1, 2)) or (
            handler in (HTTP, HTTP_ASYNC) and batch == 10 and workers == 2)
        return self.args.runs if key else 1

    def report_work(self, handler: str, workers: int, batch: int,
                    runs: list[dict[str, Any]]) -> None:
        rates = [r["rate"] for r in runs]
        med = statistics.median(rates)
        mr = min(runs, key=lambda r: abs(r["rate"] - med))
        row = {"bench": "outbox_dispatch", "section": "work",
               "handler": HANDLER_NAMES[handler],
               "workers": workers, "batch": batch,
               "concurrency": self.args.concurrency or batch,
               "rate_median": med, "rates": rates,
               "delivered_in_window": mr["delivered_in_window"], "window_s": mr["window_s"],
               "prefill": mr["prefill"], "lease_lost": sum(r["lease_lost"] for r in runs),
               "cpu_median_run": mr["cpu"], "bottleneck": bottleneck(mr["cpu"]),
               "pre_busy": [r["pre_busy"] for r in runs], "load": mr["load"]}
        self.results.append(row)
        emit(row)

    # -- enqueue ----------------------------------------------------------------------

    def enqueue(self) -> None:
        tables = {"outbox": "outbox.effects", "raw": "public.bench_outbox"}
        for clients in self.args.clients:
            runs: dict[str, list[dict[str, Any]]] = {by: [] for by in tables}
            kids = {by: spawn(clients, "_enqueue", self.db.url, "client", [by])
                    for by in tables}
            roles = {k.pid: "client" for group in kids.values() for k in group}
            try:
                for run in range(self.args.runs):
                    order = list(tables.items())
                    if run % 2:  # interleaved, and which goes first swaps run by run
                        order.reverse()
                    for by, table in order:
                        self.db.reset()
                        pre_busy = wait_quiet(timeout=self.args.quiet_timeout)
                        load0 = load()
                        mon = CpuMonitor(DB, roles).start()
                        for k in kids[by]:
                            k.send({"cmd": "go", "seconds": self.args.duration})
                        got = [k.recv(self.args.duration + 60) for k in kids[by]]
                        cpu = mon.stop()
                        with self.db.conn() as c:
                            rows = int(c.execute(f"SELECT count(*) FROM {table}")
                                       .fetchone()[0])
                        tx = sum(g["transactions"] for g in got)
                        el = max(g["elapsed_s"] for g in got)
                        assert tx == rows, (by, tx, rows)
                        runs[by].append({"rate": round(tx / el, 1), "cpu": cpu,
                                         "pre_busy": pre_busy, "load": load0,
                                         "transactions": tx})
            finally:
                for group in kids.values():
                    close_all(group)
            for by, done in runs.items():
                rates = [r["rate"] for r in done]
                med = statistics.median(rates)
                mr = min(done, key=lambda r: abs(r["rate"] - med))
                row = {"bench": "outbox_dispatch", "section": "enqueue", "by": by,
                       "clients": clients, "effects_per_tx": 1, "rate_median": med,
                       "rates": rates, "transactions": mr["transactions"],
                       "cpu_median_run": mr["cpu"], "bottleneck": bottleneck(mr["cpu"]),
                       "pre_busy": [r["pre_busy"] for r in done], "load": mr["load"]}
                self.results.append(row)
                emit(row)

    # -- latency ----------------------------------------------------------------------

    def latency(self) -> None:
        from sqlalchemy import text

        from outbox import Effect, enqueue_many
        from outbox._config import make_engine

        engine = make_engine(self.db.url, application_name="bench-producer", pool_size=1)
        insert = text("INSERT INTO public.bench_orders (customer, amount) VALUES (:c, 10.00)"
                      " RETURNING id")
        rate, seconds = self.args.rate, self.args.latency_seconds
        total = int(rate * seconds)
        for listen in (True, False):
            runs: list[dict[str, Any]] = []
            for _ in range(self.args.latency_runs):
                self.db.reset()
                worker = spawn(1, "_worker", self.db.url, "worker")[0]
                roles = {worker.pid: "worker"}
                try:
                    worker.send({"cmd": "go", "concurrency": 10, "max_batch": 10,
                                 "listen": listen, "poll": 1.0})
                    time.sleep(1.0)  # LISTEN is up, first poll done
                    pre_busy = wait_quiet(timeout=self.args.quiet_timeout)
                    load0 = load()
                    mon = CpuMonitor(DB, roles).start()
                    t_start = time.monotonic()
                    late = 0.0
                    for i in range(total):
                        delay = t_start + i / rate - time.monotonic()
                        if delay > 0:
                            time.sleep(delay)
                        else:
                            late = max(late, -delay)
                        with engine.begin() as conn:
                            oid = conn.execute(insert, {"c": i}).scalar_one()
                            enqueue_many(conn, [Effect(LAT, {"t": time.time(), "order_id": oid})])
                    sent_s = time.monotonic() - t_start
                    deadline = time.monotonic() + 30
                    while time.monotonic() < deadline:
                        if self.db.counts().get("delivered", 0) >= total:
                            break
                        time.sleep(0.1)
                    cpu = mon.stop()
                    worker.send({"cmd": "stop"})
                    got = worker.recv(60)
                finally:
                    close_all([worker])
                starts = [x * 1000 for x in got["latencies"]]
                with self.db.conn() as c:
                    recorded = [float(r[0]) for r in c.execute(
                        "SELECT 1000 * (extract(epoch FROM delivered_at)"
                        " - (payload->>'t')::float8) FROM outbox.effects"
                        " WHERE status = 'delivered'").fetchall()]
                runs.append({
                    "start_p50_ms": _r(pct(starts, 50)), "start_p99_ms": _r(pct(starts, 99)),
                    "delivered_p50_ms": _r(pct(recorded, 50)),
                    "delivered_p99_ms": _r(pct(recorded, 99)),
                    "max_ms": _r(max(recorded, default=0.0)),
                    "jobs": len(recorded), "expected": total,
                    "producer_behind_max_ms": _r(late * 1000), "send_s": round(sent_s, 2),
                    "cpu": cpu, "pre_busy": pre_busy, "load": load0})
            med = statistics.median(r["delivered_p50_ms"] for r in runs)
            mr = min(runs, key=lambda r: abs(r["delivered_p50_ms"] - med))
            row = {"bench": "outbox_dispatch", "section": "latency",
                   "wakeup": "listen_notify" if listen else "poll_1s",
                   "rate": rate, "seconds": seconds, "concurrency": 10, "batch": 10,
                   "delivered_p50_ms_median": _r(med),
                   "delivered_p99_ms_median": _r(statistics.median(
                       r["delivered_p99_ms"] for r in runs)),
                   "start_p50_ms_median": _r(statistics.median(r["start_p50_ms"] for r in runs)),
                   "start_p99_ms_median": _r(statistics.median(r["start_p99_ms"] for r in runs)),
                   "runs": [{k: v for k, v in r.items() if k not in ("cpu",)} for r in runs],
                   "cpu_median_run": mr["cpu"], "bottleneck": bottleneck(mr["cpu"])}
            self.results.append(row)
            emit(row)
        engine.dispose()

    # -- peers ------------------------------------------------------------------------

    def peers(self) -> None:
        """The ceiling and pgqueuer from the shared scripts, in this sitting."""
        home = Path(os.environ.get("PEER_BENCH", "/tmp/peer-bench"))
        py = home / ".venv" / "bin" / "python"
        if not py.exists():
            log(f"peers skipped: no {py} (copy ../shared/bench there and make its venv)")
            return
        dur = str(max(3, int(self.args.duration)))
        runs = str(self.args.runs)
        if any(r["section"] == "enqueue" for r in self.results):
            # The enqueue ceiling: BEGIN; INSERT business row; INSERT outbox row; COMMIT
            # from pgbench, at each client count of ours.
            for clients in self.args.clients:
                self._peer(py, home, ["pgbench_outbox.py", "enqueue", "--clients",
                                      str(clients), "--duration", dur, "--runs", runs],
                           {"peer": "ceiling_enqueue", "batch": None, "clients": clients},
                           "rows_per_s_median")
        for batch in self.args.batches:
            if batch == 1:
                continue
            # The ceiling at 1 and 4 clients, and at each worker count of ours (the
            # scaling curve, issue 17).
            for clients in sorted({1, 4, *self.args.workers}):
                self._peer(py, home, ["pgbench_outbox.py", "dispatch", "--batch", str(batch),
                                      "--clients", str(clients), "--duration", dur,
                                      "--runs", runs, "--prefill",
                                      str({10: 200_000}.get(batch, 500_000))],
                           {"peer": "ceiling", "batch": batch, "clients": clients},
                           "rows_per_s_median")
            n = {10: 20_000, 100: 60_000}.get(batch, 30_000)
            self._peer(py, home, ["pgqueuer_bench.py", "work", "--batch-size", str(batch),
                                  "--concurrency", "0", "--n", str(n), "--runs", runs],
                       {"peer": "pgqueuer", "batch": batch, "workers": 1}, "rate_median")

    def _peer(self, py: Path, home: Path, cmd: list[str], what: dict[str, Any],
              key: str) -> None:
        log("peer: " + " ".join(cmd))
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        try:
            out = subprocess.run([str(py), *cmd], cwd=home, capture_output=True, text=True,
                                 timeout=600, env=env)
        except subprocess.TimeoutExpired:
            log("peer timed out")
            return
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            log(f"peer printed nothing: {out.stderr[-500:]}")
            return
        got = json.loads(lines[-1])
        row = {"bench": "outbox_dispatch", "section": "peers", **what,
               "rate_median": got.get(key), "rates": got.get("rows_per_s_runs")
               or got.get("rates"), "cpu_median_run": got.get("cpu_median_run"),
               "load": load()}
        self.results.append(row)
        emit(row)

    # -- summary ----------------------------------------------------------------------

    def summary(self, started: float, load_start: list[float], server: str) -> None:
        work = [r for r in self.results if r["section"] == "work"]
        out: dict[str, Any] = {"bench": "outbox_dispatch", "section": "summary"}
        for h in HANDLER_NAMES.values():
            rows = [r for r in work if r["handler"] == h]
            if not rows:
                continue
            best = max(rows, key=lambda r: r["rate_median"])
            out[f"{h}_best"] = {k: best[k] for k in ("workers", "batch", "rate_median")}
            out[f"{h}_rates"] = {f"W{r['workers']}xB{r['batch']}": r["rate_median"]
                                 for r in rows}
        peers = {(r["peer"], r["batch"], r.get("clients", 1)): r["rate_median"]
                 for r in self.results if r["section"] == "peers" and r["rate_median"]}
        if peers:
            ours = {(r["workers"], r["batch"]): r["rate_median"]
                    for r in work if r["handler"] == "noop"}
            out["peer_rates"] = {(f"{p}_B{b}_c{c}" if b is not None else f"{p}_c{c}"): v
                                 for (p, b, c), v in peers.items()}
            ratios: dict[str, float] = {}
            for b in self.args.batches:
                one = ours.get((1, b))
                if one and peers.get(("pgqueuer", b, 1)):
                    ratios[f"W1xB{b}_vs_pgqueuer"] = round(one / peers[("pgqueuer", b, 1)], 2)
                if one and peers.get(("ceiling", b, 1)):
                    ratios[f"W1xB{b}_vs_ceiling_1c"] = round(one / peers[("ceiling", b, 1)], 2)
            best = max(ours.values(), default=0.0)
            ceil4 = max((v for (p, _, c), v in peers.items() if p == "ceiling" and c == 4),
                        default=0.0)
            if best and ceil4:
                ratios["best_vs_ceiling_4c"] = round(best / ceil4, 2)
            out["ratios"] = ratios
        for r in self.results:
            if r["section"] == "enqueue" and r.get("by") == "raw":
                out[f"enqueue_raw_{r['clients']}c"] = r["rate_median"]
                library = next((o["rate_median"] for o in self.results
                                if o["section"] == "enqueue" and o.get("by") == "outbox"
                                and o["clients"] == r["clients"]), None)
                if library:
                    out.setdefault("ratios", {})[
                        f"enqueue_{r['clients']}c_vs_python_raw"] = \
                        round(library / r["rate_median"], 2)
            elif r["section"] == "enqueue":
                out[f"enqueue_{r['clients']}c"] = r["rate_median"]
                ceiling = peers.get(("ceiling_enqueue", None, r["clients"]))
                if ceiling:
                    out.setdefault("ratios", {})[f"enqueue_{r['clients']}c_vs_ceiling"] = \
                        round(r["rate_median"] / ceiling, 2)
            if r["section"] == "latency":
                out[f"latency_{r['wakeup']}_ms"] = {
                    "delivered_p50": r["delivered_p50_ms_median"],
                    "delivered_p99": r["delivered_p99_ms_median"],
                    "start_p50": r["start_p50_ms_median"],
                    "start_p99": r["start_p99_ms_median"]}
        try:
            git = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                                 capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            git = None
        out.update({"quick": self.args.quick, "elapsed_s": round(time.monotonic() - started, 1),
                    "git": git,
                    "load_start": load_start, "load_end": load(), "server": server,
                    "cores": os.cpu_count()})
        emit(out)


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_worker":
        return worker_main(argv[1:])
    if argv and argv[0] == "_enqueue":
        return enqueue_client_main(argv[1:])

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="reduced matrix, under 2 minutes")
    ap.add_argument("--sections", default="work,enqueue,latency",
                    help="any of work,enqueue,latency,peers")
    ap.add_argument("--handlers", default="noop,http,http_async")
    ap.add_argument("--workers", default=None, help="worker processes, e.g. 1,2,4,8")
    ap.add_argument("--batches", default=None, help="concurrency = max_batch, e.g. 1,10,100")
    ap.add_argument("--concurrency", type=int, default=0,
                    help="ours: slots per worker, whatever the batch (0: = the batch); "
                    "pgqueuer's batches run with unlimited concurrency")
    ap.add_argument("--clients", default="1,4", help="enqueue client processes")
    ap.add_argument("--duration", type=float, default=None, help="timed window, seconds")
    ap.add_argument("--warmup", type=float, default=None)
    ap.add_argument("--runs", type=int, default=None, help="runs of the key cells (3)")
    ap.add_argument("--rate", type=float, default=200.0, help="latency: effects/s")
    ap.add_argument("--latency-seconds", type=float, default=None)
    ap.add_argument("--latency-runs", type=int, default=None)
    ap.add_argument("--quiet-timeout", type=float, default=2.0,
                    help="wait at most this long for a quiet box before each cell")
    ap.add_argument("--keep-db", action="store_true")
    args = ap.parse_args(argv)
    q = args.quick
    args.workers = [int(x) for x in (args.workers or ("1,4" if q else "1,2,4,8")).split(",")]
    args.batches = [int(x) for x in (args.batches or "1,10,100").split(",")]
    args.clients = [int(x) for x in args.clients.split(",")]
    args.duration = args.duration or (2.0 if q else 4.0)
    args.warmup = args.warmup if args.warmup is not None else (0.5 if q else 1.0)
    args.runs = args.runs or (1 if q else 3)
    args.latency_seconds = args.latency_seconds or (4.0 if q else 10.0)
    args.latency_runs = args.latency_runs or (1 if q else 2)
    by_name = {v: k for k, v in HANDLER_NAMES.items()}
    args.handlers = [by_name[h] for h in args.handlers.split(",")]
    if q:
        args.quiet_timeout = 0.0  # one 0.5 s sample: record how busy the box is, no wait
    sections = args.sections.split(",")

    from outbox._config import database_url

    scratch = Scratch(database_url())
    started, load_start = time.monotonic(), load()
    where = scratch.server.set(database=DB).render_as_string(hide_password=True)
    log(f"scratch database {where}; load {load_start}")
    scratch.create()
    with scratch.conn() as c:
        server = str(c.execute("SHOW server_version").fetchone()[0])
    bench = Bench(args, scratch)
    try:
        if "work" in sections:
            bench.work()
        if "enqueue" in sections:
            bench.enqueue()
        if "latency" in sections:
            bench.latency()
        if "peers" in sections:
            bench.peers()
        bench.summary(started, load_start, server)
    finally:
        if not args.keep_db:
            scratch.drop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
