"""Silent connections (issue 14): a peer that stops answering costs a bounded wait.

The proxy's `silence_open()` makes every connection open at that moment silent (bytes
read and dropped, no FIN, no RST; the kernel keeps acknowledging, as a wedged middlebox
does), while new connections work: what a failover behind a proxy, or an idle-timeout
NAT, looks like to a client.

Unit-level: a bounded call, the pool's checks, the server-side idle-in-transaction
bound, the LISTEN probe, one API request and one delivery silenced at a chosen moment.
`slow`: real `outbox worker` and Celery worker processes, the example API as its own
process and the fake PSP, under load, with every connection of a leg silenced mid-run;
they print the recovery times recorded in docs/guarantees.md ("Network faults").
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from sqlalchemy import Engine, event, text
from sqlalchemy.exc import OperationalError

from dispatcher.examples.payments.app import create_app
from dispatcher.examples.payments.psp import Receiver, ReceiverProcess
from dispatcher.examples.payments.schema import ensure_schema
from dispatcher.handlers import EffectContext, HttpHandler
from dispatcher.worker import listen_for_due
from outbox._config import NOTIFY_CHANNEL, PING_AFTER, make_engine
from outbox._connections import idle_in_transaction_timeout
from outbox._idempotency import Mode
from outbox.errors import AmbiguousOutcome
from tests.dispatch_support import (
    add_effects,
    outcome_counts,
    status_counts,
    summarize,
    wait_until,
)
from tests.process_support import (
    Procs,
    process_group,
    producer,
    wait_all_final,
)
from tests.tcp_proxy import TcpProxy
from tests.test_dispatcher_processes import (
    check_exactly_once,
    redis_broker,  # noqa: F401  (fixture: Redis db 13, ours alone; skipped without Redis)
    ring,
)
from tests.test_faults import api_up, free_port, pg_upstream, scalar, via_proxy

with warnings.catch_warnings():  # as in test_http: starlette would rather have httpx2
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

CLIENT = {"Authorization": "Bearer net-faults"}  # the example's open demo mode
PAYMENT = {"amount": 700, "currency": "EUR", "customer": "net@example.com"}
# Small bounds so the slow tests stay fast; docs/network.md has the defaults.
CALL_TIMEOUT = 2.0
IDLE_IN_TRANSACTION = 3.0
LEASE = 5.0
POLL = 0.5
HTTP_TIMEOUT = 2.0
NET_ENV = {
    "OUTBOX_DB_CALL_TIMEOUT": str(CALL_TIMEOUT),
    "OUTBOX_WORKER_DB_CALL_TIMEOUT": str(CALL_TIMEOUT),
    "OUTBOX_DB_IDLE_IN_TRANSACTION_TIMEOUT": str(IDLE_IN_TRANSACTION),
    "OUTBOX_LISTEN_PROBE_INTERVAL": "1",
    "OUTBOX_HTTP_TIMEOUT": str(HTTP_TIMEOUT),
    "OUTBOX_LEASE": str(LEASE),
    "OUTBOX_SWEEP_INTERVAL": "1",
}


@pytest.fixture
def pg_proxy(db_url: str) -> Iterator[TcpProxy]:
    proxy = TcpProxy(pg_upstream(db_url)).start()
    yield proxy
    proxy.stop()


def proxied(db_url: str, proxy: TcpProxy, **kwargs: object) -> Engine:
    return make_engine(via_proxy(db_url, proxy.port),
                       application_name="net-faults", **kwargs)  # type: ignore[arg-type]


def test_a_call_on_a_silenced_connection_fails_within_the_bound(
        db_url: str, pg_proxy: TcpProxy) -> None:
    engine = proxied(db_url, pg_proxy, call_timeout=1.0)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT 1")).scalar_one() == 1
            assert pg_proxy.silence_open() == 1
            started = time.monotonic()
            with pytest.raises(OperationalError, match="no answer from PostgreSQL"):
                conn.execute(text("SELECT 2"))
            took = time.monotonic() - started
        assert 0.9 <= took < 3.0, took
        # The dead connection left the pool: the next checkout opens a working one.
        with engine.connect() as conn:
            assert conn.execute(text("SELECT 3")).scalar_one() == 3
        assert pg_proxy.connections == 2
    finally:
        engine.dispose()


def test_a_pooled_connection_silenced_while_idle_is_replaced_at_checkout(
        db_url: str, pg_proxy: TcpProxy) -> None:
    """make_engine's pool pings a connection idle for a second or more, and the ping is
    a bounded call: checkout costs at most the bound. One in steady use is not pinged."""
    engine = proxied(db_url, pg_proxy, call_timeout=1.0, pool_size=1)
    pings: list[object] = []
    ping = engine.dialect.do_ping

    def counted(dbapi_connection: Any) -> bool:  # the pings bypass the cursor events
        pings.append(dbapi_connection)
        return bool(ping(dbapi_connection))

    engine.dialect.do_ping = counted  # type: ignore[method-assign]
    try:
        for _ in range(5):  # steady use: no round trip but the statements
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        assert pings == []
        pg_proxy.silence_open()  # the pooled connection, idle, goes silent
        time.sleep(PING_AFTER + 0.1)
        started = time.monotonic()
        with engine.connect() as conn:
            assert conn.execute(text("SELECT 2")).scalar_one() == 2
        assert time.monotonic() - started < 3.0
        assert pg_proxy.connections == 2
        assert len(pings) == 1  # idle past PING_AFTER: pinged, silent, replaced
    finally:
        engine.dispose()


def test_a_pooled_connection_the_server_ended_is_replaced_at_once(
        db_url: str, engine: Engine) -> None:
    """A backend terminated (or a server restarted) while its connection sat in the
    pool: the close is readable on the socket, so the next checkout pings it, finds it
    dead and opens another, however recently it was used. No error reaches the caller."""
    app = make_engine(db_url, application_name="net-ended", pool_size=1)
    try:
        with app.connect() as conn:
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        with engine.connect() as admin:
            assert admin.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar()
        wait_until(lambda: scalar(engine, "SELECT count(*) FROM pg_stat_activity"
                                          " WHERE pid = :p", p=pid) == 0, 5, interval=0.01,
                   message="the backend gone")
        with app.connect() as conn:  # well within PING_AFTER of its last use
            assert conn.execute(text("SELECT pg_backend_pid()")).scalar_one() != pid
    finally:
        app.dispose()


def test_a_silenced_commit_fails_within_the_bound(db_url: str, pg_proxy: TcpProxy,
                                                  engine: Engine) -> None:
    """COMMIT waits too: its outcome is unknown, so the caller must see an error."""
    silent = proxied(db_url, pg_proxy, call_timeout=1.0)
    try:
        started = time.monotonic()
        with pytest.raises(OperationalError), silent.begin() as conn:
            conn.execute(text("INSERT INTO public.test_orders (key, amount) VALUES ('s', 1)"))
            pg_proxy.silence_open()
        assert time.monotonic() - started < 3.0
    finally:
        silent.dispose()
    # The server never saw the COMMIT: once the dead backend is gone, nothing is there.
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM public.test_orders")).scalar() == 0


# --------------------------------------------------------------------------- the pool


def test_a_pool_without_pre_ping_pings_a_connection_idle_past_the_bound(
        db_url: str, pg_proxy: TcpProxy) -> None:
    """Workers turn the pre-ping off; a connection idle longer than the call timeout is
    still checked at checkout (and replaced), one in steady use never is."""
    engine = proxied(db_url, pg_proxy, call_timeout=1.0, pool_size=1,
                     pool_pre_ping=False)
    pings: list[str] = []

    @event.listens_for(engine, "before_cursor_execute")
    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        pings.append(statement)

    try:
        for _ in range(3):  # steady use: no ping
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        time.sleep(1.1)
        with engine.connect() as conn:  # idle past the bound: pinged, fine
            conn.execute(text("SELECT 2"))
        assert pg_proxy.connections == 1
        time.sleep(1.1)
        pg_proxy.silence_open()
        started = time.monotonic()
        with engine.connect() as conn:  # pinged, silent: replaced before we see it
            assert conn.execute(text("SELECT 3")).scalar_one() == 3
        took = time.monotonic() - started
        assert 0.9 <= took < 3.0, took
        assert pg_proxy.connections == 2
        assert len(pings) == 5  # the pings bypass SQLAlchemy's cursor events
    finally:
        engine.dispose()


# --------------------------------------------------------------------------- the server's half


def test_make_engine_sets_the_server_side_idle_in_transaction_timeout(
        db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Default: the call timeout + 5 s; the environment or the argument override it; 0
    leaves the server's setting; options the caller passes are kept."""
    def setting(**kwargs: Any) -> tuple[str, str]:
        engine = make_engine(db_url, **kwargs)
        try:
            with engine.connect() as conn:
                return (conn.execute(text("SHOW idle_in_transaction_session_timeout")).scalar_one(),
                        conn.execute(text("SHOW statement_timeout")).scalar_one())
        finally:
            engine.dispose()

    monkeypatch.delenv("OUTBOX_DB_IDLE_IN_TRANSACTION_TIMEOUT", raising=False)
    assert setting(call_timeout=2.0)[0] == "7s"
    assert setting(call_timeout=2.0, idle_in_transaction_timeout=0.5)[0] == "500ms"
    assert setting(call_timeout=2.0, idle_in_transaction_timeout=0)[0] == "0"
    assert setting(call_timeout=2.0, connect_args={
        "options": "-c statement_timeout=1234"}) == ("7s", "1234ms")
    assert setting(call_timeout=2.0, connect_args={
        "options": "-c idle_in_transaction_session_timeout=9000"})[0] == "9s"
    monkeypatch.setenv("OUTBOX_DB_IDLE_IN_TRANSACTION_TIMEOUT", "4")
    assert idle_in_transaction_timeout(2.0) == 4.0
    assert setting(call_timeout=2.0)[0] == "4s"
    monkeypatch.setenv("OUTBOX_DB_IDLE_IN_TRANSACTION_TIMEOUT", "0")
    assert idle_in_transaction_timeout(2.0) is None


