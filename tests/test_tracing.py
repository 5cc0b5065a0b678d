"""Observability proof: one trace from the business request to the receiver, and the
metrics operators alert on (DESIGN.md §7).

request span (SERVER) -> `enqueue <queue>` (PRODUCER, messaging `create`) ->
traceparent in effects.headers -> `deliver <queue>` (CONSUMER, messaging `process`, one
per attempt, parent = the enqueue span; ERROR with error.type when the attempt failed)
-> `POST` (CLIENT, the httpx instrumentation) -> the receiver's `POST` (SERVER) ->
attempts.trace_id. Spans follow the OpenTelemetry messaging and HTTP conventions.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.pool import NullPool

import outbox._enqueue
from dispatcher import Dispatcher, EffectContext, HttpHandler, Registry
from dispatcher.examples.payments.psp import Receiver
from dispatcher.http_async import AsyncHttpHandler
from dispatcher.metrics import QueueGauges, register_queue_gauges
from outbox import enqueue
from outbox._telemetry import DURATION_BUCKETS, LAG_BUCKETS
from outbox.errors import AmbiguousOutcome, PermanentFailure
from outbox.sql import dispatch as dsql
from outbox.sql import effects as fx
from outbox.sql import keys as kx
from tests.otel_helpers import (
    counter_points,
    metric_points,
    metric_reader,
    point_value,
    span_exporter,
)

ROOT = Path(__file__).resolve().parents[1]
#: Our own queue, so no other dispatcher in the session (a Celery test worker) takes
#: these effects; and no doorbells while we run.
QUEUE = "otel-tests"


@pytest.fixture(autouse=True)
def _no_doorbells(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(outbox._enqueue, "_doorbells", [])


def _hex_trace(span: ReadableSpan) -> str:
    assert span.context is not None
    return format(span.context.trace_id, "032x")


def _hex_span(span: ReadableSpan) -> str:
    assert span.context is not None
    return format(span.context.span_id, "016x")


def _drain(engine: Engine, registry: Registry, budget: float = 5.0,
           queue: str = QUEUE) -> Dispatcher:
    d = Dispatcher(engine, registry, queue=queue, concurrency=4, lease=10.0,
                   worker_id=f"test-{uuid.uuid4().hex[:6]}")
    try:
        d.drain(budget)
    finally:
        d.shutdown(0.0)
    return d


def _spans(name: str) -> list[ReadableSpan]:
    return [s for s in span_exporter().get_finished_spans() if s.name == name]


def test_trace_runs_from_request_to_receiver_and_attempt_row(engine: Engine) -> None:
    exporter = span_exporter()
    exporter.clear()
    tracer = trace.get_tracer("tests.request")
    with Receiver() as psp:
        registry = Registry()
        registry.register("psp.charge", HttpHandler(f"{psp.url}/charges", timeout=5.0))
        with tracer.start_as_current_span("POST /payments", kind=SpanKind.SERVER) as req, \
                engine.begin() as conn:
            enq = enqueue(conn, "psp.charge",
                          {"payment_id": "p-1", "amount": 1200, "currency": "EUR"},
                          queue=QUEUE)
        request_trace = format(req.get_span_context().trace_id, "032x")
        request_span = format(req.get_span_context().span_id, "016x")

        # Delivered later, by pool threads with no current context: only the row links.
        assert trace.get_current_span() is trace.INVALID_SPAN
        _drain(engine, registry)
        deliveries = psp.ledger(enq.effect_key)["deliveries"]

    # 1. The enqueue span is a PRODUCER child of the request span.
    (enq_span,) = _spans(f"enqueue {QUEUE}")
    assert enq_span.kind is SpanKind.PRODUCER
    assert dict(enq_span.attributes or {}) == {
        "messaging.system": "pg_outbox", "messaging.operation.type": "create",
        "messaging.operation.name": "enqueue", "messaging.destination.name": QUEUE,
        "messaging.message.id": str(enq.id), "outbox.effects": 1}
    assert _hex_trace(enq_span) == request_trace
    assert enq_span.parent is not None
    assert format(enq_span.parent.span_id, "016x") == request_span

    # 2. The row carries the enqueue span's context.
    with engine.connect() as conn:
        row = fx.get_effect(conn, str(enq.id))
        attempts = fx.attempts_of(conn, enq.id)
    assert row is not None and row.status == "delivered"
    traceparent = row.headers["traceparent"]
    version, tp_trace, tp_parent, _flags = traceparent.split("-")
    assert (version, tp_trace, tp_parent) == ("00", request_trace, _hex_span(enq_span))

    # 3. The deliver span continues that trace as a CONSUMER child of the enqueue span.
    (deliver,) = _spans(f"deliver {QUEUE}")
    assert deliver.kind is SpanKind.CONSUMER
    assert deliver.status.status_code is StatusCode.UNSET
    assert _hex_trace(deliver) == request_trace
    assert deliver.parent is not None and deliver.parent.span_id == enq_span.context.span_id
    attrs = dict(deliver.attributes or {})
    assert attrs["outbox.effect_id"] == enq.id
    assert attrs["outbox.effect_key"] == enq.effect_key
    assert attrs["outbox.attempt"] == 1
    assert attrs["outbox.outcome"] == "delivered"
    assert {k: v for k, v in attrs.items() if k.startswith("messaging.")} == {
        "messaging.system": "pg_outbox", "messaging.operation.type": "process",
        "messaging.operation.name": "deliver", "messaging.destination.name": QUEUE,
        "messaging.message.id": str(enq.id)}

    # 4. The receiver saw a traceparent of the same trace, whose parent is the CLIENT
    #    span the httpx instrumentation made under the deliver span.
    assert len(deliveries) == 1
    sent = deliveries[0]["traceparent"]
    assert sent is not None
    _, sent_trace, sent_parent, _ = sent.split("-")
    assert sent_trace == request_trace
    ours = {_hex_span(s): s for s in span_exporter().get_finished_spans()}
    client = ours[sent_parent]
    assert client.kind is SpanKind.CLIENT and client.name == "POST"
    assert client.parent is not None and client.parent.span_id == deliver.context.span_id

    # 5. The attempt row records the trace id, so `outbox trace ID` leads to the trace.
    assert [(a.attempt, a.outcome, a.trace_id) for a in attempts] == [
        (1, "delivered", request_trace)]


@pytest.mark.parametrize("http_cls", [HttpHandler, AsyncHttpHandler], ids=["httpx", "aiohttp"])
def test_every_attempt_is_its_own_span_in_the_same_trace(engine: Engine,
                                                         http_cls: Any) -> None:
    exporter = span_exporter()
    exporter.clear()
    with Receiver() as psp:
        registry = Registry()
        registry.register("psp.charge", http_cls(f"{psp.url}/charges", timeout=5.0))
        with trace.get_tracer("tests.request").start_as_current_span("POST /payments"), \
                engine.begin() as conn:
            enq = enqueue(conn, "psp.charge", {"payment_id": "p-2", "amount": 5}, queue=QUEUE)
        # First attempt: 503 with Retry-After: 0, so the retry is due at once.
        psp.set_mode("status", key=enq.effect_key, status=503, retry_after="0", times=1)
        _drain(engine, registry)
        deliveries = psp.ledger(enq.effect_key)["deliveries"]

    (enq_span,) = _spans(f"enqueue {QUEUE}")
    spans = sorted(_spans(f"deliver {QUEUE}"),
                   key=lambda s: (s.attributes or {})["outbox.attempt"])
    assert [(s.attributes or {})["outbox.outcome"] for s in spans] == ["retry", "delivered"]
    assert spans[0].attributes is not None
    assert spans[0].attributes["http.response.status_code"] == 503
    # The failed attempt is an ERROR, typed; the delivered one is not.
    assert spans[0].status.status_code is StatusCode.ERROR
    assert spans[0].attributes["error.type"] == "outbox.errors.RetryAfter"
    assert spans[1].status.status_code is StatusCode.UNSET
    assert "error.type" not in (spans[1].attributes or {})
    trace_id = _hex_trace(enq_span)
    for s in spans:
        assert _hex_trace(s) == trace_id
        assert s.parent is not None and s.parent.span_id == enq_span.context.span_id
    assert len({_hex_span(s) for s in spans}) == 2

    # Each HTTP attempt's CLIENT span is a child of its own deliver span.
    assert [d["attempt"] for d in deliveries] == ["1", "2"]
    assert [d["traceparent"].split("-")[1] for d in deliveries] == [trace_id, trace_id]
    ours = {_hex_span(s): s for s in span_exporter().get_finished_spans()}
    clients = [ours[d["traceparent"].split("-")[2]] for d in deliveries]
    assert [c.parent.span_id if c.parent else None for c in clients] == [
        s.context.span_id for s in spans]
    with engine.connect() as conn:
        attempts = fx.attempts_of(conn, enq.id)
    assert [(a.outcome, a.trace_id) for a in attempts] == [
        ("retry", trace_id), ("delivered", trace_id)]


def test_one_trace_from_the_api_request_to_the_receivers_request(engine: Engine) -> None:
    """The example service, served by uvicorn: its FastAPI SERVER span is the root of
    one trace that runs through `enqueue`, every `deliver` attempt (the failed one an
    ERROR) and the httpx CLIENT span to the receiver's own SERVER span."""
    from dispatcher.examples.payments.app import create_app
    from dispatcher.examples.payments.auth import BearerTokens
    from tests.test_http import serving

    exporter = span_exporter()
    exporter.clear()
    app = create_app(engine, auth=BearerTokens({"tok": "alice"}))
    with Receiver() as psp, serving(app) as base:
        reply = httpx.post(f"{base}/payments", timeout=10,
                           json={"amount": 1200, "currency": "EUR", "customer": "c-1"},
                           headers={"Idempotency-Key": str(uuid.uuid4()),
                                    "Authorization": "Bearer tok"})
        assert reply.status_code == 201, reply.text
        with engine.connect() as conn:
            charge_key = conn.execute(text(
                "SELECT effect_key FROM outbox.effects WHERE kind = 'psp.charge' "
                "AND payload->>'payment_id' = :id"),
                {"id": str(reply.json()["id"])}).scalar_one()
        psp.set_mode("status", key=charge_key, status=503, retry_after="0", times=1)
        registry = Registry()
        registry.register("psp.charge", HttpHandler(f"{psp.url}/charges", timeout=5.0))
        registry.register("email.receipt", HttpHandler(f"{psp.url}/emails", timeout=5.0))
        _drain(engine, registry, queue="default")
        assert [d["status"] for d in psp.ledger(charge_key)["deliveries"]] == [503, 201]

    spans = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans if s.context is not None}

    def ancestors(span: ReadableSpan) -> list[ReadableSpan]:
        chain = []
        while span.parent is not None and span.parent.span_id in by_id:
            span = by_id[span.parent.span_id]
            chain.append(span)
        return chain

    (server,) = [s for s in spans if s.kind is SpanKind.SERVER and s.name == "POST /payments"]
    assert server.parent is None  # the root: nothing before the API request
    assert (server.attributes or {}).get("http.route") == "/payments"
    trace_id = server.context.trace_id
    creates = [s for s in spans if s.name == "enqueue default"]
    assert len(creates) == 2  # the charge and the receipt
    for create in creates:
        assert create.kind is SpanKind.PRODUCER and create.context.trace_id == trace_id
        assert server in ancestors(create)
    delivers = sorted((s for s in spans if s.name == "deliver default"
                       and (s.attributes or {}).get("outbox.kind") == "psp.charge"),
                      key=lambda s: (s.attributes or {})["outbox.attempt"])
    assert [s.status.status_code for s in delivers] == [StatusCode.ERROR, StatusCode.UNSET]
    for deliver in delivers:
        assert deliver.context.trace_id == trace_id
        assert deliver.parent is not None and by_id[deliver.parent.span_id] in creates
        (client,) = [s for s in spans if s.kind is SpanKind.CLIENT and s.parent is not None
                     and s.parent.span_id == deliver.context.span_id]
        (received,) = [s for s in spans if s.kind is SpanKind.SERVER
                       and s.parent is not None
                       and s.parent.span_id == client.context.span_id]
        assert received.context.trace_id == trace_id
        assert ancestors(received)[:3] == [client, deliver,
                                           by_id[deliver.parent.span_id]]
        status = (received.attributes or {})["http.response.status_code"]
        assert (client.attributes or {}).get("http.response.status_code",
                                              (client.attributes or {}).get(
                                                  "http.status_code")) == status
    assert (delivers[0].attributes or {})["error.type"] == "outbox.errors.RetryAfter"


