"""The Celery runner: `celery -A dispatcher.celery_app worker` (beat is optional).

Our own default app, built with `dispatcher.celery_tasks.register` (to put our tasks on
*your* app instead, call that). It is created with `set_as_current=False`: importing
this module does not make it Celery's current app, so a user's `@shared_task` stays
bound to the user's app and queue. (A worker started with `-A dispatcher.celery_app`
makes it current in that worker, as for any app.)

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
`OUTBOX_DATABASES` (as for `outbox worker`) makes the workers serve several outbox
databases: each drain message names its database (`celery_tasks.register`).
"""

from __future__ import annotations

import os

from celery import Celery

from dispatcher._core import Dispatcher
from dispatcher.celery_tasks import (
    CONCURRENCY,
    DRAIN_BUDGET,
    LEASE,
    REARM_MAX,
    REARM_MIN,
    SWEEP_INTERVAL,
    Rearms,
    register,
)
from dispatcher.celery_tasks import _dispatchers as _shared_dispatchers
from dispatcher.celery_tasks import dispatcher_for as _dispatcher_for
from dispatcher.databases import DatabaseSpec
from dispatcher.metrics import register_queue_gauges
from outbox._config import database_url

__all__ = ["CONCURRENCY", "DRAIN_BUDGET", "LEASE", "REARM_MAX", "REARM_MIN",
           "SWEEP_INTERVAL", "Rearms", "app", "dispatcher_for", "drain",
           "install_doorbell", "rearm", "ring", "ring_sweep", "sweep"]


def _broker_url() -> str:
    url = os.environ.get("BROKER_URL") or os.environ.get("CELERY_BROKER_URL")
    if url:
        return url
    import kombu.transport.sqlalchemy as kombu_sqla

    kombu_sqla.Transport.polling_interval = 0.2
    return "sqla+" + database_url()


app = Celery("outbox", set_as_current=False)
# Resolved when the configuration is first read (a worker or a producer using the app),
# never at import: without BROKER_URL the default broker is our database, and without
# DATABASE_URL that may mean starting the embedded server.
app.add_defaults(lambda: {"broker_url": _broker_url()})
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
)

_dispatchers = _shared_dispatchers


def dispatcher_for(queue: str, *, database: DatabaseSpec | None = None) -> Dispatcher:
    """One Dispatcher per process, database and queue, created after the prefork fork."""
    return _dispatcher_for(queue, database=database, cache=_dispatchers,
                           gauges=register_queue_gauges)


# Messages go to the app's default queue (OUTBOX_CELERY_QUEUE); the doorbell is
# installed by whoever enqueues (`install_doorbell`), not by importing this module.
tasks = register(app, sweep_interval=SWEEP_INTERVAL, beat=True, doorbell=False,
                 drain_budget=DRAIN_BUDGET)
tasks.dispatcher_for = dispatcher_for
drain = tasks.drain
sweep = tasks.sweep
_rearms = tasks.rearms


def rearm(d: Dispatcher, queue: str) -> float | None:
    """After a drain found nothing to claim: schedule one for when work is due."""
    return tasks.rearm(d, queue, rearms=_rearms)


def ring(queue: str) -> None:
    """The after-commit doorbell: a payload-less drain message (best effort)."""
    tasks.ring(queue)


def ring_sweep() -> None:
    """Publish one sweep message; a broker that is down is retried on the next tick."""
    tasks.ring_sweep()


def install_doorbell() -> None:
    """Make every committed enqueue in this process ring Celery."""
    tasks.install_doorbell()
