"""Celery delivers on every queue, and without beat (issue 8, item 2).

A drain that stops while work is due later (a retry's backoff, a lease that expires
because its worker was killed) must run again when that work is due, on any queue; the
sweep must ring every queue with due work; and `celery -A dispatcher.celery_app worker`
alone (DESIGN §8: no beat) must deliver retries, lease rescues and lost doorbells.

The process tests run real Celery workers on Redis against the session's database and
the fake PSP, which counts applications per Idempotency-Key: "exactly once" is counted
at the receiver, never inferred.
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
from celery import Celery
from sqlalchemy import Engine, text

from dispatcher import celery_app
from dispatcher._core import Dispatcher
from dispatcher.examples.payments.psp import ReceiverProcess
from dispatcher.handlers import Registry
from outbox.sql import dispatch as sql
from tests.dispatch_support import add_effects, db_now, effect_row, keys, wait_until
from tests.process_support import (
    AMQP_URL,
    Proc,
    Procs,
    process_group,
    producer,
    redis_or_skip,
    wait_all_final,
)
from tests.test_dispatcher_processes import check_exactly_once

# Not the db the F-tests flush before each test: a parallel run of theirs must not
# wipe our queues (each worker here has its own queue name, so nothing is shared).
REDIS_URL = "redis://127.0.0.1:6379/11"
LEASE = 5.0


# --------------------------------------------------------------------------- statements


def _claim(engine: Engine, queue: str, owner: str, now: Any, lease: float = 10.0
           ) -> list[Any]:
    with engine.begin() as conn:
        return sql.claim_due(conn, queue=queue, limit=10, owner=owner, lease_seconds=lease,
                             now=now)


def test_queues_with_due_work_lists_every_queue_a_claim_would_take(engine: Engine) -> None:
    add_effects(engine, ["a-now"], queue="a")
    add_effects(engine, ["b-later"], queue="b", delay=60)
    add_effects(engine, ["c-leased"], queue="c")
    add_effects(engine, ["d-last"], queue="d", max_attempts=1)
    # e: the head of an ordering key is dead-lettered; its successor is due but blocked.
    add_effects(engine, ["e-head", "e-next"], queue="e", ordering_key=lambda i, k: "k")
    t0 = db_now(engine)
    [c] = _claim(engine, "c", "dead", t0)
    _claim(engine, "d", "dead", t0)
    [head] = _claim(engine, "e", "w", t0)
    with engine.begin() as conn:
        conn.execute(text(
            "UPDATE outbox.effects SET status = 'failed', finished_at = now(),"
            " lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL"
            " WHERE id = :i"), {"i": head.id})
    with engine.connect() as conn:
        assert sql.queues_with_due_work(conn, now=t0 + timedelta(seconds=1)) == ["a"]
        # Leases of c and d expired: c is rescued, d has no attempt left (the sweep's
        # dead-letter step takes it), the blocked successor in e stays blocked.
        assert sql.queues_with_due_work(conn, now=t0 + timedelta(seconds=11)) == ["a", "c"]
        assert sql.queues_with_due_work(conn, now=t0 + timedelta(seconds=61)) == [
            "a", "b", "c"]
        # Seconds until a drain on each queue would claim something.
        at = t0 + timedelta(seconds=1)
        assert sql.seconds_until_claimable(conn, "a", now=at) == 0.0
        assert sql.seconds_until_claimable(conn, "b", now=at) == pytest.approx(59, abs=1)
        assert sql.seconds_until_claimable(conn, "c", now=at) == pytest.approx(9, abs=0.01)
        expiry = (c.lease_expires_at - at).total_seconds()
        assert sql.seconds_until_claimable(conn, "c", now=at) == pytest.approx(expiry)
        assert sql.seconds_until_claimable(conn, "d", now=at) is None  # exhausted lease
        assert sql.seconds_until_claimable(conn, "e", now=at) is None  # blocked by head
        assert sql.seconds_until_claimable(conn, "nothing", now=at) is None


def test_many_drains_in_one_process_rearm_once(engine: Engine,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """N drains that stop with work due later publish one re-arm, not N."""
    add_effects(engine, ["later"], queue="rearm", delay=3)
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(celery_app, "_rearms", celery_app.Rearms())
    monkeypatch.setattr(celery_app.drain, "apply_async",
                        lambda *a, **kw: sent.append(kw))
    d = Dispatcher(engine, Registry(), queue="rearm")
    try:
        first = celery_app.rearm(d, "rearm")
        assert first is not None and 2.5 < first <= 3.5
        for _ in range(50):
            assert celery_app.rearm(d, "rearm") is None
        assert len(sent) == 1
        assert sent[0]["args"] == ["rearm"] and sent[0]["kwargs"] == {"kick": False}
        # Something due earlier than the scheduled drain gets its own, earlier one.
        add_effects(engine, ["sooner"], queue="rearm", delay=1)
        sooner = celery_app.rearm(d, "rearm")
        assert sooner is not None and sooner < first
        assert len(sent) == 2
        # Waits are capped: a retry an hour away re-arms within REARM_MAX.
        add_effects(engine, ["far"], queue="far", delay=3600)
        far = celery_app.rearm(d, "far")
        assert far is not None and far <= celery_app.REARM_MAX + celery_app.REARM_MIN
        # Nothing waiting: nothing scheduled.
        assert celery_app.rearm(d, "empty") is None
        assert len(sent) == 3
    finally:
        d.shutdown(0.0)


def test_rearms_one_message_per_moment() -> None:
    book = celery_app.Rearms()
    first = book.reserve("q", 5.0, now=100.0)
    assert first == 105.0
    assert book.reserve("q", 5.0, now=100.1) is None  # covered by the one at 105
    assert book.reserve("q", 30.0, now=101.0) is None
    assert book.reserve("other", 5.0, now=100.0) == 105.0  # per queue
    assert book.reserve("q", 1.0, now=101.0) == 102.0  # earlier: its own message
    assert book.reserve("q", 0.3, now=101.5) is None  # snapped to 102.0: same slot
    assert book.reserve("q", 1.0, now=102.5) == 103.5  # the one at 102 has fired
    book.release("q", 103.5)
    assert book.reserve("q", 1.0, now=102.6) == 103.75


# --------------------------------------------------------------------------- processes


@pytest.fixture
def psp(psp_process: ReceiverProcess) -> ReceiverProcess:
    return psp_process


@pytest.fixture
def procs(tmp_path: Path, psp: ReceiverProcess, db_url: str) -> Iterator[Procs]:
    yield from process_group(tmp_path, psp.url, tail=80)


@pytest.fixture
def redis_url() -> str:
    return redis_or_skip(REDIS_URL, flush=False)


def celery_worker(procs: Procs, name: str, *, beat: bool, celery_queue: str | None = None,
                  broker: str | None = REDIS_URL, env: Mapping[str, str] | None = None
                  ) -> Proc:
    """A Celery worker (on Redis unless told; None: the default SQLAlchemy transport).

    Without beat it is DESIGN §8's command as written, plus a node name, two children
    and INFO logs."""
    settings = {"OUTBOX_LEASE": str(LEASE), **(env or {})}
    if beat:
        assert celery_queue is None
        return procs.celery(name, broker=broker, env=settings)
    queue = celery_queue or f"outbox-test-{uuid.uuid4().hex[:8]}"
    return procs.celery_app_worker(
        name, ["-c", "2", "--loglevel", "INFO", "-n", f"{name}-{uuid.uuid4().hex[:6]}@%h"],
        queue=queue, broker=broker, env=settings)


def ring(app: Celery, celery_queue: str, queue: str) -> None:
    """The doorbell an enqueue in `queue` rings (what `celery_app.ring` sends)."""
    app.send_task("outbox.drain", args=[queue], kwargs={"kick": True}, queue=celery_queue)


def wait_ready(worker: Proc) -> None:
    wait_until(lambda: " ready." in worker.tail(400) or not worker.alive(), 60,
               interval=0.2, message=f"{worker.name} ready")
    assert worker.alive(), worker.tail()


def wait_delivered(engine: Engine, expected: Sequence[str], timeout: float) -> None:
    def done() -> bool:
        with engine.connect() as conn:
            left: int = conn.execute(text(
                "SELECT count(*) FROM outbox.effects"
                " WHERE effect_key = ANY(:k) AND status <> 'delivered'"),
                {"k": list(expected)}).scalar_one()
        return left == 0

    def state() -> str:
        with engine.connect() as conn:
            rows = conn.execute(text(
                "SELECT effect_key, queue, status, attempts,"
                " round(extract(epoch FROM available_at - now()), 1) AS due_in,"
                " round(extract(epoch FROM lease_expires_at - now()), 1) AS lease_left"
                " FROM outbox.effects"
                " WHERE effect_key = ANY(:k) AND status <> 'delivered' ORDER BY id LIMIT 10"),
                {"k": list(expected)}).all()
        return f"{len(expected)} delivered; still waiting: {rows}"
    wait_until(done, timeout, interval=0.2, message=state)


def delivering_children(engine: Engine, worker: Proc, psp: ReceiverProcess
                        ) -> dict[int, set[str]]:
    """{child pid: keys it holds leases on}, once the receiver has seen a delivery."""
    if psp.stats()["deliveries"] == 0:
        return {}
    with engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT lease_owner, effect_key FROM outbox.effects WHERE status = 'in_flight'"
        )).all()
    children = {c.pid for c in psutil.Process(worker.pid).children(recursive=True)}
    held: dict[int, set[str]] = {}
    for owner, key in rows:
        pid = int(owner.split(":")[1])
        if pid in children:
            held.setdefault(pid, set()).add(key)
    return held


def fail_once_then_kill_a_child(engine: Engine, psp: ReceiverProcess, worker: Proc,
                                queue: str, prefix: str, *, before: Sequence[str] = ()
                                ) -> None:
    """Transient failures, then a child SIGKILLed mid-delivery; all delivered once.

    The failures answer 503 with Retry-After: 2 s (and a plain 500 twice), so the drain
    that delivered the rest has stopped before they are due again; the killed child's
    leases expire LEASE seconds later, after its requeued drain message ran and found
    nothing claimable. Only a drain that re-arms (or a sweep of this queue) delivers.
    """
    app = producer(REDIS_URL, worker.queue)
    retry_keys = keys(f"{prefix}-retry", 6)
    psp.set_mode("status", key=retry_keys[0], status=503, retry_after=2, times=1)
    psp.set_mode("status", key=retry_keys[1], status=503, retry_after=2, times=1)
    psp.set_mode("fail_500", key=retry_keys[2], times=2)
    add_effects(engine, retry_keys, kind="psp.charge", queue=queue)
    ring(app, worker.queue, queue)
    wait_delivered(engine, retry_keys, timeout=45)
    for key in retry_keys[:3]:
        assert effect_row(engine, key).attempts >= 2, key

    # As many as one claim takes (OUTBOX_CONCURRENCY): the victim holds them all, so
    # no other drain is still running when its leases expire to rescue them by chance.
    kill_keys = keys(f"{prefix}-kill", 4)
    psp.set_mode("slow", key_prefix=f"{prefix}-kill", delay=1.0)
    add_effects(engine, kill_keys, kind="psp.charge", queue=queue)
    ring(app, worker.queue, queue)
    held = wait_until(lambda: delivering_children(engine, worker, psp), 60, interval=0.05,
                      message="a child delivering")
    victim, stranded = next(iter(held.items()))
    assert stranded == set(kill_keys)
    os.kill(victim, signal.SIGKILL)
    wait_delivered(engine, kill_keys, timeout=60)
    assert worker.alive()
    for key in stranded:
        assert effect_row(engine, key).attempts >= 2, key  # rescued after the lease
    check_exactly_once(engine, psp, [*before, *retry_keys, *kill_keys],
                       single_attempt=False)


@pytest.mark.slow
def test_non_default_queue_retries_rescues_and_lost_doorbells(
        engine: Engine, procs: Procs, psp: ReceiverProcess, redis_url: str) -> None:
    """Queue "billing" with beat running: beat's sweep used to look only at "default"."""
    worker = celery_worker(procs, "billing", beat=True)
    wait_ready(worker)
    # A lost doorbell: committed rows nobody rang for. Only a sweep of "billing" finds them.
    lost = keys("nd-lost", 5)
    add_effects(engine, lost, kind="psp.charge", queue="billing")
    wait_delivered(engine, lost, timeout=30)
    fail_once_then_kill_a_child(engine, psp, worker, "billing", "nd", before=lost)