# --------------------------------------------------------------------------- LISTEN


def test_the_listener_finds_its_silent_connection_and_listens_again(
        db_url: str, pg_proxy: TcpProxy, engine: Engine) -> None:
    """LISTEN is idle by design, so nothing on it times out: without the probe a silent
    listener just stopped ringing. Now a probe fails within probe + call timeout, the
    listener reconnects and rings once (the NOTIFY lost meanwhile), then rings again
    for new notifications."""
    silent = proxied(db_url, pg_proxy, call_timeout=1.0)
    wake, stop = threading.Event(), threading.Event()
    listener = threading.Thread(
        target=listen_for_due, args=(silent, NOTIFY_CHANNEL, wake, stop, "net-q"),
        kwargs={"application_name": "net-listener", "probe_interval": 0.5}, daemon=True)

    def notify() -> None:
        with engine.begin() as conn:
            conn.execute(text("SELECT pg_notify(:c, 'net-q')"), {"c": NOTIFY_CHANNEL})

    listener.start()
    try:
        assert wake.wait(10), "the listener never connected"
        wake.clear()
        notify()
        assert wake.wait(5), "a NOTIFY did not ring"
        wake.clear()
        assert pg_proxy.silence_open() == 1
        silenced = time.monotonic()
        notify()  # lost in the silence
        assert wake.wait(10), "the listener never came back"
        took = time.monotonic() - silenced
        assert pg_proxy.connections == 2
        # At most one probe interval, one call timeout and the first backoff.
        assert 0.9 <= took < 0.5 + 1.0 + 0.1 + 1.0, took
        wake.clear()
        notify()
        assert wake.wait(5), "the new LISTEN connection does not ring"
        print(f"LISTEN: silent connection replaced {took:.2f} s after the silence "
              "(probe 0.5 s, call timeout 1 s)")
    finally:
        stop.set()
        listener.join(10)
        silent.dispose()
    assert not listener.is_alive()


