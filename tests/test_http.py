"""outbox.http and the example payments service, against a real PostgreSQL.

Table-driven bad inputs (research/anchors-reliability.md §6, B1-B35) each assert their
documented status, a problem+json body with `detail`, no business row and no key left
`processing`. Concurrency runs through a real uvicorn server on a loopback port.

No `from __future__ import annotations`: FastAPI reads the test apps' annotations.
"""

import gzip
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import httpx
import pytest
import uvicorn
from fastapi import Depends, FastAPI
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response

from dispatcher.examples.payments.app import create_app
from dispatcher.examples.payments.auth import BearerTokens
from outbox import Claim, IdempotencyGuard
from outbox._canonical import fingerprint
from outbox._config import make_engine
from outbox._idempotency import Mode, advisory_lock_id
from outbox.http import (
    OMITTED_HEADER,
    PROBLEM_MEDIA_TYPE,
    REPLAYED_HEADER,
    Idempotency,
    IdempotentRequest,
    Problem,
    _database_problem,
    anonymous_scope,
    install_problem_handlers,
)
from tests.http_support import TestClient, payments_schema

ROOT = Path(__file__).resolve().parents[1]
MODES: list[Mode] = ["atomic", "phased"]
PAYMENT = {"amount": 1250, "currency": "EUR", "customer": "alice@example.com"}
# The example's clients (DESIGN §8): tok-a and tok-b are one identity, as after a refresh.
AUTH = BearerTokens({"test-token": "tester", "tok-a": "alice", "tok-b": "alice",
                     "tok-c": "bob"})
AS_CLIENT = {"Authorization": "Bearer test-token"}
PAYMENT_BYTES = json.dumps(PAYMENT).encode()
MiB = 1_048_576


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture
def payments_db(engine: Engine) -> Iterator[Engine]:
    yield from payments_schema(engine)


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> Mode:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def client(payments_db: Engine, mode: Mode) -> Iterator[TestClient]:
    with TestClient(create_app(payments_db, idempotency_mode=mode, auth=AUTH),
                    headers=AS_CLIENT) as c:
        yield c


@pytest.fixture
def atomic_client(payments_db: Engine) -> Iterator[TestClient]:
    with TestClient(create_app(payments_db, auth=AUTH), headers=AS_CLIENT) as c:
        yield c


def count(engine: Engine, sql: str, **params: Any) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(sql), params).scalar_one())


def processing_keys(engine: Engine) -> int:
    return count(engine, "SELECT count(*) FROM outbox.idempotency_keys "
                         "WHERE status = 'processing'")


def payment_rows(engine: Engine) -> int:
    return count(engine, "SELECT count(*) FROM payments.payments")


