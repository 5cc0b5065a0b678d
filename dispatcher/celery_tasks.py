"""Our Celery tasks on *your* Celery app: `register(app)`.

    from celery import Celery
    from dispatcher.celery_tasks import register

    app = Celery("myproject", broker="redis://...")   # your app, your config
    outbox = register(app, queue_name="outbox")        # our drain/sweep, beat entry
    # celery -A myproject worker -Q celery,outbox

`register` defines `outbox.drain` and `outbox.sweep` on the given app (`app.task`,
never `shared_task`, so no other app gets them and your `@shared_task`s stay yours),
adds the beat entry, the per-worker sweep bootstep and a `worker_process_init` hook
that sets up telemetry in each prefork child; engines and Dispatchers are created
lazily per process and queue. `dispatcher/celery_app.py` is our own default app built
with this function (`celery -A dispatcher.celery_app worker`, DESIGN §8).

The broker is a doorbell, the database is the mailbox: see dispatcher/celery_app.py and
docs/architecture.md for drain, re-arm and sweep.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from celery import Celery, bootsteps, signals
from celery.exceptions import SoftTimeLimitExceeded
from sqlalchemy.exc import DBAPIError

from dispatcher._core import Dispatcher
from dispatcher.databases import DatabaseSpec, databases_from
from dispatcher.fleet import worker_engine
from dispatcher.handlers import load_registry
from dispatcher.metrics import configure_metrics, register_queue_gauges
from dispatcher.producer import FULL_SCAN_EVERY
from dispatcher.worker import sweep as sweep_leases
from outbox._config import make_engine, seconds_setting
from outbox._connections import DEFAULT_WORKER_CALL_TIMEOUT
from outbox._enqueue import Where, add_doorbell
from outbox.errors import ConfigurationError
from outbox.retention import scheduled_retention
from outbox.sql import dispatch as sql
from outbox.telemetry_setup import configure as configure_traces
from outbox.telemetry_setup import instrument_library

log = logging.getLogger("outbox.celery")

DRAIN_BUDGET = float(os.environ.get("OUTBOX_DRAIN_BUDGET", "10"))
SWEEP_INTERVAL = float(os.environ.get("OUTBOX_SWEEP_INTERVAL", "5"))
CONCURRENCY = int(os.environ.get("OUTBOX_CONCURRENCY", "8"))
LEASE = float(os.environ.get("OUTBOX_LEASE", "30"))


# The producer's full scans under a backlog (seconds; 0: every claim), as `outbox worker
# --full-scan-every`.
FULL_SCAN = seconds_setting(os.environ, "OUTBOX_FULL_SCAN_EVERY", FULL_SCAN_EVERY,
                            low=0, high=3600)
# The longest a sweep skips a database it could not reach (seconds).
SWEEP_BACKOFF_MAX = 60.0
# The retention runs a sweep starts (one thread per database and process, see
# run_sweep) end with the process: never set.
_RETENTION_STOP = threading.Event()
# A re-armed drain waits at most this long (then looks again and re-arms if need be).
# Its message is an ETA message the worker holds unacknowledged until it is due, so
# this must stay far below Redis's visibility_timeout (1 h by default: a message held
# longer is restored and run twice) and RabbitMQ's consumer_timeout (30 min).
REARM_MAX = float(os.environ.get("OUTBOX_REARM_MAX", "60"))
# The shortest wait: a doorbell's follow-up look, a re-arm for work claimable "now"
# (freed just after the drain's last claim), and the grid that re-arm times snap to.
REARM_MIN = 0.25
_ETA_SLACK = 0.05  # ETA timers fire a little early or late; never ask before it is due
# After a drain's soft time limit: seconds in-flight deliveries get before release.
RELEASE_GRACE = 1.0
SERVICE_NAME = "outbox-celery"

_RING_RETRY = {"max_retries": 1, "interval_start": 0, "interval_step": 0.1,
               "interval_max": 0.1}

_lock = threading.Lock()
_dispatchers: dict[tuple[int, str, str], Dispatcher] = {}
_telemetry_pid: int | None = None


def drain_time_limits(budget: float, lease: float) -> tuple[float, float]:
    """(soft, hard) seconds for one drain.

    A drain claims for `budget` seconds, then waits for what it claimed; each attempt's
    deadline is 0.8 x lease after its claim (dispatcher/executor.py). So a drain that
    runs past budget + lease has a handler ignoring its deadline: the soft limit
    releases it, the hard limit (a little later) kills the child if even that hangs.
    """
    soft = budget + lease + 5.0
    return soft, soft + RELEASE_GRACE + 10.0


def setup_telemetry() -> None:
    """Our tracer and meter providers, once per process (after the prefork fork)."""
    global _telemetry_pid
    with _lock:
        if _telemetry_pid == os.getpid():
            return
        _telemetry_pid = os.getpid()
    if configure_traces(SERVICE_NAME):
        # Our exporter is on in this child: the task spans of Celery's maintained
        # instrumentation (run/apply_async), beside our deliver spans.
        instrument_library("celery")
    configure_metrics(SERVICE_NAME)


def dispatcher_for(queue: str, *, database: DatabaseSpec | None = None,
                   cache: dict[tuple[int, str, str], Dispatcher] | None = None,
                   gauges: Callable[..., Any] | None = None) -> Dispatcher:
    """One Dispatcher per process, database and queue, created lazily after the prefork
    fork. `database`: one of OUTBOX_DATABASES (None: DATABASE_URL)."""
    found_cache = _dispatchers if cache is None else cache
    key = (os.getpid(), database.name if database else "", queue)
    with _lock:
        found = found_cache.get(key)
    if found is not None:
        return found
    setup_telemetry()
    with _lock:
        found = found_cache.get(key)
        if found is None:
            if database is None:
                engine = make_engine(application_name=SERVICE_NAME, pool_size=3,
                                     max_overflow=2, pool_pre_ping=False,  # see cmd_worker
                                     call_timeout=DEFAULT_WORKER_CALL_TIMEOUT)
            else:
                engine = worker_engine(database, SERVICE_NAME)
            db = database.name if database else (engine.url.database or "default")
            (gauges or register_queue_gauges)(engine, db=db)
            found = Dispatcher(engine, load_registry(), queue=queue,
                               concurrency=CONCURRENCY, lease=LEASE,
                               full_scan_every=FULL_SCAN, metric_labels={"db": db})
            found_cache[key] = found
        return found


def _forget(d: Dispatcher) -> None:
    """Drop a Dispatcher that was shut down; the next drain makes a new one."""
    with _lock:
        for key, value in list(_dispatchers.items()):
            if value is d:
                del _dispatchers[key]


def _on_worker_process_init(**_: Any) -> None:
    """A prefork child starts: its own telemetry; engines follow lazily per queue.

    Connections and SDK exporters inherited from the parent are not safe to use in a
    child; `dispatcher_for` is keyed by pid, so nothing of the parent's is reused.
    """
    try:
        setup_telemetry()
    except Exception:  # telemetry must never stop a worker from starting
        log.exception("outbox: telemetry setup in the worker child failed")


signals.worker_process_init.connect(_on_worker_process_init, weak=False)


def _on_worker_process_shutdown(**_: Any) -> None:
    """A child exits (max-tasks-per-child, a warm shutdown): its Dispatchers write what
    they still hold (outcomes a lost connection kept from the database, released
    deliveries), a last try before those effects wait for their leases."""
    with _lock:
        mine = [d for (pid, *_rest), d in _dispatchers.items() if pid == os.getpid()]
    for d in mine:
        try:
            d.shutdown(0)
        except Exception:  # never stop a child from exiting
            log.exception("outbox: a Dispatcher's shutdown failed in the exiting child")


signals.worker_process_shutdown.connect(_on_worker_process_shutdown, weak=False)


class Rearms:
    """This process's re-armed drains not yet due: one per queue and moment, not N.

    Every drain that stops with work due later would schedule its own drain for that
    moment; a burst of N drains (N doorbells) would then keep N messages alive, each
    re-arming again when it runs. A re-arm is skipped when this process already has a
    drain for the queue due no later than it: that drain runs after this state was
    committed, so it sees the work and re-arms for it itself. Times snap up to a
    REARM_MIN grid, so even ever-earlier due times leave at most one message per slot.
    Across P worker processes at most P drains run for one moment, whatever N was.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._due: dict[str, float] = {}  # queue -> monotonic time of the earliest
        self._pid = os.getpid()

    def reserve(self, queue: str, countdown: float, now: float) -> float | None:
        """The moment to re-arm for (`now` + countdown, snapped up to the grid), or
        None when a drain this process scheduled already covers it."""
        target = math.ceil((now + countdown) / REARM_MIN) * REARM_MIN
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's messages are not ours
                self._due.clear()
                self._pid = os.getpid()
            due = self._due.get(queue)
            if due is not None and now < due <= target:
                return None
            self._due[queue] = target
        return target

    def release(self, queue: str, target: float) -> None:
        """Forget a reservation whose message could not be published."""
        with self._lock:
            if self._due.get(queue) == target:
                del self._due[queue]


