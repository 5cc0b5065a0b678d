"""The web console (outbox/console/): every page, filter and action over real HTTP
(Starlette's TestClient, real PostgreSQL), the CLI's bind rule, and one real browser.

The browser test drives Debian's Chromium (`apt-get install chromium`) through the
Playwright package against `outbox ui` and `outbox worker` started as subprocesses;
it is skipped, with the reason, where /usr/bin/chromium is not installed.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, text
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route

from outbox import IdempotencyGuard, StoredResponse, enqueue
from outbox.console import MASKED, Mask, create_console_app, trust_upstream
from outbox.console._views import derived_key_names
from outbox.sql import console as cq

with warnings.catch_warnings():  # starlette would rather have `httpx2`; httpx works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

ROOT = Path(__file__).resolve().parents[1]
LOCAL = ("127.0.0.1", 50000)
BASE = "http://127.0.0.1"
CHROMIUM = Path("/usr/bin/chromium")
TRACE_URL = "http://jaeger.local:16686/trace/{trace_id}"


# -- fixtures and helpers ------------------------------------------------------------------


@pytest.fixture
def db(engine: Engine) -> Iterator[Engine]:
    """The session engine; the audit table (not in conftest's list) is emptied too."""
    yield engine
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE outbox.console_actions RESTART IDENTITY"))


def client_for(engine: Engine, **options: Any) -> TestClient:
    options.setdefault("trace_url", TRACE_URL)
    options.setdefault("mask", ["card.number", "**.password"])
    return TestClient(create_console_app(engine, **options), base_url=BASE, client=LOCAL,
                      follow_redirects=False)


@pytest.fixture
def client(db: Engine) -> Iterator[TestClient]:
    with client_for(db) as c:
        yield c


def add(engine: Engine, status: str = "pending", **cols: Any) -> int:
    """Insert one effect in `status`, with the columns its CHECKs require."""
    row: dict[str, Any] = {
        "effect_key": f"{cols.get('kind', 'noop')}:{uuid.uuid4().hex}", "kind": "noop",
        "payload": "{}", "headers": "{}", "queue": "default", "status": status,
    }
    lease = cols.pop("lease_expires_at", None)
    row.update(cols)
    names = list(row)
    values = [f"CAST(:{k} AS jsonb)" if k in ("payload", "headers") else f":{k}" for k in row]
    if status in ("delivered", "failed", "cancelled", "needs_review"):
        names.append("finished_at")
        values.append("now()")
    if status == "delivered":
        names.append("delivered_at")
        values.append("now()")
    if status == "in_flight":
        names += ["lease_owner", "lease_token", "lease_expires_at"]
        values += ["'w-test'", "gen_random_uuid()",
                   "coalesce(CAST(:lease AS timestamptz), now() + interval '30 s')"]
        row["lease"] = lease
    with engine.begin() as conn:  # and its key, as enqueue writes it (migration 0007)
        return int(conn.execute(text(
            f"WITH e AS (INSERT INTO outbox.effects ({', '.join(names)})"
            f" VALUES ({', '.join(values)}) RETURNING id, effect_key),"
            " k AS (INSERT INTO outbox.effect_keys (effect_key, effect_id)"
            " SELECT effect_key, id FROM e) SELECT id FROM e"), row).scalar_one())


def add_attempt(engine: Engine, effect_id: int, outcome: str, **cols: Any) -> None:
    row = {"effect_id": effect_id, "attempt": 1, "worker": "w-1", "outcome": outcome,
           "http_status": None, "error": None, "trace_id": None, "ago": 0.0}
    row.update(cols)
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO outbox.attempts (effect_id, attempt, worker, started_at, finished_at,"
            " outcome, http_status, error, trace_id) VALUES (:effect_id, :attempt, :worker,"
            " now() - make_interval(secs => :ago + 0.25), now() - make_interval(secs => :ago),"
            " :outcome, :http_status, :error, :trace_id)"), row)


def status_of(engine: Engine, effect_id: int) -> str:
    with engine.connect() as conn:
        return str(conn.execute(text("SELECT status FROM outbox.effects WHERE id = :i"),
                                {"i": effect_id}).scalar_one())


def audit_rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT * FROM outbox.console_actions ORDER BY id")))


def csrf_of(html: str) -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', html)
    assert match, "no CSRF field in the form"
    return match.group(1)


