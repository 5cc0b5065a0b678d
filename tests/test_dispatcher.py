"""The dispatcher in-process: claim, lease, fence, classify, retry, order (fast).

Real PostgreSQL; the HTTP cases go through the fake PSP (dispatcher/examples/payments/psp.py) on a
loopback thread. Time moves through the statements' `now` argument and the
Dispatcher's injectable clock (H8b), never through sleeps longer than a blip.
Catalogue IDs: research/anchors-reliability.md section C (F17, F20, F22-F25, F31).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import psycopg
import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import OperationalError
from tenacity import retry_if_exception_type, wait_fixed

from dispatcher import Dispatcher, HttpHandler, Registry, RetryPolicy
from dispatcher.examples.payments.psp import Receiver
from dispatcher.handlers import EffectContext
from dispatcher.http_async import AsyncHttpHandler
from outbox import _driver
from outbox.errors import (
    AmbiguousOutcome,
    PermanentFailure,
    RetryAfter,
    TransientFailure,
)
from outbox.sql import dispatch as sql
from outbox.sql.effects import requeue
from tests.dispatch_support import (
    add_effects,
    attempts_of,
    db_now,
    drain_then_shut_down,
    effect_row,
    keys,
    outcome_counts,
    status_counts,
    wait_until,
)

SOAK = os.environ.get("OUTBOX_SOAK") == "1"
NO_WAIT = RetryPolicy(wait=wait_fixed(60))  # backoff far beyond one drain


def claim(engine: Engine, *, limit: int = 10, owner: str = "w", lease: float = 30.0,
          now: datetime | None = None, queue: str = "default") -> list[Any]:
    with engine.begin() as conn:
        return sql.claim_due(conn, queue=queue, limit=limit, owner=owner,
                             lease_seconds=lease, now=now)


def outcome_for(row: Any, outcome: str, next_status: str, **kw: Any) -> sql.Outcome:
    return sql.Outcome(effect_id=row.id, lease_token=row.lease_token, attempt=row.attempts,
                       outcome=outcome, next_status=next_status,
                       started_at=datetime.now(UTC), **kw)


def record(engine: Engine, outcomes: list[sql.Outcome], worker: str = "w",
           now: datetime | None = None) -> dict[int, str]:
    with engine.begin() as conn:
        return sql.record_outcomes(conn, outcomes, worker, now=now)


class StatementCounter:
    """Counts outbox statements sent while active (`with StatementCounter(e) as c`).

    Counted where the driver seam (outbox/_driver.py) sends them, under SQLAlchemy,
    where its cursor events do not see them: at psycopg's cursor, and under it (a
    statement that opens a transaction or runs in autocommit, `_driver._exchange`).
    Pool pings and session statements are not ours (they name no outbox table).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.statements: list[str] = []
        self._real: Any = None
        self._exchange: Any = None

    def __enter__(self) -> StatementCounter:
        real = self._real = psycopg.Cursor.execute
        exchange = self._exchange = _driver._exchange
        statements = self.statements

        def execute(cur: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            text_ = query if isinstance(query, str) else str(query)
            if "outbox." in text_:
                statements.append(text_)
            return real(cur, query, *args, **kwargs)

        def direct(pgconn: Any, begin: Any, name: Any, prepare: bool,
                   statement: Any, *args: Any) -> Any:
            if "outbox." in statement.sql:
                statements.append(statement.sql)
            return exchange(pgconn, begin, name, prepare, statement, *args)

        psycopg.Cursor.execute = execute  # type: ignore[method-assign,assignment]
        _driver._exchange = direct  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        psycopg.Cursor.execute = self._real  # type: ignore[method-assign]
        _driver._exchange = self._exchange


# --------------------------------------------------------------------------- claim


def test_claim_marks_rows_in_flight_with_a_fresh_lease(engine: Engine) -> None:
    ids = add_effects(engine, keys("c", 5))
    add_effects(engine, ["later"], delay=3600)
    add_effects(engine, ["other-queue"], queue="other")
    t0 = db_now(engine)
    rows = claim(engine, limit=3, owner="A", lease=30, now=t0)
    assert [r.id for r in rows] == ids[:3]  # oldest due first
    assert {r.attempts for r in rows} == {1}
    # One token per claim (a retried claim finds its rows by it); fencing is per row.
    assert len({r.lease_token for r in rows}) == 1
    for r in rows:
        assert r.lease_expires_at == t0 + timedelta(seconds=30)
    rest = claim(engine, limit=10, owner="B", now=t0)
    assert [r.id for r in rest] == ids[3:]  # not the delayed one, not the other queue
    assert claim(engine, limit=10, owner="C", now=t0) == []
    assert [r.effect_key for r in claim(engine, queue="other", now=t0)] == ["other-queue"]
    with engine.connect() as conn:
        owners = dict(conn.execute(text(
            "SELECT lease_owner, count(*) FROM outbox.effects WHERE status = 'in_flight' "
            "GROUP BY lease_owner")).all())
    assert owners == {"A": 3, "B": 2, "w": 1}
    # Two hours on: the delayed row is due, and every lease above has expired (rescue).
    later = claim(engine, limit=10, owner="D", now=t0 + timedelta(hours=2))
    assert sorted(r.effect_key for r in later) == sorted([*keys("c", 5), "later"])
    assert {r.attempts for r in later if r.effect_key != "later"} == {2}
    assert claim(engine, limit=0) == []


def test_expired_lease_is_rescued_with_a_new_token(engine: Engine) -> None:
    [eid] = add_effects(engine, ["r1"])
    t0 = db_now(engine)
    [first] = claim(engine, owner="dead", lease=10, now=t0)
    assert claim(engine, owner="B", now=t0 + timedelta(seconds=9)) == []  # still leased
    [again] = claim(engine, owner="B", lease=10, now=t0 + timedelta(seconds=11))
    assert again.id == eid and again.attempts == 2
    assert again.lease_token != first.lease_token
    row = effect_row(engine, "r1")
    assert (row.status, row.lease_owner, row.attempts) == ("in_flight", "B", 2)


def test_rescue_respects_max_attempts_and_the_sweep_dead_letters(engine: Engine) -> None:
    add_effects(engine, ["last-try"], max_attempts=1)
    t0 = db_now(engine)
    claim(engine, owner="dead", lease=5, now=t0)
    later = t0 + timedelta(seconds=6)
    assert claim(engine, owner="B", now=later) == []  # no attempt left: never redelivered
    with engine.begin() as conn:
        assert sql.seconds_until_due(conn, "default", now=later) == pytest.approx(-1.0)
        dead = sql.fail_exhausted_leases(conn, now=later)
    row = effect_row(engine, "last-try")
    assert dead == [row.id]
    assert (row.status, row.lease_token, row.attempts) == ("failed", None, 1)
    [a] = attempts_of(engine, row.id)
    assert (a.outcome, a.worker, a.attempt) == ("failed", "dead", 1)
    with engine.begin() as conn:
        assert sql.seconds_until_due(conn, "default", now=later) is None


# --------------------------------------------------------------------------- F17


def _plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _plan_nodes(child)


def _subplan(plan: dict[str, Any], name: str) -> dict[str, Any]:
    for node in _plan_nodes(plan):
        if node.get("Subplan Name") == name:
            return node
    raise AssertionError(f"no {name!r} in the plan: the CTE was inlined, not materialized")


def _backlog(engine: Engine, pending: int, delivered: int) -> None:
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO outbox.effects (effect_key, kind, payload) "
            "SELECT 'bp-' || g, 'noop', '{}' FROM generate_series(1, :n) g"), {"n": pending})
        conn.execute(text(
            "INSERT INTO outbox.effects (effect_key, kind, payload, status, delivered_at,"
            " finished_at, attempts) SELECT 'bd-' || g, 'noop', '{}', 'delivered', now(),"
            " now(), 1 FROM generate_series(1, :n) g"), {"n": delivered})
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("ANALYZE outbox.effects"))


