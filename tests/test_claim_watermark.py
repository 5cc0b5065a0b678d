"""The claim's watermark (issue 17): the fresh scan resumes after the last row claimed.

A held xmin horizon leaves the index entries of every row claimed since then at the
head of effects_pending_idx (dead, unremovable); a claim from the head steps over all
of them. The producer resumes from a watermark instead, and claims without it (a full
scan) when it caught up and at least every `full_scan_every` seconds: rows that
appear behind the watermark (a late commit, a released lock) are delivered by that
full scan, exactly once. The negative controls (`full_scan_every=inf`) show the full
scan is what delivers them: without it the row waits while the backlog lasts.

Real PostgreSQL and a real Dispatcher; deliveries are counted per effect key.
"""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text

import outbox
from dispatcher import Dispatcher, Registry
from dispatcher.handlers import EffectContext
from dispatcher.producer import Producer
from outbox.sql import dispatch as sql
from outbox.sql.dispatch import Watermark
from tests.dispatch_support import add_effects, keys, status_counts, wait_until

KIND = "wm.count"


def _plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _plan_nodes(child)


def _fresh_scan(plan: dict[str, Any]) -> dict[str, Any]:
    for node in _plan_nodes(plan):
        if node.get("Subplan Name") == "CTE fresh":
            for n in _plan_nodes(node):
                if n.get("Index Name") == "effects_pending_idx":
                    return n
    raise AssertionError(json.dumps(plan, indent=1))


def _explain(conn: Connection, how: str, after: Watermark | None,
             limit: int = 10) -> dict[str, Any]:
    params = {"queue": "default", "limit": limit, "owner": "x", "lease": 30.0,
              "now": None, "token": uuid.uuid4(), "rescue": False,
              "after_at": after.available_at if after else None,
              "after_id": after.id if after else None}
    raw = conn.connection.driver_connection
    assert raw is not None
    [[doc]] = raw.execute(f"EXPLAIN ({how}) " + sql._CLAIM.sql, params).fetchall()
    plan: dict[str, Any] = (json.loads(doc) if isinstance(doc, str) else doc)[0]["Plan"]
    return plan


def _position(engine: Engine, key: str) -> Watermark:
    with engine.connect() as conn:
        at, id_ = conn.execute(text(
            "SELECT available_at, id FROM outbox.effects WHERE effect_key = :k"),
            {"k": key}).one()
    return Watermark(at, id_)


# --------------------------------------------------------------------------- statement


@pytest.mark.parametrize("settings", [(), ("enable_seqscan = off",),
                                      ("enable_bitmapscan = off", "enable_sort = off")],
                         ids=lambda s: ",".join(x.split()[0] for x in s) or "default")
def test_watermark_is_an_index_cond_and_skips_the_dead_head(
        engine: Engine, settings: tuple[str, ...]) -> None:
    """The row comparison is an Index Cond on effects_pending_idx (the scan starts at
    the watermark), not a Filter; with the entries of 3000 claimed rows dead at the
    head of the index (a REPEATABLE READ snapshot holds the horizon), the watermark
    scan touches a few buffers where the full scan touches many."""
    add_effects(engine, keys("head", 3000))
    add_effects(engine, keys("tail", 100))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.execute(text("ANALYZE outbox.effects"))
    holder = engine.connect().execution_options(isolation_level="REPEATABLE READ")
    try:
        holder.begin()
        holder.execute(text("SELECT count(*) FROM outbox.effects")).scalar_one()
        with engine.begin() as conn:  # claimed: their pending-index entries are dead
            got = sql.claim_batch(conn, queue="default", limit=3000, owner="w",
                                  lease_seconds=30, rescue=False)
        assert got.watermark == _position(engine, "head-002999")
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            c.execute(text("VACUUM outbox.effects"))  # removes nothing: the horizon
        with engine.connect() as conn:
            for s in settings:
                conn.execute(text(f"SET LOCAL {s}"))
            scan = _fresh_scan(_explain(conn, "FORMAT JSON", got.watermark))
            assert "ROW(available_at, id) >" in scan.get("Index Cond", ""), scan
            assert "available_at" not in scan.get("Filter", ""), scan
            full = _fresh_scan(_explain(conn, "ANALYZE, BUFFERS, FORMAT JSON", None))
            conn.rollback()
            for s in settings:
                conn.execute(text(f"SET LOCAL {s}"))
            resumed = _fresh_scan(_explain(conn, "ANALYZE, BUFFERS, FORMAT JSON",
                                           got.watermark))
            conn.rollback()
    finally:
        holder.rollback()
        holder.close()
    assert full["Actual Rows"] == resumed["Actual Rows"] == 10
    hits = {name: n["Shared Hit Blocks"] + n["Shared Read Blocks"]
            for name, n in (("full", full), ("resumed", resumed))}
    print("buffers", hits)
    assert hits["resumed"] * 10 < hits["full"], hits


