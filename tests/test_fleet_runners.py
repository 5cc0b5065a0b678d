"""Celery and Django's `manage.py outbox_worker` serving several outbox databases
(issue 17: one fleet, many databases; `outbox worker` itself: tests/test_fleet.py).

`OUTBOX_DATABASES="a=... b=..."` on `celery -A dispatcher.celery_app worker`: each drain
message names its database, the sweep visits every one (a database that is down does not
stop the others'), and the after-commit doorbell rings the database the rows were
committed to. `manage.py outbox_worker --database A --database B`: the fleet of `outbox
worker`, on Django's aliases. Real Celery on Redis, real Django, fresh databases, and the
loopback receiver's ledger of applications per key (each key prefixed with its database).
"""

from __future__ import annotations

import signal
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from dispatcher.celery_tasks import register
from dispatcher.examples.payments.psp import ReceiverProcess
from outbox import enqueue
from outbox._enqueue import remove_doorbell
from outbox.errors import ConfigurationError
from tests.dispatch_support import add_effects, keys, wait_until
from tests.process_support import Proc, Procs, process_group, redis_or_skip
from tests.test_fleet import Db, Server, check_database, delivered

REDIS_URL = "redis://127.0.0.1:6379/11"  # as tests/test_celery_queues.py


@pytest.fixture
def procs(tmp_path: Path, psp_process: ReceiverProcess) -> Iterator[Procs]:
    yield from process_group(tmp_path, psp_process.url, tail=80)


def _producer(celery_queue: str, databases: list[str]) -> Any:
    app = Celery(f"fleet-producer-{uuid.uuid4().hex[:6]}", broker=REDIS_URL,
                 set_as_current=False)
    app.conf.task_default_queue = celery_queue
    return register(app, beat=False, periodic_sweep=False, doorbell=False,
                    databases=databases)


def test_the_doorbell_rings_the_database_the_rows_were_committed_to(
        server: Server) -> None:
    """`where` of the enqueue's connection picks the drain's database; a connection to
    none of them (or an unreadable one) rings a drain that fans out to all."""
    a, b = server.db("a"), server.db("b")
    tasks = _producer("unused", [a.arg(), b.arg()])
    sent: list[dict[str, Any]] = []
    tasks.drain.apply_async = lambda *args, **kw: sent.append(kw["kwargs"])
    tasks.install_doorbell()
    try:
        with a.engine.begin() as conn:
            enqueue(conn, "noop", {"n": 1}, key="ring-a", queue="q1")
        with b.engine.begin() as conn:
            enqueue(conn, "noop", {"n": 2}, key="ring-b", queue="q2")
    finally:
        remove_doorbell(tasks.ring_located)
    assert sent == [{"kick": True, "database": "a"}, {"kick": True, "database": "b"}]

    sent.clear()
    tasks.ring_located("q3", ("elsewhere", 5432, "x"))  # not one of ours: fan out
    assert sent == [{"kick": True}]
    assert tasks.run_drain("q3", True) == {"claimed": 0, "more": False, "rearmed_in": None,
                                           "fanned_out": ["a", "b"]}
    assert sent[1:] == [{"kick": True, "database": "a"}, {"kick": True, "database": "b"}]
    # A message for a database no longer served is dropped with a warning, not retried;
    # so is one naming a database at a worker that serves DATABASE_URL alone (it used
    # to drain its own database instead, and re-arm under the other's name).
    assert tasks.run_drain("q3", False, "gone")["unknown"] == "gone"
    single = _producer("unused", [])
    assert single.databases is None
    assert single.run_drain("q3", False, "a")["unknown"] == "a"


def test_the_sweep_skips_a_database_it_could_not_reach_for_a_while(server: Server) -> None:
    """Reviewed: the sweep visits the databases one after another, so one that does not
    answer cost its connect timeout on every sweep (every 5 s). After a failure it is
    skipped for 5 s, then 10, 20, ... up to a minute; the others are swept as usual."""
    import functools

    from dispatcher.celery_tasks import dispatcher_for

    a, down = server.db("a"), server.db("c", create=False)
    tasks = _producer("unused", [a.arg(), down.arg()])
    sent: list[dict[str, Any]] = []
    tasks.drain.apply_async = lambda *args, **kw: sent.append(kw["kwargs"])
    cache: dict[tuple[int, str, str], Any] = {}
    tasks.dispatcher_for = functools.partial(dispatcher_for, cache=cache,
                                             gauges=lambda *_, **__: None)
    add_effects(a.engine, ["swept"], queue="sweep-q")
    try:
        first = tasks.run_sweep(None)
        assert first["rung"] == ["a/sweep-q"] and tasks._down_for == {"c": 5.0}
        second = tasks.run_sweep(None)  # within 5 s: c is not tried again
        assert second["rung"] == ["a/sweep-q"] and tasks._down_for == {"c": 5.0}
        tasks._down_until["c"] = 0.0  # its wait is over: tried, still down, 10 s now
        tasks.run_sweep(None)
        assert tasks._down_for == {"c": 10.0}
        assert sent.count({"kick": False, "database": "a"}) == 3
    finally:
        for d in cache.values():
            d.shutdown(0)
            d.engine.dispose()


