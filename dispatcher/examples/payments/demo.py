"""`outbox demo`: the whole promise, with crashes, in under a minute.

With nothing configured it starts the embedded PostgreSQL (in this process, which
owns it and stops it on every exit), migrates, and starts real processes: the fake
PSP (with injected 500s, timeouts after applying, and slow answers), the payments
API and several dispatcher workers (`outbox worker`; Celery workers and beat when
`BROKER_URL` is set). Then it drives a storm from threads: every payment is POSTed
by several clients with the same `Idempotency-Key` (twins at once, latecomers after
completion, clients whose response is lost), some keys are replayed with another
amount, some requests are malformed; meanwhile it SIGKILLs the worker holding the
most leases and starts a replacement. When the storm is over it waits for the
outbox to drain, checks the invariants against the database and the PSP's ledger,
and prints a report. Exit status: 0 when every invariant holds, 1 otherwise.

Everything of one run is tagged with a run id (the idempotency keys are
`demo-<run>-<n>`), so a database that already holds data (yours, or an earlier run)
does not change the counts. Child logs and the PSP ledger stay in `.outbox/demo/`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any, TextIO

import httpx
from sqlalchemy import Engine, make_url, text

from dispatcher.examples.payments.schema import ensure_schema
from outbox import _embedded, _migrate
from outbox._config import database_url, make_engine

KINDS = ("psp.charge", "email.receipt")
FINISHED = ("delivered", "failed", "needs_review", "cancelled")


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Plan:
    """How big the storm is and how the system misbehaves."""

    payments: int
    clients: int
    workers: int
    storm_seconds: float
    kills: int
    mismatches: int
    bad_requests: int
    drain_timeout: float
    short: bool
    lease: float = 4.0            # worker lease: a SIGKILLed worker's effects return after it
    concurrency: int = 4          # deliveries in flight per worker
    http_timeout: float = 1.5     # the handler gives up on the PSP after this (ambiguous)
    fail_500: float = 0.10        # PSP answers 500 without applying
    apply_then_timeout: float = 0.04  # PSP applies, then hangs past the handler's timeout
    slow: float = 0.08            # PSP takes `slow_delay` s (deliveries in flight at a kill)
    slow_delay: float = 0.6
    lossy: float = 0.25           # share of payments with one client whose response is lost

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Plan:
        short = bool(getattr(args, "short", False))

        def given(name: str, default: int) -> int:
            value = getattr(args, name, None)
            return default if value is None else int(value)

        payments = given("payments", 40 if short else 150)
        clients = given("clients", 4)
        workers = given("workers", 2 if short else 3)
        if payments < 1 or clients < 1 or workers < 1:
            raise ValueError("--payments, --clients and --workers must be at least 1")
        storm = 6.0 if short else 20.0
        return cls(
            payments=payments, clients=clients, workers=workers,
            storm_seconds=storm, kills=1 if short else 4,
            mismatches=max(1, payments // 10), bad_requests=5 if short else 10,
            drain_timeout=30.0 if short else 40.0, short=short)


# --------------------------------------------------------------------------- output


class Console:
    """Permanent lines plus one progress line: rewritten in place on a terminal,
    printed every few seconds otherwise (logs, CI, a pipe)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self._status = ""
        self._last_plain = 0.0
        self._last_body = ""

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def stamp(self) -> str:
        return f"[{self.elapsed():5.1f}s]"

    def line(self, msg: str = "") -> None:
        with self._lock:
            if self.tty and self._status:
                self.stream.write("\r\033[K")
            self.stream.write(msg + "\n")
            if self.tty and self._status:
                self.stream.write(self._status)
            self.stream.flush()

    def progress(self, body: str, *, force: bool = False) -> None:
        """`force`: print now (not on a terminal: unless the same numbers just were)."""
        with self._lock:
            msg = f"{self.stamp()} {body}"
            if self.tty:  # one row, or `\r` cannot go back to its start
                msg = msg[:shutil.get_terminal_size().columns - 1]
                self._status = msg
                self.stream.write("\r\033[K" + msg)
                self.stream.flush()
            elif (force and body != self._last_body) or \
                    time.monotonic() - self._last_plain >= 2.0:
                self._last_plain = time.monotonic()
                self._last_body = body
                self.stream.write(msg + "\n")
                self.stream.flush()

    def end_progress(self) -> None:
        with self._lock:
            if self.tty and self._status:
                self.stream.write("\n")
                self.stream.flush()
            self._status = ""


# --------------------------------------------------------------------------- processes


@dataclass
class Child:
    name: str
    role: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log: IO[bytes]
    reported: bool = False  # exited by itself and already said so

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None


