#!/usr/bin/env python3
"""Idempotency guard benchmark: prints ONE JSON line on stdout (progress on stderr).

    .venv/bin/python bench/bench_guard.py                       # about 50-70 s
    .venv/bin/python bench/bench_guard.py --seconds 2 --trials 50   # quick look

Parts, all on the same database and the same engine:

1. Throughput, C threads (--concurrency, default 8) each looping one request with a
   fresh key, interleaved in 3 rounds so that drift on a shared machine hits all alike:
     a_bare    BEGIN; INSERT one order row; COMMIT
     b_atomic  fingerprint + guard.run(mode="atomic"): advisory lock, key read, the
               order row, 2 outbox rows (enqueue_many), the completed key: 1 commit
     c_phased  fingerprint + guard.run(mode="phased"): the claim commits first, then
               order row + 2 outbox rows + completion: 2 commits
     d_detect  b_atomic with duplicate detection on (issue 15): same_request= hashes
               customer + amount + currency, every request a different payment (the
               usual case: nothing found)
     e_suspect d_detect where every request is the same payment (the worst case: each
               finds the last 100 keys of its scope, the cap)
     f_deferred b_atomic with the 2 effects deferred to the key's completion
               (`claim.enqueue_many`): lock + read, the order row, the key and its
               effects in one statement: 1 commit, 2 statements of ours (b: 3)
     g_raw     a reference, not ours: the guard a careful user writes by hand in the
               same SQLAlchemy client (insert-first: the key's INSERT ... ON CONFLICT
               DO NOTHING, the order row, then one statement completing the key and
               adding 2 rows to a plain outbox table as pgbench's ceiling has it;
               1 commit, 5 round trips: BEGIN, 3 statements, COMMIT). It has none of
               ours: no 409 for a twin (it waits on the key's row lock), no lease for
               a crashed claim, no effect keys, trace context or doorbell. Ours sends
               fewer round trips (f_deferred: 3, the BEGIN with the lock and read, the
               COMMIT with the key's write), so g is a plain hand-written guard, not
               the cheapest one possible.
   Per variant: requests/s, latency p50/p99 (ms), commits per request (counted by an
   engine `commit` listener in an untimed pass of 50: a commit listener keeps the
   guard's COMMIT apart, so none is attached while timing). Ratios b/a and c/a of
   requests/s (and of p50), d/b and
   e/b (what detection costs).
1d. The same across processes (--parts processes): --procs (8) processes of one
   thread each, as a pre-forking server runs them, a_bare / b_atomic / f_deferred /
   g_raw in 3
   interleaved rounds; requests/s and b/a, f/a. No GIL is shared: the box's cores,
   clients' and server's together, are the limit.
1c. Client CPU per request (--parts cpu): one thread, a_bare / b_atomic / f_deferred /
   g_raw in
   8 interleaved blocks of 300 requests; the medians and a/b, a/f.
1b. Detection cost per request, one thread, no contention: --single (1000) requests
   each of b_atomic, d_detect and e_suspect, interleaved b, d, e, b, d, e... so drift
   hits all alike; median and mean latency, and the differences to b_atomic in ms.
   Then the key-writing statement alone, the only one detection changes: the same
   number of interleaved executions of insert_completed_key, and of the detecting
   statement with a new identity and with one that finds the cap, each committed
   (commit not timed), on one connection.
2. Same-key storm: --storm-size (100) requests on ONE key released together by a
   barrier, --storm-rounds (5) rounds per mode: latency p50/p99/max, the executing
   request's latency, and the mix (201 executed / 409 in progress / replay). The
   engine has --pool (50) connections, opened up front and held for the run: beyond
   that, requests queue for one, as they would in an application. Three forms:
     local      one process, the guard's default: twins of the request running here
                answer 409 without a round trip (outbox/_inflight.py)
     database   one process, `local_twins=False`: every twin asks PostgreSQL
     processes  --storm-processes (4) processes of size/N threads each, started
                together (by the clock): twins in other processes ask PostgreSQL,
                as behind a load balancer
3. F01 trial counter: --trials (200) trials per mode of 50 concurrent requests with one
   key, every twin asking the database (`local_twins=False`: the protocol under test):
   executions per key (business rows per key, read back from the database; max must
   be 1, min must be 1) and the counts of 201 / 409 / replay. The exit status is 1 if
   any key executed other than once.

Database: $DATABASE_URL or the embedded server (outbox._config.database_url()),
migrated with outbox._migrate.upgrade. Everything this run writes is tagged with a run
id (its own business table, key scopes `bench:<run>:*`, queue `bench-<run>` that no
dispatcher serves) and deleted at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchlib import pct  # noqa: E402
from sqlalchemy import Connection, Engine, event, text  # noqa: E402
from sqlalchemy.exc import OperationalError  # noqa: E402

from outbox import (  # noqa: E402
    Claim,
    Effect,
    IdempotencyGuard,
    Result,
    StoredResponse,
    enqueue_many,
    fingerprint,
    make_engine,
)
from outbox._config import database_url  # noqa: E402
from outbox._idempotency import Mode, business_key  # noqa: E402
from outbox._migrate import upgrade  # noqa: E402
from outbox.errors import RequestInProgress  # noqa: E402
from outbox.sql import keys as keysql  # noqa: E402

MODES: tuple[Mode, ...] = ("atomic", "phased")
BODY = {"amount": 42, "currency": "EUR", "customer": "bench"}
VARIANTS = ("a_bare", "b_atomic", "c_phased", "d_detect", "e_suspect", "f_deferred",
            "g_raw")
PARTS = ("throughput", "processes", "cpu", "single", "storm", "f01")


def same_payment(body: dict[str, Any]) -> str:
    """The business identity the detection variants declare."""
    return f"{body['customer']}|{body['amount']}|{body['currency']}"


class FormatOnly(logging.Handler):
    """Formats each record and drops it: e_suspect pays for its WARNING line (as an app
    with logging configured would) without flooding stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        self.format(record)