@pytest.mark.parametrize("settings", [
    (),
    ("enable_hashjoin = off", "enable_mergejoin = off"),
    ("enable_seqscan = off",),
    ("enable_seqscan = off", "enable_hashjoin = off", "enable_bitmapscan = off"),
], ids=lambda s: ",".join(x.split()[0] for x in s) or "default")
def test_f17_claim_plan_materializes_ctes_and_uses_the_pending_index(
        engine: Engine, settings: tuple[str, ...]) -> None:
    """H11: the CTEs are materialized (evaluated once) and the hot path is an index scan
    over the partial pending index that stops at LIMIT, however large the backlog."""
    _backlog(engine, pending=20_000, delivered=20_000)
    params = {"queue": "default", "limit": 10, "owner": "x", "lease": 30.0, "now": None,
              "token": uuid.uuid4(), "rescue": True, "after_at": None, "after_id": None}

    def explain(conn: Any, how: str) -> list[Any]:  # the statement is psycopg-style
        raw = conn.connection.driver_connection
        return list(raw.execute(f"EXPLAIN ({how}) " + sql._CLAIM.sql, params).fetchall())

    with engine.connect() as conn:
        for s in settings:
            conn.execute(text(f"SET LOCAL {s}"))
        [[doc]] = explain(conn, "FORMAT JSON")
        plan = (json.loads(doc) if isinstance(doc, str) else doc)[0]["Plan"]
        for name in ("CTE rescue", "CTE fresh", "CTE picked"):
            _subplan(plan, name)
        fresh = _subplan(plan, "CTE fresh")
        assert any(n.get("Index Name") == "effects_pending_idx" for n in _plan_nodes(fresh)), \
            json.dumps(fresh, indent=1)
        rescue = _subplan(plan, "CTE rescue")
        assert any(n.get("Index Name") == "effects_in_flight_idx"
                   for n in _plan_nodes(rescue)), json.dumps(rescue, indent=1)
        # Actually run it (then roll back): the index scan reads about LIMIT rows.
        [[doc]] = explain(conn, "ANALYZE, FORMAT JSON")
        conn.rollback()
    plan = (json.loads(doc) if isinstance(doc, str) else doc)[0]["Plan"]
    fresh = _subplan(plan, "CTE fresh")
    scans = [n for n in _plan_nodes(fresh) if n.get("Index Name") == "effects_pending_idx"]
    assert scans and all(n["Actual Rows"] <= 20 for n in scans), json.dumps(fresh, indent=1)
    assert plan["Actual Rows"] == 10  # the UPDATE returned exactly LIMIT rows


PLAN_FORCING = [
    (),
    ("enable_hashjoin = off", "enable_mergejoin = off"),
    ("enable_seqscan = off",),
    ("enable_indexscan = off", "enable_bitmapscan = off"),
    ("enable_nestloop = off", "enable_hashjoin = off"),
    ("enable_material = off", "enable_sort = off", "enable_seqscan = off"),
]


def test_f17_limit_never_exceeded_under_plan_forcing_settings(engine: Engine) -> None:
    """PG bug #15715 shape: 4 concurrent claimers, LIMIT 1 and 10, plans forced every way;
    no call may mark more than LIMIT rows and no row may be claimed twice in a round."""
    rows_per_round = 10_000 if SOAK else 500  # soak: over 10,000 claim calls
    rescue_rows = rows_per_round // 5
    add_effects(engine, keys("f17", rows_per_round))
    worst: dict[int, int] = {1: 0, 10: 0}
    calls = 0
    for settings in PLAN_FORCING:
        with engine.begin() as conn:  # a fifth of the rows in flight with expired leases
            conn.execute(text(
                "UPDATE outbox.effects SET status = 'pending', attempts = 0, lease_owner = NULL,"
                " lease_token = NULL, lease_expires_at = NULL"))
            conn.execute(text(
                "UPDATE outbox.effects SET status = 'in_flight', attempts = 1,"
                " lease_owner = 'dead', lease_token = gen_random_uuid(),"
                " lease_expires_at = now() - interval '1 second'"
                " WHERE id IN (SELECT id FROM outbox.effects ORDER BY random() LIMIT :n)"),
                {"n": rescue_rows})

        def claimer(limit: int, settings: tuple[str, ...] = settings) -> list[list[int]]:
            got: list[list[int]] = []
            while True:
                with engine.begin() as conn:
                    for s in settings:
                        conn.execute(text(f"SET LOCAL {s}"))
                    rows = sql.claim_due(conn, queue="default", limit=limit,
                                         owner=f"t{limit}", lease_seconds=30)
                if not rows:
                    return got
                got.append([r.id for r in rows])

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(claimer, [1, 1, 10, 10]))
        claimed = [ids for per_thread in results for ids in per_thread]
        calls += len(claimed)
        for limit, per_thread in zip([1, 1, 10, 10], results, strict=True):
            for ids in per_thread:
                worst[limit] = max(worst[limit], len(ids))
        flat = [i for ids in claimed for i in ids]
        assert len(flat) == len(set(flat)) == rows_per_round, settings
        with engine.connect() as conn:
            counts = dict(conn.execute(text(
                "SELECT attempts, count(*) FROM outbox.effects GROUP BY attempts")).all())
        assert counts == {1: rows_per_round - rescue_rows, 2: rescue_rows}, settings
    assert worst[1] == 1 and worst[10] <= 10, worst
    print(f"F17: {calls} claim calls, max rows per call {worst}")


# --------------------------------------------------------------------------- fencing


def test_f20_late_record_after_takeover_is_lease_lost_and_changes_nothing(
        engine: Engine) -> None:
    [eid] = add_effects(engine, ["zombie"])
    t0 = db_now(engine)
    [a] = claim(engine, owner="A", lease=5, now=t0)
    t1 = t0 + timedelta(seconds=6)
    [b] = claim(engine, owner="B", lease=5, now=t1)  # A stalled past its lease
    with engine.begin() as conn:
        assert sql.extend_leases(conn, [(eid, a.lease_token)], 5, now=t1) == set()
    before = effect_row(engine, "zombie")
    got = record(engine, [outcome_for(a, "delivered", "delivered", result='{"x": 1}')],
                 worker="A", now=t1)
    assert got == {eid: "lease_lost"}
    after = effect_row(engine, "zombie")
    assert after._asdict() == before._asdict()  # not one column changed
    assert (after.status, after.lease_token, after.lease_owner) == ("in_flight",
                                                                   b.lease_token, "B")
    # The live worker's outcome wins; a second zombie write after that is fenced too.
    assert record(engine, [outcome_for(b, "delivered", "delivered")], worker="B",
                  now=t1) == {eid: "delivered"}
    assert record(engine, [outcome_for(a, "retry", "pending", delay=1.0)],
                  worker="A", now=t1) == {eid: "lease_lost"}
    final = effect_row(engine, "zombie")
    assert (final.status, final.attempts, final.lease_token) == ("delivered", 2, None)
    assert final.result is None and final.last_error is None
    history = [(x.attempt, x.worker, x.outcome) for x in attempts_of(engine, eid)]
    assert sorted(history) == [(1, "A", "lease_lost"), (1, "A", "lease_lost"),
                               (2, "B", "delivered")]


def test_record_outcomes_is_one_statement_per_batch(engine: Engine) -> None:
    ids = add_effects(engine, keys("batch", 50))
    rows = claim(engine, limit=50)
    outcomes = [outcome_for(r, "delivered", "delivered") if r.id % 3 else
                outcome_for(r, "retry", "pending", delay=30.0, error="boom",
                            http_status=503) for r in rows]
    stale = sql.Outcome(effect_id=ids[0], lease_token=uuid.uuid4(), attempt=1,
                        outcome="delivered", next_status="delivered",
                        started_at=datetime.now(UTC))
    with StatementCounter(engine) as counter:
        got = record(engine, [*outcomes, stale])
    assert len(counter.statements) == 1
    delivered = sum(1 for i in ids if i % 3)
    assert sum(1 for v in got.values() if v == "delivered") == delivered
    # The stale write for ids[0] (another token) is fenced although the same batch
    # carries the live outcome for that effect.
    assert outcome_counts(engine) == {"delivered": delivered, "retry": 50 - delivered,
                                      "lease_lost": 1}
    assert status_counts(engine) == {"delivered": delivered, "pending": 50 - delivered}
    with engine.connect() as conn:
        waits = conn.execute(text(
            "SELECT DISTINCT round(extract(epoch FROM e.available_at - a.finished_at))"
            " FROM outbox.effects e JOIN outbox.attempt_history a ON a.effect_id = e.id"
            " WHERE e.status = 'pending'")).scalars().all()
    assert waits == [30]


def test_extend_leases_is_one_statement_and_only_for_our_tokens(engine: Engine) -> None:
    add_effects(engine, keys("ext", 6))
    t0 = db_now(engine)
    rows = claim(engine, limit=6, owner="A", lease=5, now=t0)
    t1 = t0 + timedelta(seconds=6)
    [taken] = claim(engine, limit=1, owner="B", lease=5, now=t1)  # one taken over
    leases = [(r.id, r.lease_token) for r in rows]
    with StatementCounter(engine) as counter, engine.begin() as conn:
        kept = sql.extend_leases(conn, leases, 30, now=t0 + timedelta(seconds=4))
    assert len(counter.statements) == 1
    assert kept == {r.id for r in rows} - {taken.id}
    with engine.connect() as conn:
        expiries = dict(conn.execute(text(
            "SELECT id, lease_expires_at FROM outbox.effects")).all())
    assert {expiries[i] for i in kept} == {t0 + timedelta(seconds=34)}
    assert expiries[taken.id] == t1 + timedelta(seconds=5)


