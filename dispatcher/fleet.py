"""One `outbox worker` process for several outbox databases (issue 17).

    outbox worker --database orders=postgresql://u@db1/orders --database billing=... \\
        --concurrency 16
    OUTBOX_DATABASES="postgresql://u@db1/orders postgresql://u@db2/billing" outbox worker

Each database gets a member of the fleet: its own engine and pool, LISTEN connection,
`Dispatcher` (so its own lease owner id, leases, producer watermark and completer),
sweep and retention, exactly what a single-database `outbox worker` runs, on a thread
of its own. What they share is the process's `--concurrency`: a `SlotBudget`.

A database that is down or has no outbox schema at start does not hold up the others:
its member probes it with exponential backoff (0.5 s doubling up to
`OUTBOX_DATABASE_RETRY_MAX` seconds, 30 by default), logs each change of state once,
and starts serving as soon as the probe passes. Once served, a database that goes away
is the dispatcher's business as in a single-database worker: its claims fail, are
logged and retried every poll interval, and the other databases go on. SIGTERM/SIGINT
stops every member: each finishes its in-flight deliveries within the grace period and
releases the rest, as the single-database worker does.

Log lines from a member's threads carry `[name]`; metrics carry `db=name`.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.exc import SQLAlchemyError

from dispatcher._core import Dispatcher

# The configuration (DatabaseSpec, databases_from, ...) lives in dispatcher/databases.py.
from dispatcher.databases import (
    DATABASES_ENV,
    DatabaseSpec,
    databases_from,
    parse_database,
    parse_databases,
)
from dispatcher.handlers import Registry
from dispatcher.producer import FULL_SCAN_EVERY
from outbox._config import seconds_setting
from outbox._redact import redact_secrets

log = logging.getLogger("outbox.fleet")

#: The longest wait between two probes of a database that is not ready (seconds).
RETRY_MAX_ENV = "OUTBOX_DATABASE_RETRY_MAX"


def retry_max_from(environ: Mapping[str, str]) -> float:
    return seconds_setting(environ, RETRY_MAX_ENV, 30.0, low=0.1, high=3600)


__all__ = ["DATABASES_ENV", "DatabaseSpec", "Fleet", "Settings", "SlotBudget",
           "databases_from", "parse_database", "parse_databases", "retry_max_from",
           "serve", "worker_engine"]


# --------------------------------------------------------------------------- slots


class SlotBudget:
    """The process's delivery slots (`--concurrency N`), shared by its dispatchers.

    The policy: **a guaranteed share, and borrowing of idle slots**. Each of the k
    databases is guaranteed `share = ceil(N / k)` slots; slots a database leaves idle
    may be borrowed by the others, so one busy database alone gets all N. A database
    *has work* from the moment it asks for more slots than it is granted, or its claim
    fills its grant (more may be due), until a claim comes up short (it has caught up).
    While it has work and holds fewer than its share, it is *hungry*: nobody borrows
    what is missing from its share, so as the borrowers' deliveries finish their slots
    go to it (each release rings it). A trickle into a quiet database therefore waits
    at most for the first delivery of the busy one to finish (plus one claim), never
    for the busy one's backlog; two busy databases settle at a share each.

    Why not the alternatives: fixed caps of N/k leave slots idle whenever one database
    is quiet (half the throughput of a lone busy database, with two); round-robin
    claims from one loop would serialize every database's claims behind the slowest
    (a database that does not answer would stall the rest for its call timeout), and
    give up the per-database loops (LISTEN doorbell, lease extension, completer)
    that `Dispatcher` already runs. Each member keeps its own loop; the budget only
    decides how many rows its next claim may take.

    Accounting: a member's use is its deliveries in flight (read from its dispatcher)
    plus the grants of claims under way, so nothing drifts; a grant that the claim
    did not fill is returned at `settle`. Ringing on release is batched like the
    dispatcher's own: a waiting borrower is rung when half a batch is free for it, a
    hungry member as soon as any slot is.
    """

    def __init__(self, total: int, members: int, *, max_batch: int = 100) -> None:
        if total < 1 or members < 1:
            raise ValueError("total and members must be >= 1")
        self.total = total
        self.share = math.ceil(total / members)
        self.lot = max(1, math.ceil(min(self.share, max_batch) / 2))
        self._lock = threading.Lock()
        self._members: list[MemberSlots] = []

    def member(self, name: str) -> MemberSlots:
        slots = MemberSlots(self, name)
        with self._lock:
            self._members.append(slots)
        return slots

    # -- under the lock ---------------------------------------------------------------

    def _used(self) -> dict[MemberSlots, int]:
        return {m: m.reserved + m.in_flight() for m in self._members}

    def _room(self, m: MemberSlots, used: dict[MemberSlots, int], want: int) -> int:
        """How many slots `m` may take now (at most `want`)."""
        available = self.total - sum(used.values())
        held = sum(max(0, self.share - used[o]) for o in self._members
                   if o is not m and o.has_work)
        own = self.share - used[m]
        if own > 0:  # its guaranteed share, whoever is hungry
            n = min(want, available, max(own, available - held))
        else:        # borrowing: never what a hungry member is missing
            n = min(want, available - held)
        return max(0, n)

    # -- for MemberSlots ---------------------------------------------------------------

    def _acquire(self, m: MemberSlots, want: int) -> int:
        with self._lock:
            used = self._used()
            n = self._room(m, used, want)
            if n < want:
                m.has_work = True
            m.waiting = n < want
            m.reserved += n
            m.granted += n
            if n < want:
                m.denied += 1
            return n

    def _settle(self, m: MemberSlots, granted: int, got: int) -> None:
        with self._lock:
            m.reserved -= granted
            # A short claim has caught up (nothing to ring it for: its doorbell and
            # its poll say when to look again); a full one may have left more behind.
            m.has_work = got >= granted
            if got < granted:
                m.waiting = False
        if got < granted:
            self.ring()

    def ring(self) -> None:
        """Wake members that wait for slots, if there are slots for them now."""
        if not any(m.waiting for m in self._members):
            return
        wake: list[threading.Event] = []
        with self._lock:
            used = self._used()
            for m in self._members:
                if not m.waiting or m.wake is None:
                    continue
                room = self._room(m, used, self.total)
                hungry = m.has_work and used[m] < self.share
                if (hungry and room > 0) or room >= self.lot:
                    m.waiting = False
                    wake.append(m.wake)
        for event in wake:
            event.set()

    def snapshot(self) -> dict[str, dict[str, int | bool]]:
        """Per member: slots in use, share, hungry (for tests and logs)."""
        with self._lock:
            used = self._used()
            return {m.name: {"used": used[m], "share": self.share,
                             "hungry": m.has_work and used[m] < self.share,
                             "granted": m.granted, "denied": m.denied}
                    for m in self._members}


class MemberSlots:
    """One dispatcher's view of the budget (`dispatcher._core.SlotShare`)."""

    def __init__(self, budget: SlotBudget, name: str) -> None:
        self.budget = budget
        self.name = name
        self.reserved = 0      # granted to claims under way
        self.has_work = False  # denied slots, or its last claim was full
        self.waiting = False   # denied some: ring it when slots free up
        self.granted = 0       # totals, for the tests
        self.denied = 0
        self.wake: threading.Event | None = None
        self.in_flight: Callable[[], int] = lambda: 0

    def bind(self, dispatcher: Dispatcher) -> None:
        """Count `dispatcher`'s deliveries in flight and ring its loop."""
        self.in_flight = lambda: dispatcher.in_flight
        self.wake = dispatcher.wake

    def acquire(self, want: int) -> int:
        return self.budget._acquire(self, want)

    def settle(self, granted: int, got: int) -> None:
        self.budget._settle(self, granted, got)

    def release(self) -> None:
        self.budget.ring()


