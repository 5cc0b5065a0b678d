"""Install an OpenTelemetry SDK for our own processes (CLI, worker, example API).

A library must not configure exporters, but our commands should emit by default when
asked: `OTEL_TRACES_EXPORTER=console` prints spans, `otlp` sends them to
`OTEL_EXPORTER_OTLP_ENDPOINT` (the compose file's collector). Unset: no exporter.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

from opentelemetry import trace

from outbox._telemetry import tracing_enabled as tracing_enabled  # re-exported

log = logging.getLogger("outbox.telemetry")


def instrument_fastapi(app: Any) -> bool:
    """The maintained FastAPI instrumentation on `app` (a SERVER span per request, by
    the HTTP conventions), when it is installed and tracing is on."""
    if not tracing_enabled():
        return False
    try:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    except ImportError:
        return False
    FastAPIInstrumentor.instrument_app(app)
    return True


def instrument_library(name: str) -> bool:
    """Turn on the maintained instrumentation `name` ("django", "celery") for this
    process when it is installed and tracing is on; it is global, so only our own
    processes call this (an application instruments its own stack)."""
    if not tracing_enabled():
        return False
    modules = {"django": ("opentelemetry.instrumentation.django", "DjangoInstrumentor"),
               "celery": ("opentelemetry.instrumentation.celery", "CeleryInstrumentor")}
    module, attr = modules[name]
    try:
        instrumentor = getattr(importlib.import_module(module), attr)()
    except ImportError:
        return False
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument()
    return True


def configure(service_name: str) -> bool:
    """Install a TracerProvider per `OTEL_TRACES_EXPORTER`; True if this call did."""
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "none").lower()
    if exporter in ("", "none"):
        return False
    try:  # the SDK comes with `pg-outbox[otel]`; without it there is nothing to export
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        log.warning("OTEL_TRACES_EXPORTER=%s needs pg-outbox[otel] (the SDK)", exporter)
        return False
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return False
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
            return False
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return True