def test_dispatcher_extends_many_leases_in_one_statement(engine: Engine) -> None:
    add_effects(engine, keys("dext", 5), kind="block")
    release = threading.Event()
    reg = Registry()
    reg.register("block", lambda e: release.wait(10) and {"ok": True})
    t0 = db_now(engine)
    clock_now = [t0]
    d = Dispatcher(engine, reg, concurrency=5, lease=0.3, clock=lambda: clock_now[0])
    try:
        assert d.fill() == 5
        time.sleep(0.15)  # lease/3 of wall time: every delivery is due an extension
        clock_now[0] = t0 + timedelta(seconds=0.2)
        with StatementCounter(engine) as counter:
            d.extend_leases()
        assert len(counter.statements) == 1
        with engine.connect() as conn:
            expiries = set(conn.execute(text(
                "SELECT lease_expires_at FROM outbox.effects")).scalars())
        assert expiries == {t0 + timedelta(seconds=0.5)}
        release.set()
        wait_until(lambda: (d.reap(), d.in_flight == 0)[1], 5)
        assert status_counts(engine) == {"delivered": 5}
    finally:
        release.set()
        d.shutdown(0)


def test_f20_in_process_zombie_is_fenced(engine: Engine) -> None:
    """A delivering Dispatcher whose lease was taken over records nothing but lease_lost."""
    [eid] = add_effects(engine, ["zp"], kind="block")
    release = threading.Event()
    reg = Registry()
    reg.register("block", lambda e: release.wait(10) and {"zombie": True})
    t0 = db_now(engine)
    zombie = Dispatcher(engine, reg, concurrency=1, lease=5, clock=lambda: t0,
                        worker_id="zombie")
    try:
        assert zombie.fill() == 1
        [live] = claim(engine, owner="live", lease=5, now=t0 + timedelta(seconds=6))
        record(engine, [outcome_for(live, "delivered", "delivered", result='{"live": 1}')],
               worker="live")
        release.set()
        wait_until(lambda: (zombie.reap(), zombie.in_flight == 0)[1], 5)
    finally:
        release.set()
        zombie.shutdown(0)
    assert zombie.stats.lease_lost == 1
    row = effect_row(engine, "zp")
    assert (row.status, row.attempts, row.result) == ("delivered", 2, {"live": 1})
    assert [(a.worker, a.outcome) for a in attempts_of(engine, eid)] == [
        ("zombie", "lease_lost"), ("live", "delivered")]


# --------------------------------------------------------------------------- policy


def test_policy_decisions() -> None:
    p = RetryPolicy()
    assert p.decide(attempt=1, max_attempts=5, error=PermanentFailure("x")).outcome == "failed"
    d = p.decide(attempt=1, max_attempts=5, error=TransientFailure("x"))
    assert (d.outcome, d.next_status) == ("retry", "pending") and 0 <= d.delay <= 1
    assert 0 <= p.decide(attempt=4, max_attempts=5, error=ValueError()).delay <= 8
    assert p.decide(attempt=5, max_attempts=5, error=TransientFailure("x")) \
        .next_status == "failed"
    assert p.decide(attempt=1, max_attempts=5, error=RetryAfter(7)).delay == 7
    amb = p.decide(attempt=1, max_attempts=5, error=AmbiguousOutcome("t"))
    assert (amb.outcome, amb.next_status) == ("ambiguous", "pending")
    park = p.decide(attempt=1, max_attempts=5, error=AmbiguousOutcome("t"), retry_safe=False)
    assert (park.outcome, park.next_status) == ("ambiguous", "needs_review")
    now = datetime.now(UTC)
    late = p.decide(attempt=1, max_attempts=5, error=RetryAfter(60),
                    retry_until=now + timedelta(seconds=30), now=now)
    assert late.next_status == "failed"
    custom = RetryPolicy(retry=retry_if_exception_type(TransientFailure))
    assert custom.decide(attempt=1, max_attempts=5, error=KeyError()).next_status == "failed"


@pytest.fixture
def psp() -> Iterator[Receiver]:
    with Receiver() as receiver:
        yield receiver


# The HTTP contract tests below run on both handlers (httpx in threads, aiohttp on the
# dispatcher's event loop): one classification, whichever client delivers.
HTTP_HANDLERS: dict[str, Any] = {"httpx": HttpHandler, "aiohttp": AsyncHttpHandler}


@pytest.fixture(params=sorted(HTTP_HANDLERS))
def http_cls(request: pytest.FixtureRequest) -> Any:
    return HTTP_HANDLERS[request.param]


def _http_registry(url: str, timeout: float = 0.5, cls: Any = HttpHandler) -> Registry:
    reg = Registry()
    reg.register("psp.charge", cls(f"{url}/charges", timeout=timeout))
    reg.register("psp.unsafe", cls(f"{url}/charges", timeout=timeout), retry_safe=False)
    reg.register("refused", cls("http://127.0.0.1:9/charges", timeout=timeout))
    return reg


def test_f22_http_classification_table(engine: Engine, psp: Receiver, http_cls: Any) -> None:
    """Each receiver answer -> the attempt's outcome and the effect's next status (F22)."""
    date_in_30s = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    # key: (rule, kind, expected attempt outcome, expected status, expected delay)
    table: dict[str, tuple[dict[str, Any] | None, str, str, str, float | None]] = {
        "s200": ({"mode": "status", "status": 200}, "psp.charge", "delivered", "delivered", None),
        "s201": (None, "psp.charge", "delivered", "delivered", None),
        "s400": ({"mode": "status", "status": 400}, "psp.charge", "failed", "failed", None),
        "s404": ({"mode": "status", "status": 404}, "psp.charge", "failed", "failed", None),
        "s408": ({"mode": "status", "status": 408}, "psp.charge", "retry", "pending", 60),
        "s409": ({"mode": "status", "status": 409}, "psp.charge", "retry", "pending", 60),
        "s422": ({"mode": "status", "status": 422}, "psp.charge", "failed", "failed", None),
        "s425": ({"mode": "status", "status": 425}, "psp.charge", "retry", "pending", 60),
        "s429": ({"mode": "status", "status": 429, "retry_after": "7"}, "psp.charge",
                 "retry", "pending", 7),
        "s429d": ({"mode": "status", "status": 429, "retry_after": date_in_30s},
                  "psp.charge", "retry", "pending", 30),
        "s500": ({"mode": "fail_500"}, "psp.charge", "retry", "pending", 60),
        "s503": ({"mode": "status", "status": 503}, "psp.charge", "retry", "pending", 60),
        "s503ra": ({"mode": "status", "status": 503, "retry_after": "5"}, "psp.charge",
                   "retry", "pending", 5),
        "apply500": ({"mode": "apply_then_500"}, "psp.charge", "retry", "pending", 60),
        "timeout": ({"mode": "apply_then_timeout", "delay": 3}, "psp.charge", "ambiguous",
                    "pending", 60),
        "reset": ({"mode": "reset"}, "psp.charge", "ambiguous", "pending", 60),
        "refused": (None, "refused", "retry", "pending", 60),
        "unsafe-timeout": ({"mode": "apply_then_timeout", "delay": 3}, "psp.unsafe",
                           "ambiguous", "needs_review", None),
        "unsafe-ok": (None, "psp.unsafe", "delivered", "delivered", None),
    }
    for key, (rule, kind, *_rest) in table.items():
        if rule is not None:
            psp.set_mode(rule.pop("mode"), key=key, **rule)
        add_effects(engine, [key], kind=kind, payload=lambda i, k: {"amount": i})
    d = Dispatcher(engine, _http_registry(psp.url, cls=http_cls), concurrency=32,
                   policy=NO_WAIT)
    drain_then_shut_down(d, 10)
    got: dict[str, tuple[str, str, float | None]] = {}
    with engine.connect() as conn:
        for r in conn.execute(text(
                "SELECT e.effect_key, e.status, a.outcome, a.http_status,"
                " CASE WHEN e.status = 'pending'"
                "      THEN extract(epoch FROM e.available_at - a.finished_at) END AS delay"
                " FROM outbox.effects e JOIN outbox.attempt_history a ON a.effect_id = e.id")):
            got[r.effect_key] = (r.outcome, r.status,
                                 None if r.delay is None else round(float(r.delay)))
    expected = {k: (v[2], v[3], v[4]) for k, v in table.items()}
    # An HTTP date has one-second resolution, and it was computed before the drain
    # began (seconds earlier on a loaded box): accept 25-30 s.
    if 25 <= (got.get("s429d", (None, None, 0))[2] or 0) <= 29:
        got["s429d"] = (got["s429d"][0], got["s429d"][1], 30)
    assert got == expected
    with engine.connect() as conn:
        statuses = dict(conn.execute(text(
            "SELECT e.effect_key, a.http_status FROM outbox.effects e"
            " JOIN outbox.attempt_history a ON a.effect_id = e.id")).all())
    assert statuses["s429"] == 429 and statuses["s422"] == 422 and statuses["s500"] == 500
    assert statuses["timeout"] is None and statuses["refused"] is None
    # The receiver saw every key exactly once, each with its effect key.
    assert psp.stats()["deliveries"] == len(table) - 1  # "refused" never arrived


