"""Queue gauges for operators, and the metrics SDK setup for our own processes.

The counters and histograms in `outbox._telemetry` say what the workers did; these
observable gauges say what the database holds: effects by live status, due rows and the
age of the oldest one, expired leases, and idempotency claims stuck in `processing`.
They are read with the same statements as `outbox status` (outbox/sql/), at most once
per `ttl` seconds per process, however many gauges or readers collect meanwhile.

The values are database-wide, so every worker process reports the same numbers (one
series per `service.instance.id`): aggregate with `max()`, never `sum()`, in queries.
`outbox worker` labels every gauge with `db`, the database's short name (issue 17: one
process may serve several databases, `outbox worker --database`; one set of gauges
reads each of them, `QueueGauges.add`): split or filter by `db`, and take `max()`
across processes per `db`.
The same snapshot reads the lock waits on our tables from `pg_locks` (issue 15:
`outbox.db.lock_waits`, `outbox.db.lock_wait_age`, per table; outbox/sql/locks.py),
and table health (issue 12, outbox/sql/health.py): live and dead tuples and the age of
the last (auto)vacuum per table, and the xmin horizon by kind of holder (sessions,
replication slots, prepared transactions) in transactions and, where known, seconds:
the long transaction that keeps VACUUM from removing what the workers delete.

Pool occupancy is per process: `instrument_pool(engine)` attaches the maintained
OpenTelemetry SQLAlchemy instrumentation (the `otel` extra), which exports
`db.client.connections.usage` (idle / used), and registers `db.client.connections.max`
(the pool's size + overflow) beside it, so a panel can show used / max.

`configure_metrics()` installs an SDK MeterProvider when `OTEL_METRICS_EXPORTER` is
`otlp` (to `OTEL_EXPORTER_OTLP_ENDPOINT`, the compose file's collector) or `console`;
unset or `none`: nothing is installed and every instrument stays a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Meter, MeterProvider, Observation
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from outbox import _telemetry
from outbox._redact import redact_secrets
from outbox._schema import metadata
from outbox.sql import effects as fx
from outbox.sql import health as hx
from outbox.sql import keys as kx
from outbox.sql import locks as lx
from outbox.sql import watch as wx

log = logging.getLogger("outbox.metrics")

#: Effect statuses reported by `outbox.queue.effects` (the ones an operator acts on;
#: delivered and cancelled only grow until `outbox purge`).
GAUGE_STATUSES = ("pending", "in_flight", "failed", "needs_review")
DEFAULT_TTL = float(os.environ.get("OUTBOX_METRICS_CACHE_SECONDS", "5"))
#: A `processing` idempotency claim older than this is stale (the guard's default TTL).

# Boundaries live with the instruments (advisory, so any MeterProvider uses them).
DURATION_BUCKETS = _telemetry.DURATION_BUCKETS
LAG_BUCKETS = _telemetry.LAG_BUCKETS
WRITE_BUCKETS = _telemetry.WRITE_BUCKETS
#: The tables lock waits are reported for (a bounded `table` label).
LOCK_TABLES = tuple(sorted(t.name for t in metadata.tables.values()))


@dataclass(frozen=True, slots=True)
class QueueSnapshot:
    """One read of the queue's health (what the gauges report)."""

    effects: dict[str, int]
    due: int
    oldest_due_age_seconds: float
    expired_leases: int
    stale_processing_keys: int
    taken_at: float  # monotonic
    # Per table of ours: sessions waiting for a lock, and the longest wait (seconds).
    lock_waits: dict[str, lx.LockWaits] = field(default_factory=dict)
    # Per table of ours: tuples and vacuum ages; per kind of holder: the xmin horizon.
    tables: dict[str, hx.TableHealth] = field(default_factory=dict)
    horizon: dict[str, hx.HorizonHolder] = field(default_factory=dict)
    # Per queue (its name, or `#<hashtext>`): the workers keeping watch over it.
    watchers: dict[str, int] = field(default_factory=dict)