# --------------------------------------------------------------------------- metrics


def test_deliveries_counter_by_outcome(engine: Engine) -> None:
    reader = metric_reader()
    before = counter_points(reader, "outbox.deliveries", "outcome")
    lag_before = sum(p.count for p in metric_points(reader, "outbox.delivery.lag"))

    registry = Registry()
    registry.register("t.ok", lambda e: {"ok": True})

    def permanent(effect: EffectContext) -> Any:
        raise PermanentFailure("no such account", http_status=422)

    def steal_lease(effect: EffectContext) -> Any:
        # Another worker rescues our row (its lease looks expired to it): our outcome
        # is fenced and recorded as lease_lost.
        with engine.begin() as conn:
            stolen = dsql.claim_due(conn, queue=QUEUE, limit=10, owner="thief",
                                    lease_seconds=30.0,
                                    now=datetime.now(UTC) + timedelta(hours=1))
        assert [r.id for r in stolen] == [effect.id]
        return {"ok": True}

    registry.register("t.permanent", permanent)
    registry.register("t.steal", steal_lease)
    with engine.begin() as conn:
        enqueue(conn, "t.ok", {"n": 1}, queue=QUEUE)
        enqueue(conn, "t.ok", {"n": 2}, queue=QUEUE)
        enqueue(conn, "t.permanent", {"n": 3}, queue=QUEUE)
    _drain(engine, registry)
    with engine.begin() as conn:
        enqueue(conn, "t.steal", {"n": 4}, queue=QUEUE)
    d = _drain(engine, registry)
    assert d.stats.lease_lost == 1

    after = counter_points(reader, "outbox.deliveries", "outcome")
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert {k: v for k, v in delta.items() if v} == {"delivered": 2, "failed": 1,
                                                     "lease_lost": 1}
    # Delivery duration by kind/outcome, and lag only for delivered attempts.
    # Recorded attempts carry kind and queue as well as the outcome.
    labelled = metric_points(reader, "outbox.deliveries")
    assert any(dict(p.attributes) == {"kind": "t.permanent", "queue": QUEUE,
                                      "outcome": "failed"} for p in labelled)
    durations = metric_points(reader, "outbox.delivery.duration")
    assert any(dict(p.attributes) == {"kind": "t.permanent", "queue": QUEUE,
                                      "outcome": "failed"} for p in durations)
    lag_after = sum(p.count for p in metric_points(reader, "outbox.delivery.lag"))
    assert lag_after - lag_before == 3  # two t.ok and the (fenced) t.steal delivery
    # Buckets are in seconds, from the instruments' advisory boundaries: this provider
    # (like an application's own) has no View of ours.
    lag = metric_points(reader, "outbox.delivery.lag")[0]
    assert tuple(lag.explicit_bounds) == LAG_BUCKETS
    assert tuple(durations[0].explicit_bounds) == DURATION_BUCKETS
    # The conventions' own histogram, with error.type on failed attempts.
    processed = metric_points(reader, "messaging.process.duration")
    assert any(dict(p.attributes).get("error.type") == "outbox.errors.PermanentFailure"
               and dict(p.attributes)["messaging.destination.name"] == QUEUE
               for p in processed)


