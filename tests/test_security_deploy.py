"""Issue 16, outbound replay and deployment: what the idempotency store keeps at rest,
and what the fake PSP lets a non-local peer do.

Real HTTP through FastAPI's TestClient against a real PostgreSQL for the stored
responses; a real PSP on a real socket for its control endpoints. The compose file
and the Dockerfile are checked offline in tests/test_ops.py.

No `from __future__ import annotations`: FastAPI reads the test app's annotations.
"""

import json
import socket
import warnings
from collections.abc import Iterator
from typing import Annotated, Any

import httpx
import pytest
from fastapi import Depends, FastAPI
from sqlalchemy import Connection, Engine, text
from starlette.responses import JSONResponse, Response

from dispatcher.examples.payments.psp import Receiver
from outbox import Claim
from outbox.errors import ConfigurationError
from outbox.http import (
    DEFAULT_STORED_HEADERS,
    OMITTED_HEADER,
    PROBLEM_MEDIA_TYPE,
    REPLAYED_HEADER,
    Idempotency,
    IdempotentRequest,
    anonymous_scope,
    install_problem_handlers,
    unless_no_store,
)

with warnings.catch_warnings():  # starlette would rather have `httpx2`; httpx works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

SECRET = "sk_live_4f9c2b7d1e"


def secrets_app(engine: Engine, **options: Any) -> FastAPI:
    """`POST /keys` creates an API key and shows its secret once (the case of issue 16);
    `POST /plain` answers without one; `POST /empty` is a 204."""
    app = FastAPI()
    install_problem_handlers(app)
    app.state.engine = engine
    options.setdefault("scope", anonymous_scope)
    guard = Idempotency(dict, **options)
    Req = Annotated[IdempotentRequest[dict[str, Any]], Depends(guard)]

    def order(conn: Connection) -> int:
        return int(conn.execute(text(
            "INSERT INTO public.test_orders (key, amount) VALUES ('k', 1) RETURNING id"
        )).scalar_one())

    @app.post("/keys")
    def create_key(req: Req) -> Response:
        def work(conn: Connection, claim: Claim) -> Response:
            oid = order(conn)
            return JSONResponse(
                {"id": oid, "secret": SECRET}, 201,
                headers={"Location": f"/keys/{oid}", "Cache-Control": "no-store",
                         "Set-Cookie": "session=alice", "WWW-Authenticate": "Bearer",
                         "Proxy-Authenticate": "Basic", "X-Request-Id": "r-1",
                         "Connection": "x-trace", "X-Trace": "hop"})
        return req.run(work)

    @app.post("/plain")
    def plain(req: Req) -> Response:
        def work(conn: Connection, claim: Claim) -> Response:
            return JSONResponse({"id": order(conn)}, 201)
        return req.run(work)

    @app.post("/empty")
    def empty(req: Req) -> Response:
        def work(conn: Connection, claim: Claim) -> Response:
            order(conn)
            return Response(status_code=204)
        return req.run(work)

    return app