def ids_on(html: str) -> list[int]:
    """Effect ids in the list table, in page order."""
    return [int(m) for m in re.findall(r"<td class='num'><a href='[^']*/effects/(\d+)'>", html)]


# -- pages -----------------------------------------------------------------------------------


def test_overview_counts_chart_blocked_and_stale_keys(db: Engine, client: TestClient) -> None:
    add(db, "pending")
    add(db, "pending")
    later = add(db, "pending")
    with db.begin() as conn:
        conn.execute(text("UPDATE outbox.effects SET available_at = now() + interval '1 h'"
                          " WHERE id = :i"), {"i": later})
    add(db, "in_flight", queue="mail", lease_expires_at=None)
    expired = add(db, "in_flight", queue="mail")
    with db.begin() as conn:
        conn.execute(text("UPDATE outbox.effects SET lease_expires_at = now() - interval '5 s'"
                          " WHERE id = :i"), {"i": expired})
    head = add(db, "failed", ordering_key="customer-7", last_error="HTTP 503 from PSP",
               attempts=3)
    add(db, "pending", ordering_key="customer-7")
    add(db, "needs_review")
    add(db, "cancelled")
    for i in range(4):
        delivered = add(db, "delivered")
        add_attempt(db, delivered, "delivered", http_status=200, ago=60.0 * i)
    add_attempt(db, head, "failed", http_status=503, ago=30.0)
    with db.begin() as conn:  # a phased claim whose holder died (past its own TTL)
        conn.execute(text(
            "INSERT INTO outbox.idempotency_keys (scope, key, fingerprint, status, lock_token,"
            " locked_at, lock_expires_at, expires_at) VALUES ('tenant-1', 'stuck-key', 'fp',"
            " 'processing', gen_random_uuid(), now() - interval '5 min',"
            " now() - interval '4 min', now() + interval '1 day')"))

    page = client.get("/")
    assert page.status_code == 200, page.text
    html = page.text
    assert "due now" in html and "scheduled later" in html
    assert re.search(r'<span class="n">3</span><span class="label">due now', html)
    assert re.search(r'<span class="n">1</span><span class="label">scheduled later', html)
    assert re.search(r'<span class="n">2</span><span class="label">in flight', html)
    assert "1 expired leases" in html
    assert re.search(r'<span class="n">4</span><span class="label">delivered', html)
    assert "<svg" in html and html.count('class="ok"') == 4 and html.count('class="bad"') == 1
    assert "customer-7" in html and f"/effects/{head}'>#{head}" in html  # blocked key
    assert "stuck-key" in html and "1 past their TTL" in html
    assert "queue=mail" in html
    live = client.get("/live")
    assert live.status_code == 200 and "<html" not in live.text and "customer-7" in live.text
    assert page.headers["content-security-policy"].startswith("default-src 'self'")
    assert page.headers["x-frame-options"] == "DENY"


def test_static_assets_are_served_by_the_app(client: TestClient) -> None:
    html = client.get("/").text
    for asset in re.findall(r'(?:href|src)="(/static/[^"]+)"', html):
        got = client.get(asset)
        assert got.status_code == 200 and got.content, asset
    assert not re.findall(r'(?:href|src)="(?:https?:)?//', html), "nothing from elsewhere"


@pytest.mark.parametrize(("query", "expect"), [
    ("status=failed", {"f1", "f2"}),
    ("status=failed&status=needs_review", {"f1", "f2", "r1"}),
    ("status=pending&queue=mail", {"p2"}),
    ("kind=psp.charge", {"p1", "f1"}),
    ("queue=mail", {"p2", "f2"}),
    ("ordering_key=cust-1", {"p1", "f1"}),
    ("key=psp.charge%3Aabc", {"p1"}),
    ("key=psp.", {"p1", "f1"}),
    ("older=1h", {"old"}),
    ("newer=1h&status=failed", {"f1", "f2"}),
    ("status=delivered&older=30m", {"old"}),
    ("status=in_flight", {"i1"}),
    ("status=cancelled", set()),
])
def test_list_filters(db: Engine, client: TestClient, query: str, expect: set[str]) -> None:
    made = {
        "p1": add(db, "pending", kind="psp.charge", effect_key="psp.charge:abc123",
                  ordering_key="cust-1"),
        "p2": add(db, "pending", queue="mail"),
        "f1": add(db, "failed", kind="psp.charge", effect_key="psp.charge:def456",
                  ordering_key="cust-1"),
        "f2": add(db, "failed", queue="mail"),
        "r1": add(db, "needs_review"),
        "i1": add(db, "in_flight"),
        "old": add(db, "delivered"),
    }
    with db.begin() as conn:
        conn.execute(text("UPDATE outbox.effects SET created_at = now() - interval '2 h'"
                          " WHERE id = :i"), {"i": made["old"]})
    page = client.get(f"/effects?{query}")
    assert page.status_code == 200, page.text
    names = {v: k for k, v in made.items()}
    assert {names[i] for i in ids_on(page.text)} == expect
    assert ids_on(page.text) == sorted(ids_on(page.text), reverse=True)