def test_claim_after_a_watermark_takes_only_rows_past_it(engine: Engine) -> None:
    """`after` is exclusive and ordered by (available_at, id); rescued rows do not
    move the watermark; no watermark claims from the head, as before."""
    add_effects(engine, keys("k", 6))
    third = _position(engine, "k-000002")
    with engine.begin() as conn:
        got = sql.claim_batch(conn, queue="default", limit=2, owner="w",
                              lease_seconds=30, after=third)
    assert [r.effect_key for r in got.rows] == ["k-000003", "k-000004"]
    assert got.watermark == _position(engine, "k-000004")
    with engine.begin() as conn:
        rows = sql.claim_due(conn, queue="default", limit=10, owner="w", lease_seconds=30)
    assert [r.effect_key for r in rows] == ["k-000000", "k-000001", "k-000002", "k-000005"]
    # Expired leases are rescued; the fresh scan took nothing: no watermark.
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox.effects SET lease_expires_at = now() - "
                          "interval '1 second' WHERE effect_key IN ('k-000000', 'k-000001')"))
        got = sql.claim_batch(conn, queue="default", limit=10, owner="r",
                              lease_seconds=30, after=third)
    assert sorted(r.effect_key for r in got.rows) == ["k-000000", "k-000001"]
    assert got.watermark is None


def claim_afters(monkeypatch: pytest.MonkeyPatch) -> list[Watermark | None]:
    """Record the watermark (`after`) every claim the producer makes is given."""
    seen: list[Watermark | None] = []
    real = sql.claim_batch

    def spy(conn: Any, **kw: Any) -> sql.ClaimBatch:
        seen.append(kw["after"])
        return real(conn, **kw)

    monkeypatch.setattr(sql, "claim_batch", spy)
    return seen