# --------------------------------------------------------------------------- members


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None)
    lines = str(orig or exc).strip().splitlines()
    return redact_secrets(lines[0] if lines else type(exc).__name__)


@dataclass(frozen=True, slots=True)
class Settings:
    """What every member's dispatcher and loop run with (`outbox worker`'s flags)."""

    concurrency: int = 8
    queue: str = "default"
    lease: float = 30.0
    poll_interval: float = 1.0
    grace: float = 10.0
    full_scan_every: float = FULL_SCAN_EVERY
    max_batch: int = 100
    application_name: str = "outbox-worker"
    retry_min: float = 0.5   # backoff between probes of a database that is not ready
    retry_max: float = 30.0
    gauges: bool = True      # register the queue gauges (dispatcher/metrics.py)


class Member:
    """One database of the fleet: probe it until it is ready, then run its worker."""

    def __init__(self, spec: DatabaseSpec, registry: Registry, slots: MemberSlots,
                 settings: Settings, engine_factory: Callable[[DatabaseSpec], Engine]
                 ) -> None:
        self.spec = spec
        self.name = spec.name
        self.registry = registry
        self.slots = slots
        self.settings = settings
        self.engine = engine_factory(spec)
        self.state = "starting"
        self.dispatcher: Dispatcher | None = None
        self.thread: threading.Thread | None = None

    def probe(self) -> tuple[str, str]:
        """("up", revision) | ("unmigrated", why) | ("down", first line of the error)."""
        try:
            with self.engine.connect() as conn:
                present = conn.execute(text(
                    "SELECT to_regclass('outbox.effects') IS NOT NULL")).scalar()
                revision = conn.execute(text(
                    "SELECT max(version_num) FROM outbox.alembic_version")).scalar() \
                    if present else None
        except SQLAlchemyError as exc:
            return "down", _first_line(exc)
        if not present:
            return "unmigrated", "no outbox schema (run `outbox migrate` against it)"
        return "up", revision or "unknown"

    def _note(self, state: str, detail: str) -> None:
        """Log a change of state once (a retry in the same state logs nothing)."""
        if state == self.state:
            log.debug("database %s: still %s: %s", self.name, state, detail)
            return
        self.state = state
        if state == "up":
            log.info("database %s (%s): up, schema %s: serving", self.name,
                     self.spec.shown, detail)
        else:
            log.warning("database %s (%s): %s: %s; retrying with backoff (up to %.0f s) "
                        "while the others are served", self.name, self.spec.shown, state,
                        detail, self.settings.retry_max)

    def wait_ready(self, stop: threading.Event) -> bool:
        """Probe until the database has our schema (True) or `stop` is set (False)."""
        backoff = self.settings.retry_min
        while not stop.is_set():
            state, detail = self.probe()
            self._note(state, detail)
            if state == "up":
                return True
            stop.wait(backoff)
            backoff = min(backoff * 2, self.settings.retry_max)
        return False

    def run(self, stop: threading.Event) -> None:
        """The member's thread: wait for the database, then serve it until `stop`."""
        from dispatcher.worker import run_worker

        s = self.settings
        backoff = s.retry_min
        while self.wait_ready(stop):
            dispatcher = Dispatcher(
                self.engine, self.registry, queue=s.queue, concurrency=s.concurrency,
                lease=s.lease, full_scan_every=s.full_scan_every, max_batch=s.max_batch,
                metric_labels={"db": self.name}, slots=self.slots)
            self.slots.bind(dispatcher)
            self.dispatcher = dispatcher
            if s.gauges:
                from dispatcher.metrics import register_queue_gauges

                register_queue_gauges(self.engine, db=self.name)
            try:
                run_worker(dispatcher, poll_interval=s.poll_interval, grace=s.grace,
                           stop=stop, install_signals=False,
                           application_name=s.application_name, label=self.name)
                return
            except Exception:  # a bug, not an outage (the loop survives those): retry
                log.exception("database %s: the worker failed; starting it again in "
                              "%.1f s", self.name, backoff)
                self.state = "failed"
                # Finish or release what the failed dispatcher still has in flight
                # before a new one takes its slots: its outcomes would otherwise go to
                # a stopped completer (redelivered only after the lease, blindly for
                # kinds that are not retry-safe) and its deliveries leave the budget.
                try:
                    dispatcher.shutdown(s.grace)
                except Exception:
                    log.exception("database %s: releasing the failed worker's deliveries "
                                  "failed; their leases will expire", self.name)
                stop.wait(backoff)
                backoff = min(backoff * 2, s.retry_max)