def test_key_prefix_search_under_either_collation_rule(db: Engine) -> None:
    wanted = {add(db, "pending", effect_key=f"webhook.crm:{i:04d}") for i in range(3)}
    add(db, "pending", effect_key="webhook.crn:0000")
    add(db, "pending", effect_key="webhook.cr")
    f = cq.EffectFilter(key_prefix="webhook.crm:")
    with db.connect() as conn:
        for bytewise in (True, False):
            rows = cq.list_effects(conn, f, limit=10, bytewise_keys=bytewise)
            assert {r.id for r in rows} == wanted
        assert cq.effect_keys_sort_bytewise(conn) in (True, False)
    assert cq.prefix_upper_bound("ab") == "ac"
    assert cq.prefix_upper_bound("a\U0010ffff") == "b"
    assert cq.prefix_upper_bound("\U0010ffff") is None
    assert cq.prefix_upper_bound("a\ud7ff") == "a\ue000"


def test_keyset_pages_have_no_duplicates_or_gaps_while_rows_arrive(db: Engine) -> None:
    for i in range(47):
        add(db, "pending" if i % 3 else "failed", queue="q")
    with client_for(db, page_size=10) as c:
        for query, where in (("queue=q", "queue = 'q'"), ("status=pending", "status = 'pending'"),
                             ("", "true")):
            with db.connect() as conn:
                expected = [r.id for r in conn.execute(text(
                    f"SELECT id FROM outbox.effects WHERE {where} ORDER BY id DESC"))]
            seen: list[int] = []
            url = f"/effects?{query}"
            pages = 0
            while True:
                page = c.get(url)
                assert page.status_code == 200, page.text
                seen.extend(ids_on(page.text))
                pages += 1
                add(db, "pending", queue="q")  # new rows arrive between page loads
                nxt = re.search(r'<a rel="next" href="([^"]+)"', page.text)
                if not nxt:
                    break
                url = nxt.group(1).replace("&amp;", "&")
            # Rows that arrived meanwhile have higher ids than every cursor: none shows,
            # and every row that existed shows exactly once, in order.
            assert seen == expected
            assert pages == -(-len(expected) // 10)
        # ... and back: "newer" from the second page returns exactly the first page.
        first = c.get("/effects?status=failed")
        assert first.status_code == 200
        ids_first = ids_on(first.text)
        with client_for(db, page_size=5) as small:
            one = ids_on(small.get("/effects?status=failed").text)
            older = small.get(f"/effects?status=failed&before={one[-1]}")
            two = ids_on(older.text)
            newer = re.search(r'<a rel="prev" href="([^"]+)"', older.text)
            assert newer
            back = ids_on(small.get(newer.group(1).replace("&amp;", "&")).text)
        assert back == one and one + two == ids_first[:len(one) + len(two)]


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/effects?status=bogus", 400),
    ("GET", "/effects?older=soon", 400),
    ("GET", "/effects?newer=99999999d", 400),
    ("GET", "/effects?before=abc", 400),
    ("GET", "/effects?before=-3", 400),
    ("GET", "/effects?before=99999999999999999999", 400),
    ("GET", "/effects?before=9223372036854775808", 400),
    ("GET", "/effects?before=1&after=2", 400),
    ("GET", "/effects?kind=a%00b", 400),
    ("GET", "/effects?kind=" + "k" * 300, 400),
    ("GET", "/effects?queue=a&queue=b", 400),
    ("GET", "/effects/abc", 400),
    ("GET", "/effects/1.5", 400),
    ("GET", "/effects/-1", 400),
    ("GET", "/effects/99999999999999999999", 400),
    ("GET", "/effects/424242", 404),
    ("GET", "/effects/424242/origin", 404),
    ("GET", "/effects/424242/retry", 404),
    ("GET", "/effects/x/cancel", 400),
    ("GET", "/redrive?older=x", 400),
    ("GET", "/audit?before=x", 400),
    ("GET", "/no/such/page", 404),
    ("POST", "/effects", 405),
    ("POST", "/effects/1/retry", 403),   # no CSRF token
    ("DELETE", "/effects/1/retry", 405),
])
def test_bad_input_is_a_4xx_page_never_a_500(client: TestClient, method: str, path: str,
                                            status: int) -> None:
    got = client.request(method, path)
    assert got.status_code == status, got.text[:500]
    assert got.headers["content-type"].startswith("text/html")


