"""One dispatcher process for several outbox databases (issue 17, dispatcher/fleet.py).

Real PostgreSQL: every test gets two fresh, migrated databases of its own (a and b) on
the session's server, dropped at the end. The process tests start the real command
(`python -m dispatcher.cli worker --database a=... --database b=...`) and count, at the
real loopback receiver (dispatcher/examples/payments/psp.py, its own process), how
often each effect key was applied: each key is prefixed with its database, so one
ledger proves exactly-once for both.
"""

from __future__ import annotations

import random
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, make_url, text
from sqlalchemy.pool import NullPool

from dispatcher import cli
from dispatcher._core import Dispatcher
from dispatcher.examples.payments.psp import ReceiverProcess
from dispatcher.fleet import (
    DATABASES_ENV,
    Fleet,
    Settings,
    SlotBudget,
    databases_from,
)
from dispatcher.handlers import EffectContext, Registry
from dispatcher.metrics import QueueGauges
from outbox import _migrate
from outbox._config import make_engine
from tests.dispatch_support import add_effects, keys, summarize, wait_until
from tests.otel_helpers import metric_points, metric_reader
from tests.process_support import Proc, Procs, process_group
from tests.tcp_proxy import TcpProxy
from tests.test_faults import pg_upstream, via_proxy

HANDLERS = "tests.fleet_handlers:registry"
SECRET = "s3cret-pw"  # in every URL we give the worker: trust auth ignores it
TABLES = "outbox.attempts, outbox.effect_keys, outbox.effects"


# --------------------------------------------------------------------------- databases


@dataclass
class Db:
    name: str        # the fleet's short name (a, b, ...)
    database: str    # the PostgreSQL database
    url: str         # with SECRET as the password
    engine: Engine

    def arg(self, port: int | None = None) -> str:
        url = make_url(self.url)
        if port is not None:
            url = url.set(port=port)
        return f"{self.name}={url.render_as_string(hide_password=False)}"


class Server:
    """Creates (and drops) databases on the session's server."""

    def __init__(self, db_url: str) -> None:
        self.base = make_url(db_url)
        self.admin = create_engine(self.base.set(database="postgres"),
                                   isolation_level="AUTOCOMMIT", poolclass=NullPool)
        self.made: list[Db] = []

    def db(self, name: str, *, create: bool = True, migrate: bool = True) -> Db:
        database = f"outbox_fleet_{uuid.uuid4().hex[:8]}_{name}"
        url = self.base.set(database=database, password=SECRET).render_as_string(
            hide_password=False)
        if create:
            self.create(database)
        db = Db(name, database, url, make_engine(url, application_name="tests-fleet",
                                                 pool_size=5, max_overflow=10))
        self.made.append(db)
        if create and migrate:
            _migrate.upgrade(url)
        return db

    def create(self, database: str) -> None:
        with self.admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{database}"'))

    def drop_all(self) -> None:
        for db in self.made:
            db.engine.dispose()
            with self.admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{db.database}" WITH (FORCE)'))
        self.admin.dispose()


@pytest.fixture
def two(server: Server) -> tuple[Db, Db]:
    return server.db("a"), server.db("b")


def counts(db: Db) -> dict[str, int]:
    with db.engine.connect() as conn:
        return {r.status: int(r.n) for r in conn.execute(text(
            "SELECT status, count(*) AS n FROM outbox.effects GROUP BY status"))}


def delivered(db: Db) -> int:
    return counts(db).get("delivered", 0)


def check_database(db: Db, expected: Sequence[str], *, single_attempt: bool) -> None:
    """Every effect of `db` delivered; no two attempts of one effect overlapped."""
    with db.engine.connect() as conn:
        bad = conn.execute(text(
            "SELECT effect_key, status FROM outbox.effects WHERE status <> 'delivered'"
            " LIMIT 10")).all()
        assert bad == [], f"{db.name}: not delivered: {bad}"
        n = conn.execute(text("SELECT count(*) FROM outbox.effects")).scalar_one()
        assert n == len(expected)
        overlap = conn.execute(text(
            "SELECT a.effect_id FROM outbox.attempt_history a JOIN outbox.attempt_history b"
            " ON a.effect_id = b.effect_id AND a.id < b.id"
            " WHERE a.outcome <> 'lease_lost' AND b.outcome <> 'lease_lost'"
            "   AND a.started_at < b.finished_at AND b.started_at < a.finished_at"
            " LIMIT 10")).all()
        assert overlap == [], f"{db.name}: overlapping attempts {overlap}"
        if single_attempt:
            multi = conn.execute(text(
                "SELECT effect_key FROM outbox.effects WHERE attempts <> 1 LIMIT 10")).all()
            assert multi == [], f"{db.name}: claimed more than once: {multi}"


