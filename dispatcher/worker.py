"""`outbox worker`: the delivery loop without Celery, woken by LISTEN/NOTIFY.

NOTIFY is sent inside the enqueueing transaction, so PostgreSQL delivers it only on
commit; polling every `poll_interval` seconds covers missed notifications, scheduled
retries and expired leases. SIGTERM/SIGINT stop claiming, let in-flight deliveries
finish within `grace`, and release the rest so another worker takes them at once.

The LISTEN connection is idle by design, so no bounded call on it ever expires: a
connection gone silent (failover, NAT idle timeout) would just stop ringing. The
listener probes it every `OUTBOX_LISTEN_PROBE_INTERVAL` seconds (one bounded round
trip) and reconnects with backoff when the probe fails; the worker polls meanwhile, so
a lost doorbell costs at most one poll interval (docs/network.md).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import psycopg
from sqlalchemy import Engine, make_url

from dispatcher._core import Dispatcher
from dispatcher.producer import spaced
from dispatcher.watch import Watch
from outbox._config import NOTIFY_CHANNEL, call_timeout_of
from outbox._connections import connect
from outbox.retention import ScheduledRetention
from outbox.sql import dispatch as sql
from outbox.sql import watch as watch_sql

log = logging.getLogger("outbox.worker")

# Seconds between two probes of the idle LISTEN connection. A silent one is found
# within this + the engine's call timeout; polling covers the gap meanwhile.
LISTEN_PROBE_INTERVAL = float(os.environ.get("OUTBOX_LISTEN_PROBE_INTERVAL", "5"))


def _psycopg_dsn(engine: Engine) -> str:
    url = make_url(engine.url).set(drivername="postgresql")
    return url.render_as_string(hide_password=False)


def listen_for_due(engine: Engine, channel: str, wake: threading.Event,
                   stop: threading.Event, queue: str,
                   application_name: str = "outbox-listener", *,
                   probe_interval: float | None = None) -> None:
    """Set `wake` on every NOTIFY for our queue; reconnect with backoff on errors.

    Every `probe_interval` seconds (default `LISTEN_PROBE_INTERVAL`) one `SELECT 1`,
    bounded by the engine's call timeout, proves the connection still carries
    notifications; a probe that fails (a silent peer) or any other error drops the
    connection and reconnects. Each (re)connection rings `wake` once: a NOTIFY sent
    while we were not listening is lost, so the worker looks at once.
    """
    interval = LISTEN_PROBE_INTERVAL if probe_interval is None else probe_interval
    call_timeout = call_timeout_of(engine)
    backoff = 0.1
    while not stop.is_set():
        try:
            with connect(_psycopg_dsn(engine), call_timeout=call_timeout, autocommit=True,
                         application_name=application_name) as conn:
                conn.execute(f"LISTEN {channel}")  # channel is our constant, not input
                backoff = 0.1
                wake.set()
                next_probe = time.monotonic() + interval
                while not stop.is_set():
                    for note in conn.notifies(timeout=min(0.5, interval)):
                        if note.payload in ("", queue):
                            wake.set()
                    if time.monotonic() >= next_probe:
                        conn.probe()  # notifications it receives wait in the backlog
                        next_probe = time.monotonic() + interval
        except psycopg.Error as exc:
            log.warning("listener lost its connection (%s); polling meanwhile", exc)
            stop.wait(backoff)
            backoff = min(backoff * 2, 5.0)


def sweep(engine: Engine) -> list[int]:
    """Dead-letter expired leases that have no attempts left (the poison-loop stop)."""
    with engine.begin() as conn:
        return sql.fail_exhausted_leases(conn)


def run_worker(dispatcher: Dispatcher, *, poll_interval: float = 1.0, grace: float = 10.0,
               stop: threading.Event | None = None, install_signals: bool = True,
               listen: bool = True, application_name: str = "outbox-worker",
               label: str | None = None, watch: bool | None = None) -> None:
    """Run until SIGTERM/SIGINT (or `stop`), then shut down gracefully.

    `listen=False` runs without the LISTEN/NOTIFY doorbell: polling every
    `poll_interval` seconds only (the benchmark's polling-only latency case).
    `watch`: keep watch when busy, silencing the enqueue's NOTIFY (dispatcher/watch.py;
    None: `OUTBOX_WATCH`, on unless "0"); only with `listen`.
    `label`: the database's short name, in log lines and the listener thread's name
    (one of several dispatchers in one process: dispatcher/fleet.py).
    Retention (outbox/retention.py, `OUTBOX_RETENTION*`) runs from the tick on a
    thread of its own; a bad setting refuses to start (ConfigurationError).
    """
    retention = ScheduledRetention.from_env()
    stop = stop or threading.Event()
    if install_signals:
        def on_signal(signum: int, _frame: Any) -> None:
            log.info("signal %s: stop claiming, finishing in-flight deliveries", signum)
            stop.set()
            dispatcher.wake.set()
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    if watch is None:
        watch = os.environ.get("OUTBOX_WATCH", "1") != "0"
    if listen and watch:
        # Busy, the worker keeps watch and enqueuers skip the NOTIFY (dispatcher/watch.py).
        dsn, timeout = _psycopg_dsn(dispatcher.engine), call_timeout_of(dispatcher.engine)
        dispatcher.watch = Watch(dispatcher.queue, lambda: connect(
            dsn, call_timeout=timeout, autocommit=True,
            application_name=watch_sql.application_name(application_name,
                                                         dispatcher.queue)))
    if listen:
        threading.Thread(
            target=listen_for_due, daemon=True,
            name="outbox-listen" if label is None else f"outbox-listen-{label}",
            args=(dispatcher.engine, NOTIFY_CHANNEL, dispatcher.wake, stop, dispatcher.queue,
                  f"{application_name}-listener"),
        ).start()
    last_sweep = 0.0
    sweep_gap = max(poll_interval, 5.0)

    def on_tick() -> None:
        nonlocal last_sweep, sweep_gap
        if time.monotonic() - last_sweep >= sweep_gap:
            last_sweep = time.monotonic()
            try:
                dead = sweep(dispatcher.engine)
            except Exception:
                log.exception("sweep failed")
                return
            finally:
                # The sweep runs on the loop's thread and walks effects_in_flight_idx,
                # which a held xmin horizon fills with dead entries: at most
                # FULL_SCAN_SHARE of the time, like the producer's full scans.
                took = time.monotonic() - last_sweep
                sweep_gap = spaced(took, max(poll_interval, 5.0))
            if dead:
                log.warning("dead-lettered %d effects whose last lease expired", len(dead))
        retention.start_if_due(dispatcher.engine, stop)  # never blocks the loop

    on = "" if label is None else f" database {label}:"
    log.info("worker %s:%s queue=%s concurrency=%d lease=%.0fs", dispatcher.worker_id,
             on, dispatcher.queue, dispatcher.concurrency, dispatcher.lease)
    log.info("retention:%s %s", on, retention.plan.describe() if retention.plan else "off")
    dispatcher.run(stop, poll_interval=poll_interval, grace=grace, on_tick=on_tick)
    retention.join(5.0)  # it stops between two batches once `stop` is set
    log.info("worker %s stopped:%s %s", dispatcher.worker_id, on, dispatcher.stats)