def read_snapshot(engine: Engine, *, taken_at: float | None = None) -> QueueSnapshot:
    """Query the database once (seven short statements on one connection)."""
    with engine.connect() as conn:
        counts = fx.count_effects(conn)
        health = fx.effect_health(conn)
        keys = kx.count_keys().run(conn)  # stale by each claim's own TTL
        waits = lx.lock_waits().run(conn)
        tables = hx.table_health().run(conn)
        horizon = hx.xmin_horizon().run(conn)
        watching = wx.watchers().run(conn)
    watchers: dict[str, int] = {}
    for w in watching:
        watchers[w.label] = watchers.get(w.label, 0) + 1
    return QueueSnapshot(
        effects={s: int(counts.get(s, 0)) for s in GAUGE_STATUSES},
        due=int(health["due"]),
        oldest_due_age_seconds=float(health["oldest_due_age_seconds"]),
        expired_leases=int(health["expired_leases"]),
        stale_processing_keys=int(keys["stale_processing"]),
        taken_at=time.monotonic() if taken_at is None else taken_at,
        lock_waits=waits,
        tables={t: h for t, h in tables.items() if t in LOCK_TABLES},
        horizon=horizon,
        watchers=watchers,
    )


class _Source:
    """One database the gauges read, with its own cache (and lock: a database that
    does not answer delays only its own read)."""

    def __init__(self, engine: Engine, db: str | None) -> None:
        self.engine = engine
        self.labels: dict[str, str] = {} if db is None else {"db": db}
        self.db = db
        self.lock = threading.Lock()
        self.cached: QueueSnapshot | None = None
        self.failed_at: float | None = None
        # Queues seen watched: reported as 0 once their watch ends, not dropped (a
        # series that vanishes reads as "no data", not as "the doorbell rings again").
        self.watched: set[str] = set()