def test_producer_resumes_from_its_watermark_and_scans_fully_when_short(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Full batches move the watermark; a short batch resets it (next: a full scan);
    `full_scan_every` forces a full scan under a full backlog; 0 never resumes."""
    add_effects(engine, keys("p", 25))
    seen = claim_afters(monkeypatch)
    clock = [0.0]
    monkeypatch.setattr("dispatcher.producer.time.monotonic", lambda: clock[0])
    p = Producer(engine, queue="default", worker_id="w", lease=30, clock=lambda: None,
                 full_scan_every=5.0)
    assert [r.effect_key for r in p.claim(10)] == keys("p", 10)
    assert p.watermark == _position(engine, "p-000009")
    clock[0] = 1.0
    assert [r.effect_key for r in p.claim(10)] == keys("p", 20)[10:]
    clock[0] = 6.0  # past full_scan_every: from the head (the first 20 are in flight)
    assert [r.effect_key for r in p.claim(3)] == ["p-000020", "p-000021", "p-000022"]
    clock[0] = 7.0
    assert len(p.claim(10)) == 2  # short: caught up
    assert p.watermark is None
    assert seen == [None, _position(engine, "p-000009"), None,
                    _position(engine, "p-000022")]
    seen.clear()
    add_effects(engine, keys("q", 30))
    p0 = Producer(engine, queue="default", worker_id="w0", lease=30, clock=lambda: None,
                  full_scan_every=0)
    for _ in range(3):
        assert len(p0.claim(10)) == 10
    assert seen == [None, None, None] and p0.watermark is None
    with pytest.raises(ValueError):
        Producer(engine, queue="default", worker_id="w", lease=30, clock=lambda: None,
                 full_scan_every=math.nan)


def test_producer_looks_behind_at_once_when_nothing_is_past_its_watermark(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty claim ends a drain: one past the watermark is followed, in the same
    call, by a full scan, which finds a row that committed behind the watermark."""
    add_effects(engine, keys("a", 10))
    seen = claim_afters(monkeypatch)
    p = Producer(engine, queue="default", worker_id="w", lease=30, clock=lambda: None,
                 full_scan_every=60.0)
    assert len(p.claim(10)) == 10  # full: the watermark is its last row
    mark = p.watermark
    assert mark is not None
    with engine.begin() as conn:  # a row behind the watermark
        conn.execute(text("INSERT INTO outbox.effects (effect_key, kind, payload,"
                          " available_at) VALUES ('behind', 'noop', '{}',"
                          " now() - interval '1 hour')"))
    assert [r.effect_key for r in p.claim(10)] == ["behind"]
    assert seen == [None, mark, None]


def test_an_ordering_key_chain_is_not_held_behind_the_watermark(engine: Engine) -> None:
    """Under a saturated backlog every claim is full, so the watermark keeps moving and
    only catch-up full scans look behind it. An ordering key's successor is unblocked
    when its head is recorded, behind the watermark: it waited for a full scan (one
    effect per scan; with full_scan_every=inf, until the backlog ran out). Recording a
    delivered head with an ordering key now makes the next claim look behind."""
    chain = keys("chain", 8)
    add_effects(engine, chain, ordering_key=lambda i, k: "acct-1")  # oldest rows
    add_effects(engine, keys("bulk", 4000))
    done: list[str] = []
    lock = threading.Lock()

    def noop(effect: EffectContext) -> None:
        time.sleep(0.002)
        with lock:
            done.append(effect.key)

    registry = Registry()
    registry.register("noop", noop)
    d = Dispatcher(engine, registry, concurrency=10, max_batch=10, lease=30,
                   full_scan_every=math.inf)  # no periodic full scan: only rescans
    try:
        stop = threading.Event()
        runner = threading.Thread(target=d.run, kwargs={"stop": stop, "poll_interval": 0.2},
                                  daemon=True)
        runner.start()
        try:
            wait_until(lambda: all(k in done for k in chain), 60, interval=0.05,
                       message=lambda: f"chain delivered: {[k for k in chain if k in done]}")
            with lock:
                bulk_done = sum(1 for k in done if k.startswith("bulk"))
        finally:
            stop.set()
            runner.join(30)
    finally:
        d.shutdown(0)
    # The chain finished while most of the backlog was still waiting.
    assert bulk_done < 3000, bulk_done
    with lock:
        order = [k for k in done if k in chain]
    assert order == chain  # in order, each once


def test_rescue_is_spaced_out_when_it_is_slow(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim with the rescue that took long (a held horizon bloats the in-flight
    index it walks) spaces the next rescues to 1/FULL_SCAN_SHARE of that, even after
    short claims; a fast one keeps the rescue on every short claim."""
    from dispatcher.producer import FULL_SCAN_SHARE

    rescues: list[bool] = []
    monkeypatch.setattr(sql, "claim_batch",
                        lambda conn, **kw: rescues.append(kw["rescue"]) or sql.ClaimBatch(
                            [], None))
    clock = [100.0]
    monkeypatch.setattr("dispatcher.producer.time.monotonic", lambda: clock[0])
    p = Producer(engine, queue="default", worker_id="w", lease=30, clock=lambda: None)
    p.claim(10)
    p.claim(10)  # short: rescue again
    assert rescues == [True, True]
    p._rescue_took = 0.5  # seconds: rescues every 0.5 / FULL_SCAN_SHARE = 10 s
    clock[0] += 1.0
    p.claim(10)
    clock[0] += 0.5 / FULL_SCAN_SHARE
    p.claim(10)
    assert rescues == [True, True, False, True]


def test_fenced_writes_do_not_walk_the_in_flight_index(engine: Engine) -> None:
    """record_outcomes and extend_leases find their rows by primary key: through
    effects_in_flight_idx (statistics saying nothing is in flight made it the cheap
    plan) each walked every entry a held horizon kept there."""
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO outbox.effects (effect_key, kind, payload)"
                          " SELECT 'f-' || g, 'noop', '{}' FROM generate_series(1, 20000) g"))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.execute(text("ANALYZE outbox.effects"))  # nothing in flight
    with engine.begin() as conn:
        rows = sql.claim_due(conn, queue="default", limit=100, owner="w", lease_seconds=30)
    outs = [sql.Outcome(effect_id=r.id, lease_token=r.lease_token, attempt=r.attempts,
                        outcome="delivered", next_status="delivered",
                        started_at=r.created_at) for r in rows]
    record = {"batch": sql._batch_json(outs), "worker": "w", "now": None}
    extend = {"ids": [r.id for r in rows], "tokens": [r.lease_token for r in rows],
              "secs": [30.0] * len(rows), "lease": 30.0, "now": None}
    with engine.connect() as conn:
        raw = conn.connection.driver_connection
        assert raw is not None
        for statement, params in ((sql._RECORD, record), (sql._EXTEND, extend)):
            [[doc]] = raw.execute("EXPLAIN (FORMAT JSON) " + statement.sql,
                                  params).fetchall()
            plan = (json.loads(doc) if isinstance(doc, str) else doc)[0]["Plan"]
            names = {n.get("Index Name") for n in _plan_nodes(plan)}
            assert "effects_in_flight_idx" not in names, json.dumps(plan, indent=1)
            assert "effects_pkey" in names, json.dumps(plan, indent=1)


# --------------------------------------------------------------------------- a real worker


class Deliveries:
    """Counts deliveries per effect key; each takes `seconds` (paces the worker)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.count: Counter[str] = Counter()
        self.at: dict[str, float] = {}
        self._lock = threading.Lock()

    def __call__(self, effect: EffectContext) -> None:
        time.sleep(self.seconds)
        with self._lock:
            self.count[effect.key] += 1
            self.at.setdefault(effect.key, time.monotonic())

    def total(self) -> int:
        with self._lock:
            return sum(self.count.values())


class Running:
    """A Dispatcher running its loop (`run`) on a thread, polling every 50 ms."""

    def __init__(self, engine: Engine, full_scan_every: float, seconds: float) -> None:
        self.deliveries = Deliveries(seconds)
        registry = Registry()
        registry.register(KIND, self.deliveries)
        self.dispatcher = Dispatcher(engine, registry, concurrency=4, max_batch=4,
                                     lease=30.0, full_scan_every=full_scan_every)
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=self.dispatcher.run, args=(self.stop,),
            kwargs={"poll_interval": 0.05, "grace": 5.0}, daemon=True)

    def __enter__(self) -> Running:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.dispatcher.wake.set()
        self.thread.join(15)
        assert not self.thread.is_alive()


# The backlog outlasts the window: 4 slots x 10 ms per delivery is at most ~400/s.
BACKLOG = 2500
PERIOD = 1.0        # full_scan_every in the positive cases
WINDOW = PERIOD + 2.0  # a claim, a 10 ms delivery and its record fit in the slack
CASES = [pytest.param(PERIOD, id="periodic-full-scan"),
         pytest.param(math.inf, id="no-full-scan-control")]


def _await_watermark_past(run: Running, late: Watermark) -> None:
    """The worker has claimed past the row: its watermark is beyond it."""
    wait_until(lambda: (w := run.dispatcher.producer.watermark) is not None and w > late,
               timeout=20, interval=0.01,
               message=lambda: f"a watermark past {late} "
                               f"(now {run.dispatcher.producer.watermark})")


def _pending_backlog(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT count(*) FROM outbox.effects WHERE status = 'pending'"
            " AND effect_key LIKE 'bl-%'")).scalar_one())