def test_f21_ambiguous_outcome_is_retried_with_the_same_key_and_replayed(
        engine: Engine, psp: Receiver, http_cls: Any) -> None:
    for key, mode in (("amb-timeout", "apply_then_timeout"), ("amb-500", "apply_then_500"),
                      ("amb-reset", "reset")):
        psp.set_mode(mode, key=key, times=1, **({"delay": 3} if mode != "reset" else {}))
    add_effects(engine, ["amb-timeout", "amb-500", "amb-reset"], kind="psp.charge")
    t0 = db_now(engine)
    clock = [t0 + timedelta(seconds=1)]
    d = Dispatcher(engine, _http_registry(psp.url, cls=http_cls), concurrency=8,
                   policy=NO_WAIT, clock=lambda: clock[0])
    try:
        d.drain(budget=10)
        assert status_counts(engine) == {"pending": 3}
        clock[0] += timedelta(seconds=61)
        d.drain(budget=10)
    finally:
        d.shutdown(0)
    assert status_counts(engine) == {"delivered": 3}
    ledger = psp.ledger()
    per_key = {k["key"]: (k["deliveries"], k["applied"]) for k in ledger["keys"]}
    assert per_key == {k: (2, 1) for k in ("amb-timeout", "amb-500", "amb-reset")}
    attempts_sent = sorted((x["key"], x["attempt"]) for x in ledger["deliveries"])
    assert attempts_sent == sorted((k, n) for k in per_key for n in ("1", "2"))
    psp.assert_exactly_once(per_key)


def test_f23_exhausted_attempts_fail_with_the_error_history(engine: Engine,
                                                            psp: Receiver) -> None:
    psp.set_mode("fail_500", key="poison")
    [eid] = add_effects(engine, ["poison"], kind="psp.charge", max_attempts=3)
    add_effects(engine, keys("fine", 20), kind="psp.charge")
    t0 = db_now(engine)
    clock = [t0]
    d = Dispatcher(engine, _http_registry(psp.url), concurrency=8,
                   policy=RetryPolicy(wait=wait_fixed(10)), clock=lambda: clock[0])
    try:
        for _ in range(4):  # one more round than attempts: nothing left to do then
            d.drain(budget=10)
            clock[0] += timedelta(seconds=11)
    finally:
        d.shutdown(0)
    row = effect_row(engine, "poison")
    assert (row.status, row.attempts) == ("failed", 3)
    assert row.last_error.startswith("TransientFailure: HTTP 500")
    history = attempts_of(engine, eid)
    assert [(a.attempt, a.outcome, a.http_status) for a in history] == [
        (1, "retry", 500), (2, "retry", 500), (3, "failed", 500)]
    assert all(a.error.startswith("TransientFailure: HTTP 500") for a in history)
    assert status_counts(engine) == {"delivered": 20, "failed": 1}
    assert psp.ledger("poison")["keys"][0]["deliveries"] == 3
    psp.assert_exactly_once(keys("fine", 20))


def test_retry_until_stops_retries_by_the_dispatcher_clock(engine: Engine,
                                                           psp: Receiver) -> None:
    """F24 shape: retry_for bounds the retries; the decision uses the injected clock."""
    psp.set_mode("fail_500", key="horizon")
    [eid] = add_effects(engine, ["horizon"], kind="psp.charge", retry_for=30)
    t0 = db_now(engine)
    clock = [t0]
    d = Dispatcher(engine, _http_registry(psp.url), concurrency=2,
                   policy=RetryPolicy(wait=wait_fixed(10)), clock=lambda: clock[0])
    try:
        for _ in range(6):
            d.drain(budget=10)
            clock[0] += timedelta(seconds=11)
    finally:
        d.shutdown(0)
    history = [a.outcome for a in attempts_of(engine, eid)]
    # attempts at t0, +11, +22; the third would wait until +32 >= retry_until (+30).
    assert history == ["retry", "retry", "failed"]
    assert effect_row(engine, "horizon").status == "failed"


def _forgetting_receiver_retry(engine: Engine, psp: Receiver, key: str,
                               registry: Registry) -> tuple[int, int]:
    """F24's setting: the first attempt is applied by the receiver, which answers 500;
    the receiver then forgets the key (its retention passes, in wall time) and the
    dispatcher's clock is 2 h later when the retry is due. (deliveries, applications)
    the receiver counted for the key."""
    psp.set_mode("apply_then_500", key=key, times=1)
    psp.set_mode("forget", older_than=0.5)
    add_effects(engine, [key], kind="psp.charge")
    clock = [db_now(engine) + timedelta(seconds=1)]
    d = Dispatcher(engine, registry, concurrency=2, policy=RetryPolicy(wait=wait_fixed(60)),
                   clock=lambda: clock[0])
    try:
        d.drain(budget=10)
        assert effect_row(engine, key).status == "pending"
        time.sleep(0.7)  # the receiver's retention passes: it forgets the key
        clock[0] += timedelta(hours=2)
        d.drain(budget=10)
    finally:
        d.shutdown(0)
    [entry] = psp.ledger(key)["keys"]
    return int(entry["deliveries"]), int(entry["applied"])


def test_f24_a_retry_after_the_receiver_forgot_the_key_applies_twice_without_the_horizon(
        engine: Engine, psp: Receiver) -> None:
    """The hazard itself, so the next test means something: a receiver that forgot the
    key takes the retry for a new request and applies the charge a second time."""
    assert _forgetting_receiver_retry(engine, psp, "f24-open", _http_registry(psp.url)) \
        == (2, 2)
    assert effect_row(engine, "f24-open").status == "delivered"


def _retained_registry(psp: Receiver, seconds: float) -> Registry:
    registry = _http_registry(psp.url)
    registry.register("psp.charge", HttpHandler(f"{psp.url}/charges", timeout=0.5),
                      key_retention=seconds)
    return registry


def test_f24_no_retry_is_sent_past_the_receivers_key_retention(
        engine: Engine, psp: Receiver) -> None:
    """With the receiver's key retention declared (1 h), the retry due 2 h after the
    first attempt is not sent: the effect is parked for review with the reason, applied
    once, and the attempt says so. `outbox retry` by id (an operator looked) sends it as
    a first contact."""
    registry = _retained_registry(psp, 3600)
    assert _forgetting_receiver_retry(engine, psp, "f24-held", registry) == (1, 1)
    row = effect_row(engine, "f24-held")
    assert (row.status, row.attempts) == ("needs_review", 2)
    assert row.last_error.startswith("KeyRetentionPassed: not sent: attempt 2")
    history = attempts_of(engine, row.id)
    assert [(a.attempt, a.outcome, a.http_status) for a in history] == [
        (1, "retry", 500), (2, "failed", None)]
    with engine.begin() as conn:
        assert requeue(conn, [row.id]) == [row.id]
    d = Dispatcher(engine, registry, concurrency=1, policy=NO_WAIT)
    drain_then_shut_down(d, 10)
    assert effect_row(engine, "f24-held").status == "delivered"
    [entry] = psp.ledger("f24-held")["keys"]
    assert (entry["deliveries"], entry["applied"]) == (2, 2)  # the operator's choice


def _dead_letter_requeued_2h_later(engine: Engine, psp: Receiver, key: str,
                                   requeue_it: Callable[[Connection, int], list[int]]
                                   ) -> Any:
    """A psp.charge whose one allowed attempt failed (its receiver keeps keys 1 h),
    requeued by `requeue_it` 2 h later and drained again: its row."""
    psp.set_mode("fail_500", key=key)
    [eid] = add_effects(engine, [key], kind="psp.charge", max_attempts=1)
    clock = [db_now(engine) + timedelta(seconds=1)]
    d = Dispatcher(engine, _retained_registry(psp, 3600), concurrency=1, policy=NO_WAIT,
                   clock=lambda: clock[0])
    try:
        d.drain(budget=10)
        assert effect_row(engine, key).status == "failed"
        clock[0] += timedelta(hours=2)
        with engine.begin() as conn:
            assert requeue_it(conn, eid) == [eid]
        d.drain(budget=10)
    finally:
        d.shutdown(0)
    return effect_row(engine, key)


def test_f24_a_bulk_redrive_past_the_key_retention_sends_nothing(
        engine: Engine, psp: Receiver) -> None:
    """A dead letter of a kind with a key retention, redriven in bulk (`outbox retry
    --failed`, the console's redrive) after the retention has passed: its first claim is
    kept, so the next attempt is refused, not sent blind, and the effect is parked."""
    row = _dead_letter_requeued_2h_later(
        engine, psp, "f24-dead", lambda conn, eid: requeue(conn, [], all_failed=True))
    assert (row.status, row.attempts) == ("needs_review", 1)
    assert row.last_error.startswith("KeyRetentionPassed")
    assert psp.ledger("f24-dead")["keys"][0]["deliveries"] == 1  # the first only