# --------------------------------------------------------------------------- the API


@pytest.fixture
def payments_db(engine: Engine) -> Engine:
    ensure_schema(engine)
    return engine


@pytest.mark.parametrize("mode", ["atomic", "phased"])
def test_a_request_silenced_mid_transaction_is_a_503_in_bound_and_its_key_recovers(
        payments_db: Engine, db_url: str, pg_proxy: TcpProxy, mode: Mode) -> None:
    """The connection goes silent right after the business INSERT, inside the request's
    transaction. The client gets 503 `outcome_unknown` + Retry-After within the call
    timeout. The server still holds the session "idle in transaction" (in atomic mode
    with the key's advisory lock: every retry was 409 until PostgreSQL noticed, which
    behind this proxy is never): `idle_in_transaction_session_timeout` ends it, and the
    same key then executes exactly once."""
    call_timeout, idle = 1.0, 2.0
    api = proxied(db_url, pg_proxy, call_timeout=call_timeout,
                  idle_in_transaction_timeout=idle, pool_size=2, max_overflow=2)
    armed = [True]

    @event.listens_for(api, "after_cursor_execute")
    def silence_after_insert(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if armed[0] and statement.lstrip().startswith("INSERT INTO payments.payments"):
            armed[0] = False
            pg_proxy.silence_open()

    key = f"net-{mode}-{uuid.uuid4().hex[:8]}"
    statuses: list[int] = []
    try:
        with TestClient(create_app(api, idempotency_mode=mode),
                        raise_server_exceptions=False, headers=CLIENT) as client:
            def post() -> httpx.Response:
                answer: httpx.Response = client.post("/payments", json=PAYMENT,
                                                     headers={"Idempotency-Key": key})
                return answer

            started = time.monotonic()
            first = post()
            answered = time.monotonic() - started
            assert first.status_code == 503, first.text
            assert first.json()["code"] == "outcome_unknown"
            assert first.headers["retry-after"] == "1"
            assert answered < call_timeout + 1.0, answered
            while True:  # the client's retries, as Retry-After says (faster here)
                response = post()
                statuses.append(response.status_code)
                if response.status_code != 409:
                    break
                assert time.monotonic() - started < idle + 3.0, statuses
                time.sleep(0.1)
            recovered = time.monotonic() - started
    finally:
        api.dispose()
    assert response.status_code == 201, response.text
    assert response.headers.get("idempotent-replayed") is None  # executed, not replayed
    if mode == "atomic":  # the zombie held the key's lock until the server ended it
        assert statuses[0] == 409 and recovered >= idle - 0.2, (statuses, recovered)
    else:  # the claim was released on a fresh connection; the zombie held nothing
        assert statuses == [201]
    # The silenced session ends within the bound (phased: it may still be there when
    # the retry succeeded; it holds nothing the retry needs and commits nothing).
    wait_until(lambda: scalar(
        payments_db, "SELECT count(*) = 0 FROM pg_stat_activity WHERE application_name"
        " = 'net-faults' AND state LIKE 'idle in transaction%'"), idle + 2.0,
        interval=0.05, message="the server to end the silenced session")
    with payments_db.connect() as conn:
        payments = conn.execute(text(
            "SELECT count(*) FROM payments.payments WHERE idempotency_key = :k"),
            {"k": key}).scalar_one()
        effects = conn.execute(text("SELECT count(*) FROM outbox.effects")).scalar_one()
        keys_ = conn.execute(text(
            "SELECT status FROM outbox.idempotency_keys WHERE key = :k"), {"k": key}).all()
    assert (payments, effects, [k.status for k in keys_]) == (1, 2, ["completed"])
    print(f"API {mode}: 503 after {answered:.2f} s (call timeout {call_timeout:g} s); "
          f"retries {statuses}; executed once {recovered:.2f} s after the first try "
          f"(idle_in_transaction_session_timeout {idle:g} s)")


@pytest.mark.parametrize("mode", ["atomic", "phased"])
def test_a_blackholed_database_is_a_503_within_the_connect_timeout_and_recovers(
        payments_db: Engine, db_url: str, pg_proxy: TcpProxy, mode: Mode) -> None:
    """The database's host takes the connection and never answers (a black hole: no
    RST, no startup reply) while the API's pool has no connection open. The request
    waits for the connect timeout, not for the kernel's TCP timeouts, and is a 503 +
    Retry-After (never a 500); once the path is back, the same key executes once."""
    connect_timeout = 2.0
    api = proxied(db_url, pg_proxy, call_timeout=1.0, pool_size=2, max_overflow=2,
                  connect_args={"connect_timeout": int(connect_timeout)})
    key = f"net-hole-{mode}-{uuid.uuid4().hex[:8]}"
    try:
        with TestClient(create_app(api, idempotency_mode=mode),
                        raise_server_exceptions=False, headers=CLIENT) as client:
            api.dispose()  # no pooled connection: the next request must open one
            pg_proxy.set_mode("blackhole")
            started = time.monotonic()
            first = client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": key})
            answered = time.monotonic() - started
            pg_proxy.set_mode("pass")
            retry = client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": key})
    finally:
        api.dispose()
    assert first.status_code == 503, first.text
    assert first.headers["retry-after"] == "1"
    assert connect_timeout - 0.2 <= answered < 2 * connect_timeout + 1.0, answered
    assert retry.status_code == 201, retry.text
    assert retry.headers.get("idempotent-replayed") is None  # executed now, once
    with payments_db.connect() as conn:
        assert conn.execute(text(
            "SELECT count(*) FROM payments.payments WHERE idempotency_key = :k"),
            {"k": key}).scalar_one() == 1
    print(f"blackholed database ({mode}): 503 after {answered:.2f} s (connect_timeout "
          f"{connect_timeout:g} s); the retry executed once")


# --------------------------------------------------------------------------- the receiver


def test_a_delivery_silenced_after_its_request_was_sent_is_ambiguous_and_replayed(
        tmp_path: Path) -> None:
    """httpx's timeout bounds every read, so a receiver that goes silent after the
    request body was sent (here while it applies the charge) costs one timeout: the
    attempt is ambiguous, the receiver applied it once, and the retry with the same
    key gets the replay. A keep-alive connection silenced while idle costs the same
    (the request may or may not have arrived: ambiguous, never "not sent")."""
    timeout = 1.0
    with Receiver(db=tmp_path / "psp.sqlite3") as psp:
        proxy = TcpProxy(("127.0.0.1", int(psp.url.rsplit(":", 1)[1])), pg=False).start()
        handler = HttpHandler(f"http://127.0.0.1:{proxy.port}/charges", timeout=timeout)

        def effect(key: str, attempt: int = 1) -> EffectContext:
            return EffectContext(id=1, key=key, kind="psp.charge", payload={"amount": 5},
                                 attempt=attempt, max_attempts=5,
                                 deadline=time.monotonic() + 30,
                                 created_at=datetime.now().astimezone())

        try:
            # 1. Silent after the request was sent: the receiver applies, slowly.
            psp.set_mode("slow", key="net-sent", delay=0.3)
            outcome: list[BaseException | Any] = []
            call = threading.Thread(target=lambda: outcome.append(_call(handler, effect(
                "net-sent"))))
            started = time.monotonic()
            call.start()
            wait_until(lambda: psp.ledger("net-sent")["deliveries"], 5, interval=0.01,
                       message="the request to reach the receiver")
            proxy.silence_open()
            call.join(10)
            took = time.monotonic() - started
            assert isinstance(outcome[0], AmbiguousOutcome), outcome
            assert timeout - 0.1 <= took < timeout + 1.0, took
            assert psp.applied_counts() == {"net-sent": 1}
            again = handler(effect("net-sent", attempt=2))  # a new connection
            assert again["status"] == 201  # the first answer, replayed
            assert psp.applied_counts() == {"net-sent": 1}
            assert [d["outcome"] for d in psp.ledger("net-sent")["deliveries"]] == [
                "applied", "replayed"]
            # 2. Silent while idle in the keep-alive pool: the next request vanishes.
            handler(effect("net-idle-0"))
            proxy.silence_open()
            started = time.monotonic()
            with pytest.raises(AmbiguousOutcome):
                handler(effect("net-idle-1"))
            idle_took = time.monotonic() - started
            assert timeout - 0.1 <= idle_took < timeout + 1.0, idle_took
            assert "net-idle-1" not in psp.applied_counts()  # it never arrived
            handler(effect("net-idle-1", attempt=2))
            assert psp.applied_counts()["net-idle-1"] == 1
        finally:
            proxy.stop()
    print(f"receiver: silent after the request: ambiguous after {took:.2f} s, silent "
          f"keep-alive connection: ambiguous after {idle_took:.2f} s (timeout {timeout:g} "
          "s); both applied once, the retries replayed or applied")


def _call(handler: HttpHandler, effect: EffectContext) -> Any:
    try:
        return handler(effect)
    except Exception as exc:
        return exc


# =========================================================================== slow: processes


@pytest.fixture
def procs(tmp_path: Path, psp_process: ReceiverProcess, db_url: str) -> Iterator[Procs]:
    yield from process_group(tmp_path, psp_process.url, tail=60)


def _redis(request: pytest.FixtureRequest) -> str:
    broker: str = request.getfixturevalue("redis_broker")
    return broker


def worker_env(db_url: str, pg: TcpProxy | None, psp_url: str | None = None,
               **extra: str) -> dict[str, str]:
    env = {**NET_ENV, **extra}
    if pg is not None:
        env["DATABASE_URL"] = via_proxy(db_url, pg.port)
    if psp_url is not None:
        env["PSP_URL"] = psp_url
    return env


def process_tree(procs: Procs) -> set[int]:
    """Every worker process and child we started (a restart would change the set)."""
    pids: set[int] = set()
    for proc in procs.started:
        pids.add(proc.pid)
        pids.update(c.pid for c in psutil.Process(proc.pid).children(recursive=True))
    return pids


class Load:
    """Enqueue `per_tick` effects every `tick` seconds, on a direct connection."""

    def __init__(self, engine: Engine, prefix: str, *, per_tick: int = 10, tick: float = 0.1,
                 kind: Callable[[int], str] = lambda i: "psp.charge",
                 after_commit: Callable[[], None] | None = None) -> None:
        self.engine, self.prefix, self.per_tick, self.tick = engine, prefix, per_tick, tick
        self.kind, self.after_commit = kind, after_commit
        self.keys: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            by_kind: dict[str, list[str]] = {}
            for i in range(n, n + self.per_tick):
                by_kind.setdefault(self.kind(i), []).append(f"{self.prefix}-{i:06d}")
            for kind, batch in by_kind.items():
                add_effects(self.engine, batch, kind=kind,
                            payload=lambda i, k: {"amount": 100 + i, "currency": "EUR"})
                self.keys.extend(batch)
            n += self.per_tick
            if self.after_commit is not None:
                self.after_commit()
            self.stop.wait(self.tick)

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


def silence(*proxies: TcpProxy, engine: Engine) -> tuple[datetime, int]:
    """Silence every connection open on each proxy; returns the database's clock then."""
    count = sum(p.silence_open() for p in proxies)
    at: datetime = scalar(engine, "SELECT clock_timestamp()")
    return at, count


def recovery(engine: Engine, silenced_at: datetime, prefix: str) -> dict[str, Any]:
    """Delivery timeline around the silence, from the database's clock."""
    with engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT created_at, delivered_at FROM outbox.effects"
            " WHERE effect_key LIKE :p AND delivered_at IS NOT NULL ORDER BY delivered_at"),
            {"p": f"{prefix}%"}).all()
    after = [r.delivered_at for r in rows if r.delivered_at > silenced_at]
    backlog = [(r.delivered_at - silenced_at).total_seconds() for r in rows
               if r.created_at < silenced_at < r.delivered_at]
    later = [(r.delivered_at - r.created_at).total_seconds() for r in rows
             if r.created_at >= silenced_at]
    gaps = [(b - a).total_seconds() for a, b in zip([silenced_at, *after], after, strict=False)]
    return {
        # The first outcome recorded after the silence: a worker found its silent
        # connection and replaced it.
        "first_record_s": round((after[0] - silenced_at).total_seconds(), 2) if after else None,
        # The longest pause in recorded deliveries from the silence on.
        "stall_s": round(max(gaps), 2) if gaps else None,
        # Everything committed before the silence and not yet delivered then.
        "backlog": len(backlog),
        "backlog_delivered_s": round(max(backlog), 2) if backlog else 0.0,
        # Effects committed after the silence: commit -> delivered.
        "lag_after": {k: round(v, 2) for k, v in summarize(later).items()},
    }


