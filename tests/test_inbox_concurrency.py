"""Concurrent webhook batches and database errors at the ingestion endpoints (issue 8, item 6).

Real PostgreSQL, real threads on their own connections, real database errors (a lock
timeout, a terminated backend, a deadlock): nothing is mocked.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from sqlalchemy import Connection, Engine, text

from dispatcher.examples.payments.app import create_app
from outbox import InboxOutcome, IncomingEvent, ingest, ingest_many
from outbox._config import make_engine
from outbox.http import PROBLEM_MEDIA_TYPE

with warnings.catch_warnings():  # starlette would rather have `httpx2`; httpx works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

INSERTED, DUPLICATE, CONFLICT, STALE = (InboxOutcome.INSERTED, InboxOutcome.DUPLICATE,
                                        InboxOutcome.CONFLICT, InboxOutcome.STALE)
APP_NAME = "webhooks-under-test"


def rows(engine: Engine, sql: str, **params: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(text(sql), params))


def wait_until(condition: Callable[[], bool], what: str, patience: float = 30.0) -> None:
    """Poll a condition on the database's state (never a fixed sleep as proof)."""
    deadline = time.monotonic() + patience
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.01)


def app_backend_waits_on_a_lock(engine: Engine) -> bool:
    return bool(rows(engine, "SELECT count(*) FROM pg_stat_activity WHERE application_name"
                             " = :app AND wait_event_type = 'Lock'", app=APP_NAME)[0][0])


# -- (a) opposite-role batches -----------------------------------------------------------

ROUNDS = 40


def round_batches(src: str) -> tuple[list[IncomingEvent], list[IncomingEvent]]:
    """Two batches over the same keys with every role swapped, in opposite orders.

    x and y exist: A repeats y (duplicate) and changes x (conflict); B the reverse.
    Entities E, F and G are at version 1: A brings E v2 and F v3, B brings E v3 and
    F v2, and both bring G v2 with different payloads (one applies, one conflicts).
    """
    a = [IncomingEvent(src, "y", {"v": 0}),
         IncomingEvent(src, "x", {"v": "A"}),
         IncomingEvent(src, "a-G2", {"by": "A"}, 2, "G"),
         IncomingEvent(src, "a-F3", {"by": "A"}, 3, "F"),
         IncomingEvent(src, "a-E2", {"by": "A"}, 2, "E")]
    b = [IncomingEvent(src, "b-E3", {"by": "B"}, 3, "E"),
         IncomingEvent(src, "b-F2", {"by": "B"}, 2, "F"),
         IncomingEvent(src, "b-G2", {"by": "B"}, 2, "G"),
         IncomingEvent(src, "x", {"v": 0}),
         IncomingEvent(src, "y", {"v": "B"})]
    return a, b