def test_effect_page_attempts_trace_links_and_masking(db: Engine, client: TestClient) -> None:
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    effect = add(db, "failed", kind="psp.charge", ordering_key="cust-9",
                 payload=json.dumps({"amount": 500, "card": {"number": "4242424242424242"},
                                     "user": {"password": "hunter2", "name": "Ada"}}),
                 headers=json.dumps({"traceparent": f"00-{trace}-00f067aa0ba902b7-01"}),
                 last_error="HTTP 500: upstream exploded", attempts=2)
    add_attempt(db, effect, "retry", attempt=1, http_status=503, error="HTTP 503",
                worker="worker-a", trace_id="a" * 32, ago=10)
    add_attempt(db, effect, "failed", attempt=2, http_status=500, error="HTTP 500: upstream "
                "exploded", worker="worker-b", trace_id="b" * 32)
    page = client.get(f"/effects/{effect}")
    assert page.status_code == 200, page.text
    html = page.text
    assert "4242424242424242" not in html and "hunter2" not in html
    assert html.count(MASKED) == 2 and "Ada" in html and "500" in html
    assert f'href="http://jaeger.local:16686/trace/{trace}"' in html  # enqueue trace
    assert f'href="http://jaeger.local:16686/trace/{"a" * 32}"' in html  # attempt 1
    assert "worker-a" in html and "worker-b" in html and "HTTP 503" in html
    assert "250 ms" in html  # attempt duration
    assert f"/effects/{effect}/retry" in html and f"/effects/{effect}/cancel" in html
    assert "ordering_key=cust-9" in html
    live = client.get(f"/effects/{effect}/live")
    assert live.status_code == 200 and "worker-b" in live.text and "<html" not in live.text
    with client_for(db, trace_url=None, mask=[]) as plain:
        html = plain.get(f"/effects/{effect}").text
        assert "jaeger" not in html and "hunter2" in html and trace in html


def test_origin_finds_the_idempotency_key_the_effect_came_from(db: Engine,
                                                             client: TestClient) -> None:
    def work(conn: Any, claim: Any) -> StoredResponse:
        enqueue(conn, "psp.charge", {"amount": 1}, claim=claim)
        enqueue(conn, "psp.charge", {"amount": 2}, claim=claim)
        return StoredResponse(201, (), b"{}")

    IdempotencyGuard().run(db, "tenant-a", "order-77", "fp-77", work)
    with db.connect() as conn:
        ids = [r.id for r in conn.execute(text("SELECT id FROM outbox.effects ORDER BY id"))]
    second = client.get(f"/effects/{ids[1]}/origin")
    assert second.status_code == 200, second.text
    assert "order-77" in second.text and "tenant-a" in second.text
    assert "derived from it" in second.text and "(effect #1 of its kind)" in second.text
    lonely = add(db, "pending")
    page = client.get(f"/effects/{lonely}/origin")
    assert page.status_code == 200 and "No idempotency key was written" in page.text


def test_derivation_matches_claim_effect_key() -> None:
    from outbox._idempotency import Claim

    generation = uuid.uuid4()
    claim = Claim(scope="s", key="k", fingerprint="f", mode="atomic", token=uuid.uuid4(),
                  generation=generation)
    first, second = claim.effect_key("email"), claim.effect_key("email")
    assert derived_key_names("s", "k", generation, "email", first) == "0"
    assert derived_key_names("s", "k", generation, "email", second) == "1"
    assert derived_key_names("s", "other", generation, "email", first) is None
    assert derived_key_names("s", "k", None, "email", claim.effect_key("email", "x")) is None