def wait_ready(proc: Any, engine: Engine, app_name: str | None, timeout: float = 60) -> None:
    if app_name is None:  # Celery: its log says when the consumer runs
        wait_until(lambda: "ready" in proc.tail(200), timeout, interval=0.2,
                   message=f"{proc.name} ready")
        return
    wait_until(lambda: scalar(
        engine, "SELECT count(*) > 0 FROM pg_stat_activity WHERE application_name = :n"
        " AND datname = current_database()", n=app_name), timeout, interval=0.2,
        message=f"{app_name} connected")


@pytest.mark.slow
@pytest.mark.parametrize("runner", ["outbox-worker", "celery"])
def test_workers_recover_from_a_silenced_database_under_load(
        engine: Engine, db_url: str, pg_proxy: TcpProxy, procs: Procs,
        psp_process: ReceiverProcess, runner: str, request: pytest.FixtureRequest) -> None:
    """Every database connection of the workers (pool, LISTEN) goes silent at once
    while effects keep coming: each worker finds out within its call timeout (LISTEN:
    probe + call timeout), replaces its connections and goes on; every effect is
    applied once at the receiver, nothing is left in flight, no worker restarted."""
    env = worker_env(db_url, pg_proxy)
    ring_doorbell: Callable[[], None] | None = None
    if runner == "outbox-worker":
        workers = [procs.worker(f"net-w{i}", concurrency=4, lease=LEASE, poll=POLL, env=env)
                   for i in range(2)]
        for w in workers:
            wait_ready(w, engine, w.name)
    else:
        broker = _redis(request)
        worker = procs.celery("net-celery", broker=broker, concurrency=2, env=env)
        wait_ready(worker, engine, None)
        app = producer(broker, worker.queue)
        ring_doorbell = lambda: ring(app, worker.queue)  # noqa: E731
    prefix = f"net-db-{runner}"
    # 0.1 s per charge at the receiver: deliveries are in flight when the silence
    # starts, so their outcomes must be recorded through a replaced connection.
    psp_process.set_mode("slow", key_prefix=prefix, delay=0.1)
    with Load(engine, prefix, per_tick=5, tick=0.1, after_commit=ring_doorbell) as load:
        wait_until(lambda: psp_process.stats()["applied"] >= 50, 60, interval=0.2,
                   message="deliveries under load")
        before = process_tree(procs)
        time.sleep(1.0)
        silenced_at, count = silence(pg_proxy, engine=engine)
        time.sleep(2 * LEASE)
    wait_all_final(engine, len(load.keys), timeout=60)
    stats = check_exactly_once(engine, psp_process, load.keys, single_attempt=False)
    assert status_counts(engine) == {"delivered": len(load.keys)}
    assert process_tree(procs) == before, "a worker process was restarted"
    assert all(p.alive() for p in procs.started)
    timeline = recovery(engine, silenced_at, prefix)
    # A silent call costs the call timeout, then one retry on a fresh connection.
    assert timeline["stall_s"] < CALL_TIMEOUT + 3.0, timeline
    # Within lease + the bound, even for an effect whose outcome had to wait for it.
    assert timeline["backlog_delivered_s"] < LEASE + CALL_TIMEOUT + 3.0, timeline
    print(f"DB leg, {runner}: {len(load.keys)} effects at ~50/s, {count} connections "
          f"silenced, {pg_proxy.connections} opened in all; {timeline}; applied "
          f"{stats['applied']}, deliveries {stats['deliveries']}, "
          f"attempts {outcome_counts(engine)}; 0 restarts")