def test_f24_a_dead_letter_retried_by_id_keeps_its_first_claim(
        engine: Engine, psp: Receiver) -> None:
    """A dead letter (here: its one allowed attempt failed) retried by id 2 h later keeps
    its first claim: only an effect parked because its retention had passed is sent as
    a first contact by `outbox retry <id>`; this one is refused and parked, unsent."""
    row = _dead_letter_requeued_2h_later(
        engine, psp, "f24-by-id", lambda conn, eid: requeue(conn, [eid]))
    assert (row.status, row.attempts) == ("needs_review", 1)
    assert row.last_error.startswith("KeyRetentionPassed")
    assert psp.ledger("f24-by-id")["keys"][0]["deliveries"] == 1


def test_a_row_attempted_without_a_first_claim_counts_from_its_creation(
        engine: Engine) -> None:
    """A row a worker of the previous release attempted (no first_claimed_at) gets its
    creation at its next claim, never that claim's time; a fresh row gets the claim's."""
    [tried, fresh] = add_effects(engine, ["attempted-before", "fresh"])
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox.effects SET attempts = 1 WHERE id = :i"),
                     {"i": tried})
    later = db_now(engine) + timedelta(minutes=5)
    rows = {r.id: r for r in claim(engine, owner="w", now=later)}
    assert rows[tried].first_claimed_at == rows[tried].created_at
    assert rows[fresh].first_claimed_at == later


def test_f24_no_retry_is_scheduled_past_the_receivers_key_retention(
        engine: Engine, psp: Receiver) -> None:
    """A retry whose wait would end past 90 % of the key retention (540 s of 600) is
    never scheduled: the failing first attempt dead-letters the effect at once, while
    one whose wait ends before is scheduled. The retention counts from the first claim:
    an effect enqueued with a long delay keeps its retries."""
    psp.set_mode("fail_500", key_prefix="f24-")
    registry = _retained_registry(psp, 600)
    add_effects(engine, ["f24-late"], kind="psp.charge")
    add_effects(engine, ["f24-delayed"], kind="psp.charge", delay=3600)
    clock = [db_now(engine)]
    late = Dispatcher(engine, registry, concurrency=2,
                      policy=RetryPolicy(wait=wait_fixed(560)), clock=lambda: clock[0])
    try:
        late.drain(budget=10)  # f24-late: a retry 560 s later would pass 540 s
    finally:
        late.shutdown(0)
    clock[0] += timedelta(seconds=3601)  # f24-delayed falls due, an hour after creation
    soon = Dispatcher(engine, registry, concurrency=2,
                      policy=RetryPolicy(wait=wait_fixed(60)), clock=lambda: clock[0])
    drain_then_shut_down(soon, 10)
    late_row, delayed = effect_row(engine, "f24-late"), effect_row(engine, "f24-delayed")
    assert (late_row.status, late_row.attempts) == ("failed", 1)
    assert late_row.last_error.startswith("TransientFailure: HTTP 500")
    assert (delayed.status, delayed.attempts) == ("pending", 1)  # retried in 60 s


def test_f24_a_lost_lease_redelivered_past_the_key_retention_is_not_sent(
        engine: Engine, psp: Receiver) -> None:
    """A worker died mid-delivery (the receiver may have applied it); its lease is
    rescued 2 h later, past the receiver's key retention (1 h): not sent, parked."""
    add_effects(engine, ["f24-rescued"], kind="psp.charge")
    t0 = db_now(engine)
    assert len(claim(engine, owner="died", lease=5, now=t0)) == 1
    clock = [t0 + timedelta(hours=2)]
    d = Dispatcher(engine, _retained_registry(psp, 3600), concurrency=1, policy=NO_WAIT,
                   clock=lambda: clock[0])
    drain_then_shut_down(d, 10)
    _parked_unsent(engine, psp, "f24-rescued", attempts=2)


def _parked_unsent(engine: Engine, psp: Receiver, key: str, attempts: int) -> None:
    """Past the key retention: parked for review, and nothing reached the receiver."""
    row = effect_row(engine, key)
    assert (row.status, row.attempts) == ("needs_review", attempts)
    assert row.last_error.startswith("KeyRetentionPassed")
    assert psp.ledger(key)["keys"] == []


