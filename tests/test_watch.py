"""A busy worker keeps watch over its queue and the enqueue's doorbell goes quiet
(dispatcher/watch.py, migration 0010): no NOTIFY while it watches, every row whose bell
was skipped still claimed at once, the bell back when the watcher's session ends."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, text

from dispatcher import Dispatcher, Registry
from dispatcher.examples.payments.psp import ReceiverProcess
from dispatcher.watch import Watch
from dispatcher.worker import _psycopg_dsn, run_worker
from outbox import Effect, enqueue
from outbox._config import NOTIFY_CHANNEL
from outbox._connections import connect
from outbox.sql import watch as watch_sql
from tests.dispatch_support import add_effects, effect_row, wait_until
from tests.process_support import Procs, process_group, wait_all_final, wait_connected


def _watch(engine: Engine, queue: str = "default") -> Watch:
    dsn = _psycopg_dsn(engine)
    return Watch(queue, lambda: connect(
        dsn, autocommit=True, application_name=watch_sql.application_name("tests", queue)))


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
    watch.after_claim(watch.start_rows, True, time.monotonic())
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
        watch.after_claim(0, True, time.monotonic() + 1)  # no rows for a whole window
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
            watch.after_claim(1 + i % 3, True, t + i * 0.0025)
            watch.after_claim(0, True, t + i * 0.0025 + 0.001)
        assert not watch.watching and watch.watches == 0
        for i in range(30):  # 2 000 rows/s, each claim full: a backlog, others needed
            watch.after_claim(2, False, t + 1 + i * 0.001)
        assert not watch.watching
        for i in range(30):  # 2 000 rows/s, taking all that is due
            watch.after_claim(2, True, t + 2 + i * 0.001)
        assert watch.watching and watch.watches == 1
    finally:
        watch.close()


def test_four_workers_keep_watch_at_most_and_the_bell_waits_for_all_of_them(
        engine: Engine, listener: psycopg.Connection[Any]) -> None:
    watches = [_watch(engine) for _ in range(5)]
    try:
        for w in watches:
            w.after_claim(w.start_rows, True, time.monotonic())
        assert [w.watching for w in watches] == [True] * 4 + [False]
        for w in watches[:3]:
            w.after_claim(0, True, time.monotonic() + 1)
        _enqueue_one(engine, "one-left")
        assert _rung(listener) == []  # the fourth still watches
        watches[3].after_claim(0, True, time.monotonic() + 1)
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
                " WHERE application_name = 'tests-watch:default'")).scalar_one()
        assert killed == 1
        # The server releases a session's locks as it ends: wait for that, not for us.
        wait_until(lambda: not _slot_held(engine), 5, interval=0.02,
                   message="the slot released")
        _enqueue_one(engine, "after-kill")
        assert _rung(listener) == ["default"]
        # The watch finds out at its next use, drops what it had without raising, and
        # owes one claim (what it silenced is for polling from then on).
        assert watch.due(time.monotonic() + 10) and not watch.watching
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
            watch.after_claim(0, True, time.monotonic() + 1)
            assert watch.waiting == 1
            assert watch.due(time.monotonic() + 1)  # one claim owed at the watch's end
            watch.after_claim(0, True, time.monotonic() + 1)
            assert not watch.due(time.monotonic() + 1)  # still open: nothing to claim
            open_tx.commit()
        assert watch.due(time.monotonic() + 2)  # it ended: claim now
        assert watch.waiting == 0
        assert watch.due(time.monotonic() + 2)  # owed until a claim has run
        watch.after_claim(1, True, time.monotonic() + 2)
        assert not watch.due(time.monotonic() + 2)
    finally:
        watch.close()


def test_a_row_committed_before_the_list_is_read_is_claimed_once_more(
        engine: Engine) -> None:
    """A transaction that skipped the bell and committed after the watcher's last
    claim but before its list is on no list: the watch's end owes one more claim
    (found in review: without it, the row waited for the poll)."""
    watch = _watch(engine)
    try:
        _start(watch)
        with engine.connect() as t:
            t.begin()
            enqueue(t, "noop", {"k": 1}, key="late")
            t.commit()  # after the last claim, before the list
        watch.after_claim(0, True, time.monotonic() + 1)
        assert not watch.watching and watch.waiting == 0
        assert watch.timeout(time.monotonic()) == watch.poll
        assert watch.due(time.monotonic() + 1)
        watch.claim_failed()  # the database unreachable: no retry at once, polling finds it
        assert not watch.due(time.monotonic() + 1)
    finally:
        watch.close()


def test_a_watcher_with_no_free_slot_gives_the_bell_back(
        engine: Engine, listener: psycopg.Connection[Any]) -> None:
    """Saturated (no claim took all that was due for a window, or no claim at all),
    a watcher stops: the other workers of the queue need their bell."""
    watch = _watch(engine)
    try:
        _start(watch)
        _enqueue_one(engine, "silenced")
        assert _rung(listener) == []
        assert watch.due(time.monotonic() + watch.window)  # owed: the watch ended
        assert not watch.watching
        _enqueue_one(engine, "rung")
        assert _rung(listener) == ["default"]
        # Fallen behind, it does not start again at once (a worker at its capacity
        # would start and stop several times a second).
        watch.after_claim(watch.start_rows, True, time.monotonic() + watch.window + 0.01)
        assert not watch.watching
    finally:
        watch.close()


class _Feed:
    """Enqueues `per_tx` effects per transaction, back to back, until stopped: a
    stream one worker keeps up with, so its claims take all that is due."""

    def __init__(self, engine: Engine, per_tx: int = 10) -> None:
        self.engine, self.per_tx, self.keys = engine, per_tx, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        n = 0
        while not self.stop.is_set():
            batch = [f"feed-{n + i}" for i in range(self.per_tx)]
            add_effects(self.engine, batch)
            self.keys.extend(batch)
            n += self.per_tx
            time.sleep(0.002)

    def __enter__(self) -> _Feed:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def _worker(engine: Engine, delivered: Counter[str]) -> tuple[Dispatcher, Any]:
    lock = threading.Lock()

    def handler(effect: Any) -> dict[str, bool]:
        with lock:
            delivered[effect.key] += 1
        return {"ok": True}

    registry = Registry()
    registry.register("noop", handler)
    dispatcher = Dispatcher(engine, registry, concurrency=32, max_batch=32)
    stop = threading.Event()
    worker = threading.Thread(target=run_worker, args=(dispatcher,), kwargs={
        "poll_interval": 60.0, "grace": 5, "stop": stop, "install_signals": False})
    worker.start()

    def finish() -> None:
        stop.set()
        dispatcher.wake.set()
        worker.join(15)
        assert not worker.is_alive()
    return dispatcher, finish


@pytest.mark.parametrize("commit", ["after_the_list", "before_the_list"])
def test_a_row_whose_bell_was_skipped_is_claimed_when_its_transaction_commits(
        engine: Engine, listener: psycopg.Connection[Any], commit: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end, a worker polling only every 60 s keeps watch over a stream of
    enqueues; a transaction enqueues while it watches (no NOTIFY) and commits either
    after the watch ended and listed it, or (held inside `give_slot`, the review's
    case) after the worker's last claim but before its list. Either way the worker
    claims the row within a second of the commit: without the list, or without the
    claim owed at the watch's end, it waited for the 60 s poll."""
    in_give = threading.Event()
    committed = threading.Event()
    real_give = watch_sql.give_slot

    def give(conn: Any, queue: str, index: int) -> bool:
        if commit == "before_the_list" and not in_give.is_set():
            in_give.set()
            committed.wait(10)
        return real_give(conn, queue, index)

    monkeypatch.setattr(watch_sql, "give_slot", give)
    delivered: Counter[str] = Counter()
    dispatcher, finish = _worker(engine, delivered)
    try:
        with _Feed(engine) as feed:
            wait_until(lambda: dispatcher.watch is not None and dispatcher.watch.watching,
                       20, interval=0.002, message="the worker keeping watch")
            watch = dispatcher.watch
            assert watch is not None
            late = engine.connect()
            late.begin()
            enqueue(late, "noop", {"k": "late"}, key="late")
            assert watch.watching  # the enqueue looked at a held slot: no NOTIFY
        _rung(listener, 0.05)  # the feed's bells, rung before the watch began
        try:
            if commit == "before_the_list":
                assert in_give.wait(10)
                late.commit()
                committed.set()
            else:
                wait_until(lambda: not watch.watching and watch.waiting >= 1, 20,
                           interval=0.005, message="the watch's end, the open tx listed")
                time.sleep(0.2)
                late.commit()
        finally:
            late.close()
        t0 = time.monotonic()
        wait_until(lambda: delivered["late"] == 1, 5, interval=0.01,
                   message="the late row delivered")
        took = time.monotonic() - t0
        assert _rung(listener, 0.2) == []  # not rung: the watch found it
        everything = [*feed.keys, "late"]
        wait_until(lambda: all(delivered[k] for k in everything), 20)
        assert set(delivered.values()) == {1}  # each effect applied exactly once
        print(f"\n{commit}: late row claimed {took * 1000:.0f} ms after its commit; "
              f"{watch.watches} watch(es) kept; {len(feed.keys)} fed")
        assert took < 2.0
    finally:
        finish()


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


