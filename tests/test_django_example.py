"""The DRF example against the FastAPI one: real `outbox example-api` processes (issue 10).

Both servers run as `outbox example-api --framework fastapi|django` on the session's
database. Every request of the HTTP contract (B1-B35 from tests/test_http.py, the
routes, replays, conflicts, auth, webhooks) is sent as raw bytes to each, on a fresh
database each time, and the two answers must be the same: status, body byte for byte
(ids included: both start from an empty table), and the headers a client reads.
Then the storms run against the Django server alone: 50 and 300 parallel requests
with one key make one payment and one `psp.charge`, which `manage.py outbox_worker`
delivers exactly once to the counting receiver.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, text

from dispatcher.examples.payments.psp import ReceiverProcess
from outbox._idempotency import advisory_lock_id
from outbox.webhooks import StandardWebhooks
from tests.test_http import CASES, PAYMENT, PAYMENT_BYTES, WEBHOOK_CASES, Case, event

ROOT = Path(__file__).resolve().parents[1]
TOKENS = "test-token=tester,tok-a=alice,tok-b=alice,tok-c=bob"
AUTH = (b"authorization", b"Bearer test-token")
JSON = (b"content-type", b"application/json")
COMPARED = ("content-type", "location", "retry-after", "www-authenticate", "allow",
            "idempotent-replayed", "idempotent-replay-omitted")
TABLES = ("outbox.attempts, outbox.effect_keys, outbox.effects, outbox.idempotency_keys, "
          "outbox.inbox, "
          "outbox.inbox_conflicts, outbox.entity_versions, payments.payments")


@dataclass
class Server:
    framework: str
    proc: subprocess.Popen[str]
    base: str = ""
    lines: list[str] = field(default_factory=list)

    @property
    def port(self) -> int:
        return int(self.base.rsplit(":", 1)[1])


@contextmanager
def example_api(framework: str, **env: str) -> Iterator[Server]:
    """`outbox example-api --framework F --port 0` until SIGTERM, which must exit 0."""
    full = {**os.environ, "EXAMPLE_API_TOKENS": TOKENS, **env}
    full.pop("BROKER_URL", None)
    if "EXAMPLE_WEBHOOK_SECRETS" not in env:
        full.pop("EXAMPLE_WEBHOOK_SECRETS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dispatcher.cli", "example-api", "--framework", framework,
         "--port", "0"], cwd=ROOT, env=full, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    server = Server(framework, proc)
    assert proc.stdout is not None
    stdout = proc.stdout
    started = threading.Event()

    def read() -> None:
        for line in stdout:
            server.lines.append(line)
            match = re.search(r"Uvicorn running on (http://\S+)", line)
            if match:
                server.base = match.group(1)
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert started.wait(90), "".join(server.lines)
        health = httpx.get(f"{server.base}/healthz", timeout=30)
        assert health.status_code == 200, health.text
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
        else:
            code = proc.returncode
        reader.join(10)
    output = "".join(server.lines)
    assert code == 0, output
    assert "Traceback" not in output, output


@pytest.fixture(scope="module")
def servers(db_url: str) -> Iterator[dict[str, Server]]:
    with example_api("fastapi") as fastapi, example_api("django") as django:
        yield {"fastapi": fastapi, "django": django}


@pytest.fixture
def django_base(servers: dict[str, Server]) -> str:
    return servers["django"].base


# -- raw HTTP ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2:]
    return bytes(out)


def exchange(base: str, method: str, path: str, headers: list[tuple[bytes, bytes]],
             body: bytes = b"") -> Answer:
    """Send exactly these bytes (httpx refuses some of them) and read the whole answer."""
    port = int(base.rsplit(":", 1)[1])
    head = [f"{method} {path} HTTP/1.1".encode(), b"host: 127.0.0.1",
            b"connection: close"]
    if body or method in ("POST", "PUT", "PATCH"):
        head.append(b"content-length: " + str(len(body)).encode())
    head += [k + b": " + v for k, v in headers]
    request = b"\r\n".join(head) + b"\r\n\r\n" + body
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        # Answered before the whole body was read (413): read that answer.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(request)
        data = b""
        try:
            while chunk := sock.recv(65_536):
                data += chunk
        except ConnectionResetError:
            pass
    raw_head, _, payload = data.partition(b"\r\n\r\n")
    lines = raw_head.decode("latin-1").split("\r\n")
    match = re.match(r"HTTP/1\.[01] (\d{3})", lines[0])
    assert match, data[:200]
    found: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        found[name.strip().lower()] = value.strip()
    if found.get("transfer-encoding", "").lower() == "chunked":
        payload = _dechunk(payload)
    return Answer(int(match.group(1)), found, payload)


def reset(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE"))


def count(engine: Engine, sql: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(sql)).scalar_one())


Request = tuple[str, str, list[tuple[bytes, bytes]], bytes]


def compare(servers: dict[str, Server], engine: Engine, requests: list[Request]
            ) -> list[Answer]:
    """Run `requests` on each server from an empty database; the answers must match."""
    answers: dict[str, list[Answer]] = {}
    for name, server in servers.items():
        reset(engine)
        answers[name] = [exchange(server.base, *r) for r in requests]
    for (method, path, _, _), fa, dj in zip(requests, answers["fastapi"], answers["django"],
                                            strict=True):
        where = f"{method} {path[:60]}"
        assert dj.status == fa.status, (where, fa.body[:300], dj.body[:300])
        assert dj.body == fa.body, (where, fa.body[:300], dj.body[:300])
        for name in COMPARED:
            left = fa.headers.get(name, "").replace(servers["fastapi"].base, "BASE")
            right = dj.headers.get(name, "").replace(servers["django"].base, "BASE")
            assert left == right, (where, name, left, right)
    return answers["django"]


def post(body: bytes = PAYMENT_BYTES, key: bytes | None = b"k-1",
         *extra: tuple[bytes, bytes], auth: tuple[bytes, bytes] | None = AUTH) -> Request:
    headers = [h for h in (auth, JSON) if h is not None]
    if key is not None:
        headers.append((b"idempotency-key", key))
    return ("POST", "/payments", [*headers, *extra], body)


def get(path: str, auth: tuple[bytes, bytes] | None = AUTH) -> Request:
    return ("GET", path, [auth] if auth else [], b"")


# -- the contract, answer for answer --------------------------------------------------------


def _case_request(case: Case) -> Request:
    headers: list[tuple[bytes, bytes]] = [AUTH, *case.headers]
    if case.key == b"fresh":
        headers.append((b"idempotency-key", re.sub(r"[^A-Za-z0-9]+", "-", case.name).encode()))
    elif case.key is not None:
        headers.append((b"idempotency-key", case.key))
    if case.content_type is not None:
        headers.append((b"content-type", case.content_type))
    return ("POST", "/payments", headers, case.body)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_b1_b28_answer_for_answer(servers: dict[str, Server], engine: Engine,
                                  case: Case) -> None:
    (answer,) = compare(servers, engine, [_case_request(case)])
    if answer.headers.get("content-type") in ("application/json",
                                               "application/problem+json"):
        assert answer.status == case.status, answer.body[:300]  # else h11 refused the bytes
    if answer.status >= 400:
        assert count(engine, "SELECT count(*) FROM payments.payments") == 0
        assert count(engine, "SELECT count(*) FROM outbox.effects") == 0
    assert count(engine, "SELECT count(*) FROM outbox.idempotency_keys "
                         "WHERE status = 'processing'") == 0


SCENARIOS: dict[str, list[Request]] = {
    "created, replayed byte for byte, then read": [
        post(), post(b'{ "customer" : "alice@example.com", "currency":"EUR",\n"amount":1250 }'),
        get("/payments/1"), get("/payments/1", (b"authorization", b"Bearer tok-c")),
        get("/payments/1", None), get("/payments/2")],
    "same key, other body: 422, then the first answer again": [
        post(), post(json.dumps({**PAYMENT, "amount": 1251}).encode()), post()],
    "a refreshed token replays; another client is its own request": [
        post(key=b"shared", auth=(b"authorization", b"Bearer tok-a")),
        post(key=b"shared", auth=(b"authorization", b"Bearer tok-b")),
        post(key=b"shared", auth=(b"authorization", b"Bearer tok-c"))],
    "the same key on another tenant is another request": [
        post(key=b"t"), post(b"", b"t", (b"x-tenant", b"acme")),
        post(PAYMENT_BYTES, b"t", (b"x-tenant", b"acme"))],
    "auth": [
        post(auth=None), post(auth=(b"authorization", b"Bearer nope")),
        post(auth=(b"authorization", b"Basic dXNlcg==")), get("/payments/1", None),
        get("/healthz", (b"authorization", b"Bearer nope"))],
    "routing": [
        get("/payments/abc"), get("/payments/0"), get("/payments/-1"), get("/payments/1.5"),
        get(f"/payments/{2**63}"), get("/payments/" + "9" * 5000), get("/payments/%00"),
        get("/payments/424242"), get("/nope"), ("PUT", "/payments", [AUTH], b""),
        ("DELETE", "/payments/1", [AUTH], b""), ("OPTIONS", "/payments", [AUTH], b""),
        ("HEAD", "/payments/1", [AUTH], b""), ("GET", "/payments/", [AUTH], b""),
        ("GET", "/webhooks/s", [], b""), ("POST", "/webhooks/", [JSON], b"{}"),
        get("/healthz", None)],
    "webhook outcomes": [
        ("POST", "/webhooks/billing", [JSON], json.dumps(event()).encode()),
        ("POST", "/webhooks/billing", [JSON], json.dumps(event()).encode()),
        ("POST", "/webhooks/billing", [JSON], json.dumps(event(data={"x": 2})).encode()),
        ("POST", "/webhooks/billing", [JSON],
         json.dumps(event(id="e2", version=5, entity="p1")).encode()),
        ("POST", "/webhooks/billing", [JSON],
         json.dumps(event(id="e3", version=4, entity="p1")).encode()),
        ("POST", "/webhooks/crm/batch", [JSON],
         json.dumps([event(id="b1"), event(id="b1"), event(id="b2")]).encode()),
        ("POST", "/webhooks/crm/batch", [JSON], b"[]"),
        ("POST", "/webhooks/crm", [(b"content-type", b"text/plain")],
         json.dumps(event()).encode())],
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenarios_answer_for_answer(servers: dict[str, Server], engine: Engine,
                                     name: str) -> None:
    answers = compare(servers, engine, SCENARIOS[name])
    assert all(a.status < 500 for a in answers), [a.status for a in answers]


@pytest.mark.parametrize(("name", "source", "body", "status"), WEBHOOK_CASES,
                         ids=[c[0] for c in WEBHOOK_CASES])
def test_b29_b35_webhooks_answer_for_answer(servers: dict[str, Server], engine: Engine,
                                            name: str, source: str, body: bytes,
                                            status: int) -> None:
    (answer,) = compare(servers, engine, [("POST", f"/webhooks/{source}", [JSON], body)])
    assert answer.status == status
    assert count(engine, "SELECT count(*) FROM outbox.inbox") == (1 if status == 200 else 0)


def test_a_key_held_by_a_running_twin_is_409_with_retry_after(servers: dict[str, Server],
                                                              engine: Engine) -> None:
    answers = {}
    for name, server in servers.items():
        reset(engine)
        with engine.begin() as conn:  # a twin's transaction holds the key's lock
            conn.execute(text("SELECT pg_advisory_xact_lock(:id)"),
                         {"id": advisory_lock_id("user:tester", "held")})
            started = time.monotonic()
            answers[name] = exchange(server.base, *post(key=b"held"))
            assert time.monotonic() - started < 10  # a try-lock: never waits
        assert exchange(server.base, *post(key=b"held")).status == 201
    fa, dj = answers["fastapi"], answers["django"]
    assert dj.status == fa.status == 409
    assert dj.body == fa.body and dj.headers["retry-after"] == fa.headers["retry-after"] == "1"


def test_signed_webhooks_on_the_django_example(db_url: str, engine: Engine) -> None:
    """EXAMPLE_WEBHOOK_SECRETS: unknown source 404, bad or missing signature 401,
    nothing stored for either; a signed event is ingested."""
    secret = "whsec_" + "c2VjcmV0LWJpbGxpbmctMzItYnl0ZXMtbG9uZyEhISE="
    with example_api("django", EXAMPLE_WEBHOOK_SECRETS=f"billing={secret}") as server:
        body = json.dumps(event()).encode()
        signed = StandardWebhooks(secret).sign(body, "msg_1")
        headers = [JSON, *((k.encode(), v.encode()) for k, v in signed.items())]
        unknown = exchange(server.base, "POST", "/webhooks/crm", headers, body)
        forged = exchange(server.base, "POST", "/webhooks/billing",
                          [*headers[:-1], (b"webhook-signature", b"v1,AAAA")], body)
        unsigned = exchange(server.base, "POST", "/webhooks/billing", [JSON], body)
        assert (unknown.status, forged.status, unsigned.status) == (404, 401, 401)
        assert count(engine, "SELECT count(*) FROM outbox.inbox") == 0
        good = exchange(server.base, "POST", "/webhooks/billing", headers, body)
        assert (good.status, good.json()) == (200, {"outcome": "inserted"})


# -- the storms, and the worker command -------------------------------------------------------


async def _storm(base: str, n: int, key: str) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        return list(await asyncio.gather(*(
            client.post("/payments", json=PAYMENT, headers={
                "Idempotency-Key": key, "Authorization": "Bearer test-token"})
            for _ in range(n))))


@pytest.mark.parametrize("n", [50, 300])
def test_a_same_key_storm_makes_one_payment_and_one_charge(django_base: str, engine: Engine,
                                                           n: int) -> None:
    """F01, and the article's 300 parallel retries: one payment, the rest 409 or the
    first answer replayed byte for byte."""
    answers = asyncio.run(_storm(django_base, n, f"storm-{n}"))
    statuses = [r.status_code for r in answers]
    assert set(statuses) <= {201, 409}, statuses
    created = [r for r in answers if r.status_code == 201]
    assert sum(1 for r in created if "idempotent-replayed" not in r.headers) == 1
    assert len({r.content for r in created}) == 1
    for r in answers:
        if r.status_code == 409:
            assert r.headers["retry-after"] == "1"
            assert r.json()["code"] in ("request_in_progress", "transaction_conflict")
    assert count(engine, "SELECT count(*) FROM payments.payments") == 1
    assert count(engine, "SELECT count(*) FROM outbox.effects WHERE kind = 'psp.charge'") == 1
    assert count(engine, "SELECT count(*) FROM outbox.effects") == 2


@pytest.mark.slow
def test_manage_py_outbox_worker_delivers_each_charge_once(django_base: str, engine: Engine,
                                                           psp_process: ReceiverProcess,
                                                           db_url: str) -> None:
    asyncio.run(_storm(django_base, 50, "worker-storm"))
    for key in ("w-1", "w-2", "w-3"):
        assert exchange(django_base, *post(key=key.encode())).status == 201
    env = {**os.environ, "DATABASE_URL": db_url, "PSP_URL": psp_process.url,
           "DJANGO_SETTINGS_MODULE": "dispatcher.examples.payments.django_app.settings"}
    env.pop("BROKER_URL", None)
    worker = subprocess.Popen(
        [sys.executable, "-m", "django", "outbox_worker", "--concurrency", "4",
         "--poll", "0.2", "--name", "django-worker-test"], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while count(engine, "SELECT count(*) FROM outbox.effects "
                            "WHERE status <> 'delivered'") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert count(engine, "SELECT count(*) FROM outbox.effects "
                             "WHERE status = 'delivered'") == 8
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            code = worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
            code = worker.wait()
        output = worker.stdout.read() if worker.stdout else ""
    assert code == 0, output
    with engine.connect() as conn:
        keys = conn.execute(text("SELECT effect_key FROM outbox.effects")).scalars().all()
        attempts = conn.execute(text("SELECT count(*) FROM outbox.attempt_history")).scalar_one()
    psp_process.assert_exactly_once(keys)
    assert attempts >= len(keys) == 8