def test_a_bad_databases_entry_is_a_configuration_error(server: Server) -> None:
    with pytest.raises(ConfigurationError, match="--database #1"):
        _producer("unused", ["not a url"])


@pytest.mark.slow
def test_celery_workers_serve_two_databases_exactly_once(
        server: Server, procs: Procs, psp_process: ReceiverProcess) -> None:
    """Doorbell-rung and lost-doorbell effects on both databases, a third database that
    is down the whole time: every effect of a and b delivered, each applied once."""
    redis_or_skip(REDIS_URL, flush=False)
    a, b = server.db("a"), server.db("b")
    down = server.db("c", create=False)  # never created: every connection fails
    databases = [a.arg(), b.arg(), down.arg()]
    celery_queue = f"outbox-fleet-{uuid.uuid4().hex[:8]}"
    # Lost doorbells: rows nobody rang for, committed before the worker starts; only
    # each database's sweep (the one a worker sends itself at start) finds them.
    lost_a, lost_b = keys("a-lost", 20), keys("b-lost", 20)
    add_effects(a.engine, lost_a, kind="psp.charge")
    add_effects(b.engine, lost_b, kind="psp.charge")
    # No periodic sweep after that one: what is rung later is delivered by its doorbell
    # alone, so a doorbell rung at the wrong database would leave its rows undelivered.
    worker = procs.celery_app_worker(
        "fleet-celery", ["-c", "2", "--loglevel", "INFO",
                         "-n", f"fleet-{uuid.uuid4().hex[:6]}@%h"],
        queue=celery_queue, broker=REDIS_URL,
        env={"OUTBOX_DATABASES": " ".join(databases), "OUTBOX_SWEEP_INTERVAL": "3600",
             "OUTBOX_HANDLERS": "tests.fleet_handlers:registry"})
    wait_until(lambda: " ready." in worker.tail(400) or not worker.alive(), 60,
               interval=0.2, message="the worker ready")
    assert worker.alive(), worker.tail()

    # Rung: the producer's doorbell names each one's database.
    tasks = _producer(celery_queue, databases)
    tasks.install_doorbell()
    try:
        rung_a, rung_b = keys("a-rung", 30), keys("b-rung", 30)
        add_effects(a.engine, rung_a, kind="psp.charge", chunk=3)
        add_effects(b.engine, rung_b, kind="psp.charge", chunk=3)
    finally:
        remove_doorbell(tasks.ring_located)
    wait_until(lambda: delivered(a) == 50 and delivered(b) == 50, 60, interval=0.2,
               message=lambda: f"a {delivered(a)}/50, b {delivered(b)}/50")
    check_database(a, [*lost_a, *rung_a], single_attempt=True)
    check_database(b, [*lost_b, *rung_b], single_attempt=True)
    psp_process.assert_exactly_once([*lost_a, *rung_a, *lost_b, *rung_b])
    log = worker.tail(100_000)
    assert "database c unreachable" in log
    assert "raised unexpected" not in log, log[-3000:]


def _manage_py(procs: Procs, a: Db, b: Db, *args: str) -> Proc:
    return procs.spawn(
        "manage-py", [sys.executable, "-m", "django", "outbox_worker", *args],
        {"DATABASE_URL": a.url, "SECOND_DATABASE_URL": b.url,
         "DJANGO_SETTINGS_MODULE": "tests.django_two_databases_settings"})


@pytest.mark.slow
def test_manage_py_outbox_worker_serves_two_aliases_exactly_once(
        server: Server, procs: Procs, psp_process: ReceiverProcess) -> None:
    a, b = server.db("a"), server.db("b")
    on_a, on_b = keys("dj-a", 40), keys("dj-b", 40)
    add_effects(a.engine, on_a, kind="psp.charge", chunk=7)
    add_effects(b.engine, on_b, kind="psp.charge", chunk=7)
    worker = _manage_py(procs, a, b, "--database", "default", "--database", "second",
                        "--concurrency", "4", "--poll", "0.2", "--full-scan-every", "0.5",
                        "--handlers", "tests.fleet_handlers:registry",
                        "--name", "django-fleet-test")
    try:
        wait_until(lambda: delivered(a) == 40 and delivered(b) == 40, 60, interval=0.2,
                   message=lambda: f"a {delivered(a)}/40, b {delivered(b)}/40")
    finally:
        worker.send(signal.SIGTERM)
        code = worker.wait(30)  # (the fixture kills what is left)
    assert code == 0, worker.tail()
    check_database(a, on_a, single_attempt=True)
    check_database(b, on_b, single_attempt=True)
    psp_process.assert_exactly_once([*on_a, *on_b])


def test_manage_py_outbox_worker_names_an_unknown_alias_in_one_line(
        server: Server, procs: Procs) -> None:
    a, b = server.db("a", create=False), server.db("b", create=False)
    worker = _manage_py(procs, a, b, "--database", "default", "--database", "nope")
    code = worker.wait(60)
    output = worker.tail(200)
    assert code == 1, output
    assert "Traceback" not in output and "nope" in output, output
