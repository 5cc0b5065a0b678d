"""Issue 16, ingestion: signed webhooks, registered sources, a bounded version, retention
of conflicts and versions, bounded metric labels.

Real PostgreSQL, real HTTP through the example service (FastAPI's TestClient), real
OpenTelemetry SDK reader. The test signs with its own HMAC code, written from each
scheme's published description, never with the library's signers; two published test
vectors pin the library to the schemes as their owners define them.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, text

from dispatcher.examples.payments.app import create_app
from dispatcher.examples.payments.auth import BearerTokens
from outbox import ingest
from outbox._inbox import (
    MAX_CONFLICT_COPIES,
    purge_entity_versions,
    purge_inbox_conflicts,
)
from outbox._schema import InboxOutcome
from outbox.errors import ConfigurationError, InvalidSignature, RetentionTooShort
from outbox.webhooks import (
    GitHubSignature,
    StandardWebhooks,
    StripeSignature,
    Verifier,
    WebhookSources,
    parse_secrets,
)
from tests.http_support import TestClient, payments_schema
from tests.otel_helpers import counter_points, metric_reader

ROOT = Path(__file__).resolve().parents[1]
AUTH = BearerTokens({"test-token": "tester"})
TOLERANCE = 300
TABLES = ("outbox.inbox", "outbox.inbox_conflicts", "outbox.entity_versions")


# -- the senders: HMAC written here, from each scheme's documentation ------------------


def new_secret() -> str:
    """A Standard Webhooks secret: whsec_ + base64 of 32 random bytes."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def hmac_sha256(key: bytes, message: bytes) -> bytes:
    return hmac.new(key, message, hashlib.sha256).digest()


def sign_standard(secret: str, body: bytes, ts: int, msg_id: str | None = None
                  ) -> dict[str, str]:
    msg_id = msg_id or f"msg_{uuid.uuid4().hex}"
    key = base64.b64decode(secret.removeprefix("whsec_"))
    sig = base64.b64encode(hmac_sha256(key, f"{msg_id}.{ts}.".encode() + body)).decode()
    return {"webhook-id": msg_id, "webhook-timestamp": str(ts),
            "webhook-signature": f"v1,{sig}"}


def sign_stripe(secret: str, body: bytes, ts: int) -> dict[str, str]:
    sig = hmac_sha256(secret.encode(), f"{ts}.".encode() + body).hex()
    return {"Stripe-Signature": f"t={ts},v1={sig}"}


def sign_github(secret: str, body: bytes, ts: int) -> dict[str, str]:
    return {"X-Hub-Signature-256": "sha256=" + hmac_sha256(secret.encode(), body).hex()}


@dataclass(frozen=True)
class Scheme:
    name: str
    sign: Callable[[str, bytes, int], dict[str, str]]
    verifier: Callable[[list[str]], Verifier]
    timestamped: bool

    def __str__(self) -> str:
        return self.name


SCHEMES = [
    Scheme("standard", sign_standard, lambda s: StandardWebhooks(s), True),
    Scheme("stripe", sign_stripe, lambda s: StripeSignature(s), True),
    Scheme("github", sign_github, lambda s: GitHubSignature(s), False),
]
TIMESTAMPED = [s for s in SCHEMES if s.timestamped]


def event(**overrides: Any) -> dict[str, Any]:
    return {"id": "evt_1", "type": "payment.succeeded", "data": {"payment_id": 1},
            **overrides}


