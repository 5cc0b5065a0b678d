"""Regression tests for the adversarial review's findings (one test per bug).

Each test forces the interleaving or input that broke a guarantee, on real PostgreSQL,
with explicit connections (row locks and commits in a chosen order) instead of sleeps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, make_url, text

from dispatcher import Dispatcher, HttpHandler, Registry
from dispatcher.handlers import EffectContext
from outbox import Effect, enqueue_many
from outbox.sql import dispatch as sql
from outbox.sql import effects as effects_sql
from tests.dispatch_support import (
    add_effects,
    attempts_of,
    drain_then_shut_down,
    effect_row,
    wait_until,
)


def _blocked_on_lock(engine: Engine, pid: int) -> bool:
    with engine.connect() as conn:
        return bool(conn.execute(text(
            "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :p"),
            {"p": pid}).scalar())


# ------------------------------------------------------------------ purge vs. requeue


def test_purge_does_not_delete_an_effect_requeued_while_it_ran(engine: Engine) -> None:
    """`outbox retry` of an old cancelled effect racing `outbox purge`.

    The purge picks the row while it is `cancelled`, then blocks on the requeue's row
    lock; once the requeue commits, READ COMMITTED re-checks only the DELETE's own
    WHERE. Before the fix that was `id = ANY(<ids chosen earlier>)`, still true: the
    now-pending effect was deleted, an operator's retry silently lost.
    """
    [eid] = add_effects(engine, ["old-cancelled"])
    with engine.begin() as conn:
        conn.execute(text(
            "UPDATE outbox.effects SET status = 'cancelled',"
            " finished_at = now() - interval '2 days' WHERE id = :i"), {"i": eid})
    requeuer = engine.connect()
    purger = engine.connect()
    try:
        requeuer.begin()
        assert effects_sql.requeue(requeuer, [eid]) == [eid]  # row locked, uncommitted
        purger_pid = purger.execute(text("SELECT pg_backend_pid()")).scalar_one()
        purger.commit()
        result: list[int] = []

        def purge() -> None:
            with purger.begin():
                result.append(effects_sql.purge_finished_effects(purger, 86_400, 100))

        t = threading.Thread(target=purge)
        t.start()
        wait_until(lambda: _blocked_on_lock(engine, purger_pid), 5,
                   message="the purge to wait on the requeue's row lock")
        requeuer.commit()
        t.join(10)
        assert not t.is_alive()
    finally:
        requeuer.close()
        purger.close()
    assert result == [0]
    assert effect_row(engine, "old-cancelled").status == "pending"


# ------------------------------------------------------------ receiver data vs. record


def _registry(kind: str, handler: Callable[[EffectContext], Any]) -> Registry:
    reg = Registry()
    reg.register(kind, handler)
    reg.register("noop", lambda e: {"ok": True})
    return reg


def test_nul_in_a_receivers_answer_does_not_drop_the_batch(engine: Engine) -> None:
    """A 2xx body with U+0000 (receiver-controlled) made the batch's one INSERT fail:
    jsonb refuses \\u0000. Every outcome of the batch was dropped, so the delivered
    effect and its innocent batch-mates were redelivered until their attempts ran out
    and were then dead-lettered although delivered."""
    def nul_body(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b'{"id":"a\\u0000b"}\x00tail')

    handler = HttpHandler("http://psp.invalid/charge",
                          client=httpx.Client(transport=httpx.MockTransport(nul_body)))
    [bad] = add_effects(engine, ["nul-answer"], kind="psp.charge")
    good = add_effects(engine, ["mate-1", "mate-2"], kind="noop")
    d = Dispatcher(engine, _registry("psp.charge", handler), concurrency=4)
    drain_then_shut_down(d, 5)
    for eid in (bad, *good):
        assert [a.outcome for a in attempts_of(engine, eid)] == ["delivered"]
    assert effect_row(engine, "nul-answer").status == "delivered"
    assert effect_row(engine, "mate-1").status == "delivered"


@pytest.mark.parametrize("char", ["\x00", "\udc80"], ids=["nul", "lone-surrogate"])
def test_odd_characters_in_an_error_message_do_not_drop_the_batch(engine: Engine,
                                                                  char: str) -> None:
    """NUL made the batch fail (DataError: dropped after 10 s of retries); a lone
    surrogate (say, bytes decoded with surrogateescape) raised UnicodeEncodeError,
    which is not a DBAPIError: it escaped `flush` and ended `drain`/`run`, so the
    worker died on every redelivery of that effect."""
    def boom(effect: EffectContext) -> Any:
        raise RuntimeError(f"receiver said: {char}")

    [bad] = add_effects(engine, ["nul-error"], kind="boom")
    [mate] = add_effects(engine, ["mate"], kind="noop")
    d = Dispatcher(engine, _registry("boom", boom), concurrency=4)
    drain_then_shut_down(d, 5)
    assert [a.outcome for a in attempts_of(engine, bad)] == ["retry"]
    assert effect_row(engine, "nul-error").status == "pending"
    assert [a.outcome for a in attempts_of(engine, mate)] == ["delivered"]


def test_huge_retry_after_does_not_drop_the_batch(engine: Engine) -> None:
    """`Retry-After: 1e400` parses to inf (and 1e13 overflows timestamptz): the record
    statement failed with "interval/timestamp out of range", dropping the batch."""
    values = iter(["1e400", "10000000000000"])

    def throttled(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, headers={"Retry-After": next(values)})

    handler = HttpHandler("http://psp.invalid/charge",
                          client=httpx.Client(transport=httpx.MockTransport(throttled)))
    bad = add_effects(engine, ["inf-1", "huge-2"], kind="psp.charge")
    [mate] = add_effects(engine, ["mate"], kind="noop")
    d = Dispatcher(engine, _registry("psp.charge", handler), concurrency=4)
    drain_then_shut_down(d, 5)
    for eid in bad:
        assert [a.outcome for a in attempts_of(engine, eid)] == ["retry"]
    assert [a.outcome for a in attempts_of(engine, mate)] == ["delivered"]
    with engine.connect() as conn:
        waits = conn.execute(text(
            "SELECT extract(epoch FROM available_at - now()) FROM outbox.effects"
            " WHERE status = 'pending'")).scalars().all()
    assert len(waits) == 2 and all(0 < w <= 3600 + 5 for w in waits)


# ------------------------------------------------------- shutdown vs. done callback


def test_shutdown_records_an_outcome_whose_callback_ran_late(engine: Engine,
                                                            monkeypatch: Any) -> None:
    """The handler has returned but its outcome is not handed over yet (the pool
    thread preempted between the two). `reap` forgot such a delivery, and `shutdown`
    (or the end of a Celery `drain`) returned before the outcome was queued: a
    delivered effect stayed in flight until its lease expired and was then delivered
    again (twice at a retry_safe=False receiver)."""
    [eid] = add_effects(engine, ["late-callback"], kind="gated")
    gate = threading.Event()
    d = Dispatcher(engine, _registry("gated", lambda e: gate.wait(5) and {"ok": True}),
                   concurrency=1)
    original = d._finished
    callback_may_run = threading.Event()
    returned = threading.Event()

    def slow_finished(row: Any, result: Any) -> None:
        returned.set()
        callback_may_run.wait(5)  # the pool thread preempted after the handler returned
        original(row, result)

    monkeypatch.setattr(d, "_finished", slow_finished)
    assert d.fill() == 1
    assert eid in d._inflight
    gate.set()  # finishes on the pool thread
    assert returned.wait(5)
    threading.Timer(0.3, callback_may_run.set).start()
    d.shutdown(grace=3)
    row = effect_row(engine, "late-callback")
    assert (row.status, [a.outcome for a in attempts_of(engine, eid)]) == (
        "delivered", ["delivered"])


# ------------------------------------------------------------------ ordering keys


def test_one_in_flight_per_ordering_key_when_an_earlier_id_commits_late(
        engine: Engine) -> None:
    """Ids are taken at INSERT, visibility comes at COMMIT. T1 enqueues id n for key K
    and commits late; T2 enqueues id n+1 for K and commits first. The head check only
    looks at *lower* ids, so n+1 was claimed, and once T1 committed, n was claimed too:
    two effects of one ordering key in flight at once, delivered out of id order."""
    def claim_ids() -> list[int]:
        with engine.begin() as conn:
            return [r.id for r in sql.claim_due(conn, queue="default", limit=10,
                                                owner="w", lease_seconds=30)]

    slow = engine.connect()
    second: list[int] = []
    try:
        slow.begin()
        [first] = enqueue_many(slow, [Effect("noop", {"n": 1}, key="k-1", ordering_key="K")])

        def enqueue_second() -> None:
            with engine.begin() as conn:
                second.extend(e.id for e in enqueue_many(
                    conn, [Effect("noop", {"n": 2}, key="k-2", ordering_key="K")]))

        t = threading.Thread(target=enqueue_second)
        t.start()
        t.join(1.0)  # done (T2 committed first), or waiting for T1 (the fix)
        claimed = claim_ids()  # T1 still open
        slow.commit()
        t.join(10)
        assert not t.is_alive()
    finally:
        slow.close()
    claimed += claim_ids()
    with engine.connect() as conn:
        in_flight = conn.execute(text(
            "SELECT count(*) FROM outbox.effects WHERE ordering_key = 'K'"
            " AND status = 'in_flight'")).scalar_one()
    assert in_flight == 1, f"claimed {claimed} of one ordering key at once"
    assert claimed == [first.id] and first.id < second[0]


# ------------------------------------------------------------ NOTIFY and savepoints


def test_enqueue_after_a_rolled_back_savepoint_still_notifies(engine: Engine,
                                                              db_url: str) -> None:
    """A NOTIFY once remembered as "sent" per top-level transaction; a NOTIFY sent
    inside a savepoint that rolled back (an Inbox handler that raised, say) is
    discarded with it, so a later enqueue in the same transaction sent none: the
    worker only found the effect at its next poll."""
    import psycopg

    from outbox._config import NOTIFY_CHANNEL

    dsn = make_url(db_url).set(drivername="postgresql").render_as_string(
        hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        with engine.connect() as conn:
            conn.begin()
            savepoint = conn.begin_nested()
            enqueue_many(conn, [Effect("noop", {"n": 1}, key="in-savepoint")])
            savepoint.rollback()
            enqueue_many(conn, [Effect("noop", {"n": 2}, key="after-savepoint")])
            conn.commit()
        got = [n.payload for n in listener.notifies(timeout=2.0, stop_after=1)]
    assert got == ["default"]


def test_retried_record_after_a_lost_commit_reply_adds_no_attempt_row(engine: Engine) -> None:
    """The ack's COMMIT landed but its reply was lost: the retry must be a no-op."""
    from datetime import UTC, datetime

    from outbox import enqueue
    from outbox.sql import dispatch as dsql

    with engine.begin() as conn:
        enqueue(conn, "k", {"x": 1})
    with engine.begin() as conn:
        (row,) = dsql.claim_due(conn, queue="default", limit=1, owner="w1", lease_seconds=30)
    outcome = dsql.Outcome(effect_id=row.id, lease_token=row.lease_token, attempt=1,
                           outcome="delivered", next_status="delivered",
                           started_at=datetime.now(UTC))
    with engine.begin() as conn:
        assert dsql.record_outcomes(conn, [outcome], "w1") == {row.id: "delivered"}
    with engine.begin() as conn:
        assert dsql.record_outcomes(conn, [outcome], "w1") == {}
    with engine.connect() as conn:
        outcomes = conn.execute(text(
            "SELECT outcome FROM outbox.attempt_history WHERE effect_id = :id"), {"id": row.id}
        ).scalars().all()
    assert outcomes == ["delivered"]