@pytest.mark.slow
def test_deliveries_recover_from_a_silenced_receiver_under_load(
        engine: Engine, db_url: str, procs: Procs, psp_process: ReceiverProcess) -> None:
    """Every worker-to-receiver connection goes silent mid-delivery (the receiver takes
    0.2 s per charge, so some are always in flight): each attempt ends after the HTTP
    timeout as ambiguous and is retried with the same key (the receiver replays what it
    applied); a handler that is not retry-safe parks the effect for review instead."""
    port = int(psp_process.url.rsplit(":", 1)[1])
    psp_leg = TcpProxy(("127.0.0.1", port), pg=False).start()
    try:
        env = worker_env(db_url, None, f"http://127.0.0.1:{psp_leg.port}")
        for i in range(2):
            w = procs.worker(f"net-h{i}", concurrency=4, lease=LEASE, poll=POLL, env=env)
            wait_ready(w, engine, w.name)
        psp_process.set_mode("slow", key_prefix="net-http", delay=0.2)
        prefix = "net-http"
        with Load(engine, prefix, per_tick=5, tick=0.25,
                  kind=lambda i: "psp.unsafe" if i % 10 == 0 else "psp.charge") as load:
            wait_until(lambda: psp_process.stats()["applied"] >= 30, 60, interval=0.2,
                       message="deliveries under load")
            before = process_tree(procs)
            time.sleep(1.0)
            silenced_at, count = silence(psp_leg, engine=engine)
            time.sleep(2 * LEASE)
        wait_all_final(engine, len(load.keys), timeout=90,
                       final=("delivered", "needs_review"))
    finally:
        psp_leg.stop()
    counts = status_counts(engine)
    with engine.connect() as conn:
        review = list(conn.execute(text(
            "SELECT effect_key FROM outbox.effects WHERE status = 'needs_review'")).scalars())
        delivered = list(conn.execute(text(
            "SELECT effect_key FROM outbox.effects WHERE status = 'delivered'")).scalars())
        unsafe_ambiguous = conn.execute(text(
            "SELECT count(*) FROM outbox.attempt_history a"
            " JOIN outbox.effects e ON e.id = a.effect_id"
            " WHERE e.kind = 'psp.unsafe' AND a.outcome = 'ambiguous'")).scalar_one()
    applied = psp_process.applied_counts()
    assert all(applied.get(k) == 1 for k in delivered), "a delivered effect not applied once"
    assert all(applied.get(k, 0) <= 1 for k in review)
    assert set(applied) <= set(load.keys)
    assert set(review) <= {k for i, k in enumerate(load.keys) if i % 10 == 0}  # unsafe only
    assert len(review) == unsafe_ambiguous
    outcomes = outcome_counts(engine)
    assert outcomes.get("ambiguous", 0) >= 1, outcomes  # the silence did hit deliveries
    assert process_tree(procs) == before and all(p.alive() for p in procs.started)
    timeline = recovery(engine, silenced_at, prefix)
    assert timeline["backlog_delivered_s"] < LEASE + HTTP_TIMEOUT + 5.0, timeline
    print(f"receiver leg: {len(load.keys)} effects ({counts}), {count} connections "
          f"silenced; attempts {outcomes}; parked for review {len(review)} "
          f"(applied at the receiver: {sum(applied.get(k, 0) for k in review)}); "
          f"{timeline}; 0 restarts")