def _fresh_reader() -> tuple[MeterProvider, InMemoryMetricReader]:
    reader = InMemoryMetricReader()
    return MeterProvider(metric_readers=[reader]), reader


def _gauges(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    names = ("outbox.queue.effects", "outbox.queue.due", "outbox.queue.oldest_due_age",
             "outbox.queue.expired_leases", "outbox.idempotency.stale_processing")
    data = reader.get_metrics_data()
    out: dict[str, list[Any]] = {n: [] for n in names}
    for rm in data.resource_metrics if data is not None else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name in out:
                    out[m.name].extend(m.data.data_points)
    return out


def _seed_queue(engine: Engine) -> None:
    """pending 3 (2 due, the oldest 120 s), in_flight 1 (lease expired), failed 1,
    needs_review 1, and one stale `processing` idempotency key."""
    registry = Registry()

    def permanent(effect: EffectContext) -> Any:
        raise PermanentFailure("rejected")

    def ambiguous(effect: EffectContext) -> Any:
        raise AmbiguousOutcome("timed out after sending")

    registry.register("t.permanent", permanent)
    registry.register("t.ambiguous", ambiguous, retry_safe=False)
    with engine.begin() as conn:
        enqueue(conn, "t.permanent", {}, queue=QUEUE)
        enqueue(conn, "t.ambiguous", {}, queue=QUEUE)
    _drain(engine, registry)

    past = datetime.now(UTC) - timedelta(seconds=120)
    with engine.begin() as conn:
        for i in range(3):
            enqueue(conn, "t.parked", {"i": i}, queue="parked", clock=lambda: past)
        enqueue(conn, "t.later", {}, queue="parked", delay=3600)
        # A worker claimed one 120 s ago with a 10 s lease and died.
        dsql.claim_due(conn, queue="parked", limit=1, owner="dead", lease_seconds=10.0,
                       now=past)
        kx.claim_key(scope="POST /payments", key="stuck", fingerprint="f",
                     token=uuid.uuid4(), ttl_seconds=60.0, retention_seconds=86400.0,
                     generation=uuid.uuid4(), now=past).run(conn)
        # Claimed as long ago, but with a TTL of an hour: not stale (its own TTL counts).
        kx.claim_key(scope="POST /payments", key="slow", fingerprint="f",
                     token=uuid.uuid4(), ttl_seconds=3600.0, retention_seconds=86400.0,
                     generation=uuid.uuid4(), now=past).run(conn)
        kx.claim_key(scope="POST /payments", key="fresh", fingerprint="f",
                     token=uuid.uuid4(), ttl_seconds=60.0, retention_seconds=86400.0,
                     generation=uuid.uuid4()).run(conn)


def test_queue_gauges_report_what_operators_watch(engine: Engine) -> None:
    _seed_queue(engine)
    provider, reader = _fresh_reader()
    gauges = register_queue_gauges(engine, meter_provider=provider, ttl=5.0)
    got = _gauges(reader)
    effects = got["outbox.queue.effects"]
    assert {p.attributes["status"]: p.value for p in effects} == {
        "pending": 3, "in_flight": 1, "failed": 1, "needs_review": 1}
    assert point_value(got["outbox.queue.due"]) == 2
    assert 115 <= point_value(got["outbox.queue.oldest_due_age"]) < 600
    assert point_value(got["outbox.queue.expired_leases"]) == 1
    assert point_value(got["outbox.idempotency.stale_processing"]) == 1
    # Six gauges' callbacks, one database read: the snapshot is shared and cached.
    _gauges(reader)
    assert gauges.reads == 1
    provider.shutdown()


def test_queue_gauges_cache_and_outage(engine: Engine) -> None:
    now = [1000.0]
    provider, reader = _fresh_reader()
    gauges = QueueGauges(engine, ttl=5.0, meter=provider.get_meter("t"),
                         clock=lambda: now[0])
    assert point_value(_gauges(reader)["outbox.queue.due"]) == 0
    with engine.begin() as conn:
        enqueue(conn, "t.x", {}, queue="q")
    now[0] += 4.9
    assert point_value(_gauges(reader)["outbox.queue.due"]) == 0  # cached
    now[0] += 0.2
    assert point_value(_gauges(reader)["outbox.queue.due"]) == 1  # refreshed
    assert gauges.reads == 2
    provider.shutdown()

    # Database unreachable: no points (the series goes stale), no exception, and one
    # attempt per ttl however often it is collected.
    dead = create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none", poolclass=NullPool,
                         connect_args={"connect_timeout": 2})
    provider, reader = _fresh_reader()
    down = QueueGauges(dead, ttl=5.0, meter=provider.get_meter("t"), clock=lambda: now[0])
    assert all(points == [] for points in _gauges(reader).values())
    _gauges(reader)
    assert down.reads == 1
    provider.shutdown()