class QueueGauges:
    """Observable gauges over one engine, with a `ttl`-second cache shared by all of them.

    If the database cannot be read, the gauges report nothing for that collection (the
    series goes stale and `absent()` alerts fire) rather than a stale or made-up value;
    failures are also cached for `ttl`, so an outage costs one attempt per `ttl`.

    `db`: a `db` label on every point (the database's short name). `add(engine, db)`
    reads another database into the same gauges, under its own `db` label (an SDK
    meter keeps the first callbacks of an instrument name, so a second set of gauges
    on the same meter would never be read).
    """

    def __init__(self, engine: Engine, *, ttl: float = DEFAULT_TTL,
                 meter: Meter | None = None,
                 clock: Callable[[], float] = time.monotonic, db: str | None = None) -> None:
        self.engine = engine
        self.ttl = ttl
        self.clock = clock
        self.reads = 0  # database reads so far (tests check the cache with it)
        self._lock = threading.Lock()  # guards `_sources` and `reads`
        self._sources = [_Source(engine, db)]
        m = meter or _telemetry.meter
        m.create_observable_gauge(
            "outbox.queue.effects", callbacks=[self._observe_effects], unit="{effect}",
            description="Effects by status: pending, in_flight, failed (dead letters), "
            "needs_review (parked: ambiguous outcomes, or past the receiver's key retention)")
        m.create_observable_gauge(
            "outbox.queue.due", callbacks=[self._observe_due], unit="{effect}",
            description="Pending effects whose available_at has passed")
        m.create_observable_gauge(
            "outbox.queue.oldest_due_age", callbacks=[self._observe_oldest], unit="s",
            description="Age of the oldest due pending effect (0 when none is due)")
        m.create_observable_gauge(
            "outbox.queue.expired_leases", callbacks=[self._observe_expired],
            unit="{effect}",
            description="In-flight effects whose lease expired (a worker died or stalled)")
        m.create_observable_gauge(
            "outbox.idempotency.stale_processing", callbacks=[self._observe_stale],
            unit="{key}",
            description="Idempotency keys in processing for longer than the claim TTL")
        m.create_observable_gauge(
            "outbox.db.lock_waits", callbacks=[self._observe_lock_waits],
            unit="{session}",
            description="Sessions waiting for a lock on an outbox table right now "
            "(pg_locks), by table")
        m.create_observable_gauge(
            "outbox.db.lock_wait_age", callbacks=[self._observe_lock_wait_age], unit="s",
            description="How long the longest current lock wait on an outbox table has "
            "lasted (0 when none), by table")
        m.create_observable_gauge(
            "outbox.db.table.dead_tuples", callbacks=[self._observe_dead], unit="{tuple}",
            description="Dead tuples of each outbox table (pg_stat_user_tables): what "
            "VACUUM has yet to remove, or cannot while the xmin horizon is held")
        m.create_observable_gauge(
            "outbox.db.table.live_tuples", callbacks=[self._observe_live], unit="{tuple}",
            description="Live tuples of each outbox table (pg_stat_user_tables estimate)")
        m.create_observable_gauge(
            "outbox.db.table.last_autovacuum_age", callbacks=[self._observe_autovacuum],
            unit="s", description="Seconds since autovacuum last vacuumed the table "
            "(no value when it never has since the statistics were reset)")
        m.create_observable_gauge(
            "outbox.db.table.last_vacuum_age", callbacks=[self._observe_vacuum], unit="s",
            description="Seconds since the table was last vacuumed, by VACUUM or "
            "autovacuum (no value when never)")
        m.create_observable_gauge(
            "outbox.db.xmin_horizon.age", callbacks=[self._observe_horizon_age],
            unit="{transaction}",
            description="Age in transactions of the oldest xmin held in this database, by "
            "holder: session, replication_slot, prepared_xact (0 when none)")
        m.create_observable_gauge(
            "outbox.db.xmin_horizon.duration", callbacks=[self._observe_horizon_seconds],
            unit="s",
            description="How long the oldest transaction holding the xmin horizon has "
            "been open, by holder: session, prepared_xact (0 when none; slots: unknown)")
        m.create_observable_gauge(
            "outbox.queue.watchers", callbacks=[self._observe_watchers], unit="{worker}",
            description="Workers keeping watch over the queue (claiming every 2 ms while "
            "busy): while one does, the queue's enqueues skip the NOTIFY. By queue; 0 "
            "once a watch seen by this process has ended")

    def add(self, engine: Engine, db: str) -> bool:
        """Read `engine`'s database too, labelled `db`; False if `db` is read already."""
        with self._lock:
            if any(s.db == db for s in self._sources):
                return False
            self._sources = [*self._sources, _Source(engine, db)]
            return True

    @property
    def databases(self) -> list[str | None]:
        """The `db` labels read (None: the first database, unlabelled)."""
        return [s.db for s in self._sources]

    def snapshot(self) -> QueueSnapshot | None:
        """The first database's cached snapshot, refreshed when older than `ttl`; None
        if unreadable."""
        return self._snapshot(self._sources[0])

    def _snapshot(self, source: _Source) -> QueueSnapshot | None:
        with source.lock:
            now = self.clock()
            cached = source.cached
            if cached is not None and now - cached.taken_at < self.ttl:
                return cached
            if source.failed_at is not None and now - source.failed_at < self.ttl:
                return None
            with self._lock:
                self.reads += 1
            try:
                snap = read_snapshot(source.engine, taken_at=now)
            except SQLAlchemyError as exc:
                source.cached, source.failed_at = None, now
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
                on = "" if source.db is None else f" {source.db}"
                log.warning("queue gauges: cannot read the database%s: %s", on,
                            redact_secrets(first))
                return None
            source.cached, source.failed_at = snap, None
            return snap

    def _each(self) -> list[tuple[QueueSnapshot, dict[str, str]]]:
        """(snapshot, labels) of every database that could be read."""
        out = []
        for source in self._sources:
            snap = self._snapshot(source)
            if snap is not None:
                out.append((snap, source.labels))
        return out

    def _observe_effects(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(n, {"status": s, **db}) for snap, db in self._each()
                for s, n in snap.effects.items()]

    def _observe_due(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(snap.due, db) for snap, db in self._each()]

    def _observe_oldest(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(snap.oldest_due_age_seconds, db) for snap, db in self._each()]

    def _observe_expired(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(snap.expired_leases, db) for snap, db in self._each()]

    def _observe_stale(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(snap.stale_processing_keys, db) for snap, db in self._each()]

    def _observe_lock_waits(self, options: CallbackOptions) -> Iterable[Observation]:
        none = lx.LockWaits(0, 0.0)
        return [Observation(snap.lock_waits.get(t, none).sessions, {"table": t, **db})
                for snap, db in self._each() for t in LOCK_TABLES]

    def _observe_lock_wait_age(self, options: CallbackOptions) -> Iterable[Observation]:
        none = lx.LockWaits(0, 0.0)
        return [Observation(snap.lock_waits.get(t, none).longest_seconds,
                            {"table": t, **db})
                for snap, db in self._each() for t in LOCK_TABLES]

    def _observe_dead(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(h.dead_tuples, {"table": t, **db})
                for snap, db in self._each() for t, h in sorted(snap.tables.items())]

    def _observe_live(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(h.live_tuples, {"table": t, **db})
                for snap, db in self._each() for t, h in sorted(snap.tables.items())]

    def _observe_autovacuum(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(h.since_autovacuum, {"table": t, **db})
                for snap, db in self._each() for t, h in sorted(snap.tables.items())
                if h.since_autovacuum is not None]

    def _observe_vacuum(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(h.since_vacuum, {"table": t, **db})
                for snap, db in self._each() for t, h in sorted(snap.tables.items())
                if h.since_vacuum is not None]

    def _observe_watchers(self, options: CallbackOptions) -> Iterable[Observation]:
        out: list[Observation] = []
        for source in self._sources:
            snap = self._snapshot(source)
            if snap is None:
                continue
            with source.lock:  # every queue seen watched here, 0 once its watch ended
                source.watched.update(snap.watchers)
                queues = sorted(source.watched)
            out.extend(Observation(snap.watchers.get(queue, 0),
                                   {"queue": queue, **source.labels}) for queue in queues)
        return out

    def _observe_horizon_age(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(h.xid_age if (h := snap.horizon.get(k)) else 0,
                            {"holder": k, **db})
                for snap, db in self._each() for k in hx.HOLDERS]

    def _observe_horizon_seconds(self, options: CallbackOptions) -> Iterable[Observation]:
        out = []
        for snap, db in self._each():
            for k in hx.HOLDERS:
                h = snap.horizon.get(k)
                if k == "replication_slot":  # a slot has no start time
                    continue
                if h is None:
                    out.append(Observation(0.0, {"holder": k, **db}))
                elif h.seconds is not None:  # else hidden from this role: no value, not 0
                    out.append(Observation(h.seconds, {"holder": k, **db}))
        return out