def orders(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM public.test_orders")).scalar_one())


def stored_bodies(engine: Engine) -> list[bytes]:
    with engine.connect() as conn:
        return [bytes(r[0]) for r in conn.execute(text(
            "SELECT response_body FROM outbox.idempotency_keys")) if r[0] is not None]


@pytest.fixture
def client_for(engine: Engine) -> Iterator[Any]:
    clients: list[TestClient] = []

    def make(**options: Any) -> TestClient:
        client = TestClient(secrets_app(engine, **options))
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.__exit__(None, None, None)


# -- (a) stored-response headers: a deny-list configuration cannot override -------------


@pytest.mark.parametrize("name", [
    "Set-Cookie", "set-cookie2", "WWW-Authenticate", "Authentication-Info",
    "Proxy-Authenticate", "Proxy-Authorization", "proxy-anything", "Connection",
    "Keep-Alive", "TE", "Trailer", "Transfer-Encoding", "Upgrade", "Content-Length",
    REPLAYED_HEADER, OMITTED_HEADER,
])
def test_a_denied_stored_header_is_a_configuration_error(engine: Engine, name: str) -> None:
    """Before: `stored_headers=(..., "set-cookie")` stored and replayed alice's cookie to
    whoever retried her key (or dropped a framing header silently)."""
    with pytest.raises(ConfigurationError, match=name.lower()):
        secrets_app(engine, stored_headers=(*DEFAULT_STORED_HEADERS, name))
    guard = Idempotency(dict, scope=anonymous_scope)
    with pytest.raises(ConfigurationError):
        guard.stored_headers = {"location", name}  # not after construction either
    assert guard.stored_headers == frozenset(DEFAULT_STORED_HEADERS)


def test_bad_stored_header_names_are_configuration_errors() -> None:
    for bad in (["x y"], ["set-cookie\r\nx: 1"], [""], "content-type"):
        with pytest.raises(ConfigurationError):
            Idempotency(dict, scope=anonymous_scope, stored_headers=bad)
    guard = Idempotency(dict, scope=anonymous_scope, stored_headers=[" X-Request-Id "])
    assert guard.stored_headers == {"x-request-id"}


def test_replays_never_carry_per_caller_or_hop_by_hop_headers(client_for: Any,
                                                              engine: Engine) -> None:
    client = client_for(stored_headers=(*DEFAULT_STORED_HEADERS, "x-request-id", "x-trace"))
    key = {"Idempotency-Key": "k-headers"}
    first = client.post("/keys", json={}, headers=key)
    replay = client.post("/keys", json={}, headers=key)
    assert first.status_code == replay.status_code == 201
    assert replay.headers[REPLAYED_HEADER] == "true"
    for response in (first, replay):  # both are built from the stored form
        for name in ("set-cookie", "www-authenticate", "proxy-authenticate"):
            assert name not in response.headers, name
        # x-trace is configured, but this response named it in `Connection`: one hop only
        assert "x-trace" not in response.headers
        assert response.headers["x-request-id"] == "r-1"
        assert response.headers["location"] == first.headers["location"]
    assert orders(engine) == 1


# -- (b) responses that carry secrets are not kept at rest ------------------------------


def test_store_body_false_keeps_no_body_and_replays_a_pointer(client_for: Any,
                                                              engine: Engine) -> None:
    """Before: `store_body` did not exist; the secret sat in `idempotency_keys`."""
    client = client_for(store_body=False)
    key = {"Idempotency-Key": "k-secret"}
    first = client.post("/keys", json={}, headers=key)
    replay = client.post("/keys", json={}, headers=key)
    assert first.status_code == 201 and first.json()["secret"] == SECRET  # shown once
    assert REPLAYED_HEADER not in first.headers and OMITTED_HEADER not in first.headers
    assert replay.status_code == 201
    assert replay.headers[REPLAYED_HEADER] == "true"
    assert replay.headers[OMITTED_HEADER] == "body"
    assert replay.headers["location"] == first.headers["location"]
    assert replay.headers["content-type"] == PROBLEM_MEDIA_TYPE
    note = replay.json()
    assert note["code"] == "response_not_stored" and note["original_status"] == 201
    assert "original_size" not in note  # not even the secret's length
    assert SECRET not in replay.text
    assert orders(engine) == 1  # the replay did not run the work again
    bodies = stored_bodies(engine)
    assert len(bodies) == 1 and SECRET.encode() not in bodies[0]
    # A 204 has no body to withhold: it replays as it was.
    empty = client.post("/empty", json={}, headers={"Idempotency-Key": "k-204"})
    again = client.post("/empty", json={}, headers={"Idempotency-Key": "k-204"})
    assert empty.status_code == again.status_code == 204 and again.content == b""
    assert OMITTED_HEADER not in again.headers


def test_unless_no_store_decides_per_response(client_for: Any, engine: Engine) -> None:
    client = client_for(store_body=unless_no_store)
    secret_key, plain_key = {"Idempotency-Key": "k-1"}, {"Idempotency-Key": "k-2"}
    first = client.post("/keys", json={}, headers=secret_key)
    replay = client.post("/keys", json={}, headers=secret_key)
    plain = client.post("/plain", json={}, headers=plain_key)
    plain_replay = client.post("/plain", json={}, headers=plain_key)
    assert first.json()["secret"] == SECRET
    assert replay.headers[OMITTED_HEADER] == "body" and SECRET not in replay.text
    assert replay.headers["cache-control"] == "no-store"
    # A response without `no-store` is kept and replayed byte for byte.
    assert plain_replay.content == plain.content and OMITTED_HEADER not in plain_replay.headers
    assert not any(SECRET.encode() in b for b in stored_bodies(engine))
    assert orders(engine) == 2


def test_store_body_must_be_a_bool_or_a_predicate() -> None:
    with pytest.raises(ConfigurationError):
        Idempotency(dict, scope=anonymous_scope, store_body="no")  # type: ignore[arg-type]


def test_the_stand_in_for_a_huge_body_is_unchanged(client_for: Any) -> None:
    """The size cap and the secrets opt-out share one stand-in; the cap's keeps its size."""
    guard = Idempotency(dict, scope=anonymous_scope, max_stored_body=4)
    from outbox._idempotency import StoredResponse
    note = json.loads(guard.replayable(StoredResponse(200, (), b"12345")).body)
    assert note["original_size"] == 5 and note["code"] == "response_not_stored"


# -- the fake PSP: control endpoints answer loopback peers only -------------------------


def _non_loopback_ipv4() -> str | None:
    """An address of this machine that is not loopback (None: there is none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent by a UDP connect
            address = str(s.getsockname()[0])
        except OSError:
            return None
    return None if address.startswith("127.") else address


CONTROL = [("GET", "/_stats"), ("GET", "/_ledger"), ("GET", "/_applied"),
           ("GET", "/_control"), ("POST", "/_control"), ("DELETE", "/_control"),
           ("POST", "/_reset")]


def test_psp_control_endpoints_refuse_non_loopback_peers() -> None:
    """Before: anyone who reached the published port could reset the ledger or make the
    PSP fail every charge (`/_control`), and read every key (`/_ledger`)."""
    address = _non_loopback_ipv4()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    with Receiver("0.0.0.0", 0) as psp:
        port = psp.url.rsplit(":", 1)[1]
        remote = httpx.Client(base_url=f"http://{address}:{port}", trust_env=False, timeout=10)
        local = httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=10)
        with remote, local:
            charge = remote.post("/charges", json={"amount": 1},
                                 headers={"Idempotency-Key": "c-1"})
            assert charge.status_code == 201  # deliveries from the network still work
            assert remote.get("/_health").status_code == 200  # compose's healthcheck
            for method, path in CONTROL:
                reply = remote.request(method, path, json={"mode": "fail_500"}
                                       if method == "POST" else None)
                assert reply.status_code == 403, (method, path, reply.text)
                assert reply.json()["error"] == "forbidden"
            # Nothing changed: no rule, the ledger intact; loopback still controls it.
            assert local.get("/_control").json() == {"rules": []}
            assert local.get("/_applied").json() == {"c-1": 1}
            assert local.post("/_control", json={"mode": "fail_500"}).status_code == 200