@dataclass
class OutboxTasks:
    """What `register` put on an app: its tasks, doorbell and settings."""

    app: Celery
    queue_name: str | None
    sweep_interval: float
    drain_budget: float
    drain: Any = None
    sweep: Any = None
    rearms: Rearms = field(default_factory=Rearms)
    dispatcher_for: Callable[..., Dispatcher] = dispatcher_for
    #: OUTBOX_DATABASES (or `register(databases=...)`): every database these workers
    #: serve, each drained by messages that name it; None: DATABASE_URL alone.
    databases: list[DatabaseSpec] | None = None
    # A database the sweep could not reach is skipped until then (monotonic), the wait
    # doubling from 5 s up to SWEEP_BACKOFF_MAX while it stays down (per process).
    _down_until: dict[str, float] = field(default_factory=dict)
    _down_for: dict[str, float] = field(default_factory=dict)

    def _route(self) -> dict[str, Any]:
        return {"queue": self.queue_name} if self.queue_name else {}

    def _spec(self, name: str | None) -> DatabaseSpec | None:
        if name is None:
            return None
        for spec in self.databases or ():
            if spec.name == name:
                return spec
        # Reviewed: a worker serving DATABASE_URL alone drained its own database for a
        # message meant for another one, and re-armed under that name.
        raise ConfigurationError(f"no database named {name!r} in OUTBOX_DATABASES")

    def _targets(self) -> list[DatabaseSpec | None]:
        return list(self.databases) if self.databases else [None]

    def send_drain(self, queue: str, *, kick: bool, database: str | None = None,
                   **options: Any) -> None:
        # A message that names no database is what a single-database worker (and an
        # older version) sends and takes: the same message as before, DATABASE_URL.
        kwargs: dict[str, Any] = {"kick": kick}
        if database is not None:
            kwargs["database"] = database
        self.drain.apply_async(args=[queue], kwargs=kwargs, **{**self._route(), **options})

    def rearm(self, d: Dispatcher, queue: str, rearms: Rearms | None = None,
              database: str | None = None) -> float | None:
        """After a drain found nothing to claim: schedule one for when work is due.

        Returns the countdown published, or None (nothing waits, one is already
        scheduled, or the database or broker failed: the workers' sweep rings later).
        """
        book = rearms or self.rearms
        try:
            with d.engine.connect() as conn:
                wait = sql.seconds_until_claimable(conn, queue)
        except DBAPIError as exc:
            log.warning("drain %s: could not read the next due time (%s); "
                        "the sweep will ring when it can", queue, exc)
            return None
        if wait is None:
            return None
        now = time.monotonic()
        slot = queue if database is None else f"{database}\0{queue}"
        target = book.reserve(slot, min(max(wait + _ETA_SLACK, REARM_MIN), REARM_MAX), now)
        if target is None:
            return None
        countdown = target - now
        try:
            self.send_drain(queue, kick=False, database=database, countdown=countdown,
                            retry=True, retry_policy=_RING_RETRY)
        except Exception as exc:  # the broker is down: the sweep rings when it is back
            book.release(slot, target)
            log.warning("drain %s: could not re-arm in %.2f s (%s)", queue, countdown, exc)
            return None
        return countdown

    def run_drain(self, queue: str, kick: bool, database: str | None = None
                  ) -> dict[str, Any]:
        """Deliver what is due on `queue`; then arrange exactly one follow-up, if any.

        Budget ran out: chain another drain now. A doorbell that found nothing (rung just
        before its transaction committed): look once more shortly after (`kick`). Else,
        if work is due later on `queue`: re-arm for that moment (`rearm`). A handler
        still running at budget + lease (past its deadline) or the task's soft time
        limit releases what is in flight (`Dispatcher.shutdown`, fenced by lease
        token), drops that Dispatcher and chains a new drain; the hard time limit
        kills the child if even that hangs.
        """
        if self.databases and database is None:
            # Serving several databases, a drain that names none (an older version's
            # message, a doorbell that could not tell where its rows are): one per
            # database, each of which finds its work or re-arms.
            names = [each.name for each in self.databases]
            for name in names:
                self.send_drain(queue, kick=kick, database=name)
            return {"claimed": 0, "more": False, "rearmed_in": None, "fanned_out": names}
        try:
            spec = self._spec(database)
        except ConfigurationError as exc:  # a message for a database no longer served
            log.warning("drain %s: %s; message dropped", queue, exc)
            return {"claimed": 0, "more": False, "rearmed_in": None, "unknown": database}
        d = self.dispatcher_for(queue, database=spec)
        before = d.stats.claimed
        start = time.monotonic()
        more = True
        try:
            # Claims for the budget, then waits for what it claimed until every
            # deadline (0.8 x lease after its claim) has passed, and no longer.
            more = d._loop(claim_until=start + self.drain_budget,
                           finish_until=start + self.drain_budget + d.lease)
            overran = d.in_flight > 0
        except SoftTimeLimitExceeded:
            overran = True
        if overran:
            log.warning("drain %s: handlers past their deadline; releasing in-flight "
                        "work", queue)
            try:
                d.shutdown(RELEASE_GRACE)
            finally:
                _forget(d)
            self.send_drain(queue, kick=False, database=database)
            return {"claimed": d.stats.claimed - before, "more": True,
                    "rearmed_in": None, "timed_out": True}
        claimed = d.stats.claimed - before
        rearmed: float | None = None
        if more:
            self.send_drain(queue, kick=False, database=database)
        elif claimed == 0 and kick:
            self.send_drain(queue, kick=False, database=database, countdown=REARM_MIN)
        else:
            rearmed = self.rearm(d, queue, database=database)
        return {"claimed": claimed, "more": more, "rearmed_in": rearmed}

    def run_sweep(self, queue: str | None) -> dict[str, Any]:
        """On each database served: dead-letter exhausted expired leases; ring `drain`
        for each queue with due work; start the retention plan when it is due."""
        dead = 0
        rung: list[str] = []
        retention: list[str] = []
        for spec in self._targets():
            name = spec.name if spec else None
            if name is not None and time.monotonic() < self._down_until.get(name, 0.0):
                continue  # failed lately: its connect timeout must not hold every sweep
            try:
                engine = self.dispatcher_for(queue or "default", database=spec).engine
                dead += len(sweep_leases(engine))
                with engine.connect() as conn:
                    due = [q for q in sql.queues_with_due_work(conn)
                           if queue is None or q == queue]
            except DBAPIError as exc:  # one database down must not stop the others'
                if spec is None:
                    raise
                wait = min(SWEEP_BACKOFF_MAX, 2 * self._down_for.get(spec.name, 2.5))
                self._down_for[spec.name] = wait
                self._down_until[spec.name] = time.monotonic() + wait
                log.warning("sweep: database %s unreachable (%s); skipped for %.0f s",
                            spec.name,
                            str(exc).splitlines()[0][:200], wait)
                continue
            self._down_for.pop(name or "", None)
            for q in due:
                self.send_drain(q, kick=False, database=name)
            rung += [q if name is None else f"{name}/{q}" for q in due]
            # Retention (outbox/retention.py): due every OUTBOX_RETENTION_INTERVAL per
            # process and database, one purger at a time across workers, on a thread of
            # its own for up to OUTBOX_RETENTION_BUDGET, as in `outbox worker`: a paced
            # run rests most of its time, and the sweep task must not hold its worker
            # process meanwhile (it used to run here, capped at 30 s, which at a low duty
            # purged too little to keep up).
            if scheduled_retention(name or "").start_if_due(engine, _RETENTION_STOP):
                retention.append(name or "")
        return {"dead_lettered": dead, "rung": rung, "retention_started": retention}

    def ring_sweep(self) -> None:
        """Publish one sweep message; a broker that is down is retried on the next tick."""
        try:
            self.sweep.apply_async(expires=self.sweep_interval * 2, retry=False,
                                   **self._route())
        except Exception as exc:
            log.warning("could not send the periodic sweep (%s); next try in %.0f s",
                        exc, self.sweep_interval)

    def ring(self, queue: str) -> None:
        """The after-commit doorbell: a payload-less drain message.

        Best effort, and fast: with Celery's default publish retries a broker that is
        down stalls the caller ~1.5 s per ring, and on a Core connection the ring runs
        *before* COMMIT, so the business transaction stayed open meanwhile. A lost ring
        loses nothing (the workers' sweep finds the rows): one quick reconnect, then
        give up.
        """
        self.send_drain(queue, kick=True, retry=True, retry_policy=_RING_RETRY)

    def ring_located(self, queue: str, where: Where | None) -> None:
        """The doorbell when serving several databases: a drain of the database the
        rows were committed to, matched by (host, port, database); a connection that
        matches none (or does not say) rings a drain that fans out to every one."""
        name = next((s.name for s in self.databases or () if s.target == where), None)
        self.send_drain(queue, kick=True, database=name, retry=True,
                        retry_policy=_RING_RETRY)

    def install_doorbell(self) -> None:
        """Make every committed enqueue in this process ring this app."""
        if self.databases:
            add_doorbell(self.ring_located, located=True)
        else:
            add_doorbell(self.ring)


