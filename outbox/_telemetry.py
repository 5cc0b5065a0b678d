"""OpenTelemetry instruments shared by the library and the dispatcher.

The API package is a no-op until the application installs an SDK provider, so the
library never configures exporters itself (`outbox.telemetry_setup` does, for the CLI).
"""

from __future__ import annotations

from opentelemetry import metrics, trace

tracer = trace.get_tracer("outbox")
meter = metrics.get_meter("outbox")

idempotency_requests = meter.create_counter(
    "outbox.idempotency.requests",
    description="Guarded requests by outcome: executed, replayed, in_progress, "
    "mismatch, taken_over, claim_lost, released",
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