# -- a watching worker SIGKILLed ---------------------------------------------------------


@pytest.fixture
def procs(tmp_path: Path, psp_process: ReceiverProcess, db_url: str) -> Iterator[Procs]:
    yield from process_group(tmp_path, psp_process.url)


def _watched_queues(engine: Engine) -> list[str | None]:
    with engine.connect() as conn:
        return [w.queue for w in watch_sql.watchers().run(conn)]


def _slots_held(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2"
            " AND granted AND mode = 'ExclusiveLock'"
            " AND classid::int8 = ANY(CAST(:slots AS int8[]))"),
            {"slots": list(watch_sql.SLOTS)}).scalar_one())


@pytest.mark.slow
def test_a_watching_worker_sigkilled_loses_nothing(
        engine: Engine, procs: Procs, psp_process: ReceiverProcess) -> None:
    """A real `outbox worker` keeps watch over a stream; a transaction enqueues 5
    charges while it watches (no NOTIFY) and commits after the worker was SIGKILLed,
    its promise gone with it. A second worker that never watches and was never rung
    for those rows (OUTBOX_WATCH=0, --poll 0.5) finds them by polling: each charge
    applied once at the receiver, every effect delivered."""
    procs.worker("watch-a", concurrency=32, lease=2.0, poll=0.5)
    procs.worker("watch-b", concurrency=8, lease=2.0, poll=0.5, env={"OUTBOX_WATCH": "0"})
    wait_connected(engine, ["watch-a", "watch-b"])
    late = [f"late-{i}" for i in range(5)]
    with _Feed(engine, per_tx=20) as feed:
        wait_until(lambda: _watched_queues(engine) == ["default"], 30, interval=0.01,
                   message="worker A keeping watch, its session named by its queue")
        holder = engine.connect()
        holder.begin()
        for i, key in enumerate(late):
            enqueue(holder, "psp.charge", {"amount": i, "currency": "EUR"}, key=key)
        procs.started[0].send(signal.SIGKILL)
        assert procs.started[0].wait(10) == -signal.SIGKILL
    wait_until(lambda: _slots_held(engine) == 0, 10, interval=0.02,
               message="the killed worker's slot released")
    holder.commit()
    holder.close()
    committed = time.monotonic()
    wait_until(lambda: all(effect_row(engine, k).status == "delivered" for k in late), 15,
               interval=0.05, message="the late charges delivered by worker B")
    took = time.monotonic() - committed
    wait_all_final(engine, len(feed.keys) + len(late), timeout=60)
    psp_process.assert_exactly_once(late)
    assert procs.started[1].alive()
    print(f"\nlate charges delivered {took:.2f} s after their commit (B polls every "
          f"0.5 s); {len(feed.keys)} fed")