# -- actions -------------------------------------------------------------------------------


def test_the_retry_confirmation_says_why_a_parked_effect_was_parked(
        db: Engine, client: TestClient) -> None:
    """Parked past its receiver's key retention (nothing sent) is not parked ambiguous:
    the confirmation says which, since the advice differs."""
    past = add(db, "needs_review", attempts=2,
               last_error="KeyRetentionPassed: not sent: attempt 2 would reach ...")
    ambiguous = add(db, "needs_review", attempts=1, last_error="AmbiguousOutcome: timeout")
    page = client.get(f"/effects/{past}/retry").text
    assert "may have forgotten the effect key" in page and "retry-safe" not in page
    page = client.get(f"/effects/{ambiguous}/retry").text
    assert "not declared retry-safe" in page and "forgotten" not in page


def test_retry_of_a_failed_effect_makes_it_pending_and_is_audited(db: Engine,
                                                                 client: TestClient) -> None:
    effect = add(db, "failed", attempts=25, last_error="HTTP 400")
    confirm = client.get(f"/effects/{effect}/retry")
    assert confirm.status_code == 200 and "Confirm: retry" in confirm.text
    assert status_of(db, effect) == "failed", "the confirmation page changes nothing"
    done = client.post(f"/effects/{effect}/retry", data={"csrf": csrf_of(confirm.text)})
    assert done.status_code == 303, done.text
    assert done.headers["location"] == f"/effects/{effect}?notice=retried"
    with db.connect() as conn:
        row = conn.execute(text("SELECT status, attempts, last_error FROM outbox.effects"
                                " WHERE id = :i"), {"i": effect}).one()
    assert (row.status, row.attempts, row.last_error) == ("pending", 0, None)
    [audit] = audit_rows(db)
    assert (audit.action, audit.outcome, audit.effect_ids) == ("retry", "done", [effect])
    assert audit.actor == "local@127.0.0.1" and audit.request["status_seen"] == "failed"
    page = client.get(done.headers["location"])
    assert "pending again" in page.text and "Console actions" in page.text
    again = client.post(f"/effects/{effect}/retry", data={"csrf": csrf_of(confirm.text)})
    assert again.status_code == 409  # pending now: nothing to retry
    assert [a.outcome for a in audit_rows(db)] == ["done", "refused"]


def test_cancel_of_an_in_flight_effect_is_refused_and_audited(db: Engine,
                                                             client: TestClient) -> None:
    effect = add(db, "in_flight")
    confirm = client.get(f"/effects/{effect}/cancel")
    assert confirm.status_code == 200 and "will be refused" in confirm.text
    got = client.post(f"/effects/{effect}/cancel", data={"csrf": csrf_of(confirm.text)})
    assert got.status_code == 409 and "may already be applied" in got.text
    assert status_of(db, effect) == "in_flight"
    [audit] = audit_rows(db)
    assert (audit.action, audit.outcome, audit.effect_ids) == ("cancel", "refused", [])
    pending = add(db, "pending")
    ok = client.post(f"/effects/{pending}/cancel", data={"csrf": csrf_of(confirm.text)})
    assert ok.status_code == 303 and status_of(db, pending) == "cancelled"


def test_post_without_a_valid_csrf_token_is_403(db: Engine, client: TestClient) -> None:
    effect = add(db, "failed")
    token = csrf_of(client.get(f"/effects/{effect}/retry").text)
    assert client.post(f"/effects/{effect}/retry", data={}).status_code == 403
    assert client.post(f"/effects/{effect}/retry", data={"csrf": "x" + token[1:]}
                       ).status_code == 403
    foreign = client.post(f"/effects/{effect}/retry", data={"csrf": token},
                          headers={"origin": "http://evil.example"})
    assert foreign.status_code == 403
    with client_for(db) as fresh:  # a token from another browser (cookie) does not fit
        assert fresh.post(f"/effects/{effect}/retry", data={"csrf": token}).status_code == 403
    json_post = client.post(f"/effects/{effect}/retry", json={"csrf": token})
    assert json_post.status_code == 403  # only the console's own form is accepted
    assert status_of(db, effect) == "failed" and audit_rows(db) == []
    with client_for(db) as fresh:
        set_cookie = fresh.get(f"/effects/{effect}/retry").headers["set-cookie"]
    assert "outbox_console_csrf=" in set_cookie and "HttpOnly" in set_cookie
    assert "samesite=strict" in set_cookie.lower() and "Path=/" in set_cookie