def _observe(engine: Engine, run: Running, key: str, full_scan_every: float,
             released_at: float) -> None:
    """Delivered exactly once within the window (periodic full scan); or, the
    control, not delivered within it while the backlog lasts, then delivered once
    when the backlog is gone (the caught-up full scan)."""
    d = run.deliveries
    if full_scan_every <= PERIOD:
        wait_until(lambda: d.count[key] >= 1, timeout=WINDOW, interval=0.01,
                   message=f"{key} delivered within {WINDOW}s of its release")
        assert d.at[key] - released_at <= WINDOW
        assert _pending_backlog(engine) > 0  # found by the periodic scan, not a drained queue
    else:
        time.sleep(WINDOW)
        assert d.count[key] == 0, "delivered without a full scan: the control is void"
        assert _pending_backlog(engine) > 0, "the backlog ran dry: the control is void"
        with engine.begin() as conn:  # end the backlog: the next claim comes up short
            conn.execute(text("DELETE FROM outbox.effects WHERE status = 'pending'"
                              " AND effect_key LIKE 'bl-%'"))
        wait_until(lambda: d.count[key] >= 1, timeout=10, interval=0.01,
                   message=f"{key} delivered once the backlog was gone")
    time.sleep(0.3)  # a second delivery of the row would show here
    assert d.count[key] == 1, d.count[key]
    assert all(n == 1 for n in d.count.values()), \
        {k: n for k, n in d.count.items() if n != 1}