def test_opposite_role_batches_never_deadlock_and_end_in_a_serial_state(
        engine: Engine) -> None:
    sources = [f"r{r:03d}" for r in range(ROUNDS)]
    with engine.begin() as conn:
        ingest_many(conn, [e for src in sources for e in (
            IncomingEvent(src, "x", {"v": 0}), IncomingEvent(src, "y", {"v": 0}),
            IncomingEvent(src, "e1", {}, 1, "E"), IncomingEvent(src, "f1", {}, 1, "F"),
            IncomingEvent(src, "g1", {}, 1, "G"))])

    barrier = threading.Barrier(2)
    errors: list[tuple[str, BaseException]] = []
    outcomes: dict[tuple[str, str, str], InboxOutcome] = {}
    lock = threading.Lock()

    def side(k: int) -> None:
        name = "AB"[k]
        with engine.connect() as conn:
            for src in sources:
                batch = round_batches(src)[k]
                try:
                    barrier.wait(timeout=60)
                    with conn.begin():
                        # count_duplicates=True, as the example's batch endpoint does.
                        results = ingest_many(conn, batch, count_duplicates=True)
                except threading.BrokenBarrierError:
                    return
                except BaseException as exc:
                    with lock:
                        errors.append((src, exc))
                    barrier.abort()  # the first deadlock is enough evidence
                    return
                with lock:
                    outcomes.update(((src, name, r.event_id), r.outcome) for r in results)

    threads = [threading.Thread(target=side, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
        assert not t.is_alive()
    assert errors == []

    # Outcomes: the key roles are fixed; the entity outcomes are those of one of the
    # two serial orders (whoever locked the entities first went first for all three).
    a_first = {("A", "a-E2"): INSERTED, ("A", "a-F3"): INSERTED, ("A", "a-G2"): INSERTED,
               ("B", "b-E3"): INSERTED, ("B", "b-F2"): STALE, ("B", "b-G2"): CONFLICT}
    b_first = {("A", "a-E2"): STALE, ("A", "a-F3"): INSERTED, ("A", "a-G2"): CONFLICT,
               ("B", "b-E3"): INSERTED, ("B", "b-F2"): INSERTED, ("B", "b-G2"): INSERTED}
    g_winner: dict[str, str] = {}
    for src in sources:
        got = {(s, e): o for (r, s, e), o in outcomes.items() if r == src}
        keyed = {k: got.pop(k) for k in [("A", "x"), ("A", "y"), ("B", "x"), ("B", "y")]}
        assert keyed == {("A", "x"): CONFLICT, ("A", "y"): DUPLICATE,
                         ("B", "x"): DUPLICATE, ("B", "y"): CONFLICT}, src
        assert got in (a_first, b_first), (src, got)
        g_winner[src] = "a-G2" if got == a_first else "b-G2"

    # Rows: 5 set up + 6 new per round; the stored x and y are never overwritten.
    assert rows(engine, "SELECT count(*) FROM outbox.inbox")[0][0] == 11 * ROUNDS
    counters = {(r.source, r.event_id): (r.conflicts, r.duplicates, r.payload)
                for r in rows(engine, "SELECT source, event_id, conflicts, duplicates, "
                                      "payload FROM outbox.inbox WHERE conflicts > 0 "
                                      "OR duplicates > 0")}
    expected_counters: dict[tuple[str, str], tuple[int, int, Any]] = {}
    for src in sources:
        expected_counters[(src, "x")] = (1, 1, {"v": 0})
        expected_counters[(src, "y")] = (1, 1, {"v": 0})
        loser = "b-G2" if g_winner[src] == "a-G2" else "a-G2"
        expected_counters[(src, loser)] = (1, 0, {"by": loser[0].upper()})
    assert counters == expected_counters
    # Conflicts: the refused copies are kept as evidence, one row each.
    evidence = sorted((r.source, r.event_id, r.payload["v"] if "v" in r.payload
                       else r.payload["by"]) for r in rows(
        engine, "SELECT source, event_id, payload FROM outbox.inbox_conflicts"))
    assert evidence == sorted(
        t for src in sources for t in [
            (src, "x", "A"), (src, "y", "B"),
            (src, "b-G2", "B") if g_winner[src] == "a-G2" else (src, "a-G2", "A")])
    # Versions: the highest per entity, set by the event that brought it.
    versions = {(r.source, r.entity): (r.version, r.event_id) for r in rows(
        engine, "SELECT source, entity, version, event_id FROM outbox.entity_versions")}
    assert versions == {k: v for src in sources for k, v in [
        ((src, "E"), (3, "b-E3")), ((src, "F"), (3, "a-F3")),
        ((src, "G"), (2, g_winner[src]))]}


# -- (b) database errors at the endpoints: 503 + Retry-After, never 500 ------------------


def event(event_id: str, **data: Any) -> dict[str, Any]:
    return {"id": event_id, "type": "charge.updated", "data": data}


ENDPOINTS = {
    "single": ("/webhooks/stripe", lambda: event("evt_held")),
    "batch": ("/webhooks/stripe/batch", lambda: [event("evt_free"), event("evt_held")]),
}


@pytest.fixture
def app_engine_factory(db_url: str) -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(**options: str) -> Engine:
        opts = " ".join(f"-c {k}={v}" for k, v in options.items())
        eng = make_engine(db_url, application_name=APP_NAME, pool_size=2, max_overflow=2,
                          connect_args={"options": opts} if opts else {})
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.dispose()


def assert_503_problem(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 503, resp.text
    assert resp.headers["content-type"] == PROBLEM_MEDIA_TYPE
    assert int(resp.headers["retry-after"]) >= 1
    body: dict[str, Any] = resp.json()
    assert body["status"] == 503
    assert body["detail"] and body["title"] and body["type"] and body["code"]
    return body



@contextmanager
def held_event(engine: Engine) -> Iterator[Connection]:
    """Another sender's open transaction that has just inserted evt_held (not committed)."""
    with engine.connect() as holder:
        holder.begin()
        ingest(holder, "stripe", "evt_held", {"type": "charge.updated", "data": {"n": 1}})
        try:
            yield holder
        finally:
            holder.rollback()


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_lock_timeout_at_the_endpoint_is_a_503_problem(
        engine: Engine, app_engine_factory: Callable[..., Engine], endpoint: str) -> None:
    path, body = ENDPOINTS[endpoint]
    app = create_app(app_engine_factory(lock_timeout="200ms"))
    with TestClient(app, raise_server_exceptions=False) as client:
        with held_event(engine):
            # Our INSERT waits on the uncommitted twin until lock_timeout (55P03).
            problem = assert_503_problem(client.post(path, json=body()))
        assert problem["code"] == "database_busy"
        # Nothing of the refused request was kept; the resend is processed normally.
        assert rows(engine, "SELECT count(*) FROM outbox.inbox")[0][0] == 0
        again = client.post(path, json=body())
        assert again.status_code == 200, again.text


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_terminated_backend_at_the_endpoint_is_a_503_problem(
        engine: Engine, app_engine_factory: Callable[..., Engine], endpoint: str) -> None:
    path, body = ENDPOINTS[endpoint]
    app = create_app(app_engine_factory(lock_timeout="60s"))
    answers: list[httpx.Response] = []
    with TestClient(app, raise_server_exceptions=False) as client:
        with held_event(engine):
            request = threading.Thread(
                target=lambda: answers.append(client.post(path, json=body())))
            request.start()
            wait_until(lambda: app_backend_waits_on_a_lock(engine),
                       "the request's backend waits on the held row")
            killed = rows(engine, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                                  " WHERE application_name = :app AND wait_event_type"
                                  " = 'Lock'", app=APP_NAME)
            assert [k[0] for k in killed] == [True]
            request.join(timeout=60)
            assert not request.is_alive()
        problem = assert_503_problem(answers[0])
        assert problem["code"] == "database_unavailable"
        assert rows(engine, "SELECT count(*) FROM outbox.inbox")[0][0] == 0
        again = client.post(path, json=body())  # the pool replaces the dead connection
        assert again.status_code == 200, again.text


def test_a_deadlock_at_the_batch_endpoint_is_retried_once_server_side(
        engine: Engine, app_engine_factory: Callable[..., Engine],
        caplog: pytest.LogCaptureFixture) -> None:
    """A deadlock the inbox cannot prevent (here: with another transaction's own row
    locks) rolls the request back completely; it is run once more, and the sender gets
    the committed answer instead of an error."""
    with engine.begin() as conn:
        ingest_many(conn, [IncomingEvent("s", "x", {"type": "t", "data": {}}),
                           IncomingEvent("s", "y", {"type": "t", "data": {}})])
    caplog.set_level(logging.INFO, logger="dispatcher.examples.payments.app")
    # PostgreSQL looks for a deadlock once, deadlock_timeout after a wait began: the
    # request must still be before that look when `other` closes the cycle. 100 ms lost
    # that race once on a loaded 2-core box (the request's look came first and found no
    # cycle; `other`'s own look, at 60 s, came after the call timeout).
    app = create_app(app_engine_factory(deadlock_timeout="2s"))
    answers: list[httpx.Response] = []
    lock_row = text("SELECT 1 FROM outbox.inbox WHERE source = 's' AND event_id = :k"
                    " FOR UPDATE")
    with TestClient(app, raise_server_exceptions=False) as client, \
            engine.connect() as other:
        other.begin()
        other.execute(text("SET LOCAL deadlock_timeout = '60s'"))  # the request detects it
        other.execute(lock_row, {"k": "y"})
        request = threading.Thread(target=lambda: answers.append(client.post(
            "/webhooks/s/batch", json=[event("x", n=2), event("y", n=2)])))
        request.start()
        # The request locks x, then waits for y; locking x now closes the cycle. This
        # returns only once the request's first transaction rolled back and freed x.
        wait_until(lambda: app_backend_waits_on_a_lock(engine), "the request waits for y")
        other.execute(lock_row, {"k": "x"})
        other.commit()  # the retry, waiting for x, goes on
        request.join(timeout=60)
        assert not request.is_alive()
    assert answers[0].status_code == 200, answers[0].text
    assert answers[0].json() == {"outcomes": ["conflict", "conflict"]}
    retries = [r.getMessage() for r in caplog.records if "retrying once" in r.getMessage()]
    assert len(retries) == 1 and "deadlock detected" in retries[0]
    # Counted once: the rolled-back attempt left nothing behind.
    assert [tuple(r) for r in rows(
        engine, "SELECT event_id, conflicts FROM outbox.inbox ORDER BY event_id")] == [
        ("x", 1), ("y", 1)]
    assert rows(engine, "SELECT count(*) FROM outbox.inbox_conflicts")[0][0] == 2