def test_redrive_dead_letters_in_bulk_with_filters(db: Engine, client: TestClient) -> None:
    failed_a = [add(db, "failed", queue="a") for _ in range(5)]
    failed_b = [add(db, "failed", queue="b") for _ in range(3)]
    review_a = add(db, "needs_review", queue="a")
    confirm = client.get("/redrive?queue=a")
    assert confirm.status_code == 200 and "<b>5</b> failed effects" in confirm.text
    late = add(db, "failed", queue="a")  # fails after the operator saw the count
    form = {"csrf": csrf_of(confirm.text), "queue": "a", "limit": "4",
            "max_id": re.search(r'name="max_id" value="(\d+)"', confirm.text).group(1)}  # type: ignore[union-attr]
    done = client.post("/redrive", data=form)
    assert done.status_code == 303 and "/audit?highlight=" in done.headers["location"]
    statuses = {i: status_of(db, i) for i in [*failed_a, *failed_b, review_a, late]}
    assert [statuses[i] for i in failed_a] == ["pending"] * 4 + ["failed"]  # oldest first
    assert {statuses[i] for i in failed_b} == {"failed"}
    assert statuses[review_a] == "needs_review" and statuses[late] == "failed"
    [audit] = audit_rows(db)
    assert (audit.action, audit.outcome, audit.effect_ids) == ("redrive", "done", failed_a[:4])
    assert audit.request["filter"] == {"queue": "a"} and audit.request["limit"] == 4
    page = client.get(done.headers["location"])
    assert "4 effects are pending again" in page.text and f"#{failed_a[0]}" in page.text
    assert client.post("/redrive", data={**form, "limit": "0"}).status_code == 400
    none = client.get("/redrive?queue=nowhere")
    assert none.status_code == 200 and "No failed effect matches" in none.text


def test_read_only_console_refuses_actions(db: Engine) -> None:
    effect = add(db, "failed")
    with client_for(db, read_only=True) as c:
        assert "Retry…" not in c.get(f"/effects/{effect}").text
        assert c.get(f"/effects/{effect}/retry").status_code == 403
        assert c.get("/redrive").status_code == 403


# -- access ----------------------------------------------------------------------------------


def test_without_a_token_only_loopback_is_answered(db: Engine) -> None:
    app = create_console_app(db)
    with TestClient(app, base_url=BASE, client=("10.1.2.3", 4000)) as remote:
        assert remote.get("/").status_code == 403
        assert remote.get("/effects").status_code == 403
    with TestClient(app, base_url="http://attacker.example", client=LOCAL) as rebound:
        assert rebound.get("/").status_code == 403  # DNS rebinding: Host is not loopback
    with TestClient(app, base_url="http://localhost:8080", client=("::1", 1)) as local:
        assert local.get("/").status_code == 200


def test_token_bearer_and_login_cookie(db: Engine) -> None:
    token = "s3cret-token-for-the-console"
    app = create_console_app(db, token=token)
    with TestClient(app, base_url="http://console.internal", client=("10.0.0.9", 1),
                    follow_redirects=False) as c:
        anonymous = c.get("/effects?status=failed")
        assert anonymous.status_code == 303
        assert anonymous.headers["location"].startswith("/login?next=")
        assert c.get("/live").status_code == 401
        assert c.get("/", headers={"authorization": "Bearer wrong"}).status_code in (303, 401)
        assert c.get("/", headers={"authorization": f"Bearer {token}"}).status_code == 200
        login = c.get(anonymous.headers["location"])
        assert login.status_code == 200
        bad = c.post("/login", data={"csrf": csrf_of(login.text), "token": "nope", "next": "/"})
        assert bad.status_code == 401 and "session" not in bad.headers.get("set-cookie", "")
        good = c.post("/login", data={"csrf": csrf_of(login.text), "token": token,
                                      "next": "/effects?status=failed"})
        assert good.status_code == 303 and good.headers["location"] == "/effects?status=failed"
        cookie = good.headers["set-cookie"]
        assert "outbox_console_session=" in cookie and "HttpOnly" in cookie
        assert "SameSite=strict" in cookie or "SameSite=Strict" in cookie
        assert c.get("/effects").status_code == 200
        no_csrf = c.post("/login", data={"token": token})
        assert no_csrf.status_code == 403
        evil_next = c.post("/login", data={"csrf": csrf_of(login.text), "token": token,
                                           "next": "//evil.example/"})
        assert evil_next.headers["location"] == "/"
        page = c.get("/").text
        out = c.post("/logout", data={"csrf": csrf_of(page)})
        assert out.status_code == 303
        c.cookies.delete("outbox_console_session")
        assert c.get("/").status_code == 303