@pytest.mark.parametrize("full_scan_every", CASES)
def test_a_row_committed_behind_the_watermark_is_delivered_exactly_once(
        engine: Engine, full_scan_every: float) -> None:
    """An enqueue whose transaction started first (its available_at is its start
    time, its id the lowest) commits after the worker claimed past it."""
    late_key = f"late-{uuid.uuid4().hex[:8]}"
    with engine.connect() as late_conn:
        late_conn.begin()
        outbox.enqueue(late_conn, KIND, {"late": True}, key=late_key)
        late = Watermark(*late_conn.execute(text(
            "SELECT available_at, id FROM outbox.effects WHERE effect_key = :k"),
            {"k": late_key}).one())
        add_effects(engine, keys("bl", BACKLOG), kind=KIND)
        assert late < _position(engine, "bl-000000")
        with Running(engine, full_scan_every, seconds=0.01) as run:
            _await_watermark_past(run, late)
            wait_until(lambda: run.deliveries.total() >= 20, timeout=20, interval=0.01)
            late_conn.commit()
            released_at = time.monotonic()
            _observe(engine, run, late_key, full_scan_every, released_at)
    assert status_counts(engine).get("delivered", 0) >= 21


@pytest.mark.parametrize("full_scan_every", CASES)
def test_a_row_locked_behind_the_watermark_is_delivered_once_released(
        engine: Engine, full_scan_every: float) -> None:
    """The head row is held by a claim that later rolls back (SKIP LOCKED passes it
    by, the watermark moves past it); once released it is delivered exactly once."""
    add_effects(engine, ["held"], kind=KIND)
    add_effects(engine, keys("bl", BACKLOG), kind=KIND)
    with engine.connect() as holder:
        holder.begin()
        [row] = sql.claim_due(holder, queue="default", limit=1, owner="doomed",
                              lease_seconds=30)
        assert row.effect_key == "held"
        held = _position(engine, "held")  # committed state: still pending
        with Running(engine, full_scan_every, seconds=0.01) as run:
            _await_watermark_past(run, held)
            wait_until(lambda: run.deliveries.total() >= 20, timeout=20, interval=0.01)
            holder.rollback()
            released_at = time.monotonic()
            _observe(engine, run, "held", full_scan_every, released_at)
    with engine.connect() as conn:
        attempts = conn.execute(text(
            "SELECT count(*) FROM outbox.attempt_history a JOIN outbox.effects e"
            " ON e.id = a.effect_id WHERE e.effect_key = 'held'")).scalar_one()
    assert attempts == 1
