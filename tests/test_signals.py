"""The production signals of issue 15, against a real PostgreSQL (no mocks).

* The same business request under different keys: a client that sends one payment
  three times under three keys is reported as a suspected duplicate (counter, span
  event, log line, opt-in header), a different payment and another scope are not, and
  every request still runs: sync and async guard, atomic and phased, HTTP included.
* Lock waits on our tables, read from pg_locks: they move while a test holds a row
  lock on a hot inbox key and writers wait.
* Pool occupancy from the maintained SQLAlchemy instrumentation: it moves under load.
* 409 : 2xx needs the answered status on the outcome counter (`status_class`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from fastapi import Depends, FastAPI
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from sqlalchemy import Connection, Engine, make_url, text
from starlette.responses import JSONResponse, Response

from dispatcher.metrics import (
    LOCK_TABLES,
    POOL_USAGE_INSTRUMENT,
    QueueGauges,
    instrument_pool,
    pool_name,
    read_snapshot,
)
from outbox import Claim, IdempotencyGuard, StoredResponse, fingerprint, ingest, make_engine
from outbox._idempotency import SUSPECT_EVENT, Mode
from outbox.http import (
    SUSPECTED_DUPLICATE_HEADER,
    Idempotency,
    IdempotentRequest,
    anonymous_scope,
    install_problem_handlers,
)
from tests.dispatch_support import CountingDriver
from tests.otel_helpers import counter_points, metric_points, metric_reader, span_exporter

with warnings.catch_warnings():  # starlette would rather have `httpx2`; httpx works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

SCOPE = "user:alice"
OTHER_SCOPE = "user:bob"
PAYMENT = {"customer": "cus_42", "amount": 4200, "currency": "EUR"}
OTHER_PAYMENT = {"customer": "cus_42", "amount": 4300, "currency": "EUR"}
MODES: list[Mode] = ["atomic", "phased"]


def same_payment(body: dict[str, Any]) -> str:
    """What makes two payments the same business request: customer, amount, currency."""
    return f"{body['customer']}|{body['amount']}|{body['currency']}"


def dsn(db_url: str) -> str:
    return make_url(db_url).set(drivername="postgresql").render_as_string(hide_password=False)


def fp(body: dict[str, Any]) -> str:
    return fingerprint("POST", "/payments", body)


def orders(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM public.test_orders")).scalar_one())


def sync_work(body: dict[str, Any]) -> Callable[[Connection, Claim], StoredResponse]:
    def work(conn: Connection, claim: Claim) -> StoredResponse:
        conn.execute(text("INSERT INTO public.test_orders (key, amount) VALUES (:k, :a)"),
                     {"k": claim.key, "a": body["amount"]})
        return StoredResponse(201, (("content-type", "application/json"),), b"{}")
    return work


def suspects_by_mode() -> dict[str, float]:
    return counter_points(metric_reader(), "outbox.idempotency.suspected_duplicates", "mode")


def delta(before: dict[str, float], after: dict[str, float], label: str) -> float:
    return after.get(label, 0) - before.get(label, 0)


# -- the same business request under different keys ---------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_same_payment_under_three_keys_is_suspected_sync(
        engine: Engine, mode: Mode, caplog: pytest.LogCaptureFixture) -> None:
    guard = IdempotencyGuard(same_request=same_payment)
    exporter = span_exporter()
    exporter.clear()
    before = suspects_by_mode()
    tracer = trace.get_tracer("tests.signals")
    seen: list[int] = []
    caplog.set_level(logging.WARNING, logger="outbox.idempotency")

    def send(scope: str, key: str, body: dict[str, Any]) -> int:
        with tracer.start_as_current_span(f"request {key}"):
            result = guard.run(engine, scope, key, fp(body), sync_work(body), mode=mode,
                               business_key=guard.business_key(body))
        assert not result.replayed
        return result.suspected_duplicates

    for key in ("pay-1", "pay-2", "pay-3"):      # one payment, a new key per retry
        seen.append(send(SCOPE, key, PAYMENT))
    seen.append(send(SCOPE, "pay-4", OTHER_PAYMENT))   # another payment
    seen.append(send(OTHER_SCOPE, "pay-5", PAYMENT))   # the same payment, another client
    assert seen == [0, 1, 2, 0, 0]
    # A replay of a key is not a new key: nothing more is counted.
    replay = guard.run(engine, SCOPE, "pay-3", fp(PAYMENT), sync_work(PAYMENT), mode=mode,
                       business_key=guard.business_key(PAYMENT))
    assert replay.replayed and replay.suspected_duplicates == 0

    # Never blocked: every new key executed once.
    assert orders(engine) == 5
    assert delta(before, suspects_by_mode(), mode) == 2
    assert delta(before, suspects_by_mode(), "atomic" if mode == "phased" else "phased") == 0

    events = {s.name: [e for e in s.events if e.name == SUSPECT_EVENT]
              for s in exporter.get_finished_spans()}
    assert [len(events[f"request pay-{i}"]) for i in range(1, 6)] == [0, 1, 1, 0, 0]
    third = dict(events["request pay-3"][0].attributes or {})
    assert third["outbox.idempotency.other_keys"] == 2
    assert third["outbox.idempotency.other_key"] == "pay-2"   # the newest, same scope
    assert third["outbox.idempotency.mode"] == mode

    lines = [r.getMessage() for r in caplog.records if "suspected duplicate" in r.getMessage()]
    assert len(lines) == 2
    assert "'pay-3'" in lines[1] and "'user:alice'" in lines[1] and "2 other key" in lines[1]
    assert not any("pay-5" in line or "user:bob" in line for line in lines)

    with engine.connect() as conn:
        hashes = dict(conn.execute(text(
            "SELECT key, business_hash FROM outbox.idempotency_keys")).all())
    assert hashes["pay-1"] == hashes["pay-2"] == hashes["pay-3"] == hashes["pay-5"]
    assert hashes["pay-4"] != hashes["pay-1"] and len(hashes["pay-1"]) == 32


@pytest.mark.parametrize("mode", MODES)
def test_same_payment_under_three_keys_is_suspected_async(
        engine: Engine, db_url: str, mode: Mode) -> None:
    guard = IdempotencyGuard(same_request=same_payment)
    before = suspects_by_mode()

    async def scenario() -> list[int]:
        async with await psycopg.AsyncConnection.connect(dsn(db_url)) as conn:
            out = []
            for scope, key, body in ((SCOPE, "a-1", PAYMENT), (SCOPE, "a-2", PAYMENT),
                                     (SCOPE, "a-3", PAYMENT), (SCOPE, "a-4", OTHER_PAYMENT),
                                     (OTHER_SCOPE, "a-5", PAYMENT)):
                async def work(c: Any, claim: Claim, amount: int = body["amount"]
                               ) -> StoredResponse:
                    await c.execute("INSERT INTO public.test_orders (key, amount) "
                                    "VALUES (%s, %s)", (claim.key, amount))
                    return StoredResponse(201, (), b"{}")
                result = await guard.arun(conn, scope, key, fp(body), work, mode=mode,
                                          business_key=guard.business_key(body))
                out.append(result.suspected_duplicates)
            return out

    assert asyncio.run(scenario()) == [0, 1, 2, 0, 0]
    assert orders(engine) == 5
    assert delta(before, suspects_by_mode(), mode) == 2


def test_only_keys_inside_the_window_count(engine: Engine) -> None:
    now = [datetime(2030, 1, 1, tzinfo=UTC)]
    guard = IdempotencyGuard(same_request=same_payment, same_request_window=60,
                             clock=lambda: now[0])
    business = guard.business_key(PAYMENT)

    def send(key: str) -> int:
        return guard.run(engine, SCOPE, key, fp(PAYMENT), sync_work(PAYMENT),
                         business_key=business).suspected_duplicates

    assert send("w-1") == 0
    now[0] += timedelta(seconds=61)
    assert send("w-2") == 0          # w-1 is older than the window
    now[0] += timedelta(seconds=30)
    assert send("w-3") == 1          # w-2 is inside it
    # A per-call window overrides the guard's.
    now[0] += timedelta(seconds=1)
    assert guard.run(engine, SCOPE, "w-4", fp(PAYMENT), sync_work(PAYMENT),
                     business_key=business, same_request_window=3600
                     ).suspected_duplicates == 3


def test_nothing_declared_nothing_stored_and_a_broken_declaration_never_fails(
        engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    plain = IdempotencyGuard()
    assert plain.business_key(PAYMENT) is None
    for key in ("n-1", "n-2"):
        assert plain.run(engine, SCOPE, key, fp(PAYMENT), sync_work(PAYMENT),
                         business_key=plain.business_key(PAYMENT)).suspected_duplicates == 0

    def broken(body: Any) -> str:
        raise KeyError("customer")

    caplog.set_level(logging.WARNING, logger="outbox.idempotency")
    guard = IdempotencyGuard(same_request=broken)
    result = guard.run(engine, SCOPE, "n-3", fp(PAYMENT), sync_work(PAYMENT),
                       business_key=guard.business_key(PAYMENT))
    assert result.response.status == 201 and result.suspected_duplicates == 0
    assert any("same_request raised" in r.getMessage() for r in caplog.records)
    # Declaring None means "nothing to compare" for this body.
    assert IdempotencyGuard(same_request=lambda b: None).business_key(PAYMENT) is None
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM outbox.idempotency_keys"
                                 " WHERE business_hash IS NOT NULL")).scalar_one() == 0
    assert orders(engine) == 3


@pytest.mark.parametrize("mode", MODES)
def test_detection_costs_no_extra_round_trip(db_url: str, engine: Engine, mode: Mode) -> None:
    """The look-up rides in the statement that writes the key (a CTE beside it)."""
    guard = IdempotencyGuard(same_request=same_payment)
    response = StoredResponse(201, (), b"{}")
    counts: dict[bool, list[str]] = {}
    for detect in (False, True):
        business = guard.business_key(PAYMENT) if detect else None
        with psycopg.connect(dsn(db_url)) as conn:
            driver = CountingDriver(conn)
            key = f"rt-{mode}-{detect}"
            if mode == "atomic":
                claim = driver.drive(guard._begin(SCOPE, key, fp(PAYMENT), business, 60.0))
            else:
                claim = driver.drive(guard._claim(SCOPE, key, fp(PAYMENT), business, 60.0))
            driver.drive(guard._complete(claim, response))
            conn.commit()
        counts[detect] = driver.statements
    assert len(counts[True]) == len(counts[False]), counts
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT key, business_hash IS NOT NULL FROM "
                                   "outbox.idempotency_keys ORDER BY key")).all()
    assert stored == [(f"rt-{mode}-False", False), (f"rt-{mode}-True", True)]


# -- the HTTP integration ---------------------------------------------------------------


Payment = IdempotentRequest[dict[str, Any]]


def payments_app(engine: Engine, mode: Mode) -> FastAPI:
    app = FastAPI()
    install_problem_handlers(app)
    app.state.engine = engine
    flagged = Idempotency(dict, mode=mode, scope=anonymous_scope, same_request=same_payment,
                          suspect_header=True)
    quiet = Idempotency(dict, mode=mode, scope=anonymous_scope, same_request=same_payment)

    def work(body: dict[str, Any]) -> Callable[[Connection, Claim], Response]:
        def run(conn: Connection, claim: Claim) -> Response:
            conn.execute(text("INSERT INTO public.test_orders (key, amount) VALUES (:k, :a)"),
                         {"k": json.dumps(body), "a": body["amount"]})
            return JSONResponse({"ok": True}, 201)
        return run

    @app.post("/payments")
    def create(req: Payment = Depends(flagged)) -> Response:  # noqa: B008
        return req.run(work(req.body))

    @app.post("/payments-in")
    def create_in(req: Payment = Depends(flagged)) -> Response:  # noqa: B008
        with engine.connect() as conn:  # the app's own connection: run_in
            return req.run_in(conn, work(req.body))

    @app.post("/quiet")
    def create_quiet(req: Payment = Depends(quiet)) -> Response:  # noqa: B008
        return req.run(work(req.body))

    return app


@pytest.mark.parametrize("mode", MODES)
def test_http_header_is_opt_in_and_scoped(engine: Engine, mode: Mode) -> None:
    before = suspects_by_mode()
    with TestClient(payments_app(engine, mode)) as client:
        def post(path: str, key: str, body: dict[str, Any], **headers: str) -> Any:
            resp = client.post(path, json=body, headers={"Idempotency-Key": key, **headers})
            assert resp.status_code == 201, resp.text
            return resp

        answers = [post("/payments", f"h-{i}", PAYMENT) for i in range(3)]
        assert [r.headers.get(SUSPECTED_DUPLICATE_HEADER) for r in answers] == [None, "1", "2"]
        replay = post("/payments", "h-2", PAYMENT)
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert SUSPECTED_DUPLICATE_HEADER not in replay.headers  # never stored or replayed
        # Another client (scope) sending the same payment is nobody's duplicate.
        other = post("/payments", "h-9", PAYMENT, **{"X-Tenant": "globex"})
        assert SUSPECTED_DUPLICATE_HEADER not in other.headers
        other_payment = post("/payments", "h-3", OTHER_PAYMENT)
        assert SUSPECTED_DUPLICATE_HEADER not in other_payment.headers
        # The application's own transaction (run_in) reports it too.
        assert post("/payments-in", "h-4", PAYMENT).headers[SUSPECTED_DUPLICATE_HEADER] == "3"
        # Without the opt-in: counted, no header.
        assert SUSPECTED_DUPLICATE_HEADER not in post("/quiet", "h-5", PAYMENT).headers
    assert orders(engine) == 7
    after = suspects_by_mode()
    # run_in is atomic whatever the dependency's mode: its one counts there.
    assert delta(before, after, "atomic") + delta(before, after, "phased") == 4


# -- 409 : 2xx ----------------------------------------------------------------------


def test_outcomes_carry_the_answered_status_class(engine: Engine) -> None:
    reader = metric_reader()

    def by_class(outcome: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for p in metric_points(reader, "outbox.idempotency.requests"):
            attrs = dict(p.attributes or {})
            if attrs.get("outcome") == outcome:
                label = str(attrs.get("status_class"))
                out[label] = out.get(label, 0) + p.value
        return out

    executed, replayed = by_class("executed"), by_class("replayed")
    guard = IdempotencyGuard()

    def declined(conn: Connection, claim: Claim) -> StoredResponse:
        return StoredResponse(402, (), b"{}")

    guard.run(engine, SCOPE, "s-1", fp(PAYMENT), sync_work(PAYMENT))
    guard.run(engine, SCOPE, "s-1", fp(PAYMENT), sync_work(PAYMENT))
    guard.run(engine, SCOPE, "s-2", fp(PAYMENT), declined)
    assert delta(executed, by_class("executed"), "2xx") == 1
    assert delta(executed, by_class("executed"), "4xx") == 1
    assert delta(replayed, by_class("replayed"), "2xx") == 1


# -- lock waits ---------------------------------------------------------------------------


def lock_gauges(engine: Engine) -> tuple[InMemoryMetricReader, QueueGauges]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    gauges = QueueGauges(engine, ttl=0.0, meter=provider.get_meter("tests.signals"))
    return reader, gauges


def gauge(reader: InMemoryMetricReader, name: str) -> dict[str, float]:
    return {str(p.attributes["table"]): p.value for p in metric_points(reader, name)}


def wait_for(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def writers() -> Iterator[list[threading.Thread]]:
    threads: list[threading.Thread] = []
    yield threads
    for t in threads:
        t.join(30)
        assert not t.is_alive()


def test_lock_waits_move_while_a_hot_inbox_key_is_held(
        engine: Engine, writers: list[threading.Thread]) -> None:
    with engine.begin() as conn:
        ingest(conn, "psp", "evt-hot", {"n": 1})
    reader, _ = lock_gauges(engine)
    assert set(gauge(reader, "outbox.db.lock_waits")) == set(LOCK_TABLES)
    assert sum(gauge(reader, "outbox.db.lock_waits").values()) == 0

    errors: list[BaseException] = []

    def duplicate() -> None:  # counting duplicates updates the row: it waits for the lock
        try:
            with engine.begin() as conn:
                ingest(conn, "psp", "evt-hot", {"n": 1}, count_duplicates=True)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    holder = engine.connect()
    try:
        holder.execute(text("SELECT 1 FROM outbox.inbox WHERE source = 'psp'"
                            " AND event_id = 'evt-hot' FOR UPDATE"))
        for _ in range(3):
            writers.append(threading.Thread(target=duplicate))
            writers[-1].start()
        wait_for(lambda: read_snapshot(engine).lock_waits.get("inbox") is not None
                 and read_snapshot(engine).lock_waits["inbox"].sessions == 3)
        time.sleep(0.3)
        waits = gauge(reader, "outbox.db.lock_waits")
        ages = gauge(reader, "outbox.db.lock_wait_age")
        assert waits["inbox"] == 3
        assert ages["inbox"] >= 0.3
        assert all(waits[t] == 0 for t in LOCK_TABLES if t != "inbox")
    finally:
        holder.rollback()
        holder.close()
    for t in writers:
        t.join(30)
    assert not errors
    assert sum(gauge(reader, "outbox.db.lock_waits").values()) == 0
    with engine.connect() as conn:
        assert conn.execute(text("SELECT duplicates FROM outbox.inbox"
                                 " WHERE event_id = 'evt-hot'")).scalar_one() == 3


def test_lock_waits_count_writers_behind_an_uncommitted_insert_of_the_same_key(
        engine: Engine, writers: list[threading.Thread]) -> None:
    """A unique-key insert waits for the other transaction, not for a tuple lock."""
    holder = engine.connect()
    try:
        ingest(holder, "psp", "evt-new", {"n": 1})   # inserted, not committed
        for _ in range(2):
            def copy() -> None:
                with engine.begin() as conn:
                    ingest(conn, "psp", "evt-new", {"n": 1})
            writers.append(threading.Thread(target=copy))
            writers[-1].start()
        wait_for(lambda: read_snapshot(engine).lock_waits.get("inbox") is not None
                 and read_snapshot(engine).lock_waits["inbox"].sessions == 2)
    finally:
        holder.commit()
        holder.close()
    for t in writers:
        t.join(30)
    assert read_snapshot(engine).lock_waits == {}


# -- pool occupancy -----------------------------------------------------------------------


def test_pool_occupancy_moves_under_load(db_url: str) -> None:
    from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor

    reader = metric_reader()
    SQLAlchemyInstrumentor().uninstrument()  # instrument() is once per process
    pool = make_engine(db_url, application_name="tests-pool", pool_size=2, max_overflow=3,
                       pool_logging_name="tests-pool-occupancy")
    name = pool_name(pool)
    assert name == "tests-pool-occupancy"

    def usage() -> dict[str, float]:
        return {str(p.attributes["state"]): p.value
                for p in metric_points(reader, POOL_USAGE_INSTRUMENT)
                if p.attributes.get("pool.name") == name}

    def limit() -> float:
        return float(sum(p.value for p in metric_points(reader, "db.client.connections.max")
                         if p.attributes.get("pool.name") == name))

    try:
        assert instrument_pool(pool)
        assert instrument_pool(pool)  # the same engine again: still reported
        base = usage()
        inside, release = threading.Barrier(6), threading.Event()

        def hold() -> None:
            with pool.connect() as conn:
                conn.execute(text("SELECT 1"))
                inside.wait(10)
                release.wait(10)

        threads = [threading.Thread(target=hold) for _ in range(5)]
        for t in threads:
            t.start()
        inside.wait(10)
        loaded = usage()
        assert loaded["used"] - base.get("used", 0) == 5      # the whole pool, overflow too
        assert limit() == 5
        release.set()
        for t in threads:
            t.join(10)
        after = usage()
        assert after["used"] - base.get("used", 0) == 0
        assert after["idle"] - base.get("idle", 0) == 2       # overflow closed on checkin
    finally:
        SQLAlchemyInstrumentor().uninstrument()
        pool.dispose()


def test_one_engine_per_process_is_reported(db_url: str,
                                            caplog: pytest.LogCaptureFixture) -> None:
    from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor

    SQLAlchemyInstrumentor().uninstrument()
    first = make_engine(db_url, application_name="tests-pool-1", pool_logging_name="p1")
    second = make_engine(db_url, application_name="tests-pool-2", pool_logging_name="p2")
    caplog.set_level(logging.INFO, logger="outbox.metrics")
    try:
        assert instrument_pool(first)
        assert not instrument_pool(second)
        assert any("pool occupancy of p2 is not exported" in r.getMessage()
                   for r in caplog.records)
    finally:
        SQLAlchemyInstrumentor().uninstrument()
        first.dispose()
        second.dispose()


# -- write latency per source -----------------------------------------------------------


def test_inbox_write_latency_is_recorded_per_source(engine: Engine) -> None:
    reader = metric_reader()

    def count() -> int:
        return sum(int(p.count) for p in metric_points(reader, "outbox.inbox.write.duration"))

    before = count()
    with engine.begin() as conn:
        ingest(conn, "psp", f"lat-{uuid.uuid4()}", {"n": 1})
    assert count() == before + 1