def test_register_queue_gauges_once_per_process_on_the_global_meter(engine: Engine) -> None:
    reader = metric_reader()
    first = register_queue_gauges(engine)
    assert register_queue_gauges(engine) is first
    effects = metric_points(reader, "outbox.queue.effects")
    assert {p.attributes["status"] for p in effects} == {
        "pending", "in_flight", "failed", "needs_review"}


def test_celery_dispatcher_for_registers_the_gauges(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    from dispatcher import celery_app

    seen: list[Any] = []
    monkeypatch.setattr(celery_app, "register_queue_gauges",
                        lambda engine, **_: seen.append(engine))
    monkeypatch.setattr(celery_app, "_dispatchers", {})
    d = celery_app.dispatcher_for("gauges-test")
    try:
        assert seen == [d.engine]
    finally:
        d.shutdown(0.0)
        d.engine.dispose()


def test_outbox_worker_exports_queue_gauges(db_url: str) -> None:
    """`outbox worker` with OTEL_METRICS_EXPORTER=console prints our gauges."""
    env = dict(os.environ, DATABASE_URL=db_url, OTEL_METRICS_EXPORTER="console",
               OTEL_METRIC_EXPORT_INTERVAL="200", OTEL_TRACES_EXPORTER="none",
               OTEL_SERVICE_NAME="outbox-worker-test", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "dispatcher.cli", "worker", "--poll", "0.2"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if '"outbox.queue.oldest_due_age"' in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert seen.wait(20), "no gauge exported:\n" + "".join(lines[-40:])
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(5)
    text = "".join(lines)
    for name in ("outbox.queue.effects", "outbox.queue.due", "outbox.queue.expired_leases",
                 "outbox.idempotency.stale_processing"):
        assert f'"{name}"' in text
    assert '"service.name": "outbox-worker-test"' in text
    first = text[text.index("{"):]
    decoder = json.JSONDecoder()
    doc, _ = decoder.raw_decode(first)
    assert doc["resource_metrics"]


_NO_SDK_ENQUEUE = """
import json, sys
from opentelemetry import context, propagate
from sqlalchemy import create_engine, text
from outbox import enqueue
from outbox._telemetry import tracing_enabled
assert not tracing_enabled()
engine = create_engine(sys.argv[1])
upstream = propagate.extract({"traceparent": sys.argv[2]})
token = context.attach(upstream)  # a request whose traceparent was read, no SDK
with engine.begin() as conn:
    print(json.dumps({"id": enqueue(conn, "no-sdk.kind", {"a": 1}).id}))
context.detach(token)
"""


def test_without_an_sdk_the_row_carries_the_callers_trace_context(
        db_url: str, engine: Engine) -> None:
    """No SDK: no enqueue span is built (the API's would be the caller's context), and
    the row still carries the caller's traceparent for the delivery to continue."""
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", _NO_SDK_ENQUEUE, db_url, traceparent],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    effect_id = json.loads(out.stdout)["id"]
    with engine.connect() as conn:
        headers = conn.execute(text("SELECT headers FROM outbox.effects WHERE id = :id"),
                               {"id": effect_id}).scalar_one()
    assert headers["traceparent"] == traceparent