def raw(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def rows(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {t: int(conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one())
                for t in TABLES}


NOTHING = dict.fromkeys(TABLES, 0)


@pytest.fixture
def payments_db(engine: Engine) -> Iterator[Engine]:
    yield from payments_schema(engine)


@pytest.fixture
def serve(payments_db: Engine) -> Iterator[Callable[[WebhookSources], TestClient]]:
    """Start the example service with a given registry; every client is closed after."""
    clients: list[TestClient] = []

    def start(sources: WebhookSources) -> TestClient:
        client = TestClient(create_app(payments_db, auth=AUTH, webhooks=sources))
        client.__enter__()
        clients.append(client)
        return client

    yield start
    for client in clients:
        client.__exit__(None, None, None)


def post(client: TestClient, source: str, body: bytes, headers: dict[str, str],
         path: str = "") -> Any:
    return client.post(f"/webhooks/{source}{path}", content=body,
                       headers={"Content-Type": "application/json", **headers})


def refused(resp: Any, status: int, code: str) -> None:
    assert resp.status_code == status, resp.text[:300]
    assert resp.headers["content-type"].startswith("application/problem+json")
    assert resp.json()["code"] == code


# -- each scheme: valid, forged, tampered, expired, future, rotated, missing -----------


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_a_valid_signature_is_accepted(serve: Callable[[WebhookSources], TestClient],
                                       payments_db: Engine, scheme: Scheme) -> None:
    secret = new_secret()
    client = serve(WebhookSources({"psp": scheme.verifier([secret])}))
    body = raw(event())
    resp = post(client, "psp", body, scheme.sign(secret, body, int(time.time())))
    assert resp.status_code == 200 and resp.json() == {"outcome": "inserted"}
    assert rows(payments_db)["outbox.inbox"] == 1


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_a_forged_signature_is_401_and_nothing_is_stored(
        serve: Callable[[WebhookSources], TestClient], payments_db: Engine,
        scheme: Scheme) -> None:
    client = serve(WebhookSources({"psp": scheme.verifier([new_secret()])}))
    # The two attacks, signed with a secret the receiver does not hold.
    for doc in (event(id="evt_future_guess"),
                event(id="evt_forged", entity="pay_1", version=2**53 - 1)):
        body = raw(doc)
        refused(post(client, "psp", body, scheme.sign(new_secret(), body, int(time.time()))),
                401, "invalid_signature")
    assert rows(payments_db) == NOTHING


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_a_tampered_body_is_401_and_nothing_is_stored(
        serve: Callable[[WebhookSources], TestClient], payments_db: Engine,
        scheme: Scheme) -> None:
    secret = new_secret()
    client = serve(WebhookSources({"psp": scheme.verifier([secret])}))
    signed = raw(event(entity="pay_1", version=3))
    headers = scheme.sign(secret, signed, int(time.time()))
    for body in (raw(event(entity="pay_1", version=2**53 - 1)),  # another version
                 signed + b" ",                                  # same JSON, other bytes
                 signed.replace(b"evt_1", b"evt_2")):
        refused(post(client, "psp", body, headers), 401, "invalid_signature")
    assert rows(payments_db) == NOTHING
    assert post(client, "psp", signed, headers).json() == {"outcome": "inserted"}


@pytest.mark.parametrize("scheme", TIMESTAMPED, ids=str)
def test_an_expired_signature_is_401_and_nothing_is_stored(
        serve: Callable[[WebhookSources], TestClient], payments_db: Engine,
        scheme: Scheme) -> None:
    """A captured delivery replayed after the tolerance: signed right, but too old."""
    secret = new_secret()
    client = serve(WebhookSources({"psp": scheme.verifier([secret])}))
    body = raw(event())
    resp = post(client, "psp", body, scheme.sign(secret, body, int(time.time()) - TOLERANCE - 60))
    refused(resp, 401, "invalid_signature")
    assert "old" in resp.json()["detail"]
    assert rows(payments_db) == NOTHING


@pytest.mark.parametrize("scheme", TIMESTAMPED, ids=str)
def test_a_future_timestamp_is_401_and_nothing_is_stored(
        serve: Callable[[WebhookSources], TestClient], payments_db: Engine,
        scheme: Scheme) -> None:
    """Signed for later: it would otherwise stay replayable for longer than the tolerance."""
    secret = new_secret()
    client = serve(WebhookSources({"psp": scheme.verifier([secret])}))
    body = raw(event())
    resp = post(client, "psp", body, scheme.sign(secret, body, int(time.time()) + TOLERANCE + 60))
    refused(resp, 401, "invalid_signature")
    assert "future" in resp.json()["detail"]
    assert rows(payments_db) == NOTHING


def test_github_has_no_timestamp_so_a_replay_is_caught_by_the_inbox(
        serve: Callable[[WebhookSources], TestClient], payments_db: Engine) -> None:
    """GitHub signs no timestamp: a captured delivery verifies forever. The inbox's
    (source, id) dedup turns its replay into a duplicate that is never processed."""
    secret = new_secret()
    client = serve(WebhookSources({"github": GitHubSignature(secret)}))
    body = raw(event(entity="repo_1", version=7))
    headers = sign_github(secret, body, 0)
    assert post(client, "github", body, headers).json() == {"outcome": "inserted"}
    assert post(client, "github", body, headers).json() == {"outcome": "duplicate"}
    assert rows(payments_db) == {"outbox.inbox": 1, "outbox.inbox_conflicts": 0,
                                 "outbox.entity_versions": 1}


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_rotation_old_and_new_secrets_verify_then_the_removed_one_is_refused(
        serve: Callable[[WebhookSources], TestClient], payments_db: Engine,
        scheme: Scheme) -> None:
    old, new = new_secret(), new_secret()
    during = serve(WebhookSources({"psp": scheme.verifier([old, new])}))
    now = int(time.time())
    for n, secret in enumerate((old, new)):
        body = raw(event(id=f"evt_{n}"))
        assert post(during, "psp", body, scheme.sign(secret, body, now)).status_code == 200
    after = serve(WebhookSources({"psp": scheme.verifier([new])}))
    body = raw(event(id="evt_late"))
    refused(post(after, "psp", body, scheme.sign(old, body, now)), 401, "invalid_signature")
    assert post(after, "psp", body, scheme.sign(new, body, now)).status_code == 200
    assert rows(payments_db)["outbox.inbox"] == 3


@pytest.mark.parametrize("scheme", TIMESTAMPED, ids=str)
def test_a_header_with_several_signatures_passes_if_one_is_current(
        serve: Callable[[WebhookSources], TestClient], payments_db: Engine,
        scheme: Scheme) -> None:
    """Senders list one signature per secret while they rotate (Stripe: v1=..,v1=..)."""
    secret = new_secret()
    client = serve(WebhookSources({"psp": scheme.verifier([secret])}))
    body, now = raw(event()), int(time.time())
    if scheme.name == "stripe":
        stale = sign_stripe(new_secret(), body, now)["Stripe-Signature"]
        good = sign_stripe(secret, body, now)["Stripe-Signature"].split(",")[1]
        headers = {"Stripe-Signature": f"{stale},{good}"}
    else:
        good_headers = sign_standard(secret, body, now, "msg_1")
        stale = sign_standard(new_secret(), body, now, "msg_1")["webhook-signature"]
        headers = {**good_headers, "webhook-signature":
                   f"{stale} v1a,ZmFrZQ== {good_headers['webhook-signature']}"}
    assert post(client, "psp", body, headers).json() == {"outcome": "inserted"}


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_missing_or_malformed_headers_are_401_and_nothing_is_stored(
        serve: Callable[[WebhookSources], TestClient], payments_db: Engine,
        scheme: Scheme) -> None:
    secret = new_secret()
    client = serve(WebhookSources({"psp": scheme.verifier([secret])}))
    body = raw(event())
    signed = scheme.sign(secret, body, int(time.time()))
    variants: list[dict[str, str]] = [{}]
    variants += [{k: v for k, v in signed.items() if k != drop} for drop in signed]
    variants += [{k: "" for k in signed}]
    if scheme.name == "standard":
        variants += [{**signed, "webhook-timestamp": "soon"},
                     {**signed, "webhook-signature": "v1,not base64!"},
                     {**signed, "webhook-id": "two words"}]
    elif scheme.name == "stripe":
        value = signed["Stripe-Signature"]
        variants += [{"Stripe-Signature": value.split(",")[1]},           # no t=
                     {"Stripe-Signature": value.split(",")[0]},           # no v1=
                     {"Stripe-Signature": value + ",t=1"},                # two t=
                     {"Stripe-Signature": value.replace("v1=", "v0=")}]   # test scheme only
    else:
        variants += [{"X-Hub-Signature-256": signed["X-Hub-Signature-256"].replace(
            "sha256=", "sha1=")}]
    for headers in variants:
        refused(post(client, "psp", body, headers), 401, "invalid_signature")
    assert rows(payments_db) == NOTHING


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_the_batch_endpoint_takes_one_signature_over_the_whole_array(
        serve: Callable[[WebhookSources], TestClient], payments_db: Engine,
        scheme: Scheme) -> None:
    secret = new_secret()
    client = serve(WebhookSources({"psp": scheme.verifier([secret])}))
    body = raw([event(), event(id="evt_2")])
    headers = scheme.sign(secret, body, int(time.time()))
    one = raw([event()])
    refused(post(client, "psp", one, headers, "/batch"), 401, "invalid_signature")
    refused(post(client, "psp", body, {}, "/batch"), 401, "invalid_signature")
    assert rows(payments_db) == NOTHING
    resp = post(client, "psp", body, headers, "/batch")
    assert resp.json() == {"outcomes": ["inserted", "inserted"]}


# -- registered sources only ---------------------------------------------------------


def test_an_unknown_source_is_404_and_nothing_is_stored(
        serve: Callable[[WebhookSources], TestClient], payments_db: Engine) -> None:
    secret = new_secret()
    client = serve(WebhookSources.standard_webhooks({"billing": [secret]}))
    body = raw(event())
    headers = sign_standard(secret, body, int(time.time()))
    for source in ("crm", "billing2", "Billing", "x" * 300):
        refused(post(client, source, body, headers), 404, "unknown_source")
        refused(post(client, source, raw([event()]), headers, "/batch"), 404,
                "unknown_source")
    assert rows(payments_db) == NOTHING
    assert post(client, "billing", body, headers).status_code == 200


def test_the_example_reads_example_webhook_secrets(
        payments_db: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """DESIGN §8: `billing=whsec_..,crm=whsec_..`; a name given twice has two secrets."""
    billing_old, billing_new, crm = new_secret(), new_secret(), new_secret()
    monkeypatch.setenv("EXAMPLE_WEBHOOK_SECRETS",
                       f"billing={billing_old}, crm={crm},billing={billing_new}")
    with TestClient(create_app(payments_db, auth=AUTH)) as client:
        now = int(time.time())
        for n, (source, secret) in enumerate([("billing", billing_old),
                                              ("billing", billing_new), ("crm", crm)]):
            body = raw(event(id=f"evt_{n}"))
            assert post(client, source, body, sign_standard(secret, body, now)).status_code \
                == 200
        body = raw(event(id="evt_x"))
        refused(post(client, "crm", body, sign_standard(billing_new, body, now)), 401,
                "invalid_signature")
        refused(post(client, "stripe", body, sign_standard(crm, body, now)), 404,
                "unknown_source")
        refused(post(client, "billing", body, {}), 401, "invalid_signature")
    assert rows(payments_db)["outbox.inbox"] == 3


def test_without_example_webhook_secrets_unsigned_events_are_accepted_loudly(
        payments_db: Engine, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("EXAMPLE_WEBHOOK_SECRETS", raising=False)
    with caplog.at_level(logging.WARNING, logger="payments.webhooks"), \
            TestClient(create_app(payments_db, auth=AUTH)) as client:
        assert post(client, "anything", raw(event()), {}).status_code == 200
    assert any("UNSIGNED WEBHOOKS" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)


@pytest.mark.parametrize("spec", ["billing", "billing=", "=whsec_AAAA", "billing=whsec_!!!",
                                  "bad name=whsec_QUJD"])
def test_a_bad_secrets_variable_stops_the_service_without_echoing_secrets(
        payments_db: Engine, monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    monkeypatch.setenv("EXAMPLE_WEBHOOK_SECRETS", spec)
    with pytest.raises(ConfigurationError) as info:
        create_app(payments_db, auth=AUTH)
    assert "whsec_QUJD" not in str(info.value) and "!!!" not in str(info.value)


# -- a bounded version ---------------------------------------------------------------


def test_a_version_of_2_63_minus_1_is_refused_and_cannot_freeze_an_entity(
        serve: Callable[[WebhookSources], TestClient], payments_db: Engine) -> None:
    """The issue's attack: a version of 2^63-1 made every later event `stale`. Above
    2^53-1 (the default bound) it is a 400 and nothing is stored, even signed."""
    secret = new_secret()
    client = serve(WebhookSources.standard_webhooks({"billing": [secret]}))
    now = int(time.time())
    for n, version in enumerate((2**63 - 1, 2**53)):
        body = raw(event(id=f"evt_huge_{n}", entity="pay_1", version=version))
        resp = post(client, "billing", body, sign_standard(secret, body, now))
        refused(resp, 400, "invalid_event")
        batch = raw([event(id="evt_ok", entity="pay_2", version=1), json.loads(body)])
        refused(post(client, "billing", batch, sign_standard(secret, batch, now), "/batch"),
                400, "invalid_event")
    assert rows(payments_db) == NOTHING
    genuine = raw(event(id="evt_real", entity="pay_1", version=5))
    assert post(client, "billing", genuine, sign_standard(secret, genuine, now)).json() \
        == {"outcome": "inserted"}


# -- retention of conflicts and versions -----------------------------------------------


def ago(**delta: float) -> Callable[[], datetime]:
    moment = datetime.now(UTC) - timedelta(**delta)
    return lambda: moment


def test_conflict_copies_are_bounded_per_event(engine: Engine) -> None:
    with engine.begin() as conn:
        ingest(conn, "s", "evt", {"v": 0})
    for i in range(1, MAX_CONFLICT_COPIES + 6):
        with engine.begin() as conn:
            assert ingest(conn, "s", "evt", {"v": i}).outcome is InboxOutcome.CONFLICT
    with engine.connect() as conn:
        kept = conn.execute(text(
            "SELECT payload->>'v' FROM outbox.inbox_conflicts ORDER BY id")).scalars().all()
        counted = conn.execute(text("SELECT conflicts FROM outbox.inbox")).scalar_one()
    assert kept == [str(i) for i in range(1, MAX_CONFLICT_COPIES + 1)]  # the first ones
    assert counted == MAX_CONFLICT_COPIES + 5  # every copy is still counted


def test_conflicts_are_purged_after_their_window_and_never_before_the_horizon(
        engine: Engine) -> None:
    with engine.begin() as conn:
        ingest(conn, "s", "evt", {"v": 0}, clock=ago(days=40))
        ingest(conn, "s", "evt", {"v": 1}, clock=ago(days=40))   # old evidence
        ingest(conn, "s", "evt", {"v": 2}, clock=ago(days=1))    # recent evidence
    with pytest.raises(RetentionTooShort, match="'s'"):
        purge_inbox_conflicts(engine, timedelta(days=2), {"s": timedelta(days=3)})
    assert rows(engine)["outbox.inbox_conflicts"] == 2
    assert purge_inbox_conflicts(engine, timedelta(days=30), {"s": timedelta(days=3)},
                                 batch=1) == 1
    with engine.connect() as conn:
        left = conn.execute(text("SELECT payload->>'v' FROM outbox.inbox_conflicts")
                            ).scalars().all()
        counted = conn.execute(text("SELECT conflicts FROM outbox.inbox")).scalar_one()
    assert left == ["2"] and counted == 2  # the stored event and its count stay


def test_versions_are_purged_only_once_no_older_event_can_still_arrive(
        engine: Engine) -> None:
    horizon = {"s": timedelta(days=3)}
    with engine.begin() as conn:
        for n in range(5):  # quiet entities: last moved 10 days ago
            ingest(conn, "s", f"q{n}", {"n": n}, version=4, entity=f"quiet_{n}",
                   clock=ago(days=10))
        ingest(conn, "s", "b1", {}, version=1, entity="busy", clock=ago(days=10))
        ingest(conn, "s", "b2", {}, version=2, entity="busy", clock=ago(days=1))
    with pytest.raises(RetentionTooShort, match="'s'"):
        purge_entity_versions(engine, timedelta(days=2), horizon)
    assert rows(engine)["outbox.entity_versions"] == 6
    # Within the horizon an older event still arrives: the version row refuses it.
    with engine.begin() as conn:
        assert ingest(conn, "s", "b0", {}, version=0, entity="busy").outcome \
            is InboxOutcome.STALE
    # A page of 2 entities per transaction: every quiet one goes, the busy one stays.
    assert purge_entity_versions(engine, timedelta(days=7), horizon, batch=2) == 5
    with engine.connect() as conn:
        left = conn.execute(text("SELECT entity, version FROM outbox.entity_versions")
                            ).all()
    assert [tuple(r) for r in left] == [("busy", 2)]
    # The next event of a purged entity is newer, and starts a new row.
    with engine.begin() as conn:
        assert ingest(conn, "s", "q0-next", {}, version=5, entity="quiet_0").outcome \
            is InboxOutcome.INSERTED


def test_the_version_purge_skips_an_entity_an_open_ingestion_holds(engine: Engine) -> None:
    with engine.begin() as conn:
        for n in range(3):
            ingest(conn, "s", f"e{n}", {}, version=1, entity=f"ent_{n}", clock=ago(days=10))
    with engine.connect() as holder:
        holder.begin()
        # A stale event still locks its entity's row (the upsert's conflict check).
        ingest(holder, "s", "late", {}, version=0, entity="ent_1")
        t0 = time.perf_counter()
        assert purge_entity_versions(engine, timedelta(days=7)) == 2
        assert time.perf_counter() - t0 < 5
        holder.commit()
    assert purge_entity_versions(engine, timedelta(days=7)) == 1


def test_the_cli_purges_conflicts_and_versions_and_refuses_short_windows_first(
        engine: Engine, db_url: str) -> None:
    with engine.begin() as conn:
        ingest(conn, "s", "evt", {"v": 0}, version=1, entity="e", clock=ago(days=40))
        ingest(conn, "s", "evt", {"v": 1}, version=1, entity="e", clock=ago(days=40))
    env = {"DATABASE_URL": db_url, "PATH": os.environ.get("PATH", "/usr/bin:/bin")}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "dispatcher.cli", "purge", *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)

    short = cli("--older-than", "7d", "--versions-older-than", "1d", "--horizon", "s=3d")
    assert short.returncode == 2 and "entity_versions retention" in short.stderr, short
    assert rows(engine) == {"outbox.inbox": 1, "outbox.inbox_conflicts": 1,
                            "outbox.entity_versions": 1}
    done = cli("--older-than", "7d", "--conflicts-older-than", "30d",
               "--versions-older-than", "7d", "--horizon", "s=3d")
    assert done.returncode == 0, done
    totals = json.loads(done.stdout)
    assert totals["inbox_conflicts"] == 1 and totals["entity_versions"] == 1
    assert rows(engine) == {"outbox.inbox": 1, "outbox.inbox_conflicts": 0,
                            "outbox.entity_versions": 0}


# -- metric labels ---------------------------------------------------------------------


def test_unregistered_source_names_never_become_metric_series(
        serve: Callable[[WebhookSources], TestClient], payments_db: Engine) -> None:
    reader = metric_reader()
    before = counter_points(reader, "outbox.inbox.events", "source")
    junk = [f"junk-{uuid.uuid4().hex}" for _ in range(5)]
    open_mode = serve(WebhookSources.unsigned())
    for name in junk:
        assert post(open_mode, name, raw(event()), {}).status_code == 200
    with payments_db.begin() as conn:  # a direct caller's unregistered name too
        ingest(conn, junk[0], "direct", {})
    secret = new_secret()
    billing = f"billing-{uuid.uuid4().hex[:8]}"
    signed = serve(WebhookSources.standard_webhooks({billing: [secret]}))
    body = raw(event())
    assert post(signed, billing, body, sign_standard(secret, body, int(time.time()))
                ).status_code == 200
    after = counter_points(reader, "outbox.inbox.events", "source")
    assert not any(name in after for name in junk)
    assert after.get("other", 0) - before.get("other", 0) == 6
    assert after.get(billing, 0) - before.get(billing, 0) == 1


# -- the library, without HTTP ---------------------------------------------------------


def test_published_test_vectors() -> None:
    """Standard Webhooks' example (standard-webhooks spec) and GitHub's documented one."""
    sw = StandardWebhooks("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
                          clock=lambda: 1614265330)
    headers = {"webhook-id": "msg_p5jXN8AQM9LWM0D4loKWxJek",
               "webhook-timestamp": "1614265330",
               "webhook-signature": "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="}
    assert sw.verify(headers, b'{"test": 2432232314}') == "msg_p5jXN8AQM9LWM0D4loKWxJek"
    with pytest.raises(InvalidSignature):
        sw.verify(headers, b'{"test": 2432232315}')
    gh = GitHubSignature("It's a Secret to Everybody")
    gh_headers = {"X-Hub-Signature-256": "sha256=757107ea0eb2509fc211221cce984b8a37570b6d"
                                         "7586c22c46f4379c8b043e17"}
    assert gh.verify(gh_headers, b"Hello, World!") is None
    with pytest.raises(InvalidSignature):
        gh.verify(gh_headers, b"Hello, World?")


def test_the_library_signers_agree_with_the_schemes() -> None:
    """The signers a sender (or the demo) can use produce what the verifiers accept."""
    secret, body, now = new_secret(), b'{"a":1}', int(time.time())
    assert StandardWebhooks(secret).sign(body, "msg_1", now) == sign_standard(
        secret, body, now, "msg_1")
    assert StripeSignature(secret).sign(body, now) == sign_stripe(secret, body, now)
    assert GitHubSignature(secret).sign(body) == sign_github(secret, body, now)


def test_bad_verifier_configuration_is_refused() -> None:
    for build in (lambda: StandardWebhooks([]), lambda: StandardWebhooks("whsec_!!"),
                  lambda: StripeSignature(""), lambda: GitHubSignature([]),
                  lambda: WebhookSources({"two words": GitHubSignature("x")})):
        with pytest.raises(ConfigurationError):
            build()
    assert parse_secrets("a=whsec_QUJD==,b=whsec_REVG,a=whsec_R0hJ") == {
        "a": ["whsec_QUJD==", "whsec_R0hJ"], "b": ["whsec_REVG"]}
