"""The Celery runner: `celery -A dispatcher.celery_app worker` (and `beat`).

The broker is a doorbell, the database is the mailbox: messages carry no payload,
only "look at queue Q". `drain` claims and delivers until nothing is due or its time
budget ends (then it chains itself); `sweep` runs on beat and finds whatever a lost
doorbell left behind. A duplicated or replayed message does nothing twice: SKIP
LOCKED claims and lease tokens in the database decide, never the broker.

`BROKER_URL` selects the broker (Redis, RabbitMQ); unset, kombu's SQLAlchemy
transport on the same PostgreSQL is used (a zero-setup default, not for production).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from celery import Celery

from dispatcher._core import Dispatcher
from dispatcher.handlers import load_registry
from dispatcher.metrics import configure_metrics, register_queue_gauges
from dispatcher.worker import sweep as sweep_leases
from outbox._config import database_url, make_engine
from outbox._enqueue import add_doorbell
from outbox.sql import dispatch as sql
from outbox.telemetry_setup import configure as configure_traces

log = logging.getLogger("outbox.celery")

DRAIN_BUDGET = float(os.environ.get("OUTBOX_DRAIN_BUDGET", "10"))
SWEEP_INTERVAL = float(os.environ.get("OUTBOX_SWEEP_INTERVAL", "5"))
CONCURRENCY = int(os.environ.get("OUTBOX_CONCURRENCY", "8"))
LEASE = float(os.environ.get("OUTBOX_LEASE", "30"))


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
                                 max_overflow=2, pool_pre_ping=False)  # see cmd_worker
            configure_traces("outbox-celery")  # after the prefork fork: our own SDK
            configure_metrics("outbox-celery")
            register_queue_gauges(engine)
            found = Dispatcher(engine, load_registry(), queue=queue,
                               concurrency=CONCURRENCY, lease=LEASE)
            _dispatchers[key] = found
        return found


@app.task(name="outbox.drain", acks_late=True, reject_on_worker_lost=True)  # type: ignore[untyped-decorator]
def drain(queue: str = "default", kick: bool = True) -> dict[str, Any]:
    """Deliver what is due on `queue`; chain another drain if the budget ran out.

    A doorbell rung just before its transaction committed finds nothing: look once
    more shortly after (`kick`), and leave the rest to the sweep.
    """
    d = dispatcher_for(queue)
    before = d.stats.claimed
    more = d.drain(DRAIN_BUDGET)
    claimed = d.stats.claimed - before
    if more:
        drain.apply_async(args=[queue], kwargs={"kick": False})
    elif claimed == 0 and kick:
        drain.apply_async(args=[queue], kwargs={"kick": False}, countdown=0.25)
    return {"claimed": claimed, "more": more}


@app.task(name="outbox.sweep", acks_late=True)  # type: ignore[untyped-decorator]
def sweep(queue: str = "default") -> dict[str, Any]:
    """Beat: dead-letter exhausted expired leases; ring `drain` if anything is due."""
    d = dispatcher_for(queue)
    dead = sweep_leases(d.engine)
    with d.engine.connect() as conn:
        wait = sql.seconds_until_due(conn, queue)
    due = wait is not None and wait <= 0
    if due:
        drain.apply_async(args=[queue], kwargs={"kick": False})
    return {"dead_lettered": len(dead), "due": due}


def ring(queue: str) -> None:
    """The after-commit doorbell: a payload-less drain message.

    Best effort, and fast: with Celery's default publish retries a broker that is down
    stalls the caller ~1.5 s per ring, and on a Core connection the ring runs *before*
    COMMIT, so the business transaction stayed open meanwhile. A lost ring loses
    nothing (the beat sweep finds the rows), so allow one quick reconnect and give up.
    """
    drain.apply_async(args=[queue], kwargs={"kick": True},
                      retry=True, retry_policy=_RING_RETRY)


_RING_RETRY = {"max_retries": 1, "interval_start": 0, "interval_step": 0.1,
               "interval_max": 0.1}


def install_doorbell() -> None:
    """Make every committed enqueue in this process ring Celery."""
    add_doorbell(ring)