class Processes:
    """Every child the demo starts, so that every exit path can stop all of them."""

    def __init__(self, logdir: Path, env: Mapping[str, str]) -> None:
        self.logdir = logdir
        self.env = dict(env)
        self.children: list[Child] = []
        self._lock = threading.Lock()
        self._serial: Counter[str] = Counter()

    def start(self, role: str, argv: Sequence[str]) -> Child:
        with self._lock:
            self._serial[role] += 1
            name = f"{role}-{self._serial[role]}"
        log_path = self.logdir / f"{name}.log"
        log = log_path.open("wb")
        # Own session: a Ctrl-C in the terminal reaches only the demo, which then stops
        # the children in order (workers first) instead of all of them at once.
        proc = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=self.env, start_new_session=True)
        child = Child(name, role, proc, log_path, log)
        with self._lock:
            self.children.append(child)
        return child

    def alive(self, role: str) -> list[Child]:
        return [c for c in self.children if c.role == role and c.alive()]

    def kill(self, child: Child) -> None:
        """SIGKILL: a crash, not a shutdown. Nothing is released, nothing flushed."""
        with contextlib.suppress(ProcessLookupError):
            child.proc.send_signal(signal.SIGKILL)
        child.proc.wait()
        child.log.close()

    def stop(self, children: Sequence[Child], timeout: float = 10.0) -> None:
        """SIGTERM, wait up to `timeout`, then SIGKILL whatever is left."""
        running = [c for c in children if c.alive()]
        for c in running:
            with contextlib.suppress(ProcessLookupError):
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for c in running:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.send_signal(signal.SIGKILL)
                c.proc.wait()
        for c in children:
            c.log.close()

    def stop_all(self, timeout: float = 10.0) -> None:
        by_role = {"worker": 0, "beat": 0, "api": 1, "psp": 2}
        for rank in (0, 1, 2):
            self.stop([c for c in self.children if by_role.get(c.role, 0) == rank], timeout)

    def tail(self, child: Child, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            text_ = child.log_path.read_text(errors="replace").rstrip().splitlines()
            return "\n".join("    | " + ln for ln in text_[-lines:])
        return ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ChildFailed(RuntimeError):
    """A child did not come up, or died: one line for the user, its log's tail."""


def wait_http(url: str, child: Child, procs: Processes, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(trust_env=False, timeout=2.0) as client:
        while time.monotonic() < deadline:
            if not child.alive():
                raise ChildFailed(f"{child.name} exited with status {child.proc.returncode} "
                                   f"(log {child.log_path}):\n{procs.tail(child)}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url).status_code < 500:
                    return
            time.sleep(0.1)
    raise ChildFailed(f"{child.name} did not answer {url} within {timeout:.0f}s "
                       f"(log {child.log_path})")


# --------------------------------------------------------------------------- the storm


@dataclass
class Tally:
    """What the clients saw, from the threads of the storm."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    replies: dict[str, bytes] = field(default_factory=dict)  # key -> first 2xx body
    accepted_keys: set[str] = field(default_factory=set)
    inconsistent: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)
    mismatches_sent: int = 0
    bad_sent: int = 0

    def problem(self, msg: str) -> None:
        with self.lock:
            if len(self.problems) < 20:
                self.problems.append(msg)


QUANTILES = (0.5, 0.95, 0.99)


def percentiles(values: Sequence[float], qs: Sequence[float] = QUANTILES) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    out = {f"p{round(q * 100)}": ordered[min(len(ordered) - 1, int(q * len(ordered)))]
           for q in qs}
    out["max"] = ordered[-1]
    return out


@dataclass(frozen=True)
class PaymentSpec:
    key: str
    body: dict[str, Any]


BAD_REQUESTS: tuple[tuple[str, int], ...] = (
    ("no Idempotency-Key", 400),
    ("malformed JSON", 400),
    ("negative amount", 422),
    ("amount as a string", 422),
    ("Idempotency-Key of 300 characters", 400),
    ("unknown currency", 422),
)


class Storm:
    """Flaky clients, confused clients and broken clients against the real API."""

    def __init__(self, api: str, plan: Plan, run: str, rng: random.Random,
                 stop: threading.Event) -> None:
        self.api = api
        self.plan = plan
        self.run = run
        self.rng = rng
        self.stop = stop
        self.tally = Tally()
        self.http = httpx.Client(
            base_url=api, trust_env=False, timeout=30.0,
            headers={"Authorization": "Bearer demo-client"},  # open demo mode: any token
            limits=httpx.Limits(max_connections=100, max_keepalive_connections=50))
        self.pool = ThreadPoolExecutor(max_workers=48, thread_name_prefix="demo-client")
        self.futures: list[Future[None]] = []
        self.schedule: list[tuple[float, Callable[[], None]]] = []  # (offset, task)
        self.t0 = 0.0
        self.specs = [self._spec(i) for i in range(plan.payments)]

    def _spec(self, i: int) -> PaymentSpec:
        return PaymentSpec(
            key=f"demo-{self.run}-{i:05d}",
            body={"amount": self.rng.randrange(100, 100_000),
                  "currency": self.rng.choice(("EUR", "EUR", "USD", "GBP")),
                  "customer": f"customer-{self.rng.randrange(1, 30):02d}"})

    # -- one HTTP request, recorded

    def send(self, key: str | None, body: bytes, *, timeout: float = 30.0,
             content_type: str = "application/json") -> httpx.Response | None:
        headers = {"Content-Type": content_type}
        if key is not None:
            headers["Idempotency-Key"] = key
        with self.tally.lock:
            self.tally.sent += 1
        t0 = time.perf_counter()
        try:
            response = self.http.post("/payments", content=body, headers=headers,
                                      timeout=timeout)
        except httpx.TimeoutException:
            with self.tally.lock:
                self.tally.outcomes["lost"] += 1
            return None
        except httpx.HTTPError as exc:
            if not self.stop.is_set():
                with self.tally.lock:
                    self.tally.outcomes["unreachable"] += 1
                self.tally.problem(f"POST /payments failed: {exc!r}")
            return None
        took = time.perf_counter() - t0
        with self.tally.lock:
            self.tally.latencies.append(took)
            if response.status_code >= 500:
                self.tally.outcomes["5xx"] += 1
        if response.status_code >= 500:
            self.tally.problem(f"{response.status_code} from POST /payments: "
                               f"{response.text[:200]}")
        return response

    # -- client behaviours

    def flaky_client(self, spec: PaymentSpec, lossy: bool, confused: bool) -> None:
        """POST until a 201 arrives: wait on 409, retry when the answer is lost."""
        body = json.dumps(spec.body).encode()
        for attempt in range(200):
            if self.stop.is_set():
                return
            # A "lossy" client gives up on its first answer after 5 ms: the request
            # went out, the response never came back, so it sends the same key again.
            timeout = 0.005 if lossy and attempt == 0 else 30.0
            r = self.send(spec.key, body, timeout=timeout)
            if r is None:
                if self.stop.wait(0.05):
                    return
                continue
            if r.status_code in (409, 503):
                # 409: a twin is in flight. 503: outcome unknown (counted as a failure
                # above); both mean "retry with the same key". Retry-After says 1 s, a
                # client in a hurry polls faster, with jitter.
                if r.status_code == 409:
                    with self.tally.lock:
                        self.tally.outcomes["409"] += 1
                if self.stop.wait(0.1 + self.rng.random() * 0.2):
                    return
                continue
            if r.status_code == 201:
                replayed = r.headers.get("Idempotent-Replayed", "").lower() == "true"
                with self.tally.lock:
                    self.tally.outcomes["replayed" if replayed else "created"] += 1
                    first = self.tally.replies.setdefault(spec.key, r.content)
                    self.tally.accepted_keys.add(spec.key)
                    if first != r.content:
                        self.tally.inconsistent.add(spec.key)
                if confused:
                    self.confused_client(spec)
                return
            if r.status_code < 500:
                with self.tally.lock:
                    self.tally.outcomes["unexpected"] += 1
                self.tally.problem(f"key {spec.key}: unexpected {r.status_code} "
                                   f"{r.text[:200]}")
            return
        self.tally.problem(f"key {spec.key}: no 201 after 200 attempts")

    def confused_client(self, spec: PaymentSpec) -> None:
        """Reuses a completed key for a different amount: must get 422, change nothing.

        While a twin still holds the key the answer is 409 (the lock is checked before
        the fingerprint); like any client it retries, until the definitive 422.
        """
        changed = json.dumps(dict(spec.body, amount=spec.body["amount"] + 1)).encode()
        with self.tally.lock:
            self.tally.mismatches_sent += 1
        for _ in range(200):
            r = self.send(spec.key, changed)
            if r is None or r.status_code >= 500:
                return  # counted and described by send()
            if r.status_code != 409:
                break
            with self.tally.lock:
                self.tally.outcomes["409"] += 1
            if self.stop.wait(0.1 + self.rng.random() * 0.2):
                return
        else:
            self.tally.problem(f"mismatched replay of {spec.key}: still 409 after 200 tries")
            return
        with self.tally.lock:
            self.tally.outcomes["422" if r.status_code == 422 else "unexpected"] += 1
        if r.status_code != 422:
            self.tally.problem(f"mismatched replay of {spec.key}: {r.status_code}, not 422")

    def broken_client(self, n: int) -> None:
        """One malformed request: each must be refused with a 4xx, never a 500."""
        what, expected = BAD_REQUESTS[n % len(BAD_REQUESTS)]
        key: str | None = f"demo-{self.run}-bad-{n}"
        good = {"amount": 100, "currency": "EUR", "customer": "customer-bad"}
        body = json.dumps(good).encode()
        if what == "no Idempotency-Key":
            key = None
        elif what == "malformed JSON":
            body = b'{"amount": 100, "currency": "EUR",'
        elif what == "negative amount":
            body = json.dumps(dict(good, amount=-5)).encode()
        elif what == "amount as a string":
            body = json.dumps(dict(good, amount="100")).encode()
        elif what == "Idempotency-Key of 300 characters":
            key = "k" * 300
        elif what == "unknown currency":
            body = json.dumps(dict(good, currency="XXX")).encode()
        with self.tally.lock:
            self.tally.bad_sent += 1
        r = self.send(key, body)
        if r is None:
            return
        if r.status_code >= 500:
            return  # counted and described by send()
        with self.tally.lock:
            self.tally.outcomes["4xx" if r.status_code == expected else "unexpected"] += 1
        if r.status_code != expected:
            self.tally.problem(f"{what}: got {r.status_code}, expected {expected}")

    # -- schedule

    def start(self) -> None:
        """Plan every request, paced over `storm_seconds`; `pump()` sends them."""
        plan = self.plan
        confused = set(self.rng.sample(range(plan.payments),
                                       min(plan.mismatches, plan.payments)))
        twins = max(1, (plan.clients + 1) // 2)
        for i, spec in enumerate(self.specs):
            start = plan.storm_seconds * 0.85 * i / max(1, plan.payments)
            lossy = self.rng.random() < plan.lossy
            for c in range(plan.clients):
                if c < twins:   # concurrent twins: one wins, the others get 409
                    delay = start + self.rng.random() * 0.01
                else:           # latecomers: the payment is done, they get replays
                    delay = start + 0.3 + self.rng.random() * 1.0
                self.schedule.append((delay, functools.partial(
                    self.flaky_client, spec, lossy and c == twins - 1,
                    i in confused and c == plan.clients - 1)))
        for n in range(plan.bad_requests):
            delay = self.rng.random() * plan.storm_seconds * 0.85
            self.schedule.append((delay, functools.partial(self.broken_client, n)))
        self.schedule.sort(key=lambda item: item[0])
        self.t0 = time.monotonic()

    def pump(self) -> None:
        """Hand every request that is due to the client threads."""
        due = time.monotonic() - self.t0
        while self.schedule and self.schedule[0][0] <= due:
            self.futures.append(self.pool.submit(self.schedule.pop(0)[1]))

    def done(self) -> bool:
        return not self.schedule and all(f.done() for f in self.futures)

    def close(self) -> None:
        self.stop.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.http.close()


# --------------------------------------------------------------------------- database


_PROGRESS = text(
    """
    SELECT (SELECT count(*) FROM payments.payments WHERE idempotency_key LIKE :prefix)
             AS payments,
           count(e.id) AS effects,
           count(e.id) FILTER (WHERE e.status = 'delivered') AS delivered,
           count(e.id) FILTER (WHERE e.status IN ('failed', 'needs_review', 'cancelled'))
             AS dead,
           count(e.id) FILTER (WHERE e.status = 'in_flight') AS in_flight,
           coalesce(array_agg(e.effect_key) FILTER (WHERE e.kind = 'psp.charge'), '{}')
             AS charge_keys
      FROM payments.payments p
      JOIN outbox.effects e ON e.id > :watermark
                           AND e.payload->>'payment_id' = CAST(p.id AS text)
                           AND e.kind IN ('psp.charge', 'email.receipt')
     WHERE p.idempotency_key LIKE :prefix
    """
)

_EFFECTS = text(
    """
    SELECT p.id AS payment_id, p.idempotency_key, e.id, e.kind, e.effect_key, e.status,
           e.attempts,
           extract(epoch FROM e.delivered_at - e.created_at) AS lag,
           (SELECT count(*) FROM outbox.attempt_history a WHERE a.effect_id = e.id) AS recorded
      FROM payments.payments p
      LEFT JOIN outbox.effects e ON e.id > :watermark
                                AND e.payload->>'payment_id' = CAST(p.id AS text)
                                AND e.kind IN ('psp.charge', 'email.receipt')
     WHERE p.idempotency_key LIKE :prefix
    """
)

_ATTEMPTS = text(
    """
    SELECT a.outcome, a.http_status, count(*) AS n
      FROM outbox.attempt_history a JOIN outbox.effects e ON e.id = a.effect_id
     WHERE e.id = ANY(:ids) AND a.outcome <> 'delivered'
     GROUP BY a.outcome, a.http_status
    """
)

_LEASES = text(
    r"""
    SELECT CAST((regexp_match(lease_owner, ':(\d+):[0-9a-f]+$'))[1] AS int) AS pid,
           count(*) AS n,
           count(*) FILTER (WHERE lease_expires_at < now() + make_interval(secs => :young))
             AS long
      FROM outbox.effects
     WHERE status = 'in_flight' AND lease_expires_at > now()
     GROUP BY 1
    """
)


def leases_by_pid(engine: Engine, lease: float) -> dict[int, tuple[int, int]]:
    """Live leases per worker pid: (all, those held for 0.2 s or more)."""
    with engine.connect() as conn:
        return {int(r.pid): (int(r.n), int(r.long)) for r in conn.execute(
            _LEASES, {"young": lease - 0.2}) if r.pid is not None}


def shown(path: Path) -> str:
    """`path` relative to the current folder when it is inside it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def describe_url(url: str, embedded: bool) -> str:
    if embedded:
        return f"embedded PostgreSQL in {shown(_embedded.home() / 'pgdata')}"
    u = make_url(url)
    where = u.host or (u.query.get("host") or "local socket")
    return f"DATABASE_URL (database {u.database!r} on {where})"


# --------------------------------------------------------------------------- the run


class Interrupted(Exception):
    """SIGTERM while the demo runs: stop everything and exit 143."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Demo:
    def __init__(self, plan: Plan, console: Console, as_json: bool) -> None:
        self.plan = plan
        self.out = console
        self.as_json = as_json
        self.run = uuid.uuid4().hex[:6]
        self.rng = random.Random()
        self.stop = threading.Event()
        self.celery = bool(os.environ.get("BROKER_URL") or os.environ.get("CELERY_BROKER_URL"))
        self.procs: Processes | None = None
        self.storm: Storm | None = None
        self.engine: Engine | None = None
        self.progress_thread: threading.Thread | None = None
        self.kills: list[dict[str, Any]] = []
        self.watermark = 0
        self.psp_url = ""
        self.api_url = ""

    # -- helpers

    @property
    def prefix(self) -> str:
        return f"demo-{self.run}-%"

    def _worker_argv(self, n: int) -> list[str]:
        if self.celery:
            return [sys.executable, "-m", "celery", "-A", "dispatcher.celery_app", "worker",
                    "--pool", "solo", "--queues", "outbox", "--loglevel", "WARNING",
                    "--without-gossip", "--without-mingle", "--without-heartbeat",
                    "--hostname", f"demo-worker-{n}-{self.run}@%h"]
        return [sys.executable, "-m", "dispatcher.cli", "worker",
                "--concurrency", str(self.plan.concurrency), "--lease", str(self.plan.lease),
                "--poll", "0.5", "--grace", "3", "--name", f"demo-worker-{n}"]

    def start_worker(self) -> Child:
        assert self.procs is not None
        n = sum(1 for c in self.procs.children if c.role == "worker") + 1
        return self.procs.start("worker", self._worker_argv(n))

    def snapshot(self) -> tuple[dict[str, int], list[str]]:
        """This run's counts, and the keys of its charges."""
        assert self.engine is not None
        with self.engine.connect() as conn:
            row = conn.execute(_PROGRESS, {"prefix": self.prefix,
                                           "watermark": self.watermark}).one()
        counts = {k: int(v or 0) for k, v in row._mapping.items() if k != "charge_keys"}
        return counts, list(row.charge_keys)

    def psp_applied(self) -> dict[str, int]:
        """Applications per key in the PSP's ledger."""
        with httpx.Client(trust_env=False, timeout=30.0) as c:
            return dict(c.get(self.psp_url + "/_applied").json())

    def psp_stats(self) -> dict[str, Any]:
        with httpx.Client(trust_env=False, timeout=10.0) as c:
            return dict(c.get(self.psp_url + "/_stats").json())

    def progress_line(self) -> str:
        snap, charge_keys = self.snapshot()
        applied = self.psp_applied()
        charges = sum(1 for k in charge_keys if k in applied)
        sent = self.storm.tally.sent if self.storm else 0
        return (f"requests {sent:>4}, payments {snap['payments']:>3}/{self.plan.payments}, "
                f"effects {snap['delivered']:>3}/{2 * snap['payments']:<3} delivered "
                f"({snap['in_flight']} in flight), charges {charges:>3}")

    def _progress_loop(self) -> None:
        period = 0.25 if self.out.tty else 0.5
        while not self.stop.wait(period):
            with contextlib.suppress(Exception):  # a progress line is never fatal
                self.out.progress(self.progress_line())

    # -- phases

    def start_system(self) -> None:
        plan, out = self.plan, self.out
        embedded = not os.environ.get("DATABASE_URL")
        t = time.monotonic()
        with warnings.catch_warnings():  # pgserver's platformdirs, when XDG_RUNTIME_DIR is unset
            warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR")
            url = database_url()
        _migrate.upgrade(url)
        self.engine = make_engine(url, application_name="outbox-demo", pool_size=4,
                                  max_overflow=2)
        ensure_schema(self.engine)
        with self.engine.connect() as conn:
            self.watermark = int(conn.execute(
                text("SELECT coalesce(max(id), 0) FROM outbox.effects")).scalar_one())
        out.line(f"  database  {describe_url(url, embedded)}, migrated"
                 f"  ({time.monotonic() - t:.1f}s)")

        logdir = _embedded.home() / "demo"
        logdir.mkdir(parents=True, exist_ok=True)
        for old in [*logdir.glob("*.log"), *logdir.glob("psp.sqlite3*"),
                    *logdir.glob("celerybeat-schedule*")]:
            old.unlink()
        psp_port, api_port = free_port(), free_port()
        self.psp_url = f"http://127.0.0.1:{psp_port}"
        self.api_url = f"http://127.0.0.1:{api_port}"
        env = {k: v for k, v in os.environ.items() if k != "OUTBOX_CRASH_AT"}
        env.update({
            "DATABASE_URL": url, "PSP_URL": self.psp_url, "PYTHONUNBUFFERED": "1",
            "OUTBOX_HTTP_TIMEOUT": str(plan.http_timeout),
            # Celery runner settings (ignored by the standalone worker, which has flags)
            "OUTBOX_LEASE": str(plan.lease), "OUTBOX_CONCURRENCY": str(plan.concurrency),
            "OUTBOX_SWEEP_INTERVAL": "1", "OUTBOX_DRAIN_BUDGET": "5",
        })
        self.procs = procs = Processes(logdir, env)

        t = time.monotonic()
        psp = procs.start("psp", [sys.executable, "-m", "dispatcher.examples.payments.psp",
                                  "--host", "127.0.0.1", "--port", str(psp_port),
                                  "--db", str(logdir / "psp.sqlite3")])
        api = procs.start("api", [sys.executable, "-m", "dispatcher.cli", "example-api",
                                  "--host", "127.0.0.1", "--port", str(api_port)])
        if self.celery:
            procs.start("beat", [sys.executable, "-m", "celery", "-A", "dispatcher.celery_app",
                                 "beat", "--loglevel", "WARNING",
                                 "--schedule", str(logdir / "celerybeat-schedule")])
        for _ in range(plan.workers):
            self.start_worker()
        wait_http(self.psp_url + "/_health", psp, procs)
        self.configure_faults()
        out.line(f"  psp       fake PSP at {self.psp_url}: {plan.fail_500:.0%} HTTP 500, "
                 f"{plan.apply_then_timeout:.0%} apply-then-hang, {plan.slow:.0%} slow")
        wait_http(self.api_url + "/healthz", api, procs)
        out.line(f"  api       outbox example-api at {self.api_url}"
                 f"  ({time.monotonic() - t:.1f}s)")
        if self.celery:
            out.line(f"  workers   {plan.workers} x celery -A dispatcher.celery_app worker "
                     f"--pool solo, + beat (BROKER_URL); lease {plan.lease:g}s")
        else:
            out.line(f"  workers   {plan.workers} x outbox worker --concurrency "
                     f"{plan.concurrency} --lease {plan.lease:g}")
        out.line(f"  logs      {shown(logdir)}/")

    def configure_faults(self) -> None:
        plan = self.plan
        seed = self.rng.randrange(1 << 30)
        rules: list[dict[str, Any]] = [
            {"mode": "fail_500", "probability": plan.fail_500, "seed": seed},
            {"mode": "apply_then_timeout", "probability": plan.apply_then_timeout,
             "seed": seed + 1, "delay": plan.http_timeout * 2},
            {"mode": "slow", "probability": plan.slow, "seed": seed + 2,
             "delay": plan.slow_delay},
        ]
        with httpx.Client(trust_env=False, timeout=10.0) as c:
            for rule in rules:
                c.post(self.psp_url + "/_control", json=rule).raise_for_status()

    def kill_a_worker(self, force: bool) -> bool:
        """SIGKILL the worker with the most deliveries running for 0.2 s or more.

        Without `force`, only once some worker has such a (slow or hanging) delivery:
        a kill between two fast deliveries would show nothing. Returns True if it killed.
        """
        assert self.procs is not None and self.engine is not None
        alive = self.procs.alive("worker")
        if not alive:
            return True
        leases = leases_by_pid(self.engine, self.plan.lease)
        most = max(leases.get(c.pid, (0, 0))[1] for c in alive)
        if most == 0 and not force:
            return False
        victim = self.rng.choice([c for c in alive if leases.get(c.pid, (0, 0))[1] == most])
        self.procs.kill(victim)
        fresh = self.start_worker()
        held = leases.get(victim.pid, (0, 0))[0]
        self.kills.append({"pid": victim.pid, "leases": held,
                           "at_s": round(self.out.elapsed(), 1)})
        self.out.line(f"{self.out.stamp()} SIGKILL {victim.name} (pid {victim.pid}) with "
                      f"{held} deliver{'ies' if held != 1 else 'y'} in flight; started "
                      f"{fresh.name} (pid {fresh.pid})")
        return True

    def check_children(self) -> None:
        assert self.procs is not None
        for c in self.procs.children:
            if c.role in ("api", "psp", "beat") and not c.alive():
                raise ChildFailed(f"{c.name} exited with status {c.proc.returncode} "
                                   f"(log {c.log_path}):\n{self.procs.tail(c)}")
        # A worker that died on its own (not killed by us) is replaced, and reported.
        for c in self.procs.children:
            if c.role == "worker" and not c.alive() and c.proc.returncode != -signal.SIGKILL \
                    and not c.reported:
                c.reported = True
                self.out.line(f"{self.out.stamp()} {c.name} exited by itself with status "
                              f"{c.proc.returncode}; see {c.log_path}")
                self.start_worker()

    def drive(self) -> None:
        plan, out = self.plan, self.out
        out.line("")
        out.line(f"storm: {plan.payments} payments, each POSTed by {plan.clients} clients "
                 f"with the same Idempotency-Key")
        out.line(f"       (twins at once, latecomers after it completed, lost responses), "
                 f"{plan.mismatches} keys reused")
        out.line(f"       with another amount, {plan.bad_requests} malformed requests; "
                 f"{plan.kills} worker SIGKILL{'s' if plan.kills != 1 else ''} on the way")
        out.line("")
        self.storm = storm = Storm(self.api_url, plan, self.run, self.rng, self.stop)
        self.progress_thread = threading.Thread(target=self._progress_loop,
                                                name="demo-progress", daemon=True)
        self.progress_thread.start()
        t0 = time.monotonic()
        kill_at = [t0 + plan.storm_seconds * (k + 1) / (plan.kills + 1)
                   for k in range(plan.kills)]
        storm.start()
        while not storm.done() or kill_at:
            storm.pump()
            # Kill when a worker is caught mid-delivery (a lease older than 0.2 s), or
            # when that has not happened within 3 s of the scheduled moment.
            if kill_at and time.monotonic() >= kill_at[0] and self.kill_a_worker(
                    force=time.monotonic() >= kill_at[0] + 3.0):
                kill_at.pop(0)
            self.check_children()
            time.sleep(0.02)
        out.line(f"{out.stamp()} storm over: {storm.tally.sent} requests sent; "
                 f"waiting for the outbox to drain")
        deadline = time.monotonic() + plan.drain_timeout
        while time.monotonic() < deadline:
            self.check_children()
            snap, _ = self.snapshot()
            if snap["effects"] >= 2 * snap["payments"] and \
                    snap["delivered"] + snap["dead"] == snap["effects"]:
                break
            time.sleep(0.2)
        else:
            out.line(f"{out.stamp()} drain timeout after {plan.drain_timeout:.0f}s")
        self.stop.set()
        if self.progress_thread is not None:
            self.progress_thread.join(5)
        out.progress(self.progress_line(), force=True)
        out.end_progress()

    # -- the verdict

    def collect(self) -> dict[str, Any]:
        """Everything the report says, from the clients, the database and the PSP."""
        assert self.engine is not None and self.storm is not None and self.procs is not None
        tally = self.storm.tally
        psp = self.psp_stats()
        applied = self.psp_applied()
        with self.engine.connect() as conn:
            rows = conn.execute(_EFFECTS, {"prefix": self.prefix,
                                           "watermark": self.watermark}).all()
            ids = [r.id for r in rows if r.id is not None]
            attempt_rows = conn.execute(_ATTEMPTS, {"ids": ids}).all()

        payment_keys = {r.idempotency_key for r in rows}
        payments = len({r.payment_id for r in rows})
        effects = [r for r in rows if r.id is not None]
        by_kind = {k: [r for r in effects if r.kind == k] for k in KINDS}
        statuses = Counter(r.status for r in effects)
        per_payment = Counter((r.payment_id, r.kind) for r in effects)
        missing = sum(1 for p in {r.payment_id for r in rows} for k in KINDS
                      if per_payment[(p, k)] == 0)
        extra = sum(n - 1 for n in per_payment.values() if n > 1)
        our_keys = {r.effect_key for r in effects}
        applied_ours = {k: applied.get(k, 0) for k in our_keys}
        never_applied = sum(1 for n in applied_ours.values() if n == 0)
        charges = {r.effect_key for r in by_kind["psp.charge"]}
        charges_applied = sum(1 for k in charges if applied_ours.get(k, 0) >= 1)
        receipts_applied = sum(1 for r in by_kind["email.receipt"]
                               if applied_ours.get(r.effect_key, 0) >= 1)
        max_per_key = max(applied.values(), default=0)
        leftovers = len(set(applied) - our_keys)

        claims = sum(int(r.attempts) for r in effects)
        rescued = sum(max(0, int(r.attempts) - int(r.recorded)) for r in effects)
        retried_by: Counter[str] = Counter()
        for a in attempt_rows:
            if a.outcome == "ambiguous":
                label = "PSP timeout"
            elif a.http_status:
                label = f"PSP {a.http_status}"
            else:
                label = str(a.outcome)
            retried_by[label] += int(a.n)
        if rescued:
            retried_by["worker killed"] += rescued
        lags = [float(r.lag) for r in effects if r.lag is not None]
        o = tally.outcomes
        lost = missing + never_applied
        duplicates_api = o["replayed"] + o["409"]
        duplicates_psp = int(psp.get("replayed", 0)) + int(psp.get("conflicts", 0))
        checks = {
            "no 5xx from the API, no request unanswered":
                o["5xx"] == 0 and o["unreachable"] == 0,
            "one payment per idempotency key, every retry got the same reply":
                payments == len(tally.accepted_keys) == self.plan.payments
                and payment_keys == tally.accepted_keys and not tally.inconsistent,
            "reused keys refused with 422, malformed requests with 4xx":
                o["422"] == tally.mismatches_sent and o["4xx"] == tally.bad_sent
                and o["unexpected"] == 0,
            "every effect delivered: none lost, none stuck, none dead-lettered":
                lost == 0 and extra == 0 and statuses.get("delivered", 0) == len(effects)
                == 2 * payments,
            "exactly one charge per payment at the PSP":
                charges_applied == payments == len(charges) and max_per_key == 1
                and all(n == 1 for n in applied_ours.values()),
        }
        return {
            "ok": all(checks.values()),
            "run": self.run,
            "mode": "short" if self.plan.short else "full",
            "dispatcher": "celery" if self.celery else "standalone",
            "database": "DATABASE_URL" if os.environ.get("DATABASE_URL") else "embedded",
            "elapsed_s": round(self.out.elapsed(), 1),
            "requests": tally.sent,
            "responses": {"created": o["created"], "replayed": o["replayed"],
                          "409": o["409"], "422": o["422"], "4xx_bad_request": o["4xx"],
                          "5xx": o["5xx"], "lost_in_network": o["lost"],
                          "unreachable": o["unreachable"], "unexpected": o["unexpected"]},
            "payments": self.plan.payments,
            "payments_created": payments,
            "accepted_keys": len(tally.accepted_keys),
            "charges_applied": charges_applied,
            "receipts_applied": receipts_applied,
            "max_applied_per_key": max_per_key,
            "duplicates_prevented": {"api": duplicates_api, "psp": duplicates_psp},
            "deliveries": {"attempts": claims, "retried": claims - len(effects),
                           "by_reason": dict(retried_by.most_common()),
                           "psp_requests": int(psp.get("deliveries", 0))},
            "effects": {"expected": 2 * payments, "enqueued": len(effects),
                        "delivered": statuses.get("delivered", 0),
                        "dead_lettered": sum(statuses.get(s, 0) for s in FINISHED[1:]),
                        "stuck": statuses.get("pending", 0) + statuses.get("in_flight", 0),
                        "lost": lost, "left_over_from_earlier_runs": leftovers},
            "workers_killed": len(self.kills),
            "kills": self.kills,
            "latency_ms": {k: round(v * 1000, 1) for k, v in
                           percentiles(tally.latencies).items()},
            "delivery_lag_s": {k: round(v, 2) for k, v in percentiles(lags).items()},
            "invariants": checks,
            "problems": tally.problems,
        }

    def report(self, r: dict[str, Any]) -> None:
        out = self.out
        resp, eff, dlv = r["responses"], r["effects"], r["deliveries"]
        lat, lag = r["latency_ms"], r["delivery_lag_s"]

        def row(label: str, value: object, note: str = "") -> None:
            lines = textwrap.wrap(note, 68) or [""]
            out.line(f"  {label:<22}{value!s:>5}   {lines[0]}".rstrip())
            for more in lines[1:]:
                out.line(f"{'':<32}{more}")

        out.line("")
        where = "embedded PostgreSQL" if r["database"] == "embedded" else "DATABASE_URL"
        out.line(f"report: {r['elapsed_s']:.1f}s, {r['dispatcher']} workers, {where}")
        row("requests sent", r["requests"],
            f"201 new {resp['created']}, 201 replay {resp['replayed']}, 409 {resp['409']}, "
            f"422 {resp['422']}, bad input {resp['4xx_bad_request']}, 5xx {resp['5xx']}")
        if resp["lost_in_network"]:
            hidden = r["payments_created"] - resp["created"]
            row("responses lost", resp["lost_in_network"],
                "timed out, resent the same key"
                + (f" ({hidden} had created the payment)" if hidden > 0 else ""))
        row("payments created", r["payments_created"],
            f"= distinct keys accepted ({r['accepted_keys']})")
        row("charges applied at PSP", r["charges_applied"],
            f"one per payment; max per key {r['max_applied_per_key']}; "
            f"receipts {r['receipts_applied']}")
        row("duplicates prevented", sum(r["duplicates_prevented"].values()),
            f"API {r['duplicates_prevented']['api']} (replays, 409s), "
            f"PSP {r['duplicates_prevented']['psp']} (redeliveries deduped)")
        row("deliveries retried", dlv["retried"],
            ", ".join(f"{k}: {v}" for k, v in dlv["by_reason"].items()))
        row("workers SIGKILLed", r["workers_killed"], "each replaced at once")
        row("effects lost", eff["lost"],
            f"{eff['delivered']}/{eff['expected']} delivered, {eff['stuck']} stuck, "
            f"{eff['dead_lettered']} dead-lettered"
            + (f" (+{eff['left_over_from_earlier_runs']} left by an earlier run, "
               "delivered too)" if eff["left_over_from_earlier_runs"] else ""))
        if lat:
            row("API latency", "", f"p50 {lat['p50']:.0f} ms, p95 {lat['p95']:.0f} ms, "
                                   f"p99 {lat['p99']:.0f} ms, max {lat['max']:.0f} ms")
        if lag:
            row("commit to delivery", "", f"p50 {lag['p50']:.2f} s, p95 {lag['p95']:.2f} s, "
                                          f"p99 {lag['p99']:.2f} s, max {lag['max']:.2f} s")
        out.line("")
        for name, ok in r["invariants"].items():
            out.line(f"  {'ok  ' if ok else 'FAIL'}  {name}")
        for p in r["problems"][:10]:
            out.line(f"        {p}")
        out.line("")
        out.line("PASS: every payment charged exactly once, nothing lost." if r["ok"] else
                 "FAIL: an invariant does not hold (child logs in "
                 f"{shown(self.procs.logdir) if self.procs else '.outbox/demo'}/).")

    def shutdown(self) -> None:
        self.stop.set()
        if self.storm is not None:
            self.storm.close()
        if self.procs is not None:
            self.procs.stop_all(timeout=10.0)
        if self.engine is not None:
            self.engine.dispose()

    def main(self) -> int:
        plan, out = self.plan, self.out
        what = "short run" if plan.short else "full run"
        out.line(f"outbox demo ({what}, run {self.run}): idempotent payments and "
                 "exactly-once effects, with crashes")
        out.line("")
        self.start_system()
        self.drive()
        assert self.procs is not None
        # Stop the workers before counting, so that no late delivery changes the answer.
        self.procs.stop(self.procs.alive("worker") + self.procs.alive("beat"), timeout=10.0)
        result = self.collect()
        self.report(result)
        if self.as_json:
            out.stream.write(json.dumps(result) + "\n")
            out.stream.flush()
        return 0 if result["ok"] else 1


@contextlib.contextmanager
def signals_raise() -> Iterator[Callable[[], None]]:
    """SIGTERM raises `Interrupted` in the main thread (SIGINT stays KeyboardInterrupt);
    the returned `mask()` ignores both while the children are being stopped."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signum)

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, on_term)

    def mask() -> None:
        for s in saved:
            signal.signal(s, signal.SIG_IGN)

    try:
        yield mask
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def main(args: argparse.Namespace) -> int:
    """Entry point of `outbox demo`; returns the exit status."""
    try:
        plan = Plan.from_args(args)
    except ValueError as exc:
        print(f"outbox: error: {exc}", file=sys.stderr)
        return 2
    console = Console(sys.stdout)
    demo = Demo(plan, console, as_json=bool(getattr(args, "json", False)))
    owns_embedded = not os.environ.get("DATABASE_URL")
    status = 1
    with signals_raise() as mask:
        try:
            status = demo.main()
        except (KeyboardInterrupt, Interrupted) as exc:
            console.end_progress()
            signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
            console.line(f"interrupted ({signal.Signals(signum).name}): stopping every "
                         "process the demo started")
            status = 128 + signum
        except ChildFailed as exc:
            console.end_progress()
            console.line(f"outbox demo: {exc}")
            status = 1
        finally:
            mask()
            demo.shutdown()
            if owns_embedded:
                _embedded.stop()
    return status