@pytest.fixture
def slept(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """How long the host has slept, in seconds ([0], 0 at first; a test adds to it):
    dispatcher._clock counts it, as the database's clock would; time.monotonic() not."""
    from dispatcher import _clock

    asleep = [0.0]
    awake = _clock.now
    monkeypatch.setattr(_clock, "now", lambda: awake() + asleep[0])
    return asleep


def _sleeping_after_the_claim(slept: list[float], seconds: float, deadlines: list[float],
                              *, claims: int | None = None,
                              meanwhile: Callable[[Any], None] | None = None
                              ) -> type[Dispatcher]:
    """A Dispatcher whose host sleeps `seconds` between each claim (the first `claims`
    only, if given) and its handler's start; the attempt's deadline (Executor.deadline)
    of each goes to `deadlines`. `meanwhile(row)` runs during each sleep: what the rest
    of the world did while this host was suspended."""
    left = [claims]

    class SleepsAfterTheClaim(Dispatcher):
        def _deliver(self, row: Any, started: float) -> Any:
            if left[0] is None or left[0] > 0:
                slept[0] += seconds
                left[0] = None if left[0] is None else left[0] - 1
                if meanwhile is not None:
                    meanwhile(row)
            deadlines.append(self.executor.deadline(started))
            return super()._deliver(row, started)

    return SleepsAfterTheClaim


def test_f24_a_host_that_slept_after_the_first_claim_sends_it_as_a_first_contact(
        engine: Engine, psp: Receiver, slept: list[float]) -> None:
    """The host is suspended for 2 h between the effect's first claim and its first
    attempt (a laptop lid, a paused VM): the database's clock ran on, the monotonic one
    did not. The attempt is dated on dispatcher._clock, which counts the sleep
    (CLOCK_BOOTTIME), so it is past the receiver's key retention (1 h): not sent. Dated
    by time.monotonic() it was 'one second after the claim', and sent. No other worker
    claimed the effect meanwhile (the record's lease token still matched), so nobody
    sent it: the attempt is recorded as not made, its count given back and its first
    contact cleared, and the next claim sends it as a first contact. Applied once;
    before, it was parked for an operator to check a send that never happened."""
    from dispatcher import _clock

    [effect_id] = add_effects(engine, ["f24-slept"], kind="psp.charge")
    seen: list[float] = []
    first: list[Any] = []
    d = _sleeping_after_the_claim(slept, 2 * 3600, seen, claims=1, meanwhile=first.append)(
        engine, _retained_registry(psp, 3600), concurrency=1, policy=NO_WAIT)
    drain_then_shut_down(d, 10)
    row = effect_row(engine, "f24-slept")
    assert (row.status, row.attempts) == ("delivered", 1)
    assert [(k["deliveries"], k["applied"]) for k in psp.ledger("f24-slept")["keys"]] == [
        (1, 1)]
    history = {a.outcome: a for a in attempts_of(engine, effect_id)}
    assert sorted((a.attempt, o) for o, a in history.items()) == [
        (1, "delivered"), (1, "retry")]
    assert history["retry"].error.startswith(
        "FirstAttemptTooLate: not sent: the first attempt would reach the receiver 7200 s")
    # The key's retention counts from the second claim, the first contact, not the first.
    assert row.first_claimed_at > first[0].first_claimed_at
    # The handler's deadline stays on the monotonic clock (asyncio's, and what
    # EffectContext documents): past, after the sleep.
    assert _clock.to_monotonic(seen[0]) < time.monotonic()


def test_f24_a_host_that_slept_while_another_worker_took_the_effect_gives_nothing_back(
        engine: Engine, psp: Receiver, slept: list[float]) -> None:
    """As above, but while this host slept its lease ran out and another worker claimed
    the effect (its second attempt, in flight there). This host sends nothing, and its
    record is fenced by the lease token it no longer holds: `lease_lost`, the other
    worker's attempt count and first contact left as they are (an unfenced "not
    made" would have handed out an attempt and restarted the key's retention under
    a delivery that may reach the receiver)."""
    [effect_id] = add_effects(engine, ["f24-taken"], kind="psp.charge")
    first: list[Any] = []

    def taken_meanwhile(row: Any) -> None:
        first.append(row)
        later = row.lease_expires_at + timedelta(hours=1)
        assert [r.id for r in claim(engine, owner="other", lease=3600, now=later)] == [
            effect_id]

    d = _sleeping_after_the_claim(slept, 2 * 3600, [], claims=1,
                                  meanwhile=taken_meanwhile)(
        engine, _retained_registry(psp, 3600), concurrency=1, policy=NO_WAIT)
    drain_then_shut_down(d, 3)
    row = effect_row(engine, "f24-taken")
    assert (row.status, row.attempts, row.lease_owner) == ("in_flight", 2, "other")
    history = attempts_of(engine, effect_id)
    assert [(a.attempt, a.outcome) for a in history] == [(1, "lease_lost")]
    assert row.first_claimed_at == first[0].first_claimed_at  # the first claim's, kept
    assert psp.ledger("f24-taken")["keys"] == []


def test_f24_a_key_retention_too_short_for_any_first_attempt_parks_it(
        engine: Engine, psp: Receiver) -> None:
    """No sleep, but a key retention shorter than the time any attempt takes to start
    (1 µs, against a lease of 30 s): the first attempt is past the horizon every
    time. It is parked, counted, as any refusal; handed back as not made, it would be
    claimed and handed back again at once, forever (reviewed)."""
    add_effects(engine, ["f24-short"], kind="psp.charge")
    d = Dispatcher(engine, _retained_registry(psp, 1e-6), concurrency=1, policy=NO_WAIT)
    drain_then_shut_down(d, 5)
    _parked_unsent(engine, psp, "f24-short", attempts=1)
    assert "is shorter than the lease (30 s)" in effect_row(engine, "f24-short").last_error


def test_f24_a_handler_cannot_hand_its_attempt_back(engine: Engine) -> None:
    """Only the dispatcher's own refusal makes an attempt 'not made'. A handler that
    raises FirstAttemptTooLate itself (after sending, say) is a KeyRetentionPassed like
    any other: parked, the attempt counted, the first contact kept. Handed back, the
    key's retention would restart under a send that happened (reviewed)."""
    from outbox.errors import FirstAttemptTooLate

    registry = Registry()

    def sends_then_lies(effect: EffectContext) -> None:
        raise FirstAttemptTooLate("sent, then claims it was not")

    registry.register("liar", sends_then_lies, key_retention=3600)
    add_effects(engine, ["f24-liar"], kind="liar")
    d = Dispatcher(engine, registry, concurrency=1, policy=NO_WAIT)
    drain_then_shut_down(d, 5)
    row = effect_row(engine, "f24-liar")
    assert (row.status, row.attempts) == ("needs_review", 1)
    assert row.first_claimed_at is not None
    # Parked past its key retention all the same: `outbox retry` by id (the operator's
    # override, after checking with the receiver) sends it as a first contact.
    with engine.begin() as conn:
        assert requeue(conn, [row.id]) == [row.id]
    assert effect_row(engine, "f24-liar").first_claimed_at is None


def test_the_claim_clock_counts_what_monotonic_counts_when_awake(slept: list[float]
                                                                 ) -> None:
    """Awake, dispatcher._clock advances as time.monotonic() does, and on Linux it is
    CLOCK_BOOTTIME. `to_monotonic` takes off what the host slept: a stamp one second
    ahead is one second ahead on the monotonic clock, before a sleep and after one."""
    import sys

    from dispatcher import _clock

    a, m = _clock.now(), time.monotonic()
    time.sleep(0.05)
    b, n = _clock.now(), time.monotonic()
    assert abs((b - a) - (n - m)) < 0.02
    assert abs(_clock.to_monotonic(b + 1.0) - (n + 1.0)) < 0.02
    if sys.platform == "linux":
        assert _clock._COUNTS_SLEEP == time.CLOCK_BOOTTIME
    slept[0] = 3600.0  # an hour since b
    assert abs(_clock.to_monotonic(b + 1.0) - (time.monotonic() - 3600.0 + 1.0)) < 0.02


def test_a_host_that_slept_during_an_attempt_keeps_its_lease_to_the_handlers_deadline(
        engine: Engine, slept: list[float]) -> None:
    """The host sleeps 2 s while a handler runs (lease 3 s: the handler is held to 2.4 s
    of monotonic time, which the sleep pushed 2 s later in real time). The lease is
    still extended to cover that deadline: the extension is capped on the clock the
    handler is held to, not on the one that counted the sleep (reviewed: capped on the
    boot clock, the lease ran out while the handler could still send)."""

    add_effects(engine, ["slept-mid"], kind="block")
    release, running = threading.Event(), threading.Event()
    reg = Registry()
    reg.register("block", lambda e: (running.set(), release.wait(10))[1] and {"ok": True})
    t0 = db_now(engine)
    clock_now = [t0]
    d = Dispatcher(engine, reg, concurrency=1, lease=3, clock=lambda: clock_now[0])
    try:
        assert d.fill() == 1
        assert running.wait(5)
        slept[0] = 2.0
        time.sleep(1.1)
        clock_now[0] = t0 + timedelta(seconds=3.1)  # the database's: 1.1 s awake + 2 asleep
        d.extend_leases(force=True)
        with engine.connect() as conn:
            expires = conn.execute(text("SELECT lease_expires_at FROM outbox.effects"
                                        " WHERE effect_key = 'slept-mid'")).scalar_one()
        # The handler may run until ~1.3 s of awake time from now: kept to that + 1 s.
        assert t0 + timedelta(seconds=5) < expires <= t0 + timedelta(seconds=5.6)
        release.set()
        wait_until(lambda: (d.reap(), d.in_flight == 0)[1], 5)
        assert effect_row(engine, "slept-mid").status == "delivered"
    finally:
        release.set()
        d.shutdown(0)


def test_a_handler_is_held_to_a_monotonic_deadline_after_the_host_slept(
        engine: Engine, slept: list[float]) -> None:
    """A host that slept 5 s between the claim and the handler's start (lease 30 s, no
    key retention): the handler gets its deadline on time.monotonic()'s scale, the
    sleep taken off (24 s after the claim by the clock that counts it, so 19 s from
    now), not a stamp of the sleep-counting clock, which on Linux is off by the
    host's whole suspended time."""

    add_effects(engine, ["slept-first"], kind="seen")
    left: list[float] = []
    reg = Registry()
    reg.register("seen", lambda e: left.append(e.deadline - time.monotonic()) or {"ok": 1})
    d = _sleeping_after_the_claim(slept, 5.0, [])(engine, reg, concurrency=1, lease=30,
                                                  policy=NO_WAIT)
    drain_then_shut_down(d, 10)
    assert effect_row(engine, "slept-first").status == "delivered"
    assert 18.0 < left[0] <= 19.0


def test_the_default_policys_retry_horizon_is_13_hours_or_24_with_retry_after(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """README (F24): without `key_retention`, the default policy's waits between its 25
    attempts add up to 13.1 h even if each draws its maximum; a receiver that answers
    every attempt with a Retry-After of an hour or more stretches them to 24 h (each
    capped at `max_wait`, 1 h): a 24 h key retention is reached. Hence key_retention."""
    import random

    from outbox._config import DEFAULT_MAX_ATTEMPTS

    monkeypatch.setattr(random, "uniform", lambda low, high: high)  # every wait its max
    policy = RetryPolicy()

    def horizon(error: Exception) -> float:
        total = 0.0
        for attempt in range(1, DEFAULT_MAX_ATTEMPTS + 1):
            decision = policy.decide(attempt=attempt, max_attempts=DEFAULT_MAX_ATTEMPTS,
                                     error=error)
            if attempt == DEFAULT_MAX_ATTEMPTS:
                assert decision.next_status == "failed"
            else:
                total += decision.delay
        return total

    assert horizon(TransientFailure("HTTP 503")) == (2**12 - 1) + 12 * 3600 == 47_295
    assert horizon(RetryAfter(10**9)) == 24 * 3600


def test_a_retry_after_date_is_measured_against_the_replys_date_not_our_clock() -> None:
    """F32: an HTTP-date Retry-After is the receiver's clock; so is its `Date`. A reply
    from 2015 asking for 30 s means 30 s, whatever this host's clock says; without a
    usable `Date` the host's clock is all there is."""
    from dispatcher.handlers import _retry_after_seconds

    later, now = "Wed, 21 Oct 2015 07:28:30 GMT", "Wed, 21 Oct 2015 07:28:00 GMT"
    assert _retry_after_seconds(later, now) == 30.0
    assert _retry_after_seconds(later, None) == 0.0  # long past by this host's clock
    assert _retry_after_seconds(later, "not a date") == 0.0
    assert _retry_after_seconds("12", now) == 12.0


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), True, "3600"])
def test_key_retention_must_be_a_positive_number(bad: Any) -> None:
    with pytest.raises(ValueError, match="key_retention"):
        Registry().register("x", lambda effect: None, key_retention=bad)


def test_expired_lease_past_retry_until_is_dead_lettered_not_rescued(engine: Engine) -> None:
    add_effects(engine, ["horizon2"], retry_for=10)
    t0 = db_now(engine)
    claim(engine, owner="dead", lease=5, now=t0)
    later = t0 + timedelta(seconds=11)
    assert claim(engine, owner="B", now=later) == []
    with engine.begin() as conn:
        assert len(sql.fail_exhausted_leases(conn, now=later)) == 1
    assert effect_row(engine, "horizon2").status == "failed"


