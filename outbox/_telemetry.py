"""OpenTelemetry instruments shared by the library and the dispatcher.

The API package is a no-op until the application installs an SDK provider, so the
library never configures exporters itself (`outbox.telemetry_setup` does, for the CLI).
"""

from __future__ import annotations

import threading

from opentelemetry import metrics, trace

from outbox.errors import ConfigurationError

tracer = trace.get_tracer("outbox")
meter = metrics.get_meter("outbox")

# The OpenTelemetry messaging conventions (semconv 1.30+): an effect is a message,
# its queue the destination. `enqueue` creates messages (a PRODUCER span, operation
# type `create`: they are sent later, by a dispatcher), `deliver` processes one (a
# CONSUMER span, type `process`, parented to the creating span through the row's
# traceparent). Span names are `{operation name} {queue}`: the queue is a low-
# cardinality destination an operator names.
MESSAGING_SYSTEM = "pg_outbox"
ENQUEUE = "enqueue"
DELIVER = "deliver"


def tracing_enabled() -> bool:
    """Whether spans are recorded in this process (an SDK TracerProvider is installed,
    by us or by the application). Instrumentations cost CPU even when every span is a
    no-op (httpx's: about 0.45 ms per request), so ours are only turned on then."""
    provider = trace.get_tracer_provider()
    return not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def messaging_attributes(operation_type: str, operation_name: str,
                         queue: str | None) -> dict[str, str]:
    """The `messaging.*` attributes every span of ours carries."""
    attributes = {"messaging.system": MESSAGING_SYSTEM,
                  "messaging.operation.type": operation_type,
                  "messaging.operation.name": operation_name}
    if queue is not None:
        attributes["messaging.destination.name"] = queue
    return attributes


def span_name(operation_name: str, queue: str | None) -> str:
    """`deliver payments`, or the bare operation when a batch spans several queues."""
    return operation_name if queue is None else f"{operation_name} {queue}"


def error_type(exc: BaseException) -> str:
    """`error.type` as the conventions ask: the exception's fully qualified class name
    (low cardinality, never the message, which may carry data)."""
    cls = type(exc)
    return cls.__qualname__ if cls.__module__ == "builtins" else (
        f"{cls.__module__}.{cls.__qualname__}")


# Histogram boundaries in seconds, given to the API as advisory boundaries: any
# MeterProvider, the application's own included, aggregates with them unless a View
# says otherwise (the SDK's defaults are shaped for milliseconds: 0, 5, 10, 25 ...,
# so every attempt would land in the first bucket).
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                    60.0)
LAG_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
               3600.0, 21600.0, 86400.0)
#: Inbox writes take a millisecond or two alone and tens to hundreds under a hot key
#: (docs/benchmarks.md): finer at the bottom than DURATION_BUCKETS, so p50/p95/p99 of a
#: quiet source do not all land in the first bucket.
WRITE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                 10.0, 30.0)

idempotency_requests = meter.create_counter(
    "outbox.idempotency.requests",
    description="Guarded requests by outcome: executed, replayed, in_progress, "
    "mismatch, taken_over, claim_lost, released",
)
# Issue 15: requests whose business identity (`same_request=`) matched another key of
# the same scope within the window. One label, `mode` (atomic | phased): the scope and
# the keys are unbounded and stay in the span event and the log line.
suspected_duplicates = meter.create_counter(
    "outbox.idempotency.suspected_duplicates",
    description="Guarded requests whose business identity matched another key of the "
    "same scope within the window (a client making up a new key per retry), by mode",
)
effects_enqueued = meter.create_counter(
    "outbox.effects.enqueued", description="Effects written by enqueue(), by kind and result")
deliveries = meter.create_counter(
    "outbox.deliveries",
    description="Recorded delivery attempts by kind, queue and outcome (delivered, retry, "
    "failed, ambiguous, lease_lost)",
)
delivery_duration = meter.create_histogram(
    "outbox.delivery.duration", unit="s",
    description="Handler time per attempt, by kind, queue and outcome",
    explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
delivery_lag = meter.create_histogram(
    "outbox.delivery.lag", unit="s", description="Enqueue-to-delivered time, by kind and queue",
    explicit_bucket_boundaries_advisory=LAG_BUCKETS)
# The conventions' own instrument, for dashboards built on them: the same time as
# outbox.delivery.duration, labelled messaging.* and error.type.
process_duration = meter.create_histogram(
    "messaging.process.duration", unit="s",
    description="Duration of processing (delivering) one effect",
    explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
inbox_events = meter.create_counter(
    "outbox.inbox.events", description="Ingested events by source and outcome")
inbox_write_duration = meter.create_histogram(
    "outbox.inbox.write.duration", unit="s",
    description="Time of one ingest() / ingest_many() call in the caller's transaction "
    "(lock waits included, commit not), by source",
    explicit_bucket_boundaries_advisory=WRITE_BUCKETS)

# `source` on the inbox metrics comes from the sender (a URL path segment): a name
# becomes a series only once code registered it, every other name is counted as
# OTHER_SOURCE, so arbitrary names cannot exhaust the backend's series limit.
OTHER_SOURCE = "other"
MAX_SOURCE_LABELS = 1_000
_source_labels: set[str] = set()
_source_labels_lock = threading.Lock()


def register_source_label(name: str) -> None:
    """Let `name` be its own `source` label (done by `Inbox.handler`, `WebhookSources`)."""
    with _source_labels_lock:
        if name not in _source_labels and len(_source_labels) >= MAX_SOURCE_LABELS:
            raise ConfigurationError(f"more than {MAX_SOURCE_LABELS} source labels registered")
        _source_labels.add(name)


def source_label(name: str) -> str:
    """The metric label for `name`: itself if registered, else OTHER_SOURCE."""
    return name if name in _source_labels else OTHER_SOURCE