@pytest.mark.slow
def test_worker_without_beat_delivers_retries_and_rescues_by_itself(
        engine: Engine, procs: Procs, psp: ReceiverProcess, redis_url: str) -> None:
    """DESIGN §8's `celery -A dispatcher.celery_app worker`, no beat, queue "default".

    The worker's own periodic sweep is set to an hour here, so what delivers the
    retries and the killed child's leases is the drain re-arming itself.
    """
    worker = celery_worker(procs, "nobeat", beat=False,
                           env={"OUTBOX_SWEEP_INTERVAL": "3600"})
    wait_ready(worker)
    fail_once_then_kill_a_child(engine, psp, worker, "default", "nb")
    log = worker.tail(100_000)
    assert "beat: Starting" not in log
    assert "raised unexpected" not in log, log[-3000:]


@pytest.mark.slow
def test_restarted_worker_without_beat_finds_what_a_killed_worker_held(
        engine: Engine, procs: Procs, psp: ReceiverProcess, redis_url: str) -> None:
    """The whole worker (main process and children) is SIGKILLed while it holds leases,
    a scheduled retry and its drain messages (Redis gives those back only after the
    visibility timeout, an hour); a lost doorbell waits on another queue. A new worker,
    without beat and without any new doorbell, delivers all of it, once."""
    celery_queue = f"outbox-test-{uuid.uuid4().hex[:8]}"
    first = celery_worker(procs, "first", beat=False, celery_queue=celery_queue)
    wait_ready(first)
    app = producer(REDIS_URL, celery_queue)
    retry_key, *slow = keys("rs-billing", 9)
    psp.set_mode("slow", key_prefix="rs-billing", delay=1.0)
    psp.set_mode("status", key=retry_key, status=503, retry_after=3, times=1)  # newer wins
    add_effects(engine, [retry_key, *slow], kind="psp.charge", queue="billing")
    ring(app, celery_queue, "billing")
    wait_until(lambda: delivering_children(engine, first, psp)
               and effect_row(engine, retry_key).attempts >= 1
               and effect_row(engine, retry_key).status == "pending", 60, interval=0.05,
               message="leases held and a retry scheduled")
    with engine.connect() as conn:
        held = conn.execute(text(
            "SELECT count(*) FROM outbox.effects WHERE status = 'in_flight'")).scalar_one()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(first.pid, signal.SIGKILL)
    first.wait(10)
    lost = keys("rs-ledger", 4)
    add_effects(engine, lost, kind="psp.charge", queue="ledger")  # nobody rings
    assert held > 0

    second = celery_worker(procs, "second", beat=False, celery_queue=celery_queue)
    expected = [retry_key, *slow, *lost]
    wait_delivered(engine, expected, timeout=60)
    assert effect_row(engine, retry_key).attempts >= 2
    check_exactly_once(engine, psp, expected, single_attempt=False)
    wait_all_final(engine, len(expected), timeout=5)
    assert second.alive()