def test_status_and_the_gauge_name_the_queues_kept_under_watch(
        engine: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    """An operator sees which queues' enqueues skip the NOTIFY, and which sessions
    silence them: `outbox status` (text and JSON) and the `outbox.queue.watchers` gauge,
    which reads 0 once the watch ends rather than vanishing. A session whose name does
    not tell its queue is shown by the lock's hashtext."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from dispatcher.cli import main
    from dispatcher.metrics import QueueGauges
    from tests.otel_helpers import metric_points

    queue = "payments-watched"
    reader, tick = InMemoryMetricReader(), [0.0]
    QueueGauges(engine, ttl=1.0, clock=lambda: tick[0],
                meter=MeterProvider(metric_readers=[reader]).get_meter("tests.watch"))

    def gauge() -> dict[str, float]:
        tick[0] += 10.0  # past the cache: a fresh read
        return {str(p.attributes["queue"]): p.value
                for p in metric_points(reader, "outbox.queue.watchers")}

    def status() -> tuple[dict[str, Any], str]:
        assert main(["status", "--json"]) == 0
        snap = json.loads(capsys.readouterr().out)
        assert main(["status"]) == 0
        return snap, capsys.readouterr().out

    snap, text_out = status()
    assert snap["watchers"] == [] and gauge() == {}
    assert "watched queues    none" in text_out
    watch = _watch(engine, queue)
    unnamed = connect(_psycopg_dsn(engine), autocommit=True, application_name="plain")
    try:
        _start(watch)
        assert watch_sql.take_slot(unnamed, "other-queue") == 0
        pid = unnamed.info.backend_pid
        snap, text_out = status()
        mine = [w for w in snap["watchers"] if w["queue"] == queue]
        assert len(mine) == 1 and mine[0]["slot"] == 0
        assert mine[0]["application_name"] == f"tests-watch:{queue}"
        with engine.connect() as conn:
            hashed = conn.execute(text(
                "SELECT (CAST(hashtext('other-queue') AS int8) + 4294967296)"
                " % 4294967296")).scalar_one()
        assert {"queue": f"#{hashed}", "pid": pid, "slot": 0,
                "application_name": "plain"} in snap["watchers"]
        assert f"watched queues    {queue} (pid {mine[0]['pid']})" in text_out
        assert gauge() == {queue: 1, f"#{hashed}": 1}
        # A session holding a slot shared (what `outbox.ring` takes for an instant, or
        # keeps if a cancel lands between its lock and unlock) is not a watcher.
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock_shared(CAST(:slot AS int4),"
                              " hashtext('shared-queue'))"), {"slot": watch_sql.SLOTS[1]})
            try:
                assert len(watch_sql.watchers().run(conn)) == 2
            finally:
                conn.execute(text("SELECT pg_advisory_unlock_shared(CAST(:slot AS int4),"
                                  " hashtext('shared-queue'))"), {"slot": watch_sql.SLOTS[1]})
                conn.commit()
    finally:
        watch.close()
        unnamed.close()
    wait_until(lambda: status()[0]["watchers"] == [], 5, interval=0.05,
               message="no watcher left")
    assert gauge() == {queue: 0, f"#{hashed}": 0}


def test_status_warns_of_a_slot_a_cancelled_ring_left_held(
        engine: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    """A cancel between `outbox.ring`'s shared try-lock of a slot and its unlock leaves
    the (pooled) session holding the slot shared: no watcher of that queue can take it.
    `outbox status` names the session while it sits idle, and stops once it ends."""
    from dispatcher.cli import main

    holder = connect(_psycopg_dsn(engine), autocommit=True, application_name="app-pool")
    try:
        holder.execute("SELECT pg_advisory_lock_shared(%s, hashtext('q-stuck'))",
                       (watch_sql.SLOTS[2],))
        assert main(["status", "--json"]) == 0
        out = capsys.readouterr()
        [stuck] = json.loads(out.out)["watch_slots_stuck"]
        assert (stuck["pid"], stuck["slot"]) == (holder.info.backend_pid, 2)
        assert f"session {stuck['pid']} (app-pool) holds watch slot 2" in out.err
        assert json.loads(out.out)["watchers"] == []  # shared: not a watcher
    finally:
        holder.close()
    wait_until(lambda: not _stuck_listed(engine), 5, interval=0.05,
               message="the ended session's slot released")


def _stuck_listed(engine: Engine) -> bool:
    with engine.connect() as conn:
        return bool(watch_sql.stuck_slots().run(conn))