_lock = threading.Lock()
_process_gauges: QueueGauges | None = None


def register_queue_gauges(engine: Engine, *, ttl: float = DEFAULT_TTL,
                          meter_provider: MeterProvider | None = None,
                          db: str | None = None) -> QueueGauges:
    """Register the queue gauges, once per process on the global meter.

    The values are database-wide, so a second call (another queue's dispatcher in the
    same process) returns the gauges already registered; a second call with another
    `db` label (a worker serving several databases) adds that database to them. `db`
    labels every point with the database's short name. With `meter_provider`, a new
    set is registered on that provider (tests use their own reader this way). On the
    global meter, the engine's pool occupancy is exported too (`instrument_pool`).
    """
    global _process_gauges
    if meter_provider is not None:
        return QueueGauges(engine, ttl=ttl,
                           meter=meter_provider.get_meter("outbox"), db=db)
    instrument_pool(engine)
    with _lock:
        if _process_gauges is None:
            _process_gauges = QueueGauges(engine, ttl=ttl, db=db)
        elif db is not None:
            _process_gauges.add(engine, db)
        return _process_gauges


# -- pool occupancy --------------------------------------------------------------------
#
# Why the maintained instrumentation, and how (tried in issue 15): it works on our
# engines once given the engine itself, `instrument(engine=...)`; its global hook wraps
# `sqlalchemy.create_engine`, which `outbox.make_engine` imported before any hook could
# wrap it, so engines must be passed explicitly. `instrument()` is once per process (a
# second call is refused with a warning), so one engine per process is reported; that
# covers `outbox worker`, a Celery child serving one queue and an API with one engine.
# It counts connections from pool events (connect/checkout/checkin/close), so it must
# be attached before the engine's first connection to start right. It exports no pool
# size, hence `db.client.connections.max` here. Statement spans are not wanted (our own
# spans cover the library; a span per claim statement is worker CPU): it gets a no-op
# tracer provider.

#: What the instrumentation exports (an UpDownCounter, unit "connections", by `state`
#: idle | used and `pool.name`); tests/test_ops.py checks it against the package.
POOL_USAGE_INSTRUMENT = "db.client.connections.usage"


def pool_name(engine: Engine) -> str:
    """The `pool.name` label the instrumentation gives `engine` (no password in it)."""
    logging_name = getattr(engine.pool, "logging_name", None)
    if logging_name:
        return str(logging_name)
    url = engine.url
    return f"{url.drivername or ''}://{url.host or ''}:{url.port or ''}/{url.database or ''}"