@pytest.mark.slow
@pytest.mark.parametrize("broker", ["sqla", "amqp"])
def test_worker_without_beat_on_the_other_brokers(
        engine: Engine, procs: Procs, psp: ReceiverProcess, broker: str) -> None:
    """The default broker (kombu's SQLAlchemy transport) and RabbitMQ: the worker's own
    sweep at start finds rows nobody rang for, on a non-default queue, and a retry is
    delivered by the drain's re-armed (ETA) message (the periodic sweep is an hour)."""
    if broker == "amqp":
        import socket
        try:
            socket.create_connection(("127.0.0.1", 5672), timeout=1).close()
        except OSError:
            pytest.skip("RabbitMQ is not reachable on 127.0.0.1:5672")
    expected = keys(f"ob-{broker}", 4)
    psp.set_mode("status", key=expected[0], status=503, retry_after=2, times=1)
    add_effects(engine, expected, kind="psp.charge", queue="billing")
    worker = celery_worker(procs, f"nobeat-{broker}", beat=False,
                           broker=AMQP_URL if broker == "amqp" else None,
                           env={"OUTBOX_SWEEP_INTERVAL": "3600"})
    wait_delivered(engine, expected, timeout=60)
    assert effect_row(engine, expected[0]).attempts == 2
    check_exactly_once(engine, psp, expected, single_attempt=False)
    assert worker.alive()