def assert_problem(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == PROBLEM_MEDIA_TYPE
    body: dict[str, Any] = resp.json()
    assert body["status"] == status
    assert {"type", "title", "detail"} <= body.keys()
    assert body["detail"]
    return body


# -- a small app on the library alone (paths, methods, slow and huge responses) -----------


@dataclass
class LibraryApp:
    app: FastAPI
    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    tasks: list[int] = field(default_factory=list)


def library_app(engine: Engine, mode: Mode, **options: Any) -> LibraryApp:
    app = FastAPI()
    install_problem_handlers(app)
    app.state.engine = engine
    options.setdefault("scope", anonymous_scope)  # no auth here: the explicit opt-in
    guard = Idempotency(dict, mode=mode, **options)
    lib = LibraryApp(app)
    Req = Annotated[IdempotentRequest[dict[str, Any]], Depends(guard)]

    def order(conn: Connection, body: dict[str, Any]) -> int:
        return int(conn.execute(text(
            "INSERT INTO public.test_orders (key, amount) VALUES (:k, 1) RETURNING id"),
            {"k": json.dumps(body)}).scalar_one())

    def created(req: Req) -> Response:
        def work(conn: Connection, claim: Claim) -> Response:
            return JSONResponse({"order": order(conn, req.body), "echo": req.body}, 201)
        return req.run(work)

    app.post("/a")(created)
    app.put("/a")(created)
    app.post("/b")(created)

    @app.post("/slow")
    def slow(req: Req) -> Response:
        def work(conn: Connection, claim: Claim) -> Response:
            lib.entered.set()
            assert lib.release.wait(30)
            return JSONResponse({"order": order(conn, req.body)}, 201)
        return req.run(work)

    @app.post("/big")
    def big(req: Req) -> Response:
        size = int(req.body["size"])

        def work(conn: Connection, claim: Claim) -> Response:
            oid = order(conn, req.body)
            return Response(b"x" * size, 200, media_type="application/octet-stream",
                            headers={"Location": f"/orders/{oid}", "Set-Cookie": "s=1"})
        return req.run(work)

    @app.post("/declined")
    def declined(req: Req) -> Response:
        def work(conn: Connection, claim: Claim) -> Response:
            order(conn, req.body)
            raise Problem(402, "card declined", code="declined")
        return req.run(work)

    @app.post("/background")
    def background(req: Req) -> Response:
        def work(conn: Connection, claim: Claim) -> Response:
            oid = order(conn, req.body)
            return JSONResponse({"order": oid}, 201,
                                background=BackgroundTask(lib.tasks.append, oid))
        return req.run(work)

    def deferring(req: Req) -> Callable[[Connection, Claim], Response]:
        def work(conn: Connection, claim: Claim) -> Response:
            oid = order(conn, req.body)
            claim.enqueue("psp.charge", {"order": oid}, queue="deferred-q")
            return JSONResponse({"order": oid}, 201)
        return work

    @app.post("/deferred")
    def deferred(req: Req) -> Response:
        return req.run(deferring(req))

    @app.post("/deferred-in")
    def deferred_in(req: Req) -> Response:
        with engine.connect() as conn:  # the app's own connection
            return req.run_in(conn, deferring(req))

    @app.post("/async")
    async def in_async(req: Req) -> Response:
        def work(conn: Connection, claim: Claim) -> Response:
            return JSONResponse({"order": order(conn, req.body)}, 201)
        return await req.arun(work)

    return lib


def orders(engine: Engine) -> int:
    return count(engine, "SELECT count(*) FROM public.test_orders")


@pytest.fixture
def lib(engine: Engine, mode: Mode) -> LibraryApp:
    return library_app(engine, mode)


@pytest.fixture
def lib_client(lib: LibraryApp) -> Iterator[TestClient]:
    with TestClient(lib.app) as c:
        yield c


# -- a real server --------------------------------------------------------------------


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """uvicorn in a thread on an ephemeral loopback port; stopped on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ws="none",
                                           lifespan="on", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        assert thread.is_alive(), "uvicorn stopped during startup"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def raw_request(base: str, request: bytes) -> int:
    """Send bytes httpx refuses to send (NUL, bare CR in a header); return the status."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(request)
        head = b""
        while b"\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                break
            head += chunk
    match = re.match(rb"HTTP/1\.[01] (\d{3})", head)
    assert match, head
    return int(match.group(1))


# -- the happy path ------------------------------------------------------------------------


def test_create_payment_writes_one_row_and_two_effects(client: TestClient,
                                                       payments_db: Engine) -> None:
    resp = client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": "order-1"})
    assert resp.status_code == 201, resp.text
    body = resp.json()
    assert body == {"id": body["id"], **PAYMENT, "status": "pending"}
    assert resp.headers["location"] == f"/payments/{body['id']}"
    assert resp.headers["content-type"] == "application/json"
    assert REPLAYED_HEADER.lower() not in resp.headers
    assert payment_rows(payments_db) == 1

    with payments_db.connect() as conn:
        effects = conn.execute(text(
            "SELECT kind, effect_key, payload, status FROM outbox.effects ORDER BY kind"
        )).all()
        key = conn.execute(text(
            "SELECT scope, status, response_status, generation"
            " FROM outbox.idempotency_keys")).one()
    assert [e.kind for e in effects] == ["email.receipt", "psp.charge"]
    assert all(e.status == "pending" for e in effects)
    receipt, charge = (e.payload for e in effects)
    assert charge == {"payment_id": body["id"], "amount": 1250, "currency": "EUR"}
    assert receipt == {"payment_id": body["id"], "customer": "alice@example.com"}
    # Effect keys derive from (scope, key, record generation, kind, name): a retry
    # re-enqueues the same ones; a reuse after purge gets new ones.
    assert key.scope == "user:tester" and key.status == "completed"
    assert key.response_status == 201
    claim = Claim("user:tester", "order-1", "", "atomic", uuid.uuid4(),
                  generation=key.generation)
    assert {e.effect_key for e in effects} == {
        claim.effect_key("psp.charge", "charge"), claim.effect_key("email.receipt", "receipt")}

    got = client.get(f"/payments/{body['id']}")
    assert got.status_code == 200
    assert got.json() == body


def test_replay_is_byte_identical_and_writes_nothing(client: TestClient,
                                                     payments_db: Engine) -> None:
    headers = {"Idempotency-Key": "order-2"}
    first = client.post("/payments", json=PAYMENT, headers=headers)
    assert first.status_code == 201
    # Same JSON, other member order and whitespace: the same request (B15).
    again = client.post("/payments", headers=headers, content=b'{ "customer" : '
                        b'"alice@example.com", "currency":"EUR",\n"amount":1250 }')
    assert again.status_code == 201
    assert again.content == first.content
    assert again.headers[REPLAYED_HEADER] == "true"
    for name in ("content-type", "location", "content-length"):
        assert again.headers[name] == first.headers[name]
    assert payment_rows(payments_db) == 1
    assert count(payments_db, "SELECT count(*) FROM outbox.effects") == 2


def test_mismatch_is_422_and_leaves_the_record(client: TestClient,
                                               payments_db: Engine) -> None:
    headers = {"Idempotency-Key": "order-3"}
    first = client.post("/payments", json=PAYMENT, headers=headers)
    resp = client.post("/payments", json={**PAYMENT, "amount": 1251}, headers=headers)
    problem = assert_problem(resp, 422)
    assert problem["code"] == "idempotency_key_reused"
    assert payment_rows(payments_db) == 1
    replay = client.post("/payments", json=PAYMENT, headers=headers)
    assert replay.content == first.content


def test_get_payment_never_500(atomic_client: TestClient) -> None:
    assert_problem(atomic_client.get("/payments/424242"), 404)
    for bad in ("abc", "0", "-1", "1.5", str(2**63), "9" * 5000, "%00"):
        resp = atomic_client.get(f"/payments/{bad}")
        assert resp.status_code in (404, 422), (bad, resp.status_code)
        assert resp.json()["detail"]


def test_healthz_and_openapi(atomic_client: TestClient) -> None:
    assert atomic_client.get("/healthz").json() == {"status": "ok"}
    doc = atomic_client.get("/openapi.json").json()
    op = doc["paths"]["/payments"]["post"]
    assert op["parameters"][0]["name"] == "Idempotency-Key"
    schema = op["requestBody"]["content"]["application/json"]["schema"]
    assert schema["required"] == ["amount", "currency", "customer"]
    assert {"201", "400", "409", "413", "415", "422"} <= op["responses"].keys()
    assert "/webhooks/{source}" in doc["paths"]
    assert "/payments/{payment_id}" in doc["paths"]


def test_unknown_route_and_method_are_problems(atomic_client: TestClient) -> None:
    assert_problem(atomic_client.get("/nope"), 404)
    resp = atomic_client.delete("/payments")
    assert_problem(resp, 405)
    assert resp.headers["allow"] == "POST"


# -- B1-B28: bad inputs on POST /payments ------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    status: int
    key: bytes | None = b"fresh"              # b"fresh": a unique valid key
    body: bytes = PAYMENT_BYTES
    headers: tuple[tuple[bytes, bytes], ...] = ()
    content_type: bytes | None = b"application/json"


def nested(depth: int) -> bytes:
    return b'{"amount":1,"currency":"EUR","customer":"c","x":' + b"[" * depth + b"]" * depth + b"}"


def with_member(raw: bytes) -> bytes:
    return b'{"amount":1,"currency":"EUR","customer":"c","x":' + raw + b"}"


CASES = [
    Case("B1 missing key", 400, key=None),
    Case("B2 empty key", 400, key=b""),
    Case("B2 whitespace key", 400, key=b"   "),
    Case("B3 255 chars", 201, key=b"k" * 255),
    Case("B3 256 chars", 400, key=b"k" * 256),
    Case("B3 quoted 256 chars", 400, key=b'"' + b"k" * 256 + b'"'),
    Case("B4 16 KB header", 400, key=b"k" * 16_384),
    Case("B4 100 KB header", 400, key=b"k" * 102_400),
    Case("B5 one char (no minimum)", 201, key=b"1"),
    Case("B5 low entropy (no minimum)", 201, key=b"aaaa"),
    Case("B6 latin-1 e-acute", 400, key="cl\u00e9".encode("latin-1")),
    Case("B6 emoji", 400, key="k\U0001f600".encode()),
    Case("B6 RTL mark", 400, key="k\u200f".encode()),
    Case("B6 zero-width joiner", 400, key="a\u200db".encode()),
    Case("B7 NUL", 400, key=b"a\x00b"),
    Case("B7 tab", 400, key=b"a\tb"),
    Case("B7 DEL", 400, key=b"a\x7fb"),
    Case("B7 escape", 400, key=b"a\x1bb"),
    Case("B7 percent-encoded NUL is opaque", 201, key=b"a%00b"),
    Case("B9 two headers", 400, key=b"k-one", headers=((b"idempotency-key", b"k-two"),)),
    Case("B9 list value", 400, key=b"k-one, k-two"),
    Case("B11 SQL-ish bare", 201, key=b"';--DROP%_\\"),
    Case("B11 SQL-ish quoted with spaces", 201, key=b"\"'; DROP TABLE idem;--\""),
    Case("B17 not JSON", 400, body=b"amount=1&currency=EUR"),
    Case("B17 truncated JSON", 400, body=PAYMENT_BYTES[:-1]),
    Case("B17 JSON array", 422, body=b"[1, 2]"),
    Case("B18 invalid UTF-8", 400, body=with_member(b'"\xff\xfe"')),
    Case("B18 UTF-16 body", 400, body=PAYMENT_BYTES.decode().encode("utf-16")),
    Case("B19 duplicate members", 400,
         body=b'{"amount":1,"amount":2,"currency":"EUR","customer":"c"}'),
    Case("B20 NaN", 400, body=with_member(b"NaN")),
    Case("B20 Infinity", 400, body=with_member(b"Infinity")),
    Case("B20 -Infinity", 400, body=with_member(b"-Infinity")),
    Case("B21 5000-digit integer", 400, body=with_member(b"9" * 5000)),
    Case("B21 5000-digit amount", 400,
         body=b'{"amount":' + b"9" * 5000 + b',"currency":"EUR","customer":"c"}'),
    Case("B22 escaped NUL", 400, body=with_member(b'"a\\u0000b"')),
    Case("B22 escaped NUL in customer", 400,
         body=b'{"amount":1,"currency":"EUR","customer":"\\u0000"}'),
    Case("B23 lone surrogate", 400, body=with_member(b'"\\ud800"')),
    Case("B23 lone surrogate as a member name", 400, body=b'{"\\udc00":1}'),
    Case("B24 depth 10,000", 400, body=nested(10_000)),
    Case("B24 depth 100", 400, body=nested(100)),
    Case("B25 1 MiB + 1", 413, body=b" " * (MiB + 1)),
    Case("B25 10 MB", 413, body=b"[" + b"1," * 5_000_000 + b"1]"),
    Case("B26 empty body", 400, body=b""),
    Case("B26 whitespace body", 400, body=b" \n "),
    Case("B27 gzip", 415, body=gzip.compress(PAYMENT_BYTES),
         headers=((b"content-encoding", b"gzip"),)),
    Case("B27 latin-1 charset", 415, content_type=b"application/json; charset=iso-8859-1"),
    Case("B27 text/plain", 415, content_type=b"text/plain"),
    Case("B27 utf-8 charset accepted", 201, content_type=b"application/json; charset=UTF-8"),
    Case("B27 no content type accepted", 201, content_type=None),
    Case("schema: amount 0", 422, body=b'{"amount":0,"currency":"EUR","customer":"c"}'),
    Case("schema: amount string", 422, body=b'{"amount":"5","currency":"EUR","customer":"c"}'),
    Case("schema: amount float", 422, body=b'{"amount":5.5,"currency":"EUR","customer":"c"}'),
    Case("schema: amount true", 422, body=b'{"amount":true,"currency":"EUR","customer":"c"}'),
    Case("schema: amount > 10^12", 422,
         body=b'{"amount":10000000000001,"currency":"EUR","customer":"c"}'),
    Case("schema: amount 2^63", 422,
         body=b'{"amount":9223372036854775808,"currency":"EUR","customer":"c"}'),
    Case("schema: currency lowercase", 422, body=b'{"amount":1,"currency":"eur","customer":"c"}'),
    Case("schema: currency unknown", 422, body=b'{"amount":1,"currency":"XXX","customer":"c"}'),
    Case("schema: customer empty", 422, body=b'{"amount":1,"currency":"EUR","customer":""}'),
    Case("schema: customer 201 chars", 422,
         body=b'{"amount":1,"currency":"EUR","customer":"' + b"c" * 201 + b'"}'),
    Case("schema: customer 200 chars", 201,
         body=b'{"amount":1,"currency":"EUR","customer":"' + b"c" * 200 + b'"}'),
    Case("schema: missing customer", 422, body=b'{"amount":1,"currency":"EUR"}'),
    Case("schema: null body", 422, body=b"null"),
    Case("bad X-Tenant", 400, headers=((b"x-tenant", b"a\x01b"),)),
    Case("two X-Tenant headers", 400, headers=((b"x-tenant", b"a"), (b"x-tenant", b"b"))),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_table(client: TestClient, payments_db: Engine, case: Case) -> None:
    headers: list[tuple[bytes, bytes]] = list(case.headers)
    if case.key == b"fresh":
        headers.append((b"idempotency-key", re.sub(r"[^A-Za-z0-9]+", "-", case.name).encode()))
    elif case.key is not None:
        headers.append((b"idempotency-key", case.key))
    if case.content_type is not None:
        headers.append((b"content-type", case.content_type))
    resp = client.post("/payments", content=case.body, headers=headers)
    assert resp.status_code == case.status, resp.text[:500]
    if case.status >= 400:
        assert_problem(resp, case.status)
        assert payment_rows(payments_db) == 0
        assert count(payments_db, "SELECT count(*) FROM outbox.effects") == 0
    else:
        assert payment_rows(payments_db) == 1
    assert processing_keys(payments_db) == 0


def test_b8_quoted_and_bare_keys_are_the_same_key(client: TestClient,
                                                  payments_db: Engine) -> None:
    first = client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": "abc"})
    second = client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": '"abc"'})
    assert second.headers[REPLAYED_HEADER] == "true"
    assert second.content == first.content
    assert payment_rows(payments_db) == 1


def test_b10_keys_are_case_sensitive(client: TestClient, payments_db: Engine) -> None:
    a = client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": "ABC"})
    b = client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": "abc"})
    assert a.status_code == b.status_code == 201
    assert REPLAYED_HEADER.lower() not in b.headers
    assert a.json()["id"] != b.json()["id"]
    assert payment_rows(payments_db) == 2


def test_b11_sql_text_is_an_opaque_key(client: TestClient, payments_db: Engine) -> None:
    for key in ("%", "_", "\\", "%_", "';--"):
        assert client.post("/payments", json=PAYMENT,
                           headers={"Idempotency-Key": key}).status_code == 201
    # `%` must not match `%_` as a LIKE pattern would: each key replays only itself.
    again = client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": "%"})
    assert again.headers[REPLAYED_HEADER] == "true"
    assert again.json()["id"] == 1
    assert payment_rows(payments_db) == 5


def test_b12_same_key_other_tenant_is_independent(client: TestClient,
                                                  payments_db: Engine) -> None:
    key = {"Idempotency-Key": "shared-key"}
    results = [
        client.post("/payments", json=PAYMENT, headers={**key, **extra})
        for extra in ({"X-Tenant": "acme"}, {"X-Tenant": "globex"},
                      {"Authorization": "Bearer tok-a"}, {"Authorization": "Bearer tok-c"},
                      {})
    ]
    assert [r.status_code for r in results] == [201] * 5
    assert all(REPLAYED_HEADER.lower() not in r.headers for r in results)
    assert len({r.json()["id"] for r in results}) == 5
    # Another tenant with a different body is not a mismatch either.
    other = client.post("/payments", json={**PAYMENT, "amount": 1},
                        headers={**key, "X-Tenant": "initech"})
    assert other.status_code == 201
    with payments_db.connect() as conn:
        scopes = conn.execute(text("SELECT scope FROM outbox.idempotency_keys")).scalars().all()
    assert not any("tok-" in s for s in scopes), "credentials must not be stored"


def test_b13_same_key_on_another_path_or_method_is_422(lib_client: TestClient,
                                                       engine: Engine) -> None:
    key = {"Idempotency-Key": "path-key"}
    assert lib_client.post("/a", json={"x": 1}, headers=key).status_code == 201
    assert_problem(lib_client.post("/b", json={"x": 1}, headers=key), 422)
    assert_problem(lib_client.put("/a", json={"x": 1}, headers=key), 422)
    assert_problem(lib_client.post("/a?x=1", json={"x": 1}, headers=key), 422)
    assert orders(engine) == 1
    assert processing_keys(engine) == 0


def test_query_strings_that_differ_only_in_encoding_do_not_share_a_fingerprint(
        lib_client: TestClient, engine: Engine) -> None:
    """Issue 8.7: `?a=b&c=d` (two parameters) is not `?a=b%26c%3Dd` (one, holding `&`)."""
    key = {"Idempotency-Key": "query-key"}
    assert lib_client.post("/a?a=b&c=d", json={"x": 1}, headers=key).status_code == 201
    assert_problem(lib_client.post("/a?a=b%26c%3Dd", json={"x": 1}, headers=key), 422)
    assert_problem(lib_client.post("/a?a=b%3Dc&d", json={"x": 1}, headers=key), 422)
    # The same parameters in another order, or spelt with other escapes, are the same.
    again = lib_client.post("/a?c=d&a=%62", json={"x": 1}, headers=key)
    assert again.status_code == 201 and again.headers[REPLAYED_HEADER] == "true"
    assert orders(engine) == 1


def test_a_client_retrying_with_a_refreshed_token_gets_the_replay(
        client: TestClient, payments_db: Engine) -> None:
    """Issue 8.8: the scope is the client, not the credential it happened to send."""
    key = {"Idempotency-Key": "refresh-key"}
    first = client.post("/payments", json=PAYMENT, headers={**key, "Authorization": "Bearer tok-a"})
    retry = client.post("/payments", json=PAYMENT, headers={**key, "Authorization": "Bearer tok-b"})
    assert first.status_code == retry.status_code == 201
    assert retry.headers[REPLAYED_HEADER] == "true" and retry.content == first.content
    other = client.post("/payments", json=PAYMENT, headers={**key, "Authorization": "Bearer tok-c"})
    assert other.status_code == 201 and REPLAYED_HEADER.lower() not in other.headers
    assert payment_rows(payments_db) == 2
    with payments_db.connect() as conn:
        scopes = set(conn.execute(text("SELECT scope FROM outbox.idempotency_keys")).scalars())
    assert scopes == {"user:alice", "user:bob"}  # no credential is stored
    # Only its owner sees a payment; to anyone else it does not exist.
    pid = first.json()["id"]
    assert client.get(f"/payments/{pid}", headers={"Authorization": "Bearer tok-b"}
                      ).status_code == 200
    assert_problem(client.get(f"/payments/{pid}", headers={"Authorization": "Bearer tok-c"}),
                   404)
    for bad in ("Basic x", "Bearer unknown-token", "Bearer "):
        assert_problem(client.post("/payments", json=PAYMENT,
                                   headers={**key, "Authorization": bad}), 401)
    assert payment_rows(payments_db) == 2


def test_no_token_is_401_before_anything_else(payments_db: Engine) -> None:
    """DESIGN §8: a request without a token gets 401, and nothing is stored."""
    with TestClient(create_app(payments_db, auth=AUTH)) as anonymous:
        for headers in ({"Idempotency-Key": "k"}, {}):
            resp = anonymous.post("/payments", json=PAYMENT, headers=headers)
            assert_problem(resp, 401)
            assert resp.headers["WWW-Authenticate"] == "Bearer"
        assert_problem(anonymous.get("/payments/1"), 401)
    assert payment_rows(payments_db) == 0
    assert processing_keys(payments_db) == 0


def test_a_forged_tenant_header_cannot_spell_another_scope(
        client: TestClient, payments_db: Engine) -> None:
    """Issue 16: scope parts are encoded, so `X-Tenant: a|user:bob` is not bob's scope."""
    key = {"Idempotency-Key": "forge-key"}
    bobs = client.post("/payments", json=PAYMENT,
                       headers={**key, "X-Tenant": "acme", "Authorization": "Bearer tok-c"})
    forged = client.post("/payments", json=PAYMENT,
                         headers={**key, "X-Tenant": "acme|user:bob",
                                  "Authorization": "Bearer tok-a"})
    assert bobs.status_code == forged.status_code == 201
    assert REPLAYED_HEADER.lower() not in forged.headers
    assert forged.json()["id"] != bobs.json()["id"]


def test_b15_integral_floats_and_key_order_share_a_fingerprint(lib_client: TestClient,
                                                                engine: Engine) -> None:
    key = {"Idempotency-Key": "fp-key"}
    first = lib_client.post("/a", content=b'{"n": 1, "m": [1, 2.0]}', headers=key)
    again = lib_client.post("/a", content=b'{"m":[1.0,2],"n":1.0}', headers=key)
    assert again.status_code == 201
    assert again.content == first.content
    assert again.headers[REPLAYED_HEADER] == "true"
    assert_problem(lib_client.post("/a", content=b'{"n": 1.5, "m": [1, 2]}', headers=key), 422)
    assert orders(engine) == 1


def test_b28_huge_response_is_sent_once_and_replayed_as_a_stand_in(engine: Engine,
                                                                   mode: Mode) -> None:
    lib = library_app(engine, mode, max_stored_body=64 * 1024)
    with TestClient(lib.app) as client:
        key = {"Idempotency-Key": "big-key"}
        small = client.post("/big", json={"size": 64 * 1024}, headers={"Idempotency-Key": "s"})
        first = client.post("/big", json={"size": 5 * MiB}, headers=key)
        replay = client.post("/big", json={"size": 5 * MiB}, headers=key)
        small_replay = client.post("/big", json={"size": 64 * 1024},
                                   headers={"Idempotency-Key": "s"})
    # At the cap: stored and replayed as is. Above: the first caller gets everything.
    assert small_replay.content == small.content == b"x" * 64 * 1024
    assert first.status_code == 200
    assert first.content == b"x" * 5 * MiB
    assert first.headers["content-type"] == "application/octet-stream"
    assert "set-cookie" not in first.headers  # per-caller headers are never stored or sent
    assert replay.status_code == 200
    assert replay.headers[REPLAYED_HEADER] == "true"
    assert replay.headers[OMITTED_HEADER] == "body"
    assert replay.headers["location"] == first.headers["location"]
    assert replay.headers["content-type"] == PROBLEM_MEDIA_TYPE
    note = replay.json()
    assert note["code"] == "response_not_stored"
    assert note["original_status"] == 200 and note["original_size"] == 5 * MiB
    assert orders(engine) == 2
    stored = count(engine, "SELECT max(length(response_body)) FROM outbox.idempotency_keys")
    assert stored <= 64 * 1024


def test_errors_raised_by_work_store_nothing(lib_client: TestClient, engine: Engine) -> None:
    key = {"Idempotency-Key": "declined-key"}
    for _ in range(2):  # not cached: a retry runs again (Stripe: failures before commit)
        assert_problem(lib_client.post("/declined", json={"card": 1}, headers=key), 402)
    assert orders(engine) == 0
    assert count(engine, "SELECT count(*) FROM outbox.idempotency_keys") == 0
    # The key is free: the same key now works for a request that succeeds elsewhere.
    assert lib_client.post("/a", json={"card": 1}, headers=key).status_code == 201


@pytest.mark.parametrize("path", ["/deferred", "/deferred-in"])
def test_effects_deferred_by_an_endpoint_are_written_with_the_key(
        lib_client: TestClient, engine: Engine, path: str) -> None:
    """`claim.enqueue` in a FastAPI endpoint (run, and run_in on the app's connection):
    one effect per request, written with the key, the doorbell rung after the commit,
    nothing more on the replay."""
    from outbox import add_doorbell, remove_doorbell

    rings: list[str] = []
    add_doorbell(rings.append)
    try:
        key = {"Idempotency-Key": f"deferred-{path}"}
        first = lib_client.post(path, json={"a": 1}, headers=key)
        again = lib_client.post(path, json={"a": 1}, headers=key)
    finally:
        remove_doorbell(rings.append)
    assert first.status_code == 201 and again.content == first.content
    assert orders(engine) == 1 and rings == ["deferred-q"]
    assert count(engine, "SELECT count(*) FROM outbox.effects WHERE queue = 'deferred-q'") == 1


def test_async_endpoints_use_arun(lib_client: TestClient, engine: Engine) -> None:
    key = {"Idempotency-Key": "async-key"}
    first = lib_client.post("/async", json={"a": 1}, headers=key)
    again = lib_client.post("/async", json={"a": 1}, headers=key)
    assert first.status_code == 201 and again.content == first.content
    assert orders(engine) == 1


def test_background_tasks_run_after_the_first_answer_only(lib: LibraryApp,
                                                          lib_client: TestClient) -> None:
    key = {"Idempotency-Key": "bg-key"}
    first = lib_client.post("/background", json={}, headers=key)
    again = lib_client.post("/background", json={}, headers=key)
    assert again.content == first.content
    assert lib.tasks == [first.json()["order"]]


class FakePgError(Exception):
    def __init__(self, sqlstate: str) -> None:
        super().__init__(sqlstate)
        self.sqlstate = sqlstate


@pytest.mark.parametrize(("error", "status"), [
    (OperationalError("x", {}, FakePgError("55P03")), 409),   # lock_timeout
    (OperationalError("x", {}, FakePgError("40001")), 409),   # serialization, retries spent
    (OperationalError("x", {}, FakePgError("40P01")), 409),   # deadlock, retries spent
    (OperationalError("x", {}, FakePgError("08006")), 503),   # connection lost
    (IntegrityError("x", {}, FakePgError("23505")), None),    # a bug: stays a 500
])
def test_database_errors_map_to_retryable_answers(error: DBAPIError, status: int | None) -> None:
    problem = _database_problem(error)
    assert (problem.status_code if problem else None) == status
    if problem is not None:
        assert problem.headers is not None and problem.headers["Retry-After"] == "1"


def test_database_down_is_503_outcome_unknown(payments_db: Engine) -> None:
    dead = make_engine("postgresql://root@127.0.0.1:1/test", pool_pre_ping=False)
    app = FastAPI()
    install_problem_handlers(app)
    guard = Idempotency(dict, engine=dead, scope=anonymous_scope)

    @app.post("/x")
    def x(req: Annotated[IdempotentRequest[dict[str, Any]], Depends(guard)]) -> Response:
        return req.run(lambda conn, claim: JSONResponse({}, 201))

    with TestClient(app) as client:
        resp = client.post("/x", json={}, headers={"Idempotency-Key": "k"})
    problem = assert_problem(resp, 503)
    assert problem["code"] == "outcome_unknown"
    assert resp.headers["retry-after"] == "1"
    dead.dispose()


# -- concurrency through a real server -------------------------------------------------------


def test_b16_concurrent_twins_get_409_through_uvicorn(payments_db: Engine, mode: Mode) -> None:
    n = 16
    barrier = threading.Barrier(n)
    results: list[httpx.Response] = []
    lock = threading.Lock()

    with serving(create_app(payments_db, idempotency_mode=mode, auth=AUTH)) as base:
        def hit() -> None:
            with httpx.Client(base_url=base, timeout=30, headers=AS_CLIENT) as c:
                barrier.wait()
                r = c.post("/payments", json=PAYMENT, headers={"Idempotency-Key": "storm"})
            with lock:
                results.append(r)

        threads = [threading.Thread(target=hit) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)

    assert len(results) == n
    statuses = sorted(r.status_code for r in results)
    assert set(statuses) <= {201, 409}, statuses
    created = [r for r in results if r.status_code == 201]
    assert created and all(r.content == created[0].content for r in created)
    assert sum(REPLAYED_HEADER.lower() not in r.headers for r in created) == 1
    for r in results:
        if r.status_code == 409:
            assert_problem(r, 409)
            assert int(r.headers["retry-after"]) >= 1
    assert payment_rows(payments_db) == 1
    assert count(payments_db, "SELECT count(*) FROM outbox.effects") == 2
    assert processing_keys(payments_db) == 0


@pytest.mark.parametrize("local_twins", [True, False], ids=["local-twins", "database"])
def test_in_flight_request_gets_409_then_the_replay(engine: Engine, mode: Mode,
                                                    local_twins: bool) -> None:
    """Both ways: the twin answered by this process, and by the database."""
    lib = library_app(engine, mode, guard=IdempotencyGuard(local_twins=local_twins))
    with serving(lib.app) as base, httpx.Client(base_url=base, timeout=30, headers=AS_CLIENT) as c:
        key = {"Idempotency-Key": "slow-key"}
        first: list[httpx.Response] = []
        t = threading.Thread(target=lambda: first.append(
            httpx.post(f"{base}/slow", json={"v": 1}, headers=key, timeout=30)))
        t.start()
        assert lib.entered.wait(30)
        twin = c.post("/slow", json={"v": 1}, headers=key)
        assert_problem(twin, 409)
        assert twin.headers["retry-after"] == "1"
        assert twin.json()["code"] == "request_in_progress"
        # A different body while in flight: 409 in atomic mode (the twin cannot see the
        # uncommitted row), 422 in phased mode (the committed claim has a fingerprint).
        other = c.post("/slow", json={"v": 2}, headers=key)
        assert other.status_code == (409 if mode == "atomic" else 422)
        lib.release.set()
        t.join(30)
        assert first[0].status_code == 201
        replay = c.post("/slow", json={"v": 1}, headers=key)
        assert replay.status_code == 201 and replay.content == first[0].content
        assert replay.headers[REPLAYED_HEADER] == "true"
    assert orders(engine) == 1
    assert processing_keys(engine) == 0


def test_key_held_by_another_transaction_is_409(payments_db: Engine,
                                                atomic_client: TestClient) -> None:
    lock_id = advisory_lock_id("user:tester", "held-key")
    with payments_db.begin() as conn:
        conn.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": lock_id})
        started = time.monotonic()
        resp = atomic_client.post("/payments", json=PAYMENT,
                                  headers={"Idempotency-Key": "held-key"})
        assert time.monotonic() - started < 10  # try-lock: never waits for the holder
    assert_problem(resp, 409)
    assert resp.headers["retry-after"] == "1"
    assert payment_rows(payments_db) == 0
    after = atomic_client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": "held-key"})
    assert after.status_code == 201


def test_expired_phased_claim_is_taken_over(payments_db: Engine) -> None:
    """A crashed phased request left `processing`: 409 before the TTL, retaken after."""
    guard = IdempotencyGuard(ttl=60)
    with TestClient(create_app(payments_db, idempotency_mode="phased", auth=AUTH),
                    headers=AS_CLIENT) as client:
        fp = fingerprint("POST", "/payments", PAYMENT)
        claimed = guard.claim(payments_db, "user:tester", "crashed", fp)
        assert isinstance(claimed, Claim)
        headers = {"Idempotency-Key": "crashed"}
        assert_problem(client.post("/payments", json=PAYMENT, headers=headers), 409)
        with payments_db.begin() as conn:
            conn.execute(text("UPDATE outbox.idempotency_keys "
                              "SET locked_at = now() - interval '1 hour',"
                              " lock_expires_at = now() - interval '59 min'"))
        resp = client.post("/payments", json=PAYMENT, headers=headers)
        assert resp.status_code == 201
    assert payment_rows(payments_db) == 1
    assert processing_keys(payments_db) == 0


def test_wire_level_bad_headers_are_4xx(payments_db: Engine) -> None:
    with serving(create_app(payments_db, auth=AUTH)) as base:
        body = PAYMENT_BYTES
        for key in (b"a\x00b", b"a\rb", "cl\u00e9".encode("latin-1"), b"k" * 16_384,
                    b"k" * 102_400):
            status = raw_request(base, b"POST /payments HTTP/1.1\r\nHost: x\r\n"
                                 b"Authorization: Bearer test-token\r\n"
                                 b"Content-Type: application/json\r\n"
                                 b"Idempotency-Key: " + key + b"\r\n"
                                 b"Content-Length: " + str(len(body)).encode() + b"\r\n"
                                 b"Connection: close\r\n\r\n" + body)
            assert status in (400, 431), (key[:20], status)
        with httpx.Client(base_url=base, timeout=30, headers=AS_CLIENT) as c:
            big = c.post("/payments", content=b"[" + b"1," * 5_000_000 + b"1]",
                         headers={"Idempotency-Key": "k", "Content-Type": "application/json"})
            assert_problem(big, 413)

            def chunks() -> Iterator[bytes]:  # no Content-Length: the stream is cut off
                for _ in range(40):
                    yield b" " * 65_536

            chunked = c.post("/payments", content=chunks(),
                             headers={"Idempotency-Key": "k2",
                                      "Content-Type": "application/json"})
            assert_problem(chunked, 413)
    assert payment_rows(payments_db) == 0
    assert processing_keys(payments_db) == 0


# -- webhooks (B29-B35) ---------------------------------------------------------------------


def event(**overrides: Any) -> dict[str, Any]:
    return {"id": "evt_1", "type": "payment.succeeded", "data": {"payment_id": 1},
            **overrides}


def inbox_rows(engine: Engine) -> int:
    return count(engine, "SELECT count(*) FROM outbox.inbox")


def test_webhook_outcomes(atomic_client: TestClient, payments_db: Engine) -> None:
    post: Callable[..., httpx.Response] = atomic_client.post
    assert post("/webhooks/stripe", json=event()).json() == {"outcome": "inserted"}
    again = post("/webhooks/stripe", content=b'{"data":{"payment_id":1},'
                 b'"type":"payment.succeeded","id":"evt_1"}')
    assert again.status_code == 200 and again.json() == {"outcome": "duplicate"}
    conflict = post("/webhooks/stripe", json=event(data={"payment_id": 2}))
    assert conflict.status_code == 200
    assert conflict.json() == {"outcome": "conflict"}
    assert count(payments_db, "SELECT count(*) FROM outbox.inbox_conflicts") == 1
    # B31: the key is (source, id).
    assert post("/webhooks/adyen", json=event()).json() == {"outcome": "inserted"}
    # Versions of one entity: older ones are stale.
    v2 = event(id="evt_v2", entity="pay_1", version=2)
    assert post("/webhooks/stripe", json=v2).json() == {"outcome": "inserted"}
    v1 = event(id="evt_v1", entity="pay_1", version=1)
    assert post("/webhooks/stripe", json=v1).json() == {"outcome": "stale"}
    assert inbox_rows(payments_db) == 4
    with payments_db.connect() as conn:
        stored = conn.execute(text(
            "SELECT payload FROM outbox.inbox WHERE source = 'stripe' AND event_id = 'evt_1'"
        )).scalar_one()
    assert stored["data"] == {"payment_id": 1}  # the conflicting copy never overwrote it


def test_b35_batch_with_a_repeated_event(atomic_client: TestClient, payments_db: Engine) -> None:
    resp = atomic_client.post("/webhooks/stripe/batch", json=[event(), event(), event(id="e2")])
    assert resp.status_code == 200
    assert resp.json() == {"outcomes": ["inserted", "duplicate", "inserted"]}
    assert inbox_rows(payments_db) == 2
    assert count(payments_db, "SELECT duplicates FROM outbox.inbox WHERE event_id = 'evt_1'") == 1


WEBHOOK_CASES: list[tuple[str, str, bytes, int]] = [
    ("B29 missing id", "s", json.dumps({"type": "t", "data": {}}).encode(), 400),
    ("B29 missing type", "s", json.dumps({"id": "e", "data": {}}).encode(), 400),
    ("B29 missing data", "s", json.dumps({"id": "e", "type": "t"}).encode(), 400),
    ("B29 data not an object", "s", json.dumps(event(data=[1])).encode(), 400),
    ("B29 id not a string", "s", json.dumps(event(id=5)).encode(), 400),
    ("B29 empty id", "s", json.dumps(event(id="")).encode(), 400),
    ("B29 blank source", "%20", json.dumps(event()).encode(), 400),
    ("B30 id of 256 chars", "s", json.dumps(event(id="e" * 256)).encode(), 400),
    ("B30 id of 255 chars", "s", json.dumps(event(id="e" * 255)).encode(), 200),
    ("B30 non-ASCII id", "s", json.dumps(event(id="\u00e9v\u00e9nement")).encode(), 400),
    ("B30 NUL in id", "s", json.dumps(event(id="a\u0000b")).encode(), 400),
    ("B30 non-ASCII source", "%C3%A9", json.dumps(event()).encode(), 400),
    ("B30 source of 256 chars", "s" * 256, json.dumps(event()).encode(), 400),
    ("B32 negative version", "s", json.dumps(event(version=-1, entity="x")).encode(), 400),
    ("B32 float version", "s", json.dumps(event(version=1.5, entity="x")).encode(), 400),
    ("B32 string version", "s", json.dumps(event(version="3", entity="x")).encode(), 400),
    ("B32 version 2^63", "s", json.dumps(event(version=2**63, entity="x")).encode(), 400),
    ("B32 version 2^53", "s", json.dumps(event(version=2**53, entity="x")).encode(), 400),
    ("B32 version 2^53-1", "s", json.dumps(event(version=2**53 - 1, entity="x")).encode(), 200),
    ("B32 bool version", "s", json.dumps(event(version=True, entity="x")).encode(), 400),
    ("B17 not JSON", "s", b"id=1", 400),
    ("B19 duplicate members", "s", b'{"id":"a","id":"b","type":"t","data":{}}', 400),
    ("B20 NaN", "s", b'{"id":"a","type":"t","data":{"x":NaN}}', 400),
    ("B21 huge number", "s", b'{"id":"a","type":"t","data":{"x":' + b"1" * 5000 + b"}}", 400),
    ("B22 NUL in data", "s", b'{"id":"a","type":"t","data":{"x":"\\u0000"}}', 400),
    ("B23 lone surrogate", "s", b'{"id":"a","type":"t","data":{"x":"\\ud800"}}', 400),
    ("B24 deep data", "s", b'{"id":"a","type":"t","data":{"x":' + b"[" * 5000 + b"]" * 5000
     + b"}}", 400),
    ("B25 too large", "s", b" " * (MiB + 1), 413),
    ("B26 empty", "s", b"", 400),
    ("array on the single endpoint", "s", json.dumps([event()]).encode(), 400),
]


@pytest.mark.parametrize(("name", "source", "body", "status"), WEBHOOK_CASES,
                         ids=[c[0] for c in WEBHOOK_CASES])
def test_webhook_bad_input(atomic_client: TestClient, payments_db: Engine, name: str,
                           source: str, body: bytes, status: int) -> None:
    resp = atomic_client.post(f"/webhooks/{source}", content=body,
                              headers={"Content-Type": "application/json"})
    assert resp.status_code == status, resp.text[:300]
    if status == 200:
        assert resp.json() == {"outcome": "inserted"}
        assert inbox_rows(payments_db) == 1
    else:
        assert_problem(resp, status)
        assert inbox_rows(payments_db) == 0


def test_webhook_batch_bad_input(atomic_client: TestClient, payments_db: Engine) -> None:
    for body in (b"[]", b"{}", json.dumps([event(), {"id": "x"}]).encode()):
        assert_problem(atomic_client.post("/webhooks/s/batch", content=body), 400)
    assert_problem(atomic_client.post("/webhooks/s", json=event(),
                                      headers={"Content-Type": "text/plain"}), 415)
    assert inbox_rows(payments_db) == 0


def test_webhook_without_source_is_404(atomic_client: TestClient) -> None:
    assert_problem(atomic_client.post("/webhooks/", json=event()), 404)


# -- the process ----------------------------------------------------------------------------


@pytest.mark.slow
def test_serve_exits_cleanly_on_sigterm(payments_db: Engine, db_url: str) -> None:
    env = {**os.environ, "DATABASE_URL": db_url}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dispatcher.examples.payments.app", "--port", "0"], cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        base = None
        deadline = time.monotonic() + 60
        while base is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            match = re.search(r"Uvicorn running on (http://\S+)", line)
            if match:
                base = match.group(1)
        assert base, "".join(lines)
        health = httpx.get(f"{base}/healthz", timeout=30)
        assert health.json() == {"status": "ok"}, health.text
        resp = httpx.post(f"{base}/payments", json=PAYMENT, timeout=30,  # open demo mode
                          headers={"Idempotency-Key": "proc-key", **AS_CLIENT})
        assert resp.status_code == 201, resp.text
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        lines.append(proc.stdout.read())
        output = "".join(lines)
        assert code == 0, output
        assert "Traceback" not in output, output
        assert "Finished server process" in output, output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
