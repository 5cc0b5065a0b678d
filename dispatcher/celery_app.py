"""The Celery runner: `celery -A dispatcher.celery_app worker` (beat is optional).

The broker is a doorbell, the database is the mailbox: messages carry no payload,
only "look at queue Q". `drain` claims and delivers until nothing is due or its time
budget ends (then it chains itself); a drain that stops while work is due *later* (a
retry's backoff, a lease that will expire because its worker died) schedules one more
drain for that moment. `sweep` dead-letters exhausted leases and rings `drain` for
every queue with due work; each worker sends itself a sweep at start and every
`OUTBOX_SWEEP_INTERVAL` seconds, so a worker run without beat strands nothing (beat's
own sweep, if run, is merely redundant). A duplicated or replayed message does nothing
twice: SKIP LOCKED claims and lease tokens in the database decide, never the broker.

`BROKER_URL` selects the broker (Redis, RabbitMQ); unset, kombu's SQLAlchemy
transport on the same PostgreSQL is used (a zero-setup default, not for production).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Any

from celery import Celery, bootsteps
from sqlalchemy.exc import DBAPIError

from dispatcher._core import Dispatcher
from dispatcher.handlers import load_registry
from dispatcher.metrics import configure_metrics, register_queue_gauges
from dispatcher.worker import sweep as sweep_leases
from outbox._config import database_url, make_engine
from outbox._connections import DEFAULT_WORKER_CALL_TIMEOUT
from outbox._enqueue import add_doorbell
from outbox.retention import scheduled_retention
from outbox.sql import dispatch as sql
from outbox.telemetry_setup import configure as configure_traces

log = logging.getLogger("outbox.celery")

DRAIN_BUDGET = float(os.environ.get("OUTBOX_DRAIN_BUDGET", "10"))
SWEEP_INTERVAL = float(os.environ.get("OUTBOX_SWEEP_INTERVAL", "5"))
CONCURRENCY = int(os.environ.get("OUTBOX_CONCURRENCY", "8"))
LEASE = float(os.environ.get("OUTBOX_LEASE", "30"))
# A re-armed drain waits at most this long (then looks again and re-arms if need be).
# Its message is an ETA message the worker holds unacknowledged until it is due, so
# this must stay far below Redis's visibility_timeout (1 h by default: a message held
# longer is restored and run twice) and RabbitMQ's consumer_timeout (30 min).
REARM_MAX = float(os.environ.get("OUTBOX_REARM_MAX", "60"))
# The shortest wait: a doorbell's follow-up look, a re-arm for work claimable "now"
# (freed just after the drain's last claim), and the grid that re-arm times snap to.
REARM_MIN = 0.25
_ETA_SLACK = 0.05  # ETA timers fire a little early or late; never ask before it is due


def _broker_url() -> str:
    url = os.environ.get("BROKER_URL") or os.environ.get("CELERY_BROKER_URL")
    if url:
        return url
    import kombu.transport.sqlalchemy as kombu_sqla

    kombu_sqla.Transport.polling_interval = 0.2
    return "sqla+" + database_url()


app = Celery("outbox", broker=_broker_url())
app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_ignore_result=True,
    # One broker (a RabbitMQ vhost, a Redis db) may serve several deployments:
    # OUTBOX_CELERY_QUEUE keeps their doorbells apart.
    task_default_queue=os.environ.get("OUTBOX_CELERY_QUEUE", "outbox"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    beat_schedule={
        "outbox-sweep": {"task": "outbox.sweep", "schedule": SWEEP_INTERVAL,
                         "options": {"expires": SWEEP_INTERVAL * 2}},
    },
)

_local = threading.local()
_lock = threading.Lock()
_dispatchers: dict[tuple[int, str], Dispatcher] = {}


def dispatcher_for(queue: str) -> Dispatcher:
    """One Dispatcher per process and queue, created after the prefork fork."""
    key = (os.getpid(), queue)
    with _lock:
        found = _dispatchers.get(key)
        if found is None:
            engine = make_engine(application_name="outbox-celery", pool_size=2,
                                 max_overflow=2, pool_pre_ping=False,  # see cmd_worker
                                 call_timeout=DEFAULT_WORKER_CALL_TIMEOUT)
            configure_traces("outbox-celery")  # after the prefork fork: our own SDK
            configure_metrics("outbox-celery")
            register_queue_gauges(engine)
            found = Dispatcher(engine, load_registry(), queue=queue,
                               concurrency=CONCURRENCY, lease=LEASE)
            _dispatchers[key] = found
        return found


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


_rearms = Rearms()


def rearm(d: Dispatcher, queue: str) -> float | None:
    """After a drain found nothing to claim: schedule one for when work is due.

    Returns the countdown published, or None (nothing waits, one is already
    scheduled, or the database or broker failed: the workers' sweep rings later).
    """
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
    target = _rearms.reserve(queue, min(max(wait + _ETA_SLACK, REARM_MIN), REARM_MAX), now)
    if target is None:
        return None
    countdown = target - now
    try:
        drain.apply_async(args=[queue], kwargs={"kick": False}, countdown=countdown,
                          retry=True, retry_policy=_RING_RETRY)
    except Exception as exc:  # the broker is down: the sweep rings when it is back
        _rearms.release(queue, target)
        log.warning("drain %s: could not re-arm in %.2f s (%s)", queue, countdown, exc)
        return None
    return countdown


@app.task(name="outbox.drain", acks_late=True, reject_on_worker_lost=True)  # type: ignore[untyped-decorator]
def drain(queue: str = "default", kick: bool = True) -> dict[str, Any]:
    """Deliver what is due on `queue`; then arrange exactly one follow-up, if any.

    Budget ran out: chain another drain now. A doorbell that found nothing (rung just
    before its transaction committed): look once more shortly after (`kick`). Else,
    if work is due later on `queue`: re-arm for that moment (`rearm`).
    """
    d = dispatcher_for(queue)
    before = d.stats.claimed
    more = d.drain(DRAIN_BUDGET)
    claimed = d.stats.claimed - before
    rearmed: float | None = None
    if more:
        drain.apply_async(args=[queue], kwargs={"kick": False})
    elif claimed == 0 and kick:
        drain.apply_async(args=[queue], kwargs={"kick": False}, countdown=REARM_MIN)
    else:
        rearmed = rearm(d, queue)
    return {"claimed": claimed, "more": more, "rearmed_in": rearmed}


@app.task(name="outbox.sweep", acks_late=True)  # type: ignore[untyped-decorator]
def sweep(queue: str | None = None) -> dict[str, Any]:
    """Dead-letter exhausted expired leases; ring `drain` for each queue with due work;
    run the retention plan when it is due.

    Sent by every worker to itself (`SweepTimer`) and by beat if one runs. `queue`
    limits the rings to one queue (None: every queue).
    """
    engine = dispatcher_for(queue or "default").engine
    dead = sweep_leases(engine)
    with engine.connect() as conn:
        due = [q for q in sql.queues_with_due_work(conn) if queue is None or q == queue]
    for name in due:
        drain.apply_async(args=[name], kwargs={"kick": False})
    # Retention (outbox/retention.py): due every OUTBOX_RETENTION_INTERVAL per process,
    # one purger at a time across workers, bounded by OUTBOX_RETENTION_BUDGET.
    purged = scheduled_retention().run_if_due(engine)
    return {"dead_lettered": len(dead), "rung": due,
            "purged": purged.deleted if purged is not None else None}


class SweepTimer(bootsteps.StartStopStep):  # type: ignore[misc]
    """Each worker sends itself a `sweep` at start and every SWEEP_INTERVAL seconds.

    Beat is a separate process that may not run (DESIGN §8 starts only the worker);
    without a sweep, a lost doorbell, or the ETA drains a SIGKILLed worker held (Redis
    restores those only after its visibility_timeout), strand work. This timer lives
    exactly as long as the worker's consumer, so whatever runs deliveries also runs
    the sweep: a restarted worker finds every retry and expired lease at once.
    The message carries an expiry, so sweeps queued behind busy children do not pile up.
    """

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.trefs: list[Any] = []

    def start(self, c: Any) -> None:
        self.trefs = [c.timer.call_after(0.0, ring_sweep),
                      c.timer.call_repeatedly(SWEEP_INTERVAL, ring_sweep)]

    def stop(self, c: Any) -> None:
        for tref in self.trefs:
            c.timer.cancel(tref)
        self.trefs = []

    shutdown = stop


def ring_sweep() -> None:
    """Publish one sweep message; a broker that is down is retried on the next tick."""
    try:
        sweep.apply_async(expires=SWEEP_INTERVAL * 2, retry=False)
    except Exception as exc:
        log.warning("could not send the periodic sweep (%s); next try in %.0f s",
                    exc, SWEEP_INTERVAL)


app.steps["consumer"].add(SweepTimer)


def ring(queue: str) -> None:
    """The after-commit doorbell: a payload-less drain message.

    Best effort, and fast: with Celery's default publish retries a broker that is down
    stalls the caller ~1.5 s per ring, and on a Core connection the ring runs *before*
    COMMIT, so the business transaction stayed open meanwhile. A lost ring loses
    nothing (the workers' sweep finds the rows), so allow one quick reconnect and give up.
    """
    drain.apply_async(args=[queue], kwargs={"kick": True},
                      retry=True, retry_policy=_RING_RETRY)


_RING_RETRY = {"max_retries": 1, "interval_start": 0, "interval_step": 0.1,
               "interval_max": 0.1}


def install_doorbell() -> None:
    """Make every committed enqueue in this process ring Celery."""
    add_doorbell(ring)