class ApiClients:
    """`n` clients posting payments, each retrying a key (Retry-After) until 201."""

    def __init__(self, base: str, n: int, prefix: str) -> None:
        self.base, self.prefix = base, prefix
        self.requests: list[tuple[float, float, int]] = []  # (sent, seconds, status)
        self.done: dict[str, int] = {}  # key -> payment id
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True)
                        for i in range(n)]

    def run(self, me: int) -> None:
        with httpx.Client(base_url=self.base, headers=CLIENT, timeout=60) as client:
            n = 0
            while not self.stop.is_set():
                key = f"{self.prefix}-{me}-{n}"
                n += 1
                give_up = time.monotonic() + 60
                while time.monotonic() < give_up:
                    sent = time.monotonic()
                    try:
                        r = client.post("/payments", json={**PAYMENT, "amount": n},
                                        headers={"Idempotency-Key": key})
                        status = r.status_code
                    except httpx.HTTPError as exc:
                        status = 0
                        self.errors.append(repr(exc))
                    self.requests.append((sent, time.monotonic() - sent, status))
                    if status == 201:
                        self.done[key] = r.json()["id"]
                        break
                    time.sleep(float(r.headers.get("retry-after", 1)) if status else 0.5)
                else:
                    self.errors.append(f"{key}: no 201 within 60 s")

    def __enter__(self) -> ApiClients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)