def test_mounted_under_a_prefix_with_the_apps_own_auth(db: Engine) -> None:
    """`app.mount("/outbox", console)`: every link keeps the prefix, actions work, and
    the host application's authorization decides (and names the operator)."""
    effect = add(db, "failed", queue="mounted")
    seen: list[str] = []

    def auth(request: Request) -> str | None:
        user = request.headers.get("x-user")
        seen.append(user or "")
        return user if user in ("ada", "grace") else None

    console = create_console_app(db, auth=auth)

    async def home(request: Request) -> Response:
        return Response("the host app")

    host = Starlette(routes=[Route("/", home), Mount("/outbox", app=console)])
    with TestClient(host, base_url="http://app.example", client=("10.9.9.9", 1),
                    headers={"x-user": "ada"}, follow_redirects=False) as c:
        assert c.get("/").text == "the host app"
        pages = ["/outbox/", f"/outbox/effects/{effect}", "/outbox/effects?queue=mounted",
                 "/outbox/audit"]
        for path in pages:
            page = c.get(path)
            assert page.status_code == 200, (path, page.text[:300])
            for link in re.findall(r'(?:href|src|action|data-poll)="(/[^"]*)"', page.text):
                assert link.startswith("/outbox/"), (path, link)
                if "/logout" in link or link.endswith(("/retry", "/cancel")):
                    continue
                got = c.get(link.replace("&amp;", "&"))
                assert got.status_code == 200, (path, link, got.text[:300])
        confirm = c.get(f"/outbox/effects/{effect}/retry")
        assert 'action="/outbox/effects/' in confirm.text
        assert "Path=/outbox/" in confirm.headers.get("set-cookie", "Path=/outbox/")
        done = c.post(f"/outbox/effects/{effect}/retry", data={"csrf": csrf_of(confirm.text)})
        assert done.status_code == 303 and done.headers["location"].startswith("/outbox/")
        assert c.get("/outbox/", headers={"x-user": "mallory"}).status_code == 403
    assert status_of(db, effect) == "pending"
    assert [a.actor for a in audit_rows(db)] == ["ada"]

    upstream = create_console_app(db, auth=trust_upstream)
    with TestClient(Starlette(routes=[Mount("/ops", app=upstream)]), client=("10.0.0.1", 1),
                    base_url="http://app.example") as c:
        assert c.get("/ops/effects").status_code == 200


# -- masking ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("rules", "value", "expect"), [
    (["card.number"], {"card": {"number": "4242", "exp": "1/30"}},
     {"card": {"number": MASKED, "exp": "1/30"}}),
    (["card.number"], {"x": {"card": {"number": "4242"}}}, {"x": {"card": {"number": "4242"}}}),
    (["*.password"], {"password": "a", "u": {"password": "b"}},
     {"password": "a", "u": {"password": MASKED}}),
    (["**.password"], {"password": "a", "u": {"v": {"Password": "b"}}},
     {"password": MASKED, "u": {"v": {"Password": MASKED}}}),
    (["items.pan"], {"items": [{"pan": 1}, {"pan": 2, "q": 3}]},
     {"items": [{"pan": MASKED}, {"pan": MASKED, "q": 3}]}),
    (["items.*.pan"], {"items": [{"pan": 1}]}, {"items": [{"pan": MASKED}]}),
    (["secret"], {"secret": {"deep": [1, 2]}, "other": "secret"},
     {"secret": MASKED, "other": "secret"}),
    ([], {"password": "a"}, {"password": "a"}),
])
def test_mask_rules(rules: list[str], value: Any, expect: Any) -> None:
    assert Mask(rules).apply(value) == expect


