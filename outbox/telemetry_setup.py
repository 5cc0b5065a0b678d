"""Install an OpenTelemetry SDK for our own processes (CLI, worker, example API).

A library must not configure exporters, but our commands should emit by default when
asked: `OTEL_TRACES_EXPORTER=console` prints spans, `otlp` sends them to
`OTEL_EXPORTER_OTLP_ENDPOINT` (the compose file's collector). Unset: no exporter.
"""

from __future__ import annotations

import logging
import os

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

log = logging.getLogger("outbox.telemetry")


def configure(service_name: str) -> None:
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "none").lower()
    if exporter in ("", "none"):
        return
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME",
                                                                service_name)})
    provider = TracerProvider(resource=resource)
    if exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )
        except ImportError:
            log.warning("OTEL_TRACES_EXPORTER=otlp needs opentelemetry-exporter-otlp-proto-http")
            return
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