class PoolLimits:
    """`db.client.connections.max`: size + max overflow of each instrumented pool."""

    def __init__(self, meter: Meter) -> None:
        self._engines: weakref.WeakSet[Engine] = weakref.WeakSet()
        meter.create_observable_gauge(
            "db.client.connections.max", callbacks=[self._observe], unit="{connection}",
            description="The most connections the pool opens (pool_size + max_overflow), "
            "by pool.name, beside db.client.connections.usage")

    def add(self, engine: Engine) -> None:
        self._engines.add(engine)

    def _observe(self, options: CallbackOptions) -> Iterable[Observation]:
        out = []
        for engine in list(self._engines):
            size = getattr(engine.pool, "size", None)
            overflow = getattr(engine.pool, "_max_overflow", None)  # QueuePool only
            if callable(size) and isinstance(overflow, int) and overflow >= 0:
                out.append(Observation(int(size()) + overflow, {"pool.name": pool_name(engine)}))
        return out


_pool_lock = threading.Lock()
_pool_limits: dict[int, PoolLimits] = {}  # by id of the meter provider (None: global)
_pooled: weakref.WeakSet[Engine] = weakref.WeakSet()


def instrument_pool(engine: Engine, *, meter_provider: MeterProvider | None = None) -> bool:
    """Export `engine`'s pool occupancy: True if it is (now or already) reported.

    Needs `opentelemetry-instrumentation-sqlalchemy` (`pip install pg-outbox[otel]`);
    without it, or when another engine of this process is already instrumented, it logs
    why at INFO and returns False. Call it before the engine's first connection.
    """
    try:
        from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor
        from opentelemetry.trace import NoOpTracerProvider
    except ImportError:
        log.info("pool occupancy is not exported: install pg-outbox[otel] "
                 "(opentelemetry-instrumentation-sqlalchemy)")
        return False
    with _pool_lock:
        instrumentor = SQLAlchemyInstrumentor()
        if instrumentor.is_instrumented_by_opentelemetry:
            if engine in _pooled:
                return True
            log.info("pool occupancy of %s is not exported: the SQLAlchemy instrumentation "
                     "reports one engine per process", pool_name(engine))
            return False
        instrumentor.instrument(engine=engine, meter_provider=meter_provider,
                                tracer_provider=NoOpTracerProvider())
        slot = id(meter_provider) if meter_provider is not None else 0
        limits = _pool_limits.get(slot)
        if limits is None:
            meter = (meter_provider.get_meter("outbox") if meter_provider is not None
                     else _telemetry.meter)
            limits = _pool_limits[slot] = PoolLimits(meter)
        limits.add(engine)
        _pooled.clear()  # an earlier engine's instrumentation was removed (uninstrument)
        _pooled.add(engine)
        return True


def configure_metrics(service_name: str) -> bool:
    """Install a MeterProvider per `OTEL_METRICS_EXPORTER` (otlp|console|none).

    Returns True if this call installed one. Like `outbox.telemetry_setup.configure`
    for traces: a provider already installed (by the application or a test) is kept.
    The export interval is the SDK's `OTEL_METRIC_EXPORT_INTERVAL` (default 60 s).
    """
    choice = os.environ.get("OTEL_METRICS_EXPORTER", "none").strip().lower()
    if choice in ("", "none"):
        return False
    try:  # the SDK comes with `pg-outbox[otel]`: a worker runs without it
        from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
        from opentelemetry.sdk.metrics.export import (
            ConsoleMetricExporter,
            MetricExporter,
            PeriodicExportingMetricReader,
        )
        from opentelemetry.sdk.resources import Resource
    except ImportError:
        log.warning("OTEL_METRICS_EXPORTER=%s needs pg-outbox[otel] (the SDK)", choice)
        return False
    if isinstance(metrics.get_meter_provider(), SdkMeterProvider):
        return False
    exporter: MetricExporter
    if choice == "console":
        exporter = ConsoleMetricExporter()
    elif choice == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                OTLPMetricExporter,
            )
        except ImportError:
            log.warning("OTEL_METRICS_EXPORTER=otlp needs opentelemetry-exporter-otlp-proto-http")
            return False
        exporter = OTLPMetricExporter()
    else:
        log.warning("OTEL_METRICS_EXPORTER=%s is not supported here (otlp, console, none)",
                    choice)
        return False
    attributes = {"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)}
    if "service.instance.id=" not in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        # One series per process (the collector's `instance`): two processes' counters
        # and pools must not land on one series (issue 15's pool occupancy divides a
        # process's used connections by its own max).
        attributes["service.instance.id"] = f"{socket.gethostname()}:{os.getpid()}"
    resource = Resource.create(attributes)
    provider = SdkMeterProvider(resource=resource,
                                metric_readers=[PeriodicExportingMetricReader(exporter)])
    metrics.set_meter_provider(provider)
    return True