def test_mask_from_env() -> None:
    assert Mask.from_env("card.number, *.password").apply(
        {"card": {"number": 1}, "a": {"password": 2}}) == {
        "card": {"number": MASKED}, "a": {"password": MASKED}}
    assert Mask.from_env("").rules == ()
    assert Mask.from_env(None).apply({"x": {"token": "t"}}) == {"x": {"token": MASKED}}
    with pytest.raises(ValueError):
        Mask(["card..number"])


# -- the process: outbox ui --------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(db_url: str, **extra: str) -> dict[str, str]:
    env = {"DATABASE_URL": db_url, "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "HOME": os.environ.get("HOME", "/tmp")}
    env.update(extra)
    return env


def _start_ui(db_url: str, port: int, *args: str, **extra: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dispatcher.cli", "ui", "--port", str(port), *args], cwd=ROOT,
        env=_env(db_url, **extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"outbox ui exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("outbox ui did not listen")


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.10", "::"])
def test_ui_refuses_a_non_loopback_bind_without_a_token(db_url: str, host: str) -> None:
    done = subprocess.run([sys.executable, "-m", "dispatcher.cli", "ui", "--host", host],
                          cwd=ROOT, env=_env(db_url), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("outbox: error:") and "token" in lines[0]


@pytest.mark.slow
def test_ui_process_serves_with_a_token_off_loopback(db: Engine, db_url: str) -> None:
    import httpx

    port = _free_port()
    proc = _start_ui(db_url, port, "--host", "0.0.0.0", OUTBOX_UI_TOKEN="t" * 24)
    try:
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/live").status_code == 401
        ok = httpx.get(f"{base}/", headers={"authorization": f"Bearer {'t' * 24}"})
        assert ok.status_code == 200 and "Overview" in ok.text
    finally:
        _stop(proc)


@pytest.mark.slow
@pytest.mark.skipif(not CHROMIUM.exists(),
                    reason="no /usr/bin/chromium (Debian package `chromium`): the browser "
                    "test drives the system browser, it downloads none")
def test_browser_overview_to_failed_effect_retry_delivered(db: Engine, db_url: str) -> None:
    """A real Chromium: overview -> failed card -> the effect -> Retry… -> Confirm; the
    page shows it pending, then (a worker is running) delivered, without a reload."""
    sync_api = pytest.importorskip("playwright.sync_api")
    effect = add(db, "failed", kind="noop", attempts=3, last_error="HTTP 502 from upstream",
                 payload=json.dumps({"order": 42, "card": {"number": "4000000000000002"}}))
    add_attempt(db, effect, "failed", attempt=3, http_status=502, error="HTTP 502 from upstream")
    add(db, "delivered")
    port = _free_port()
    ui = _start_ui(db_url, port)
    worker = subprocess.Popen(
        [sys.executable, "-m", "dispatcher.cli", "worker", "--handlers",
         "tests.handlers_for_tests:registry", "--poll", "0.2", "--name", "console-test"],
        cwd=ROOT, env=_env(db_url), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    try:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM),
                                         args=["--no-sandbox", "--disable-gpu"])
            try:
                page = browser.new_page()
                page.goto(f"http://127.0.0.1:{port}/")
                assert page.locator("h1").inner_text() == "Overview"
                page.locator("a.card", has_text="failed").click()
                page.wait_for_url(re.compile(r".*/effects\?status=failed$"))
                page.locator(f"a[href='/effects/{effect}']").first.click()
                page.wait_for_url(re.compile(rf".*/effects/{effect}$"))
                assert "4000000000000002" not in page.content()
                assert page.locator("#live .badge").first.inner_text() == "failed"
                page.get_by_role("link", name="Retry…").click()
                page.get_by_role("button", name=f"Confirm: retry #{effect}").click()
                page.wait_for_url(re.compile(rf".*/effects/{effect}\?notice=retried$"))
                assert "pending again" in page.locator(".notice").inner_text()
                first_seen = page.locator("#live .badge").first.inner_text()
                assert first_seen in ("pending", "delivered", "in flight")
                # The live region refreshes every 3 s: the worker's delivery shows up.
                page.locator("#live .badge", has_text="delivered").first.wait_for(timeout=30_000)
                assert status_of(db, effect) == "delivered"
            finally:
                browser.close()
    finally:
        _stop(worker)
        _stop(ui)
    [audit] = audit_rows(db)
    assert (audit.action, audit.outcome, audit.effect_ids) == ("retry", "done", [effect])