def test_a_delivery_is_kept_on_the_effect_row_and_shown_in_the_history(
        engine: Engine, db_url: str) -> None:
    """Issue 11: a delivered attempt writes no outbox.attempts row (the record UPDATE
    keeps it on the effect row); every other attempt still gets one, and
    outbox.attempt_history, `outbox trace` and the console show them all, in order."""
    import json
    import os
    import subprocess
    import sys
    from datetime import UTC, datetime

    from outbox import enqueue
    from outbox.sql import dispatch as dsql

    with engine.begin() as conn:
        enqueue(conn, "k", {"x": 1}, key="kept-on-row")
    attempts = []
    for n, (outcome, status) in enumerate([("retry", "pending"),
                                           ("delivered", "delivered")], start=1):
        with engine.begin() as conn:
            (row,) = dsql.claim_due(conn, queue="default", limit=1, owner=f"w{n}",
                                    lease_seconds=30)
        started = datetime.now(UTC)
        attempts.append(started)
        out = dsql.Outcome(effect_id=row.id, lease_token=row.lease_token, attempt=n,
                           outcome=outcome, next_status=status, started_at=started,
                           http_status=503 if n == 1 else 201, trace_id=f"t{n}",
                           error="busy" if n == 1 else None)
        with engine.begin() as conn:
            assert dsql.record_outcomes(conn, [out], f"w{n}") == {row.id: outcome}
    with engine.connect() as conn:
        assert conn.execute(text("SELECT outcome FROM outbox.attempts WHERE effect_id = :i"),
                            {"i": row.id}).scalars().all() == ["retry"]
        kept = conn.execute(text(
            "SELECT delivered_by, delivered_started_at, delivered_http_status,"
            " delivered_trace_id, status FROM outbox.effects WHERE id = :i"),
            {"i": row.id}).one()
        history = conn.execute(text(
            "SELECT attempt, worker, started_at, outcome, http_status, trace_id"
            " FROM outbox.attempt_history WHERE effect_id = :i ORDER BY attempt"),
            {"i": row.id}).all()
    assert tuple(kept) == ("w2", attempts[1], 201, "t2", "delivered")
    assert [tuple(h) for h in history] == [
        (1, "w1", attempts[0], "retry", 503, "t1"),
        (2, "w2", attempts[1], "delivered", 201, "t2")]
    done = subprocess.run([sys.executable, "-m", "dispatcher.cli", "trace", "kept-on-row",
                           "--json"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DATABASE_URL": db_url})
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert [a["outcome"] for a in shown["attempts"]] == ["retry", "delivered"]
    assert [a["worker"] for a in shown["attempts"]] == ["w1", "w2"]