def log(msg: str) -> None:
    print(f"[bench-guard {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 3)


class Bench:
    def __init__(self, engine: Engine, run_id: str) -> None:
        self.engine = engine
        self.run = run_id
        self.table = f"bench_guard_orders_{run_id}"
        self.queue = f"bench-{run_id}"
        self.guard = IdempotencyGuard(same_request=same_payment)
        # Every twin asks PostgreSQL: F01's protocol, and the storm's `database` form.
        self.db_guard = IdempotencyGuard(same_request=same_payment, local_twins=False)
        self._commits = 0
        self._lock = threading.Lock()
        self.storm_deferred = False  # the storm's work: effects deferred (--storm-deferred)
        self._insert = text(
            f"INSERT INTO {self.table} (key, amount) VALUES (:k, :a) RETURNING id")
        # g_raw's two tables and three statements (the hand-rolled reference).
        self.raw_keys, self.raw_outbox = f"{self.table}_keys", f"{self.table}_outbox"
        self._raw_claim = text(
            f"INSERT INTO {self.raw_keys} (scope, key, fingerprint, status)"
            " VALUES (:s, :k, :f, 'processing') ON CONFLICT DO NOTHING RETURNING 1")
        self._raw_read = text(
            f"SELECT fingerprint, status, response_status, response_body"
            f" FROM {self.raw_keys} WHERE scope = :s AND key = :k")
        self._raw_complete = text(
            f"WITH done AS (UPDATE {self.raw_keys} SET status = 'completed',"
            " response_status = :st, response_body = :b WHERE scope = :s AND key = :k)"
            f" INSERT INTO {self.raw_outbox} (topic, payload) VALUES"
            " ('bench.charge', CAST(:p1 AS jsonb)), ('bench.receipt', CAST(:p2 AS jsonb))")

    # -- bookkeeping -----------------------------------------------------------------

    def _on_commit(self, _conn: Connection) -> None:
        with self._lock:
            self._commits += 1

    def commits_per_request(self, variant: str, n: int = 50) -> float:
        """Commits per request of `variant`, counted by an engine `commit` listener in
        an untimed pass of `n`. Only there: a `commit` listener keeps the guard's COMMIT
        apart from the key's write (it might run SQL), one round trip more, so the
        timed loops run without it (until session 13 they had it: every guarded
        variant measured with that extra round trip)."""
        event.listen(self.engine, "commit", self._on_commit)
        try:
            with self._lock:
                self._commits = 0
            for _ in range(n):
                self.request(variant, f"bench:{self.run}:count-{variant}", uuid.uuid4().hex)
            with self._lock:
                return self._commits / n
        finally:
            event.remove(self.engine, "commit", self._on_commit)

    def setup(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(text(
                f"CREATE TABLE {self.table} (id bigserial PRIMARY KEY, key text NOT NULL,"
                " amount int NOT NULL, created_at timestamptz NOT NULL DEFAULT now())"))
            conn.execute(text(
                f"CREATE TABLE {self.raw_keys} (scope text NOT NULL, key text NOT NULL,"
                " fingerprint text NOT NULL, status text NOT NULL,"
                " response_status int, response_body bytea,"
                " created_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (scope, key))"))
            # pgbench_outbox.py's outbox, as the raw-SQL ceiling has it.
            conn.execute(text(
                f"CREATE TABLE {self.raw_outbox} (id bigserial PRIMARY KEY,"
                " topic text NOT NULL, payload jsonb NOT NULL,"
                " status text NOT NULL DEFAULT 'pending', attempts int NOT NULL DEFAULT 0,"
                " created_at timestamptz NOT NULL DEFAULT now(), claimed_at timestamptz,"
                " delivered_at timestamptz)"))
            conn.execute(text(f"CREATE INDEX ON {self.raw_outbox} (id)"
                              " WHERE status = 'pending'"))
            conn.execute(text(f"CREATE INDEX ON {self.raw_outbox} (claimed_at)"
                              " WHERE status = 'in_flight'"))

    def cleanup(self) -> None:
        with self.engine.begin() as conn:
            for table in (self.table, self.raw_keys, self.raw_outbox):
                conn.execute(text(f"DROP TABLE IF EXISTS {table}"))
            conn.execute(text("DELETE FROM outbox.effects WHERE queue = :q"), {"q": self.queue})
            conn.execute(text("DELETE FROM outbox.idempotency_keys WHERE scope LIKE :s"),
                         {"s": f"bench:{self.run}:%"})

    # -- the three request shapes ----------------------------------------------------

    def bare(self, key: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(self._insert, {"k": key, "a": 42}).scalar_one()

    def raw(self, scope: str, key: str) -> tuple[int, bytes]:
        """g_raw: the hand-rolled guard (see the module's docstring). A twin that finds
        the key replays its answer, or gets 422 / 409 as ours would."""
        fp = fingerprint("POST", "/orders", BODY)
        with self.engine.begin() as conn:
            if conn.execute(self._raw_claim, {"s": scope, "k": key, "f": fp}).first() is None:
                seen, status, code, body = conn.execute(
                    self._raw_read, {"s": scope, "k": key}).one()
                if seen != fp:
                    return 422, b""
                return (code, bytes(body)) if status == "completed" else (409, b"")
            order_id = conn.execute(self._insert, {"k": key, "a": 42}).scalar_one()
            body = json.dumps({"id": order_id, "amount": 42, "status": "created"}).encode()
            conn.execute(self._raw_complete, {
                "s": scope, "k": key, "st": 201, "b": body,
                "p1": json.dumps({"order_id": order_id, "amount": 42}),
                "p2": json.dumps({"order_id": order_id})})
        return 201, body

    def work(self, key: str, deferred: bool = False
             ) -> Callable[[Connection, Claim], StoredResponse]:
        def handler(conn: Connection, claim: Claim) -> StoredResponse:
            order_id = conn.execute(self._insert, {"k": key, "a": 42}).scalar_one()
            pair = [
                Effect("bench.charge", {"order_id": order_id, "amount": 42},
                       queue=self.queue),
                Effect("bench.receipt", {"order_id": order_id}, queue=self.queue),
            ]
            if deferred:
                claim.enqueue_many(pair)
            else:
                enqueue_many(conn, pair, claim=claim)
            body = json.dumps({"id": order_id, "amount": 42, "status": "created"}).encode()
            return StoredResponse(201, (("content-type", "application/json"),), body)
        return handler

    def guarded(self, scope: str, key: str, mode: Mode, deferred: bool = False,
                local: bool = True) -> Result:
        fp = fingerprint("POST", "/orders", BODY)
        guard = self.guard if local else self.db_guard
        return guard.run(self.engine, scope, key, fp, self.work(key, deferred), mode=mode)

    def detecting(self, scope: str, key: str, same: bool) -> Result:
        """Atomic, with detection: a new payment per request, or always the same one."""
        body = BODY if same else {**BODY, "customer": key}
        fp = fingerprint("POST", "/orders", body)
        return self.guard.run(self.engine, scope, key, fp, self.work(key),
                              business_key=self.guard.business_key(body))

    def request(self, variant: str, scope: str, key: str) -> None:
        if variant == "a_bare":
            self.bare(key)
        elif variant in ("b_atomic", "c_phased"):
            self.guarded(scope, key, "atomic" if variant == "b_atomic" else "phased")
        elif variant == "f_deferred":
            self.guarded(scope, key, "atomic", deferred=True)
        elif variant == "g_raw":
            self.raw(scope, key)
        else:
            self.detecting(scope, key, same=variant == "e_suspect")

    # -- part 1: throughput ----------------------------------------------------------

    def _loop(self, variant: str, seconds: float, threads: int) -> tuple[int, list[float]]:
        stop = time.perf_counter() + seconds
        latencies: list[list[float]] = [[] for _ in range(threads)]
        scope = f"bench:{self.run}:{variant}"

        def worker(slot: int) -> None:
            mine = latencies[slot]
            while time.perf_counter() < stop:
                key = uuid.uuid4().hex
                started = time.perf_counter()
                self.request(variant, scope, key)
                mine.append(time.perf_counter() - started)

        with ThreadPoolExecutor(threads) as pool:
            for f in [pool.submit(worker, i) for i in range(threads)]:
                f.result()
        flat = [x for lane in latencies for x in lane]
        return len(flat), flat

    def throughput(self, seconds: float, threads: int) -> dict[str, Any]:
        variants = VARIANTS
        for variant in variants:  # warm the pool, the plans and the caches
            self._loop(variant, 0.3, threads)
        rounds = 3
        done: dict[str, list[float]] = {v: [] for v in variants}
        elapsed: dict[str, float] = dict.fromkeys(variants, 0.0)
        for r in range(rounds):
            order = variants[r:] + variants[:r]  # rotate who goes first
            for variant in order:
                t0 = time.perf_counter()
                _, lat = self._loop(variant, seconds / rounds, threads)
                elapsed[variant] += time.perf_counter() - t0
                done[variant].extend(lat)
            log(f"throughput round {r + 1}/{rounds} done")
        out: dict[str, Any] = {}
        for variant in variants:
            n = len(done[variant])
            out[variant] = {
                "requests": n,
                "rps": round(n / elapsed[variant], 1),
                "p50_ms": ms(pct(done[variant], 50)),
                "p99_ms": ms(pct(done[variant], 99)),
                "commits_per_request": round(self.commits_per_request(variant), 3),
            }
        return out

    def single(self, n: int) -> dict[str, Any]:
        """Part 1b: one thread, b/d/e interleaved; what detection adds per request."""
        variants = ("b_atomic", "d_detect", "e_suspect")
        lat: dict[str, list[float]] = {v: [] for v in variants}
        for i in range(n + 50):
            for variant in variants:
                scope = f"bench:{self.run}:single-{variant}"
                started = time.perf_counter()
                self.request(variant, scope, uuid.uuid4().hex)
                if i >= 50:  # the first 50 rounds warm plans and caches
                    lat[variant].append(time.perf_counter() - started)
        out: dict[str, Any] = {"requests_per_variant": n}
        for v in variants:
            out[v] = {"median_ms": ms(statistics.median(lat[v])),
                      "mean_ms": ms(statistics.fmean(lat[v])),
                      "p99_ms": ms(pct(lat[v], 99))}
        for v in ("d_detect", "e_suspect"):
            out[f"{v}_minus_b_median_ms"] = ms(
                statistics.median(lat[v]) - statistics.median(lat["b_atomic"]))
            out[f"{v}_minus_b_mean_ms"] = ms(
                statistics.fmean(lat[v]) - statistics.fmean(lat["b_atomic"]))
        out["key_write_statement"] = self.key_write(n)
        return out

    def cpu(self, requests: int, rounds: int) -> dict[str, Any]:
        """Part 1c: this process's CPU per request (client side: Python, psycopg, the
        kernel's socket work), one thread, a_bare / b_atomic / f_deferred in `rounds`
        interleaved blocks of `requests`; medians of the blocks. With 8 threads the
        client process is CPU-bound on its GIL, so this is what the throughput ratio
        follows on a box whose server has its own core."""
        variants = ("a_bare", "b_atomic", "f_deferred", "g_raw")
        per: dict[str, list[float]] = {v: [] for v in variants}
        for variant in variants:  # warm plans and caches
            for _ in range(100):
                self.request(variant, f"bench:{self.run}:cpu-{variant}", uuid.uuid4().hex)
        for _ in range(rounds):
            for variant in variants:
                scope = f"bench:{self.run}:cpu-{variant}"
                started = time.process_time()
                for _ in range(requests):
                    self.request(variant, scope, uuid.uuid4().hex)
                per[variant].append((time.process_time() - started) / requests)
        out: dict[str, Any] = {"requests_per_block": requests, "blocks": rounds}
        for v in variants:
            out[f"{v}_cpu_ms"] = ms(statistics.median(per[v]))
        out["a_over_b_cpu"] = round(statistics.median(per["a_bare"])
                                    / statistics.median(per["b_atomic"]), 3)
        out["a_over_f_cpu"] = round(statistics.median(per["a_bare"])
                                    / statistics.median(per["f_deferred"]), 3)
        out["a_over_g_cpu"] = round(statistics.median(per["a_bare"])
                                    / statistics.median(per["g_raw"]), 3)
        out["g_over_f_cpu"] = round(statistics.median(per["g_raw"])
                                    / statistics.median(per["f_deferred"]), 3)
        return out

    def key_write(self, n: int) -> dict[str, Any]:
        """The key write alone: plain, detecting (nothing found), detecting (cap found)."""
        scope = f"bench:{self.run}:stmt"
        same = business_key("bench|42|EUR")
        lat: dict[str, list[float]] = {"plain": [], "detect_new": [], "detect_cap": []}
        with self.engine.connect() as conn:
            for i in range(n + 50):
                for variant, found in lat.items():
                    key = uuid.uuid4().hex
                    common: dict[str, Any] = {
                        "scope": scope, "key": key, "fingerprint": "f", "status": 201,
                        "headers": [["content-type", "application/json"]], "body": b"{}",
                        "retention_seconds": 3600.0, "generation": uuid.uuid4()}
                    query: Any
                    if variant == "plain":
                        query = keysql.insert_completed_key(**common)
                    else:
                        query = keysql.insert_completed_key_with_suspects(
                            **common, window_seconds=600.0,
                            business_hash=same if variant == "detect_cap" else business_key(key))
                    started = time.perf_counter()
                    query.run(conn)
                    took = time.perf_counter() - started
                    conn.commit()
                    if i >= 50:
                        found.append(took)
        out: dict[str, Any] = {v: {"median_ms": ms(statistics.median(x)),
                                   "mean_ms": ms(statistics.fmean(x))} for v, x in lat.items()}
        for v in ("detect_new", "detect_cap"):
            out[f"{v}_minus_plain_median_ms"] = ms(
                statistics.median(lat[v]) - statistics.median(lat["plain"]))
        return out

    # -- parts 2 and 3: same-key storms ----------------------------------------------

    def _storm(self, pool: ThreadPoolExecutor, scope: str, key: str, mode: Mode,
               size: int, local: bool = True, at: float | None = None
               ) -> list[tuple[str, float]]:
        """`size` requests on one key, released together by a barrier (or, across
        processes, at the wall-clock time `at`)."""
        barrier = threading.Barrier(size)

        def one() -> tuple[str, float]:
            barrier.wait(timeout=60)
            if at is not None:
                time.sleep(max(0.0, at - time.time()))
            started = time.perf_counter()
            try:
                result = self.guarded(scope, key, mode, self.storm_deferred, local)
                outcome = "replay" if result.replayed else str(result.response.status)
            except RequestInProgress as exc:
                outcome = str(exc.status)
            return outcome, time.perf_counter() - started

        return [f.result(timeout=120) for f in [pool.submit(one) for _ in range(size)]]

    def storm(self, size: int, rounds: int, processes: int, connections: int
              ) -> dict[str, Any]:
        """The three forms of part 2, per mode, rounds interleaved form by form."""
        out: dict[str, Any] = {"size": size, "rounds": rounds, "processes": processes}
        forms = ("local", "database", "processes")
        with ThreadPoolExecutor(size) as pool, StormChildren(
                self, processes, size, connections) as kids:
            for mode in MODES:
                outcomes: dict[str, list[tuple[str, float]]] = {f: [] for f in forms}
                for r in range(rounds):
                    for form in forms:
                        scope = f"bench:{self.run}:storm-{form}-{mode}"
                        if form == "processes":
                            outcomes[form] += kids.storm(scope, f"storm-{r}", mode)
                        else:
                            outcomes[form] += self._storm(pool, scope, f"storm-{r}", mode,
                                                          size, local=form == "local")
                for form in forms:
                    out[f"{mode}_{form}"] = storm_summary(outcomes[form])
                    log(f"storm {mode} {form}: p99 {out[f'{mode}_{form}']['p99_ms']} ms, "
                        f"{out[f'{mode}_{form}']['mix']}")
                # Earlier runs' `storm.<mode>` was every twin asking the database: kept.
                out[mode] = out[f"{mode}_database"]
        return out

    def f01(self, trials: int, size: int) -> dict[str, Any]:
        out: dict[str, Any] = {"trials_per_mode": trials, "concurrency": size}
        with ThreadPoolExecutor(size) as pool:
            for mode in MODES:
                scope = f"bench:{self.run}:f01-{mode}"
                mix: Counter[str] = Counter()
                started = time.perf_counter()
                for trial in range(trials):
                    mix.update(o for o, _ in self._storm(
                        pool, scope, f"f01-{mode}-{trial}", mode, size, local=False))
                    if (trial + 1) % 50 == 0:
                        log(f"f01 {mode}: {trial + 1}/{trials} trials")
                with self.engine.connect() as conn:
                    rows = conn.execute(text(
                        f"SELECT key, count(*) FROM {self.table}"
                        " WHERE key LIKE :p GROUP BY key"), {"p": f"f01-{mode}-%"})
                    per_key: dict[str, int] = {k: int(n) for k, n in rows}
                executions = [per_key.get(f"f01-{mode}-{t}", 0) for t in range(trials)]
                out[mode] = {
                    "executions_per_key_max": max(executions),
                    "executions_per_key_min": min(executions),
                    "201": mix["201"],
                    "409": mix["409"],
                    "replay": mix["replay"],
                    "other": sum(n for o, n in mix.items() if o not in ("201", "409", "replay")),
                    "seconds": round(time.perf_counter() - started, 2),
                }
        return out


def storm_summary(outcomes: list[tuple[str, float]]) -> dict[str, Any]:
    lat = [t for _, t in outcomes]
    executed = [t for o, t in outcomes if o == "201"]
    return {
        "requests": len(outcomes),
        "p50_ms": ms(pct(lat, 50)),
        "p99_ms": ms(pct(lat, 99)),
        "max_ms": ms(max(lat, default=None)),
        "losers_p99_ms": ms(pct([t for o, t in outcomes if o != "201"], 99)),
        "executed_median_ms": ms(statistics.median(executed)) if executed else None,
        "mix": dict(Counter(o for o, _ in outcomes)),
    }


class StormChildren:
    """--storm-processes processes of this script (`--storm-child`), each with its own
    engine, guard and its share of the storm's threads on the run's table; one storm
    at a time, started by the wall clock 0.3 s after the order goes out. Their
    connections come out of the parent's budget: --pool / (2 N) each, so that the
    parent's pool and theirs stay within the server's max_connections (100 here)."""

    def __init__(self, bench: Bench, processes: int, size: int, pool: int) -> None:
        if not 1 <= processes <= size:
            raise SystemExit(f"--storm-processes must be 1..{size} (the storm's size)")
        self.bench = bench
        # The storm's requests, spread as evenly as they go.
        self.shares = [size // processes + (i < size % processes) for i in range(processes)]
        self.pool = max(2, pool // (2 * processes))
        self.kids: list[subprocess.Popen[str]] = []

    def _line(self, kid: subprocess.Popen[str]) -> dict[str, Any]:
        """The next JSON line of a child, or an error saying which child died how."""
        assert kid.stdout is not None
        line = kid.stdout.readline()
        try:
            parsed: dict[str, Any] = json.loads(line)
        except ValueError:
            raise RuntimeError(f"storm child {kid.pid} said {line[:200]!r} (exit status "
                               f"{kid.poll()}; its stderr is above)") from None
        return parsed

    def __enter__(self) -> StormChildren:
        for share in self.shares:
            self.kids.append(subprocess.Popen(
                [sys.executable, __file__, "--storm-child", self.bench.run,
                 "--storm-size", str(share), "--pool", str(self.pool)]
                + (["--storm-deferred"] if self.bench.storm_deferred else []),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for kid in self.kids:  # each says "ready" once its pool is open
            if not self._line(kid).get("ready"):
                raise RuntimeError(f"storm child {kid.pid} did not get ready")
        return self

    def _order(self, **fields: Any) -> list[dict[str, Any]]:
        """The same order to every child, to start 0.3 s from now; their answers."""
        order = json.dumps({**fields, "at": time.time() + 0.3})
        for kid in self.kids:
            assert kid.stdin is not None
            kid.stdin.write(order + "\n")
            kid.stdin.flush()
        return [self._line(kid) for kid in self.kids]

    def storm(self, scope: str, key: str, mode: Mode) -> list[tuple[str, float]]:
        return [(o, t) for answer in self._order(scope=scope, key=key, mode=mode)
                for o, t in answer["outcomes"]]

    def loop(self, variant: str, scope: str, seconds: float) -> int:
        """Every child runs `variant` on its one thread for `seconds` from the same
        start; the requests done in all."""
        return sum(int(answer["done"]) for answer in
                   self._order(loop=variant, scope=scope, seconds=seconds))

    def __exit__(self, *exc: object) -> None:
        for kid in self.kids:
            if kid.stdin is not None:
                with contextlib.suppress(OSError):
                    kid.stdin.close()
        for kid in self.kids:
            try:
                kid.wait(timeout=30)
            except subprocess.TimeoutExpired:
                kid.kill()
                kid.wait()


def storm_child(run_id: str, size: int, connections: int, deferred: bool) -> int:
    """One of StormChildren: storms on order (one JSON line on stdin each), their
    outcomes as one JSON line each on stdout."""
    engine = make_engine(database_url(), application_name="bench-guard",
                         pool_size=connections, max_overflow=0, pool_timeout=120)
    hold_pool(engine, connections)
    bench = Bench(engine, run_id)
    bench.storm_deferred = deferred
    print(json.dumps({"ready": True}), flush=True)
    with ThreadPoolExecutor(size) as pool:
        for line in sys.stdin:
            order = json.loads(line)
            if "loop" in order:  # part 1d: this process's one thread, one variant
                time.sleep(max(0.0, order["at"] - time.time()))
                stop, done = order["at"] + order["seconds"], 0
                while time.time() < stop:
                    bench.request(order["loop"], order["scope"], uuid.uuid4().hex)
                    done += 1
                print(json.dumps({"done": done}), flush=True)
                continue
            outcomes = bench._storm(pool, order["scope"], order["key"], order["mode"], size,
                                    local=True, at=order["at"])
            print(json.dumps({"outcomes": outcomes}), flush=True)
    engine.dispose()
    return 0


def hold_pool(engine: Engine, size: int, patience: float = 60.0) -> None:
    """Open the pool's connections up front and keep them, so that a shared server's
    other clients cannot take them mid-run ("too many clients" halfway through)."""
    held: list[Connection] = []
    deadline = time.monotonic() + patience
    try:
        while len(held) < size:
            try:
                held.append(engine.connect())
            except OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    finally:
        for conn in held:
            conn.close()  # back to the pool, which keeps it open


def other_active_backends(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'active'"
            " AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
            " AND application_name <> 'bench-guard'")).scalar_one())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--seconds", type=float, default=6.0,
                        help="measured seconds per throughput variant (default 6)")
    parser.add_argument("--concurrency", type=int, default=8,
                        help="threads for the throughput variants (default 8)")
    parser.add_argument("--single", type=int, default=1000,
                        help="single-thread requests per detection variant (default 1000)")
    parser.add_argument("--storm-size", type=int, default=100)
    parser.add_argument("--storm-rounds", type=int, default=5)
    parser.add_argument("--trials", type=int, default=200,
                        help="F01 trials per mode (default 200)")
    parser.add_argument("--trial-size", type=int, default=50)
    parser.add_argument("--pool", type=int, default=50,
                        help="connections (default 50: a storm of 100 queues for them, as"
                        " in an app; kept modest because the server may be shared)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated parts to run (default: all of {PARTS})")
    parser.add_argument("--storm-deferred", action="store_true",
                        help="the storm's requests defer their effects (f_deferred's form)")
    parser.add_argument("--storm-processes", type=int, default=4,
                        help="processes of the storm's `processes` form (default 4)")
    parser.add_argument("--procs", type=int, default=8,
                        help="processes of the `processes` part, one thread each (default 8)")
    parser.add_argument("--storm-child", metavar="RUN", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.storm_child:
        return storm_child(args.storm_child, args.storm_size, args.pool, args.storm_deferred)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts <= set(PARTS):
        parser.error(f"--parts: unknown {sorted(parts - set(PARTS))}; choose from {PARTS}")

    t0 = time.perf_counter()
    suspects_log = logging.getLogger("outbox.idempotency")
    suspects_log.addHandler(FormatOnly())
    suspects_log.propagate = False
    url = database_url()
    log("migrating")
    upgrade(url)
    pool_size = max(args.pool, args.concurrency)
    engine = make_engine(url, application_name="bench-guard", pool_size=pool_size,
                         max_overflow=0, pool_timeout=120)
    log(f"opening {pool_size} connections")
    hold_pool(engine, pool_size)
    busy_before = other_active_backends(engine)
    bench = Bench(engine, uuid.uuid4().hex[:8])
    report: dict[str, Any] = {"bench": "guard", "run": bench.run}
    try:
        with engine.connect() as conn:
            report["server"] = conn.execute(text("SHOW server_version")).scalar_one()
        report.update(concurrency=args.concurrency, seconds_per_variant=args.seconds,
                      pool_size=pool_size, other_active_backends_before=busy_before)
        bench.setup()
        bench.storm_deferred = args.storm_deferred
        report["f01"] = {"ok": True}
        if "throughput" in parts:
            throughput(bench, args, report)
        if "processes" in parts:
            processes(bench, args, report)
        if "cpu" in parts:
            log("client CPU per request: one thread, 8 blocks of 300 per variant")
            report["client_cpu"] = bench.cpu(300, 8)
        if "single" in parts:
            log(f"detection cost: {args.single} single-thread requests per variant")
            report["detection_single_thread"] = bench.single(args.single)
        if "storm" in parts:
            log(f"storm: {args.storm_size} requests on one key x {args.storm_rounds} rounds"
                + (" (effects deferred)" if args.storm_deferred else ""))
            report["storm"] = bench.storm(args.storm_size, args.storm_rounds,
                                          args.storm_processes, pool_size)
            report["storm"]["deferred"] = args.storm_deferred
        if "f01" in parts:
            f01(bench, args, report)
        report["other_active_backends_after"] = other_active_backends(engine)
    finally:
        bench.cleanup()
        engine.dispose()
    report["elapsed_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report, separators=(",", ":")), flush=True)
    return 0 if report["f01"]["ok"] else 1


def throughput(bench: Bench, args: argparse.Namespace, report: dict[str, Any]) -> None:
    log(f"throughput: {len(VARIANTS)} variants x {args.seconds:g} s, "
        f"{args.concurrency} threads")
    tp = bench.throughput(args.seconds, args.concurrency)
    a, b, c = tp["a_bare"], tp["b_atomic"], tp["c_phased"]
    d, e, f = tp["d_detect"], tp["e_suspect"], tp["f_deferred"]
    g = tp["g_raw"]
    report["throughput"] = tp
    report["ratios"] = {
        "b_over_a_rps": round(b["rps"] / a["rps"], 3),
        "f_over_a_rps": round(f["rps"] / a["rps"], 3),
        "g_over_a_rps": round(g["rps"] / a["rps"], 3),  # the hand-rolled reference
        "f_over_g_rps": round(f["rps"] / g["rps"], 3),
        "f_over_b_rps": round(f["rps"] / b["rps"], 3),
        "c_over_a_rps": round(c["rps"] / a["rps"], 3),
        "b_over_a_p50": round(b["p50_ms"] / a["p50_ms"], 3),
        "c_over_a_p50": round(c["p50_ms"] / a["p50_ms"], 3),
        "d_over_b_rps": round(d["rps"] / b["rps"], 3),
        "e_over_b_rps": round(e["rps"] / b["rps"], 3),
        "d_over_b_p50": round(d["p50_ms"] / b["p50_ms"], 3),
        "e_over_b_p50": round(e["p50_ms"] / b["p50_ms"], 3),
    }


def processes(bench: Bench, args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Part 1d: --procs processes of one thread each (as a pre-forking server runs a
    request per worker process), a_bare / b_atomic / f_deferred interleaved in 3
    rounds: no GIL shared, so the box's cores (clients and server) are the limit."""
    variants = ("a_bare", "b_atomic", "f_deferred", "g_raw")
    log(f"processes: {args.procs} x 1 thread, {len(variants)} variants x {args.seconds:g} s")
    done = dict.fromkeys(variants, 0)
    with StormChildren(bench, args.procs, args.procs, args.pool) as kids:
        for _ in range(20):  # warm each child's plans and prepared statements
            kids.loop("a_bare", f"bench:{bench.run}:procs-warm", 0.05)
        for r in range(3):
            for variant in variants[r:] + variants[:r]:
                done[variant] += kids.loop(variant, f"bench:{bench.run}:procs-{variant}",
                                           args.seconds / 3)
    rps = {v: round(n / args.seconds, 1) for v, n in done.items()}
    report["processes"] = {"processes": args.procs, "rps": rps,
                           "b_over_a_rps": round(rps["b_atomic"] / rps["a_bare"], 3),
                           "f_over_a_rps": round(rps["f_deferred"] / rps["a_bare"], 3),
                           "g_over_a_rps": round(rps["g_raw"] / rps["a_bare"], 3),
                           "f_over_g_rps": round(rps["f_deferred"] / rps["g_raw"], 3)}
    log(f"processes: {report['processes']}")


def f01(bench: Bench, args: argparse.Namespace, report: dict[str, Any]) -> None:
    log(f"f01: {args.trials} trials x {args.trial_size} same-key requests per mode")
    report["f01"] = bench.f01(args.trials, args.trial_size)
    report["f01"]["ok"] = all(
        report["f01"][m]["executions_per_key_max"] == 1
        and report["f01"][m]["executions_per_key_min"] == 1
        and report["f01"][m]["other"] == 0 for m in MODES)


if __name__ == "__main__":
    sys.exit(main())