def applied_exactly_once(psp: ReceiverProcess, expected: Sequence[str]) -> dict[str, Any]:
    """The receiver applied each expected key once, and nothing else."""
    return psp.assert_exactly_once(expected, allow_extra=False)


# --------------------------------------------------------------------------- processes


@pytest.fixture
def psp(psp_process: ReceiverProcess) -> ReceiverProcess:
    return psp_process


@pytest.fixture
def procs(tmp_path: Path, psp: ReceiverProcess, db_url: str) -> Iterator[Procs]:
    yield from process_group(tmp_path, psp.url, tail=80)


def fleet_worker(procs: Procs, name: str, databases: Sequence[str], *,
                 concurrency: int = 8, lease: float = 10.0, poll: float = 0.5,
                 grace: float = 5.0, env: dict[str, str] | None = None) -> Proc:
    cmd = [sys.executable, "-m", "dispatcher.cli", "worker",
           "--concurrency", str(concurrency), "--lease", str(lease), "--poll", str(poll),
           "--grace", str(grace), "--handlers", HANDLERS, "--name", name]
    for d in databases:
        cmd += ["--database", d]
    return procs.spawn(name, cmd, {"OUTBOX_DATABASE_RETRY_MAX": "1", **(env or {})})


def wait_served(db: Db, name: str, timeout: float = 30.0) -> None:
    """Wait until worker `name` holds a session on `db`."""
    def ready() -> bool:
        with db.engine.connect() as conn:
            return bool(conn.execute(text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name = :n"), {"n": name}).scalar_one())
    wait_until(ready, timeout, interval=0.1, message=f"{name} to connect to {db.name}")


# --------------------------------------------------------------------------- configuration


def test_neither_flag_nor_variable_means_database_url() -> None:
    assert databases_from(None, {}) is None
    assert databases_from([], {DATABASES_ENV: "  \n "}) is None


def test_names_urls_and_the_variable() -> None:
    specs = databases_from(
        [f"postgresql://u:{SECRET}@db1/orders",
         "billing=postgres://u@db2:6543/bill?sslmode=require&password=" + SECRET], {})
    assert specs is not None
    assert [s.name for s in specs] == ["orders", "billing"]
    assert specs[0].url.startswith("postgresql+psycopg://u:")  # kept, for connecting
    assert all(SECRET not in s.shown for s in specs), [s.shown for s in specs]
    assert specs[1].shown.startswith("postgresql://u@db2:6543/bill?")
    env = {DATABASES_ENV: "a=postgresql://h/x, postgresql://h/y\n\tpostgresql://h2/z"}
    from_env = databases_from(None, env)
    assert from_env is not None and [s.name for s in from_env] == ["a", "y", "z"]
    # A comma inside a URL (several hosts, an options value) stays in it.
    commas = databases_from(None, {DATABASES_ENV: (
        "a=postgresql://u@/x?host=h1,h2&target_session_attrs=read-write,"
        "b=postgresql://u@h/y?options=-c%20search_path%3Dp,q , postgresql://h/z")})
    assert commas is not None and [s.name for s in commas] == ["a", "b", "z"]
    assert make_url(commas[0].url).query["host"] == "h1,h2"
    assert make_url(commas[1].url).query["options"] == "-c search_path=p,q"
    for raw in ("postgresql://h/x, postgresql://h/y,", "postgresql://h/x,,y=postgresql://h/y",
                "postgresql://h/x, ,y=postgresql://h/y"):
        trailing = databases_from(None, {DATABASES_ENV: raw})
        assert trailing is not None and [s.name for s in trailing] == ["x", "y"], raw
    # The flags replace the variable.
    flags = databases_from(["q=postgresql://h/q"], env)
    assert flags is not None and [s.name for s in flags] == ["q"]


@pytest.mark.parametrize(("argv", "env", "says"), [
    (["--database", "postgresql://h/a", "--database", "postgresql://other/a"], {},
     "a second database named 'a'"),
    (["--database", f"x=postgresql://u:{SECRET}@h/a", "--database",
      f"y=postgresql://u:{SECRET}@H:5432/a"], {}, "is already served"),
    (["--database", f"u:{SECRET}@h/a"], {}, "not a database URL"),
    (["--database", f"mysql://u:{SECRET}@h/a"], {}, "only PostgreSQL"),
    (["--database", f"postgresql://u:{SECRET}@h:54x/a"], {}, "not a database URL"),
    (["--database", f"postgresql://u:{SECRET}@h/"], {}, "give it a name"),
    (["--database", "a b=postgresql://h/a"], {}, "not a usable database name"),
    (["--database", "a="], {}, "no URL"),
    ([], {DATABASES_ENV: f"postgresql://u:{SECRET}@h/a,postgresql://u@h/a"},
     f"{DATABASES_ENV} entry 2"),
    (["--database", "postgresql://h/a"], {"OUTBOX_DATABASE_RETRY_MAX": "soon"},
     "OUTBOX_DATABASE_RETRY_MAX"),
])
def test_bad_configuration_is_one_line_and_exit_2(
        argv: list[str], env: dict[str, str], says: str,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgresql://nobody@127.0.0.1:1/none")
    monkeypatch.delenv(DATABASES_ENV, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli.main(["worker", "--handlers", HANDLERS, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("outbox: "), err
    assert says in err
    assert SECRET not in err and "Traceback" not in err


def test_the_real_command_refuses_a_duplicate_without_a_traceback(db_url: str) -> None:
    import subprocess

    run = subprocess.run(
        [sys.executable, "-m", "dispatcher.cli", "worker", "--database",
         f"postgresql://u:{SECRET}@h/a", "--database", f"postgresql://u:{SECRET}@h/a"],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[1])
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "a second database" in run.stderr
    assert SECRET not in run.stderr + run.stdout


# --------------------------------------------------------------------------- the budget


class FakeMember:
    def __init__(self, budget: SlotBudget, name: str) -> None:
        self.slots = budget.member(name)
        self.inflight = 0
        self.wake = threading.Event()
        self.slots.in_flight = lambda: self.inflight
        self.slots.wake = self.wake

    def claim(self, want: int, due: int) -> int:
        """Acquire, claim min(granted, due) rows, settle; returns rows in flight now."""
        granted = self.slots.acquire(want)
        got = min(granted, due)
        self.inflight += got
        self.slots.settle(granted, got)
        return got

    def finish(self, n: int = 1) -> None:
        for _ in range(n):
            self.inflight -= 1
            self.slots.release()


def test_a_lone_busy_database_borrows_every_idle_slot() -> None:
    budget = SlotBudget(8, 2)
    a, _b = FakeMember(budget, "a"), FakeMember(budget, "b")
    assert budget.share == 4
    assert a.claim(8, due=1000) == 8   # b is idle: all eight


def test_a_hungry_database_gets_its_share_back_as_borrowed_slots_free() -> None:
    budget = SlotBudget(8, 2)
    a, b = FakeMember(budget, "a"), FakeMember(budget, "b")
    a.claim(8, due=1000)
    assert b.claim(8, due=1) == 0          # everything is lent out: b waits, hungry
    assert budget.snapshot()["b"]["hungry"]
    a.finish()                             # the first slot a frees
    assert b.wake.is_set()                 # ... rings b at once
    assert a.claim(8, due=1000) == 0       # and a may not take it back
    b.wake.clear()
    assert b.claim(8, due=1) == 1          # the trickle's effect gets it
    assert budget.snapshot()["b"]["hungry"]  # (its claim was full: more may be due)
    b.finish()
    assert b.wake.is_set()
    assert a.claim(8, due=1000) == 0       # the freed slot is still b's to take
    assert b.claim(8, due=0) == 0          # b's next claim comes up short: caught up
    assert not budget.snapshot()["b"]["hungry"]
    assert a.claim(8, due=1000) == 1       # and a borrows again


def test_two_busy_databases_converge_to_their_shares() -> None:
    budget = SlotBudget(8, 2)
    a, b = FakeMember(budget, "a"), FakeMember(budget, "b")
    a.claim(8, due=10_000)
    b.claim(8, due=10_000)
    for _ in range(40):  # deliveries finish one at a time; both claim after each
        for m in (a, b):
            if m.inflight:
                m.finish()
            a.claim(8, due=10_000)
            b.claim(8, due=10_000)
            assert a.inflight + b.inflight <= 8
    assert (a.inflight, b.inflight) == (4, 4)


def test_the_budget_never_hands_out_more_than_the_total() -> None:
    rng = random.Random(17)
    for total, k in ((1, 2), (3, 2), (8, 3), (10, 4), (100, 2)):
        budget = SlotBudget(total, k)
        ms = [FakeMember(budget, str(i)) for i in range(k)]
        for _ in range(3000):
            m = rng.choice(ms)
            if m.inflight and rng.random() < 0.5:
                m.finish(rng.randint(1, m.inflight))
            else:
                m.claim(rng.randint(1, total), due=rng.choice((0, 1, 5, 1000)))
            assert sum(x.inflight for x in ms) <= total
            assert all(x.slots.reserved == 0 for x in ms)


def test_a_database_whose_claims_fail_asks_for_one_slot_not_its_share(
        engine: Engine) -> None:
    """A database that goes down after start: its claim sits in its reconnect retries
    (up to 10 s) holding what it was granted. After one failed claim it asks for one
    slot until a claim succeeds, so the healthy database borrows the rest meanwhile
    (a review finding: it kept its whole share reserved through the outage)."""
    from sqlalchemy.exc import OperationalError

    budget = SlotBudget(8, 2)
    mine = budget.member("down")
    d = Dispatcher(engine, Registry(), concurrency=8, max_batch=8, slots=mine)
    mine.bind(d)
    b = FakeMember(budget, "up")
    asked: list[int] = []
    acquire = mine.acquire

    def spy(want: int) -> int:
        asked.append(want)
        return acquire(want)

    mine.acquire = spy  # type: ignore[method-assign]
    borrowed: list[int] = []

    def stuck(limit: int) -> list[Any]:
        # While this claim is stuck, the healthy database claims as much as it may.
        borrowed.append(b.claim(8, due=1000))
        b.finish(b.inflight)
        raise OperationalError("SELECT 1", {}, Exception("server closed the connection"))

    real_claim = d.producer.claim
    d.producer.claim = stuck  # type: ignore[method-assign]
    for _ in range(2):
        with pytest.raises(OperationalError):
            d.fill()
    assert asked == [8, 1]
    assert borrowed == [0, 7]  # the first stuck claim held all 8; the next only one
    d.producer.claim = real_claim  # type: ignore[method-assign]
    assert d.fill() == 0        # back up (nothing due): one slot asked, the flag cleared
    assert d.fill() == 0
    assert asked == [8, 1, 1, 8]
    d.shutdown(grace=1.0)


# --------------------------------------------------------------------------- metrics


def test_gauges_and_delivery_metrics_carry_the_database(two: tuple[Db, Db]) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    a, b = two
    add_effects(a.engine, keys("ga", 3))
    add_effects(b.engine, keys("gb", 5))
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    gauges = QueueGauges(a.engine, ttl=0.0, meter=provider.get_meter("t"), db="a")
    assert gauges.add(b.engine, "b") and not gauges.add(b.engine, "b")
    points = metric_points(reader, "outbox.queue.effects")
    pending = {p.attributes["db"]: p.value for p in points
               if p.attributes["status"] == "pending"}
    assert pending == {"a": 3, "b": 5}
    due = {p.attributes["db"]: p.value for p in metric_points(reader, "outbox.queue.due")}
    assert due == {"a": 3, "b": 5}
    tables = {p.attributes["db"] for p in metric_points(reader, "outbox.db.lock_waits")}
    assert tables == {"a", "b"}
    provider.shutdown()

    # Delivery metrics: `db` beside kind, queue and outcome.
    global_reader = metric_reader()
    registry = Registry()
    registry.register("noop", lambda e: {"ok": True})
    for db in (a, b):
        d = Dispatcher(db.engine, registry, concurrency=2, lease=10.0,
                       metric_labels={"db": db.name})
        try:
            d.drain(5.0)
        finally:
            d.shutdown(0.0)
    for name in ("outbox.deliveries", "outbox.delivery.duration", "outbox.delivery.lag",
                 "messaging.process.duration"):
        got = {p.attributes.get("db") for p in metric_points(global_reader, name)}
        assert {"a", "b"} <= got, (name, got)
    mine = {p.attributes["db"]: p.value for p in metric_points(global_reader,
                                                                "outbox.deliveries")
            if p.attributes.get("db") in ("a", "b")
            and p.attributes.get("outcome") == "delivered"}
    assert mine == {"a": 3, "b": 5}


# --------------------------------------------------------------------------- in process


def test_fleet_in_process_lends_idle_slots_and_serves_a_trickle_at_once(
        two: tuple[Db, Db]) -> None:
    """Four slots, two databases. While b is idle, a's backlog uses all four; once b
    gets a trickle, each of b's effects starts within a slot's turn (a 20 ms delivery
    of a), not after a's backlog; the slots in use never exceed four."""
    a, b = two
    lock = threading.Lock()
    running = {"now": 0, "max": 0, "a_max_alone": 0}
    b_started: dict[str, float] = {}
    trickling = threading.Event()

    def slow(effect: EffectContext) -> dict[str, Any]:
        with lock:
            running["now"] += 1
            running["max"] = max(running["max"], running["now"])
            if not trickling.is_set():
                running["a_max_alone"] = max(running["a_max_alone"], running["now"])
        time.sleep(0.02)
        with lock:
            running["now"] -= 1
        return {}

    def quick(effect: EffectContext) -> dict[str, Any]:
        with lock:
            running["now"] += 1
            running["max"] = max(running["max"], running["now"])
        b_started[effect.key] = time.time()
        with lock:
            running["now"] -= 1
        return {}

    registry = Registry()
    registry.register("slow", slow)
    registry.register("quick", quick)
    add_effects(a.engine, keys("a", 800), kind="slow")  # ~4 s on 4 slots, 8 s on 2
    specs = databases_from([a.arg(), b.arg()], {})
    assert specs is not None
    fleet = Fleet(specs, registry,
                  Settings(concurrency=4, poll_interval=0.5, grace=2.0, gauges=False))
    stop = threading.Event()
    runner = threading.Thread(target=fleet.run, args=(stop,),
                              kwargs={"install_signals": False}, daemon=True)
    runner.start()
    try:
        wait_until(lambda: delivered(a) >= 100, 30, message="a to get going")
        trickling.set()
        sent: dict[str, float] = {}
        for i in range(20):
            key = f"b-{i:03d}"
            sent[key] = time.time()
            add_effects(b.engine, [key], kind="quick")
            time.sleep(0.05)
        wait_until(lambda: len(b_started) == 20, 20, message="b's trickle")
        a_left = counts(a).get("pending", 0)
    finally:
        stop.set()
        runner.join(30)
    assert not runner.is_alive()
    waits = [b_started[k] - sent[k] for k in sent]
    print(f"fleet in process: b's trickle waited {summarize(waits)} s; a had {a_left} "
          f"pending when it was done; slots in use at most {running['max']}, a alone "
          f"{running['a_max_alone']}; budget {fleet.budget.snapshot()}")
    assert a_left > 100, "a's backlog was over before the trickle: not a fairness test"
    assert running["a_max_alone"] == 4      # idle slots were lent
    assert running["max"] <= 4              # never more than the process's total
    assert max(waits) < 1.0, waits          # one slot's turn, not a's backlog
    # Stopped gracefully: no lease left in either database.
    for db in (a, b):
        assert counts(db).get("in_flight", 0) == 0


# --------------------------------------------------------------------------- processes


pytest_slow = pytest.mark.slow


@pytest_slow
def test_one_worker_two_databases_each_effect_applied_once(
        two: tuple[Db, Db], procs: Procs, psp: ReceiverProcess) -> None:
    a, b = two
    n = 300
    ka, kb = keys("a", n), keys("b", n)
    add_effects(a.engine, ka, kind="psp.charge", payload=lambda i, k: {"amount": i + 1})
    add_effects(b.engine, kb, kind="psp.charge", payload=lambda i, k: {"amount": i + 1})
    worker = fleet_worker(procs, "fleet-two", [a.arg(), b.arg()])
    wait_until(lambda: delivered(a) == n and delivered(b) == n, 60,
               message=lambda: f"all delivered: a {counts(a)}, b {counts(b)}")
    stats = applied_exactly_once(psp, ka + kb)
    assert stats["deliveries"] == 2 * n
    check_database(a, ka, single_attempt=True)
    check_database(b, kb, single_attempt=True)
    owners = {}
    for db in (a, b):
        with db.engine.connect() as conn:
            owners[db.name] = set(conn.execute(text(
                "SELECT DISTINCT worker FROM outbox.attempt_history")).scalars())
            apps = set(conn.execute(text(
                "SELECT application_name FROM pg_stat_activity"
                " WHERE datname = current_database()")).scalars())
        assert "fleet-two" in apps and "fleet-two-listener" in apps
    # One lease owner per database, both in the one process.
    assert len(owners["a"]) == 1 and len(owners["b"]) == 1 and owners["a"] != owners["b"]
    assert {o.split(":")[1] for o in owners["a"] | owners["b"]} == {str(worker.pid)}
    worker.send(signal.SIGTERM)
    assert worker.wait(30) == 0
    log = worker.log.read_text()
    assert SECRET not in log
    assert "[a]" in log and "[b]" in log


@pytest_slow
def test_a_trickle_is_not_queued_behind_another_databases_backlog(
        two: tuple[Db, Db], procs: Procs, psp: ReceiverProcess) -> None:
    a, b = two
    add_effects(a.engine, keys("a", 1200), kind="slow", payload=lambda i, k: {"sleep": 0.02})
    fleet_worker(procs, "fleet-fair", [a.arg(), b.arg()], concurrency=4)
    wait_until(lambda: delivered(a) >= 100, 60, message="a's backlog to get going")
    trickle = keys("b", 20)
    for key in trickle:
        add_effects(b.engine, [key], kind="psp.charge", payload=lambda i, k: {"amount": 1})
        time.sleep(0.1)
    wait_until(lambda: delivered(b) == len(trickle), 30, message=lambda: f"b {counts(b)}")
    a_left = counts(a).get("pending", 0)
    with b.engine.connect() as conn:
        lags = [float(x) for x in conn.execute(text(
            "SELECT extract(epoch FROM delivered_at - created_at) FROM outbox.effects")
            ).scalars()]
    print(f"fairness: b's trickle enqueue->delivered {summarize(lags)} s while a still "
          f"had {a_left} pending")
    assert a_left > 100, "a's backlog was over before the trickle: not a fairness test"
    assert max(lags) < 1.5, lags
    applied_exactly_once(psp, trickle)
    wait_until(lambda: delivered(a) == 1200, 120, message=lambda: f"a {counts(a)}")


@pytest_slow
def test_databases_down_or_unmigrated_at_start_do_not_stop_the_others(
        server: Server, two: tuple[Db, Db], procs: Procs, psp: ReceiverProcess) -> None:
    """a is up; b is behind a proxy that resets every connection (down) until it lets
    them through; c does not exist yet, then exists without our schema, then is
    migrated; d (port 1) stays down. Each is served once it can be; each change of
    state is logged once; no password is printed."""
    a, b = two
    c = server.db("c", create=False)
    d = server.db("d", create=False)
    # b's server over TCP or the embedded server's Unix socket: the proxy speaks TCP.
    proxy = TcpProxy(pg_upstream(b.url)).start()
    proxy.set_mode("reset_now")
    try:
        ka, kb, kc = keys("a", 50), keys("b", 50), keys("c", 50)
        add_effects(a.engine, ka, kind="psp.charge", payload=lambda i, k: {"amount": 1})
        add_effects(b.engine, kb, kind="psp.charge", payload=lambda i, k: {"amount": 1})
        worker = fleet_worker(procs, "fleet-down", [a.arg(), f"b={via_proxy(b.url, proxy.port)}",
                                                    c.arg(), d.arg(port=1)])
        wait_until(lambda: delivered(a) == 50, 60, message=lambda: f"a {counts(a)}")
        time.sleep(3)  # several retries of b, c and d (backoff up to 1 s)
        assert counts(b) == {"pending": 50}
        proxy.set_mode("pass")  # b comes back
        wait_until(lambda: delivered(b) == 50, 30, message=lambda: f"b {counts(b)}")
        server.create(c.database)  # c exists, without our schema
        wait_until(lambda: "c (" in worker.log.read_text()
                   and ": unmigrated:" in worker.log.read_text(), 20,
                   message="c to be seen unmigrated")
        _migrate.upgrade(c.url)
        add_effects(c.engine, kc, kind="psp.charge", payload=lambda i, k: {"amount": 1})
        wait_until(lambda: delivered(c) == 50, 30, message=lambda: f"c {counts(c)}")
        applied_exactly_once(psp, ka + kb + kc)
        time.sleep(1.5)
        worker.send(signal.SIGTERM)
        assert worker.wait(30) == 0
    finally:
        proxy.stop()
    log = worker.log.read_text()
    assert SECRET not in log, "a password was printed"

    def changes(name: str) -> list[str]:
        out = []
        for line in log.splitlines():
            if f"database {name} (" not in line:
                continue
            for state in ("up", "down", "unmigrated"):
                if f": {state}" in line:
                    out.append(state)
                    break
        return out

    assert changes("a") == ["up"]
    assert changes("b") == ["down", "up"]
    assert changes("c") == ["down", "unmigrated", "up"]
    assert changes("d") == ["down"]  # retried many times, logged once


@pytest_slow
def test_sigkill_mid_run_then_restart_loses_nothing_and_doubles_nothing(
        two: tuple[Db, Db], procs: Procs, psp: ReceiverProcess) -> None:
    a, b = two
    n = 600
    ka, kb = keys("a", n), keys("b", n)
    for db, ks in ((a, ka), (b, kb)):
        add_effects(db.engine, ks, kind="psp.charge", payload=lambda i, k: {"amount": 1})
    args = [a.arg(), b.arg()]
    first = fleet_worker(procs, "fleet-kill-1", args, lease=2.0)
    wait_until(lambda: delivered(a) >= 50 and delivered(b) >= 50, 60,
               message=lambda: f"a {counts(a)}, b {counts(b)}")
    first.send(signal.SIGKILL)
    first.wait(10)
    at_kill = {db.name: counts(db) for db in (a, b)}
    assert delivered(a) < n or delivered(b) < n, "nothing left to lose: kill earlier"
    fleet_worker(procs, "fleet-kill-2", args, lease=2.0)
    wait_until(lambda: delivered(a) == n and delivered(b) == n, 90,
               message=lambda: f"a {counts(a)}, b {counts(b)}")
    stats = applied_exactly_once(psp, ka + kb)
    check_database(a, ka, single_attempt=False)
    check_database(b, kb, single_attempt=False)
    print(f"SIGKILL with {at_kill}; after restart: applied {stats['applied']}, "
          f"deliveries {stats['deliveries']}, replayed {stats.get('replayed')}")


@pytest_slow
def test_sigterm_releases_leases_in_every_database(
        two: tuple[Db, Db], procs: Procs) -> None:
    a, b = two
    for db in (a, b):
        add_effects(db.engine, keys(db.name, 6), kind="slow",
                    payload=lambda i, k: {"sleep": 3.0})
    worker = fleet_worker(procs, "fleet-term", [a.arg(), b.arg()], concurrency=4,
                          lease=30.0, grace=0.5)

    def both_in_flight() -> bool:
        return all(counts(db).get("in_flight", 0) > 0 for db in (a, b))
    wait_until(both_in_flight, 30, message=lambda: f"a {counts(a)}, b {counts(b)}")
    worker.send(signal.SIGTERM)
    assert worker.wait(30) == 0
    for db in (a, b):
        with db.engine.connect() as conn:
            held = conn.execute(text(
                "SELECT count(*) FROM outbox.effects WHERE status = 'in_flight'"
                " OR lease_owner IS NOT NULL")).scalar_one()
            released = conn.execute(text(
                "SELECT count(*) FROM outbox.attempt_history WHERE error LIKE 'released:%'"
                )).scalar_one()
        assert held == 0, f"{db.name}: leases left behind"
        assert released > 0, f"{db.name}: nothing was released"
    log = worker.log.read_text()
    assert "[a] released" in log and "[b] released" in log



def test_status_reports_each_database_and_one_it_cannot_read(
        server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    """`outbox status --database a=... --database c=...`: one block (or JSON object)
    per database, as the fleet serves them; one that cannot be read is named, the
    others still shown, and the exit status is 1 (a monitor notices)."""
    import json

    a, b = server.db("a"), server.db("b")
    down = server.db("c", create=False)
    add_effects(a.engine, keys("status-a", 3))
    add_effects(b.engine, keys("status-b", 1))
    assert cli.main(["status", "--json", "--database", a.arg(), "--database", b.arg(),
                     "--database", down.arg()]) == 1
    out = capsys.readouterr()
    got = json.loads(out.out)["databases"]
    assert (got["a"]["pending"], got["b"]["pending"]) == (3, 1)
    assert "error" in got["c"] and "c:" in out.err
    assert SECRET not in out.out + out.err
    assert cli.main(["status", "--database", a.arg(), "--database", b.arg()]) == 0
    text_ = capsys.readouterr().out
    assert text_.index("== a (") < text_.index("== b (") and SECRET not in text_