@pytest.mark.slow
def test_every_leg_silenced_at_once_under_api_load(
        engine: Engine, db_url: str, procs: Procs, psp_process: ReceiverProcess,
        request: pytest.FixtureRequest) -> None:
    """The example API (its own process), an `outbox worker` and a Celery worker, each
    behind its own proxy to PostgreSQL, the workers behind one to the receiver; clients
    post payments. Every open connection of every leg goes silent at once. No request
    waits past the API's bound, every key ends with one payment, every committed effect
    is applied once at the receiver, nothing is left in flight or processing, and no
    process is restarted."""
    ensure_schema(engine)
    broker = _redis(request)
    api_pg, worker_pg = (TcpProxy(pg_upstream(db_url)).start() for _ in range(2))
    port = int(psp_process.url.rsplit(":", 1)[1])
    psp_leg = TcpProxy(("127.0.0.1", port), pg=False).start()
    proxies = (api_pg, worker_pg, psp_leg)
    try:
        api_port = free_port()
        procs.spawn("net-api", [sys.executable, "-m", "dispatcher.cli", "example-api",
                                      "--host", "127.0.0.1", "--port", str(api_port)],
                          worker_env(db_url, api_pg))
        handlers = "dispatcher.examples.payments.handlers:registry"
        env = worker_env(db_url, worker_pg, f"http://127.0.0.1:{psp_leg.port}",
                         OUTBOX_HANDLERS=handlers)
        procs.spawn("net-all-w", [
            sys.executable, "-m", "dispatcher.cli", "worker", "--concurrency", "4",
            "--lease", str(LEASE), "--poll", str(POLL), "--grace", "5",
            "--handlers", handlers, "--name", "net-all-w"], env)
        celery = procs.celery("net-all-celery", broker=broker, concurrency=2, env=env)
        wait_ready(procs.started[1], engine, "net-all-w")
        wait_ready(celery, engine, None)
        base = f"http://127.0.0.1:{api_port}"
        wait_until(lambda: api_up(base), 60, interval=0.2, message="the API to listen")
        with ApiClients(base, 6, "net-all") as clients:
            wait_until(lambda: len(clients.done) >= 30, 60, interval=0.2,
                       message="payments under load")
            before = process_tree(procs)
            time.sleep(1.0)
            silenced_at, count = silence(*proxies, engine=engine)
            silenced_mono = time.monotonic()
            time.sleep(2 * LEASE)
        assert clients.errors == []
        with engine.connect() as conn:
            effect_keys = list(conn.execute(text(
                "SELECT effect_key FROM outbox.effects")).scalars())
        wait_all_final(engine, len(effect_keys), timeout=90)
    finally:
        for p in proxies:
            p.stop()
    keys_done = clients.done
    with engine.connect() as conn:
        per_key = {r[0]: int(r[1]) for r in conn.execute(text(
            "SELECT idempotency_key, count(*) FROM payments.payments GROUP BY 1"))}
        key_states = {r[0]: int(r[1]) for r in conn.execute(text(
            "SELECT status, count(*) FROM outbox.idempotency_keys GROUP BY 1"))}
    assert per_key == {k: 1 for k in keys_done}, "a key executed twice, or not at all"
    assert key_states == {"completed": len(keys_done)}  # none left processing
    assert len(effect_keys) == 2 * len(keys_done)
    stats = psp_process.assert_exactly_once(effect_keys, allow_extra=False)
    assert status_counts(engine) == {"delivered": len(effect_keys)}
    assert process_tree(procs) == before and all(p.alive() for p in procs.started)
    latencies = [took for _, took, _ in clients.requests]
    statuses: dict[int, int] = {}
    for _, _, status in clients.requests:
        statuses[status] = statuses.get(status, 0) + 1
    # The API's bound: one silent call (the pre-ping or a statement), never two.
    assert max(latencies) < CALL_TIMEOUT + 1.5, summarize(latencies)
    after = sorted((s, took, st) for s, took, st in clients.requests if s >= silenced_mono)
    first_201 = next((s + took - silenced_mono for s, took, st in after if st == 201), None)
    timeline = recovery(engine, silenced_at, "")
    assert timeline["backlog_delivered_s"] < LEASE + HTTP_TIMEOUT + CALL_TIMEOUT + 5.0
    print(f"every leg: {count} connections silenced; API: {len(keys_done)} payments, "
          f"requests {statuses}, latency {summarize(latencies)}, first 201 after the "
          f"silence at +{first_201:.2f} s; effects {len(effect_keys)} applied once "
          f"(deliveries {stats['deliveries']}), attempts {outcome_counts(engine)}; "
          f"{timeline}; 0 restarts")