def test_unknown_kind_is_retried_not_dropped(engine: Engine) -> None:
    [eid] = add_effects(engine, ["mystery"], kind="no.such.kind")
    d = Dispatcher(engine, Registry(), concurrency=1, policy=NO_WAIT)
    drain_then_shut_down(d, 5)
    row = effect_row(engine, "mystery")
    assert (row.status, row.attempts) == ("pending", 1)
    [a] = attempts_of(engine, eid)
    assert a.outcome == "retry" and "no handler registered" in a.error


# --------------------------------------------------------------------------- F31


def test_f31_claim_takes_only_the_head_of_each_ordering_key(engine: Engine) -> None:
    a = add_effects(engine, keys("A", 3), ordering_key=lambda i, k: "A")
    b = add_effects(engine, keys("B", 3), ordering_key=lambda i, k: "B")
    [u] = add_effects(engine, ["U"])
    t0 = db_now(engine)
    heads = claim(engine, limit=10, now=t0)
    assert sorted(r.id for r in heads) == [a[0], b[0], u]
    assert claim(engine, limit=10, now=t0) == []  # one in flight per key
    by_id = {r.id: r for r in heads}
    record(engine, [outcome_for(by_id[a[0]], "retry", "pending", delay=60.0),
                    outcome_for(by_id[b[0]], "delivered", "delivered"),
                    outcome_for(by_id[u], "delivered", "delivered")], now=t0)
    [nxt] = claim(engine, limit=10, now=t0)  # A's head waits for its retry: A is blocked
    assert nxt.id == b[1]
    record(engine, [outcome_for(nxt, "delivered", "delivered")], now=t0)
    later = t0 + timedelta(seconds=61)
    got = claim(engine, limit=10, now=later)
    assert sorted(r.id for r in got) == [a[0], b[2]]
    by_id = {r.id: r for r in got}
    # A's head is dead-lettered: A stays blocked (visible to operators), B is unaffected.
    record(engine, [outcome_for(by_id[a[0]], "failed", "failed", error="HTTP 422"),
                    outcome_for(by_id[b[2]], "delivered", "delivered")], now=later)
    assert claim(engine, limit=10, now=later) == []
    with engine.begin() as conn:  # the operator cancels the dead head: A flows again
        conn.execute(text("UPDATE outbox.effects SET status = 'cancelled' WHERE id = :i"),
                     {"i": a[0]})
    assert [r.id for r in claim(engine, limit=10, now=later)] == [a[1]]


def test_f31_failing_head_blocks_only_its_key_through_the_dispatcher(
        engine: Engine, psp: Receiver) -> None:
    psp.set_mode("fail_500", key="K1-000000")
    for name in ("K1", "K2", "K3"):
        add_effects(engine, keys(name, 5), kind="psp.charge",
                    payload=lambda i, k: {"ordering_key": k[:2], "seq": i},
                    ordering_key=lambda i, k: k[:2])
    d = Dispatcher(engine, _http_registry(psp.url), concurrency=8, policy=NO_WAIT)
    try:
        for _ in range(3):
            d.drain(budget=10)
    finally:
        d.shutdown(0)
    ordering = psp.ledger()["ordering"]
    assert ordering == {"K2": [0, 1, 2, 3, 4], "K3": [0, 1, 2, 3, 4]}
    with engine.connect() as conn:
        k1 = conn.execute(text(
            "SELECT status, attempts FROM outbox.effects WHERE ordering_key = 'K1'"
            " ORDER BY id")).all()
    assert [tuple(r) for r in k1] == [("pending", 1)] + [("pending", 0)] * 4


# --------------------------------------------------------------------------- clock, loop


def test_injected_clock_expires_a_crashed_workers_lease(engine: Engine) -> None:
    [eid] = add_effects(engine, ["crashed"])
    t0 = db_now(engine)
    claim(engine, owner="crashed-worker", lease=30, now=t0)  # then it died
    early = Dispatcher(engine, _noop_registry(), lease=30,
                       clock=lambda: t0 + timedelta(seconds=29))
    late = Dispatcher(engine, _noop_registry(), lease=30,
                      clock=lambda: t0 + timedelta(seconds=31))
    try:
        early.drain(budget=2)
        assert early.stats.claimed == 0
        late.drain(budget=2)
        assert late.stats.claimed == 1
    finally:
        early.shutdown(0)
        late.shutdown(0)
    row = effect_row(engine, "crashed")
    assert (row.status, row.attempts) == ("delivered", 2)
    assert [a.outcome for a in attempts_of(engine, eid)] == ["delivered"]


def _noop_registry() -> Registry:
    reg = Registry()
    reg.register("noop", lambda e: {"ok": e.key})
    return reg


def test_outcomes_the_database_did_not_take_are_kept_and_written_when_it_answers(
        engine: Engine) -> None:
    """A record that failed for db_retry's whole budget (a failover, a partition) used to
    drop its batch: every effect in it was delivered again once its lease expired, and
    one on its last attempt was dead-lettered (`failed`) although it had been delivered.
    A lost connection now keeps the outcomes, first in line, for the next write (until
    the lease). Dropped as before: a statement that may fail every time (a statement
    timeout, a refused value), and any failure of the final write (shutdown)."""
    from sqlalchemy.exc import DataError

    add_effects(engine, ["kept-1", "kept-2"], kind="noop", max_attempts=1)
    add_effects(engine, ["timed-out", "refused", "at-shutdown"], kind="noop")
    d = Dispatcher(engine, _noop_registry(), concurrency=8)
    real = d.completer._record
    lost = OperationalError("record", {}, psycopg.OperationalError("server closed the "
                                                                   "connection"))
    failures: list[BaseException] = [
        lost,
        OperationalError("record", {}, psycopg.errors.QueryCanceled("statement timeout")),
        DataError("record", {}, psycopg.errors.InvalidTextRepresentation("bad input")),
        lost,
    ]

    def flaky(batch: list[sql.Outcome]) -> dict[int, str]:
        if failures:
            raise failures.pop(0)
        return real(batch)

    d.completer._record = flaky  # type: ignore[method-assign]
    by_key = {}
    try:
        assert d.fill() == 5
        wait_until(lambda: len(d._done) == 5, 5)
        by_key = {effect_row(engine, k).id: k for k in
                  ("kept-1", "kept-2", "timed-out", "refused", "at-shutdown")}
        outcomes = {by_key[o.effect_id]: o for o in d._done}
        completer = d.completer  # (flush swaps its `pending` list: set it each time)
        completer.pending = [outcomes["kept-1"], outcomes["kept-2"]]
        assert d.flush() == {} and len(d._done) == 2  # a lost connection: kept
        kept = completer.pending
        for key in ("timed-out", "refused"):  # may fail every time: dropped
            completer.pending = [outcomes[key]]
            assert d.flush() == {} and d._done == []
        completer.pending = [outcomes["at-shutdown"]]
        assert completer.flush(final=True) == {} and d._done == []  # the last write
        completer.pending = kept
    finally:
        d.shutdown(0)
    # The kept ones were written by the shutdown's flush, each once, as delivered.
    for key in ("kept-1", "kept-2"):
        row = effect_row(engine, key)
        assert (row.status, row.attempts) == ("delivered", 1), key
        assert [a.outcome for a in attempts_of(engine, row.id)] == ["delivered"]
    for key in ("timed-out", "refused", "at-shutdown"):  # their leases will expire
        assert effect_row(engine, key).status == "in_flight", key