class _DatabaseTag(logging.Filter):
    """Prefixes `[name]` to records logged from a member's threads (its loop thread
    and its LISTEN thread), so a line says which database it is about."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: dict[str, str] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        name = self.threads.get(record.threadName or "")
        if name is not None and not getattr(record, "outbox_db", None):
            record.outbox_db = name
            record.msg = f"[{name}] {record.msg}"
        return True


# --------------------------------------------------------------------------- the fleet


def worker_engine(spec: DatabaseSpec, application_name: str) -> Engine:
    """The engine `outbox worker` makes (dispatcher/cli.py): no pre-ping, the workers'
    call timeout, a small pool."""
    from outbox._config import make_engine
    from outbox._connections import DEFAULT_WORKER_CALL_TIMEOUT

    return make_engine(spec.url, application_name=application_name, pool_size=3,
                       max_overflow=2, pool_pre_ping=False,
                       call_timeout=DEFAULT_WORKER_CALL_TIMEOUT)


class Fleet:
    """Serves `specs` from this process with one slot budget (see SlotBudget)."""

    def __init__(self, specs: Sequence[DatabaseSpec], registry: Registry,
                 settings: Settings | None = None, *,
                 engine_factory: Callable[[DatabaseSpec], Engine] | None = None) -> None:
        if not specs:
            raise ValueError("a fleet serves at least one database")
        self.settings = settings or Settings()
        s = self.settings
        self.budget = SlotBudget(s.concurrency, len(specs), max_batch=s.max_batch)
        factory = engine_factory or (lambda spec: worker_engine(spec, s.application_name))
        self.members = [Member(spec, registry, self.budget.member(spec.name), s, factory)
                        for spec in specs]

    def run(self, stop: threading.Event | None = None, *,
            install_signals: bool = True) -> None:
        """Serve every database until SIGTERM/SIGINT (or `stop`), then stop each member
        gracefully (in parallel: one grace period for all)."""
        from outbox.retention import ScheduledRetention

        ScheduledRetention.from_env()  # a bad setting refuses to start, before any thread
        stop = stop or threading.Event()
        if install_signals:
            def on_signal(signum: int, _frame: Any) -> None:
                log.info("signal %s: every database stops claiming, finishing in-flight "
                         "deliveries", signum)
                stop.set()
                for m in self.members:
                    if m.dispatcher is not None:
                        m.dispatcher.wake.set()
            signal.signal(signal.SIGTERM, on_signal)
            signal.signal(signal.SIGINT, on_signal)
        s = self.settings
        log.info("serving %d databases, %d delivery slots (guaranteed %d each, idle ones "
                 "lent): %s", len(self.members), s.concurrency, self.budget.share,
                 ", ".join(f"{m.name}={m.spec.shown}" for m in self.members))
        tag = _DatabaseTag()
        handlers = list(logging.getLogger().handlers)
        for h in handlers:
            h.addFilter(tag)
        try:
            for m in self.members:
                thread_name = f"outbox-db-{m.name}"
                tag.threads[thread_name] = m.name
                tag.threads[f"outbox-listen-{m.name}"] = m.name
                m.thread = threading.Thread(target=m.run, args=(stop,), name=thread_name,
                                            daemon=True)
                m.thread.start()
            # Joined with a timeout so that the main thread keeps taking signals.
            while any(m.thread is not None and m.thread.is_alive() for m in self.members):
                for m in self.members:
                    if m.thread is not None:
                        m.thread.join(0.5)
        finally:
            stop.set()
            for m in self.members:
                m.engine.dispose()
            for h in handlers:
                h.removeFilter(tag)
        log.info("fleet stopped: %s", {m.name: (m.dispatcher.stats if m.dispatcher else
                                                m.state) for m in self.members})


def serve(specs: Sequence[DatabaseSpec], registry: Registry, settings: Settings,
          ) -> None:
    """`outbox worker --database ...`: run a fleet until SIGTERM/SIGINT."""
    Fleet(specs, registry, settings).run()


__all__ = ["DATABASES_ENV", "DatabaseSpec", "Fleet", "MemberSlots", "Settings",
           "SlotBudget", "databases_from", "parse_database", "parse_databases", "serve"]