def register(app: Celery, *, queue_name: str | None = None,
             sweep_interval: float = SWEEP_INTERVAL, beat: bool = True,
             doorbell: bool = True, drain_budget: float = DRAIN_BUDGET,
             periodic_sweep: bool = True,
             databases: list[str] | None = None) -> OutboxTasks:
    """Add our `outbox.drain`/`outbox.sweep` tasks to `app`, with its configuration.

    `queue_name`: the Celery queue our messages go to (None: the app's default queue);
    the worker must consume it (`-Q`). `beat`: add the `outbox-sweep` beat entry
    (redundant with the per-worker sweep, harmless). `periodic_sweep`: each worker
    sends itself a sweep at start and every `sweep_interval` seconds (no beat needed).
    `doorbell`: enqueues committed in this process ring this app. `databases`: serve
    several outbox databases (`URL` or `NAME=URL` each, as `outbox worker --database`;
    default $OUTBOX_DATABASES, else $DATABASE_URL alone): each drain message names its
    database, the sweep visits each one, and a doorbell rings the one that has the rows.
    """
    specs = databases_from(databases, os.environ)  # a bad entry: ConfigurationError
    tasks = OutboxTasks(app=app, queue_name=queue_name, sweep_interval=sweep_interval,
                        drain_budget=drain_budget, databases=specs)
    soft, hard = drain_time_limits(drain_budget, LEASE)
    route = tasks._route()

    def drain(queue: str = "default", kick: bool = True,
              database: str | None = None) -> dict[str, Any]:
        return tasks.run_drain(queue, kick, database)

    def sweep(queue: str | None = None) -> dict[str, Any]:
        """Sent by every worker to itself (`SweepTimer`) and by beat if one runs."""
        return tasks.run_sweep(queue)

    # shared=False: only this app gets them (a shared task is added to every app).
    tasks.drain = app.task(name="outbox.drain", shared=False, acks_late=True,
                           reject_on_worker_lost=True, ignore_result=True,
                           soft_time_limit=soft, time_limit=hard, **route)(drain)
    tasks.sweep = app.task(name="outbox.sweep", shared=False, acks_late=True,
                           ignore_result=True, **route)(sweep)

    if beat:
        entry = {"task": "outbox.sweep", "schedule": sweep_interval,
                 "options": {"expires": sweep_interval * 2, **route}}

        def add_beat_entry(sender: Celery, **_: Any) -> None:
            sender.conf.beat_schedule = {**(sender.conf.beat_schedule or {}),
                                         "outbox-sweep": entry}

        # Reading the app's configuration finalizes it (and resolves its broker, which
        # for our default app may start the embedded database): add the entry once the
        # app is configured anyway, not at import.
        if app.configured:
            add_beat_entry(app)
        else:
            app.on_after_configure.connect(add_beat_entry, weak=False)

    if periodic_sweep:
        class SweepTimer(bootsteps.StartStopStep):  # type: ignore[misc]
            """Each worker sends itself a `sweep` at start and every interval.

            Beat is a separate process that may not run (DESIGN §8 starts only the
            worker); without a sweep, a lost doorbell, or the ETA drains a SIGKILLed
            worker held, strand work. This lives as long as the worker's consumer; the
            message expires after two intervals, so queued sweeps do not pile up.
            """

            requires = ("celery.worker.consumer.tasks:Tasks",)

            def __init__(self, c: Any, **kwargs: Any) -> None:
                super().__init__(c, **kwargs)
                self.trefs: list[Any] = []

            def start(self, c: Any) -> None:
                self.trefs = [c.timer.call_after(0.0, tasks.ring_sweep),
                              c.timer.call_repeatedly(sweep_interval, tasks.ring_sweep)]

            def stop(self, c: Any) -> None:
                for tref in self.trefs:
                    c.timer.cancel(tref)
                self.trefs = []

            shutdown = stop

        app.steps["consumer"].add(SweepTimer)

    if doorbell:
        tasks.install_doorbell()
    return tasks