def test_run_survives_database_errors_while_claiming(engine: Engine,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """F25/F26: a claim that fails (server gone, connection killed) must not kill the loop."""
    add_effects(engine, keys("dberr", 10))
    d = Dispatcher(engine, _noop_registry(), concurrency=4)
    real = d._claim
    failures = [3]

    def flaky(limit: int) -> list[Any]:
        if failures[0] > 0:
            failures[0] -= 1
            raise OperationalError("claim", {}, Exception("terminating connection"))
        return real(limit)

    monkeypatch.setattr(d, "_claim", flaky)
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            d.run(stop, poll_interval=0.05, grace=1)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    try:
        wait_until(lambda: status_counts(engine) == {"delivered": 10} or errors, 10)
    finally:
        stop.set()
        t.join(5)
    assert errors == [] and failures == [0]
    assert status_counts(engine) == {"delivered": 10}


def test_shutdown_releases_unfinished_deliveries_for_immediate_redelivery(
        engine: Engine) -> None:
    """F30 in-process: after `grace`, in-flight effects go back to pending, due now."""
    add_effects(engine, ["quick"], kind="noop")
    add_effects(engine, ["stuck"], kind="block")
    release = threading.Event()
    reg = _noop_registry()
    reg.register("block", lambda e: release.wait(10) and {"late": True})
    d = Dispatcher(engine, reg, concurrency=4, lease=30)
    # Every outcome handed to `_finished`, the released delivery's late one too.
    handed: list[Any] = []
    processed = threading.Event()
    finished = d._finished

    def watched(row: Any, result: Any) -> None:
        finished(row, result)
        handed.append(result)
        if row.effect_key == "stuck":
            processed.set()

    d._finished = watched  # type: ignore[method-assign]
    try:
        assert d.fill() == 2
        wait_until(lambda: (d.reap(), d.in_flight == 1)[1], 5)
        t = time.monotonic()
        d.shutdown(grace=0.3)
        assert 0.3 <= time.monotonic() - t < 5
    finally:
        release.set()
    stuck = effect_row(engine, "stuck")
    assert (stuck.status, stuck.lease_token) == ("pending", None)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT available_at <= now() FROM outbox.effects"
                                 " WHERE effect_key = 'stuck'")).scalar_one()
    [a] = attempts_of(engine, stuck.id)
    # The request may have gone out: an ambiguous attempt, retried with the same key.
    assert a.outcome == "ambiguous" and a.error.startswith("released")
    assert (a.finished_at - a.started_at).total_seconds() >= 0.3  # the real start
    assert effect_row(engine, "quick").status == "delivered"
    # The released delivery's late result is not recorded over the release. Wait until
    # it was produced and went through `_finished`, then flush as the loop would:
    # nothing to record.
    assert processed.wait(5), "the released handler never returned"
    assert handed[-1].outcome == "delivered"  # a late outcome that could be recorded
    assert d._done == [] and d.flush() == {}
    assert len(attempts_of(engine, stuck.id)) == 1


def test_handler_sees_the_same_key_and_increasing_attempts(engine: Engine) -> None:
    seen: list[tuple[str, int, int]] = []

    def flaky(effect: EffectContext) -> dict[str, Any]:
        seen.append((effect.key, effect.attempt, effect.max_attempts))
        if effect.attempt < 3:
            raise TransientFailure("not yet")
        return {"ok": True}

    reg = Registry()
    reg.register("flaky", flaky)
    add_effects(engine, ["same-key"], kind="flaky", max_attempts=5)
    t0 = db_now(engine)
    clock = [t0]
    d = Dispatcher(engine, reg, policy=RetryPolicy(wait=wait_fixed(5)), clock=lambda: clock[0])
    try:
        for _ in range(3):
            d.drain(budget=3)
            clock[0] += timedelta(seconds=6)
    finally:
        d.shutdown(0)
    assert seen == [("same-key", 1, 5), ("same-key", 2, 5), ("same-key", 3, 5)]
    assert effect_row(engine, "same-key").status == "delivered"


def test_shutdown_parks_a_released_delivery_that_is_not_retry_safe(engine: Engine) -> None:
    """Released mid-delivery = ambiguous: a non-idempotent receiver's effect is parked
    for review instead of being redelivered blindly."""
    add_effects(engine, ["unsafe-stuck"], kind="unsafe")
    release = threading.Event()
    reg = Registry()
    reg.register("unsafe", lambda e: release.wait(10) and {"late": True}, retry_safe=False)
    d = Dispatcher(engine, reg, concurrency=1)
    try:
        assert d.fill() == 1
        d.shutdown(grace=0.1)
    finally:
        release.set()
    row = effect_row(engine, "unsafe-stuck")
    assert (row.status, row.lease_token) == ("needs_review", None)
    assert [a.outcome for a in attempts_of(engine, row.id)] == ["ambiguous"]


def test_shutdown_keeps_an_outcome_that_finished_before_the_release(engine: Engine) -> None:
    """A delivery that finished after the last reap is recorded once, not also released."""
    [eid] = add_effects(engine, ["done-not-reaped"])
    d = Dispatcher(engine, _noop_registry(), concurrency=2)
    assert d.fill() == 1
    wait_until(lambda: d._done, 5)  # finished, outcome queued, not reaped yet
    d.shutdown(grace=0)
    assert [a.outcome for a in attempts_of(engine, eid)] == ["delivered"]
    assert effect_row(engine, "done-not-reaped").status == "delivered"


def test_run_does_not_spin_when_saturated_and_rung(engine: Engine) -> None:
    """A doorbell (NOTIFY) while every slot is busy must not turn the loop into a busy
    wait until a slot frees up (it burnt a core per saturated worker)."""
    add_effects(engine, ["busy"], kind="block")
    release = threading.Event()
    reg = Registry()
    reg.register("block", lambda e: release.wait(10) and {"ok": True})
    d = Dispatcher(engine, reg, concurrency=1)
    stop = threading.Event()
    ticks = [0]

    def tick() -> None:
        ticks[0] += 1

    t = threading.Thread(target=d.run, args=(stop,),
                         kwargs={"poll_interval": 1.0, "grace": 0, "on_tick": tick})
    t.start()
    try:
        wait_until(lambda: d.in_flight == 1, 5)
        ticks[0] = 0
        d.wake.set()  # NOTIFY for more work, while the only slot is busy
        time.sleep(1.0)
        spins = ticks[0]
    finally:
        release.set()
        # Let the freed delivery be recorded before stopping: with grace=0 a stop that
        # beats the handler's return releases it instead (the test is about spinning).
        wait_until(lambda: d.in_flight == 0, 5)
        stop.set()
        t.join(5)
    assert spins <= 10, f"{spins} loop iterations in 1 s while saturated"
    assert effect_row(engine, "busy").status == "delivered"


# ------------------------------------------------ the delivery threads and held connections


def test_slot_pool_runs_every_row_once_under_bursts() -> None:
    """SlotPool wakes one parked thread at a time (a thread that takes a row while more
    wait wakes the next): a lost wake-up would leave rows queued forever. Random bursts,
    fast and slow rows, every row runs exactly once; shutdown hands back what never
    started and runs nothing after it."""
    import random

    from dispatcher.executor import SlotPool

    rng = random.Random(7)
    for size in (1, 2, 4, 16):
        ran: list[int] = []
        lock = threading.Lock()

        def run(item: tuple[int, float], ran: list[int] = ran,
                lock: threading.Lock = lock) -> None:
            if item[1]:
                time.sleep(item[1])
            with lock:
                ran.append(item[0])

        pool: SlotPool[tuple[int, float]] = SlotPool(size, f"t{size}", run)
        n = 0
        for _ in range(300):
            burst = [(n + i, rng.choice((0.0, 0.0, 0.0, 0.001)))
                     for i in range(rng.randint(1, 3 * size))]
            n += len(burst)
            pool.put_many(burst)
            if rng.random() < 0.3:
                time.sleep(0.001)
        wait_until(lambda ran=ran, n=n: len(ran) == n, 20)
        assert sorted(ran) == list(range(n))  # each once
        assert not pool._waking and not pool._tasks
        # Shutdown: rows not started are handed back and never run.
        gate = threading.Event()
        started = threading.Event()

        def block(item: int, gate: threading.Event = gate,
                  started: threading.Event = started) -> None:
            started.set()
            gate.wait(5)

        blocked: SlotPool[int] = SlotPool(size, f"b{size}", block)
        blocked.put_many(list(range(size + 5)))
        assert started.wait(5)
        wait_until(lambda blocked=blocked: len(blocked._tasks) <= 5, 5)
        dropped = blocked.shutdown()
        gate.set()
        assert len(dropped) >= 5
        blocked.put_many([99])  # after shutdown: refused, never run
        time.sleep(0.05)
        assert blocked._tasks.count(99) == 0


def test_a_loop_holds_at_most_two_connections_and_gives_them_back(engine: Engine) -> None:
    """With more than one slot the claims and the outcome writes each keep one pooled
    connection while a loop runs (idle in autocommit between statements); when the loop
    ends both are back in the pool, and `fill()` driven by hand holds none."""
    from outbox._config import make_engine

    worker = make_engine(engine.url.render_as_string(hide_password=False),
                         application_name="held-test", pool_size=3, max_overflow=2,
                         pool_pre_ping=False)
    seen: list[int] = []
    try:
        reg = Registry()
        reg.register("noop", lambda e: seen.append(worker.pool.checkedout()) or None)
        add_effects(engine, [f"held-{i}" for i in range(60)], kind="noop")
        d = Dispatcher(worker, reg, concurrency=4, max_batch=10)
        assert d.drain(budget=20) is False
        assert status_counts(engine) == {"delivered": 60}
        assert seen and max(seen) <= 2  # the producer's and the completer's, no more
        assert worker.pool.checkedout() == 0  # both given back at the loop's end
        add_effects(engine, ["held-by-hand"], kind="noop")
        assert d.fill() == 1
        assert worker.pool.checkedout() == 0  # by hand: checked out per statement
        wait_until(lambda: (d.reap(), status_counts(engine).get("delivered") == 61)[1], 5)
        d.shutdown(1)
        assert worker.pool.checkedout() == 0
    finally:
        worker.dispose()
