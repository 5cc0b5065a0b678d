"""One OpenTelemetry SDK per test process, shared by every test module that reads spans
or metrics.

OpenTelemetry allows the global TracerProvider and MeterProvider to be set once per
process. Every module imports these helpers instead of setting its own:

* `span_exporter()` returns the single `InMemorySpanExporter`. If some other code has
  already installed an SDK TracerProvider, the exporter is attached to that one.
* `metric_reader()` returns the single `InMemoryMetricReader`. An SDK MeterProvider
  cannot take a reader after it is built, so if someone else installed one first, the
  test is skipped with the reason.

Metric values are cumulative for the whole process, so tests compare before and after
(`counter_points` / `point_value`) instead of expecting absolute numbers.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

_lock = threading.Lock()
_exporter: InMemorySpanExporter | None = None
_reader: InMemoryMetricReader | None = None
_reader_error: str | None = None


def span_exporter() -> InMemorySpanExporter:
    """The process's in-memory span exporter (installing the SDK provider if needed)."""
    global _exporter
    with _lock:
        if _exporter is None:
            provider = trace.get_tracer_provider()
            if not isinstance(provider, TracerProvider):
                trace.set_tracer_provider(TracerProvider())
                provider = trace.get_tracer_provider()  # whoever won, if we raced
            assert isinstance(provider, TracerProvider)
            exporter = InMemorySpanExporter()
            provider.add_span_processor(SimpleSpanProcessor(exporter))
            _exporter = exporter
        return _exporter


def metric_reader() -> InMemoryMetricReader:
    """The process's in-memory metric reader on the global MeterProvider."""
    global _reader, _reader_error
    with _lock:
        if _reader is None and _reader_error is None:
            if isinstance(metrics.get_meter_provider(), MeterProvider):
                _reader_error = ("a MeterProvider was installed before tests/otel_helpers "
                                 "could add its reader")
            else:
                # No Views: our histograms' boundaries are advisory (outbox._telemetry),
                # and a provider like an application's own must pick them up.
                reader = InMemoryMetricReader()
                metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
                _reader = reader
        if _reader is None:
            pytest.skip(_reader_error or "no metric reader")
        return _reader


def metric_points(reader: InMemoryMetricReader, name: str) -> list[Any]:
    """Every data point of metric `name` (all scopes) in one collection."""
    data = reader.get_metrics_data()
    points: list[Any] = []
    if data is None:
        return points
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == name:
                    points.extend(metric.data.data_points)
    return points


def counter_points(reader: InMemoryMetricReader, name: str,
                   by: str) -> dict[str, float]:
    """Sum of a counter's points grouped by one attribute, e.g. `outcome`."""
    out: dict[str, float] = {}
    for p in metric_points(reader, name):
        label = str(p.attributes.get(by))
        out[label] = out.get(label, 0) + p.value
    return out


def point_value(points: list[Any], attributes: Mapping[str, Any] | None = None) -> Any:
    """The value of the single point whose attributes are exactly `attributes`."""
    want = dict(attributes or {})
    found = [p for p in points if dict(p.attributes or {}) == want]
    assert len(found) == 1, f"expected one point with {want}, got {points}"
    return found[0].value
