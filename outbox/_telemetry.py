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
    description="Delivery attempts by kind and outcome (delivered, retry, failed, "
    "lease_lost, ambiguous)",
)
delivery_duration = meter.create_histogram(
    "outbox.delivery.duration", unit="s", description="Handler time per attempt")
delivery_lag = meter.create_histogram(
    "outbox.delivery.lag", unit="s", description="Enqueue-to-delivered time")
inbox_events = meter.create_counter(
    "outbox.inbox.events", description="Ingested events by source and outcome")
inbox_write_duration = meter.create_histogram(
    "outbox.inbox.write.duration", unit="s",
    description="Time of one ingest() / ingest_many() call in the caller's transaction "
    "(lock waits included, commit not), by source")

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
