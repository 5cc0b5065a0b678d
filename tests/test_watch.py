"""A busy worker keeps watch over its queue and the enqueue's doorbell goes quiet
(dispatcher/watch.py, migration 0010): no NOTIFY while it watches, every row whose bell
was skipped still claimed at once, the bell back when the watcher's session ends."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, text

from dispatcher import Dispatcher, Registry
from dispatcher.watch import Watch
from dispatcher.worker import _psycopg_dsn, run_worker
from outbox import Effect, enqueue
from outbox._config import NOTIFY_CHANNEL
from outbox._connections import connect
from outbox.sql import watch as watch_sql
from tests.dispatch_support import add_effects, keys, wait_until


def _watch(engine: Engine, queue: str = "default") -> Watch:
    dsn = _psycopg_dsn(engine)
    return Watch(queue, lambda: connect(dsn, autocommit=True,
                                        application_name="tests-watch"))


@pytest.fixture
def listener(engine: Engine) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(_psycopg_dsn(engine), autocommit=True) as conn:
        conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
        yield conn


def _rung(listener: psycopg.Connection[Any], wait: float = 0.3) -> list[str]:
    return [n.payload for n in listener.notifies(timeout=wait, stop_after=10)]


def _enqueue_one(engine: Engine, key: str, queue: str = "default") -> None:
    with engine.begin() as conn:
        enqueue(conn, "noop", {"k": key}, key=key, queue=queue)


def _start(watch: Watch) -> None:
    watch.after_claim(watch.start_rows, time.monotonic())
    assert watch.watching


def test_a_worker_keeping_watch_silences_the_doorbell_of_its_queue_only(
        engine: Engine, listener: psycopg.Connection[Any]) -> None:
    _enqueue_one(engine, "before")
    assert _rung(listener) == ["default"]  # nobody watches: the bell rings
    watch = _watch(engine)
    try:
        _start(watch)
        _enqueue_one(engine, "watched")
        assert _rung(listener) == []  # fails if outbox.ring notifies anyway
        _enqueue_one(engine, "other", queue="other")
        assert _rung(listener) == ["other"]
        watch.after_claim(0, time.monotonic() + 1)  # no rows for a whole window
        assert not watch.watching
        _enqueue_one(engine, "after")
        assert _rung(listener) == ["default"]
    finally:
        watch.close()


def test_slow_claims_never_keep_watch(engine: Engine,
                                      listener: psycopg.Connection[Any]) -> None:
    """Below 1 000 rows/s no watch is kept: every enqueue rings (a NOTIFY wakes the
    worker sooner than its polls every 2 ms would)."""
    watch = _watch(engine)
    try:
        t = time.monotonic()
        for i in range(200):  # 800 rows/s for 0.25 s, in claims of 1 to 3 rows
            watch.after_claim(1 + i % 3, t + i * 0.0025)
            watch.after_claim(0, t + i * 0.0025 + 0.001)
        assert not watch.watching and watch.watches == 0
        for i in range(30):  # 2 000 rows/s
            watch.after_claim(2, t + 1 + i * 0.001)
        assert watch.watching and watch.watches == 1
    finally:
        watch.close()


def test_four_workers_keep_watch_at_most_and_the_bell_waits_for_all_of_them(
        engine: Engine, listener: psycopg.Connection[Any]) -> None:
    watches = [_watch(engine) for _ in range(5)]
    try:
        for w in watches:
            w.after_claim(w.start_rows, time.monotonic())
        assert [w.watching for w in watches] == [True] * 4 + [False]
        for w in watches[:3]:
            w.after_claim(0, time.monotonic() + 1)
        _enqueue_one(engine, "one-left")
        assert _rung(listener) == []  # the fourth still watches
        watches[3].after_claim(0, time.monotonic() + 1)
        _enqueue_one(engine, "none-left")
        assert _rung(listener) == ["default"]
    finally:
        for w in watches:
            w.close()


def test_a_watchers_session_that_ends_gives_the_bell_back(
        engine: Engine, listener: psycopg.Connection[Any]) -> None:
    watch = _watch(engine)
    try:
        _start(watch)
        with engine.connect() as conn:
            killed = conn.execute(text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name = 'tests-watch'")).scalar_one()
        assert killed == 1
        # The server releases a session's locks as it ends: wait for that, not for us.
        wait_until(lambda: not _slot_held(engine), 5, interval=0.02,
                   message="the slot released")
        _enqueue_one(engine, "after-kill")
        assert _rung(listener) == ["default"]
        # The watch finds out at its next use and drops what it had, without raising.
        assert not watch.due(time.monotonic() + 10) and not watch.watching
    finally:
        watch.close()


def _slot_held(engine: Engine) -> bool:
    with engine.connect() as conn:
        return bool(conn.execute(text(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory'"
            " AND objsubid = 2 AND classid = CAST(:slot AS oid))"),
            {"slot": watch_sql.SLOTS[0]}).scalar_one())


def test_the_enqueuers_listed_at_the_watchs_end_are_the_open_ones(engine: Engine) -> None:
    watch = _watch(engine)
    try:
        _start(watch)
        with engine.connect() as open_tx:
            open_tx.begin()
            enqueue(open_tx, "noop", {"k": 1}, key="open")
            watch.after_claim(0, time.monotonic() + 1)
            assert watch.waiting == 1
            assert not watch.due(time.monotonic() + 1)  # still open: nothing to claim
            open_tx.commit()
        assert watch.due(time.monotonic() + 2)  # it ended: claim now
        assert watch.waiting == 0
    finally:
        watch.close()


def test_a_row_whose_bell_was_skipped_is_claimed_when_its_transaction_commits(
        engine: Engine, listener: psycopg.Connection[Any]) -> None:
    """End to end: a worker polling only every 60 s keeps watch through a backlog; a
    transaction enqueues while it watches (no NOTIFY) and commits after the watch
    ended. The worker claims that row within a second, from the list it took at the
    watch's end: without the list, the row waited for the 60 s poll."""
    delivered: Counter[str] = Counter()
    lock = threading.Lock()

    def handler(effect: Any) -> dict[str, bool]:
        time.sleep(0.0005)
        with lock:
            delivered[effect.key] += 1
        return {"ok": True}

    registry = Registry()
    registry.register("noop", handler)
    backlog = keys("backlog", 3000)
    add_effects(engine, backlog)
    _rung(listener, 0.1)
    dispatcher = Dispatcher(engine, registry, concurrency=4, max_batch=4)
    stop = threading.Event()
    worker = threading.Thread(target=run_worker, args=(dispatcher,), kwargs={
        "poll_interval": 60.0, "grace": 5, "stop": stop, "install_signals": False})
    worker.start()
    try:
        wait_until(lambda: dispatcher.watch is not None and dispatcher.watch.watching, 10,
                   interval=0.002, message="the worker keeping watch")
        watch = dispatcher.watch
        assert watch is not None
        with engine.connect() as late:
            late.begin()
            enqueue(late, "noop", {"k": "late"}, key="late")
            assert watch.watching  # the enqueue looked at a held slot
            wait_until(lambda: not watch.watching, 20, interval=0.005,
                       message="the watch's end")
            assert watch.waiting >= 1  # the open transaction is listed
            time.sleep(0.2)
            late.commit()
        committed = time.monotonic()
        wait_until(lambda: delivered["late"] == 1, 5, interval=0.01,
                   message="the late row delivered")
        took = time.monotonic() - committed
        assert _rung(listener, 0.2) == []  # not rung: the list found it
        wait_until(lambda: sum(delivered.values()) == len(backlog) + 1, 10)
        assert set(delivered.values()) == {1}  # each effect applied exactly once
        print(f"\nlate row claimed {took * 1000:.0f} ms after its commit; "
              f"{watch.watches} watch(es) kept")
        assert took < 2.0
    finally:
        stop.set()
        dispatcher.wake.set()
        worker.join(15)
    assert not worker.is_alive()


def test_enqueue_with_an_effect_key_in_the_watched_queue_and_a_guard_still_rings(
        engine: Engine, listener: psycopg.Connection[Any]) -> None:
    """The guard's completing write carries its effects through the same CTEs: the
    same bell, rung when nobody watches."""
    from outbox import IdempotencyGuard, StoredResponse

    guard = IdempotencyGuard()

    def work(conn: Any, claim: Any) -> StoredResponse:
        claim.enqueue_many([Effect("noop", {"a": 1})])
        return StoredResponse(201, (), b"{}")

    guard.run(engine, "watch-test", "k1", "fp", work)
    assert _rung(listener) == ["default"]
