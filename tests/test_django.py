"""outbox.contrib.django in a real Django process on the real PostgreSQL (issue 10).

Django is configured once per pytest process by the `django_ready` fixture, on the
session's private database (conftest's `db_url`); nothing Django-related happens at
import, so the rest of the suite never sees it. Requests go through Django's test
client (WSGI); the real ASGI server is tests/test_django_example.py's subject.

Not pytest-django: it creates its own test database and blocks database access
outside its markers, while this suite already has one database per session, cleaned
after each test, shared with real worker processes that must see committed rows.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import threading
import types
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, create_engine, make_url, text
from sqlalchemy.pool import NullPool

from outbox import Claim
from outbox._config import libpq_dsn
from outbox._idempotency import advisory_lock_id

ROOT = Path(__file__).resolve().parents[1]
TOKENS = {"test-token": "tester", "tok-a": "alice", "tok-b": "alice", "tok-c": "bob"}
AS_TESTER = {"HTTP_AUTHORIZATION": "Bearer test-token"}
RINGS: list[str] = []
GATE: dict[str, threading.Event] = {}
FAIL: dict[str, bool] = {}


def ring(queue: str) -> None:
    """The doorbell settings.OUTBOX["DOORBELLS"] names: records each ring."""
    RINGS.append(queue)


class Principal:
    """A token-based user: what a DRF authentication class returns."""

    is_authenticated = True

    def __init__(self, identity: str) -> None:
        self.identity = identity


class TokenAuth:
    """DRF authentication, duck-typed (DRF cannot be imported before settings)."""

    def authenticate(self, request: Any) -> tuple[Principal, None] | None:
        from rest_framework.exceptions import AuthenticationFailed

        scheme, _, token = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        identity = TOKENS.get(token.strip())
        if identity is None:
            raise AuthenticationFailed("unknown bearer token")
        return Principal(identity), None

    def authenticate_header(self, request: Any) -> str:
        return "Bearer"


# -- Django, once per process ------------------------------------------------------------


def _test_settings(db_url: str, scratch_url: str) -> dict[str, Any]:
    from dispatcher.examples.payments.django_app.settings import database_from_url

    pg = database_from_url(db_url)
    return {
        "SECRET_KEY": "tests", "DEBUG": False, "USE_TZ": True,
        "ALLOWED_HOSTS": ["testserver", "127.0.0.1", "localhost"],
        "DATABASES": {
            "default": pg,
            "scratch": database_from_url(scratch_url),
            "sqlite": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
            "manual": {**pg, "AUTOCOMMIT": False},
        },
        "INSTALLED_APPS": [
            "django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes",
            "django.contrib.sessions", "django.contrib.messages", "rest_framework",
            "outbox.contrib.django", "dispatcher.examples.payments.django_app",
        ],
        "MIDDLEWARE": [
            "django.contrib.sessions.middleware.SessionMiddleware",
            "django.middleware.common.CommonMiddleware",
            "django.middleware.csrf.CsrfViewMiddleware",
            "django.contrib.auth.middleware.AuthenticationMiddleware",
            "django.contrib.messages.middleware.MessageMiddleware",
        ],
        "ROOT_URLCONF": "tests_django_urls",
        "TEMPLATES": [{
            "BACKEND": "django.template.backends.django.DjangoTemplates", "APP_DIRS": True,
            "OPTIONS": {"context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages"]},
        }],
        "REST_FRAMEWORK": {
            "EXCEPTION_HANDLER": "outbox.contrib.django.drf.problem_exception_handler",
            "DEFAULT_AUTHENTICATION_CLASSES": ["tests.test_django.TokenAuth"],
            "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.AllowAny"],
            "UNAUTHENTICATED_USER": None,
        },
        "OUTBOX": {"DOORBELLS": ["tests.test_django.ring"]},
        "DEFAULT_AUTO_FIELD": "django.db.models.BigAutoField",
    }


@pytest.fixture(scope="session")
def scratch_db(db_url: str) -> Iterator[str]:
    """An empty database of its own: `manage.py migrate` must build the schema there."""
    server = make_url(db_url)
    name = f"{server.database}_django"
    admin = create_engine(server, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    yield server.set(database=name).render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(scope="session")
def django_ready(db_url: str, scratch_db: str) -> Iterator[None]:
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(**_test_settings(db_url, scratch_db))
        django.setup()
        sys.modules["tests_django_urls"] = build_urls()
    from django.core.management import call_command
    from django.db import connections

    from dispatcher.examples.payments.schema import ensure_schema
    from outbox._config import make_engine

    call_command("migrate", verbosity=0)  # auth, admin, sessions, and the outbox app
    eng = make_engine(db_url, application_name="tests-django")
    ensure_schema(eng)
    eng.dispose()
    yield
    connections.close_all()


@pytest.fixture
def dj(django_ready: None, engine: Engine) -> Iterator[Engine]:
    """Django is ready; `engine` reads what it committed (tables truncated after)."""
    RINGS.clear()
    GATE.clear()
    FAIL.clear()
    yield engine
    from django.db import connections

    connections.close_all()


def build_urls() -> types.ModuleType:
    """The test project's URLs and views (DRF can only be imported after setup)."""
    from django.contrib import admin
    from django.db import connection
    from django.http import JsonResponse
    from django.urls import path
    from django.views.decorators.csrf import csrf_exempt
    from pydantic import BaseModel, Field
    from rest_framework import serializers
    from rest_framework.decorators import api_view
    from rest_framework.response import Response
    from rest_framework.views import APIView

    from dispatcher.examples.payments.django_app.models import Payment
    from outbox import enqueue
    from outbox.contrib.django import IdempotentMixin, anonymous_scope, idempotent

    class OrderIn(serializers.Serializer[Any]):
        amount = serializers.IntegerField(min_value=1)
        note = serializers.CharField(required=False, max_length=10)

    class OrderModel(BaseModel):
        amount: int = Field(gt=0, strict=True)

    def write_order(request: Any) -> int:
        body = request.idempotency.body
        amount = body["amount"] if isinstance(body, dict) else body.amount
        claim = request.idempotency.claim
        with connection.cursor() as cur:
            cur.execute("INSERT INTO public.test_orders (key, amount) VALUES (%s, %s) "
                        "RETURNING id", [claim.key, amount])
            order_id = int(cur.fetchone()[0])
        if FAIL.get("defer"):  # written with the completed key (Claim.enqueue)
            claim.enqueue("psp.charge", {"order_id": order_id}, name="charge", queue="deferred")
        else:
            enqueue(connection, "psp.charge", {"order_id": order_id}, claim=claim,
                    name="charge")
        if "entered" in GATE:
            GATE["entered"].set()
            GATE["release"].wait(20)
        if FAIL.get("raise"):
            raise RuntimeError("the view failed after writing")
        return order_id

    def created(order_id: int) -> Response:
        return Response({"id": order_id}, status=201,
                        headers={"Location": f"/orders/{order_id}", "X-Per-Caller": "1"})

    class Orders(APIView):
        @idempotent(serializer=OrderIn)
        def post(self, request: Any) -> Response:
            return created(write_order(request))

    class OrdersPydantic(APIView):
        @idempotent(OrderModel)
        def post(self, request: Any) -> Response:
            return created(write_order(request))

    class OrdersPhased(APIView):
        @idempotent(serializer=OrderIn, mode="phased")
        def post(self, request: Any) -> Response:
            return created(write_order(request))

    class OrdersPublic(APIView):
        @idempotent(serializer=OrderIn, scope=anonymous_scope)
        def post(self, request: Any) -> Response:
            return created(write_order(request))

    class OrdersMixin(IdempotentMixin, APIView):
        idempotency_options = {"serializer": OrderIn}

        def post(self, request: Any) -> Response:
            return created(write_order(request))

    @api_view(["POST"])
    @idempotent(serializer=OrderIn)
    def orders_fn(request: Any) -> Response:
        return created(write_order(request))

    @csrf_exempt
    @idempotent(scope=anonymous_scope)
    def orders_plain(request: Any) -> JsonResponse:
        return JsonResponse({"id": write_order(request)}, status=201)

    @api_view(["POST"])
    def naive_payment(request: Any) -> Response:
        """The article's version: get_or_create on the key, no guard (the control)."""
        key = request.META["HTTP_IDEMPOTENCY_KEY"]
        payment, made = Payment.objects.get_or_create(
            idempotency_key=key, owner="naive",
            defaults={"amount": 100, "currency": "EUR", "customer": "c"})
        return Response({"id": payment.id}, status=201 if made else 200)

    class GuardedPayment(APIView):
        @idempotent(serializer=OrderIn)
        def post(self, request: Any) -> Response:
            payment = Payment.objects.create(
                amount=request.idempotency.body["amount"], currency="EUR", customer="c",
                idempotency_key=request.idempotency.key, owner="guarded")
            enqueue(connection, "psp.charge", {"payment_id": payment.id},
                    claim=request.idempotency.claim)
            return Response({"id": payment.id}, status=201)

    module = types.ModuleType("tests_django_urls")
    module.urlpatterns = [  # type: ignore[attr-defined]
        path("admin/", admin.site.urls),
        path("orders", Orders.as_view()),
        path("orders-pydantic", OrdersPydantic.as_view()),
        path("orders-phased", OrdersPhased.as_view()),
        path("orders-public", OrdersPublic.as_view()),
        path("orders-mixin", OrdersMixin.as_view()),
        path("orders-fn", orders_fn),
        path("orders-plain", orders_plain),
        path("naive", naive_payment),
        path("guarded", GuardedPayment.as_view()),
    ]
    return module


# -- helpers ------------------------------------------------------------------------------


def count(engine: Engine, sql: str, **params: Any) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(sql), params).scalar_one())


def orders(engine: Engine) -> int:
    return count(engine, "SELECT count(*) FROM public.test_orders")


def effects(engine: Engine) -> int:
    return count(engine, "SELECT count(*) FROM outbox.effects")


def post(path: str, body: Any = None, *, key: str | None = "k-1", raw: bytes | None = None,
         content_type: str = "application/json", client: Any = None, **extra: Any) -> Any:
    from django.test import Client

    headers = dict(AS_TESTER)
    if key is not None:
        headers["HTTP_IDEMPOTENCY_KEY"] = key
    headers.update(extra)
    data = raw if raw is not None else json.dumps(body if body is not None else {"amount": 5})
    return (client or Client()).post(path, data=data, content_type=content_type, **headers)


def problem_of(resp: Any, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.content[:500]
    assert resp["Content-Type"] == "application/problem+json"
    body: dict[str, Any] = json.loads(resp.content)
    assert body["status"] == status and body["detail"] and {"type", "title"} <= body.keys()
    return body


# -- settings, checks, migrations --------------------------------------------------------


def test_migrate_builds_the_outbox_schema_on_an_empty_database(dj: Engine,
                                                                scratch_db: str) -> None:
    """`manage.py migrate` runs our Alembic revisions (and `migrate outbox zero` undoes)."""
    from django.core.management import call_command

    from outbox.contrib.django.migrations_support import KNOWN_REVISIONS

    probe = create_engine(scratch_db, poolclass=NullPool)
    call_command("migrate", "outbox", database="scratch", verbosity=0)
    with probe.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM outbox.alembic_version")
                            ).scalar_one() == KNOWN_REVISIONS.head()
        assert conn.execute(text("SELECT to_regclass('outbox.effects') IS NOT NULL")
                            ).scalar_one()
    call_command("migrate", "outbox", "zero", database="scratch", verbosity=0)
    with probe.connect() as conn:
        assert not conn.execute(text("SELECT to_regclass('outbox.effects') IS NOT NULL")
                                ).scalar_one()
    probe.dispose()
    from django.db import connections

    connections["scratch"].close()


def test_the_newest_django_migration_pins_alembics_head(dj: Engine) -> None:
    from django.core.management import call_command

    from outbox.contrib.django.migrations_support import KNOWN_REVISIONS, MIGRATIONS

    assert MIGRATIONS[-1][1] == KNOWN_REVISIONS.head(), "add a Django migration for it"
    migrations = sorted(p.stem for p in (
        ROOT / "outbox" / "contrib" / "django" / "migrations").glob("0*.py"))
    assert migrations == [name for name, _ in MIGRATIONS]
    out = io.StringIO()  # the unmanaged models' state matches the migrations
    call_command("makemigrations", "outbox", "--check", "--dry-run", stdout=out)
    assert "No changes detected" in out.getvalue()


def _ids(messages: list[Any]) -> set[str]:
    return {m.id for m in messages}


@pytest.mark.parametrize(("outbox", "expected"), [
    ({"MODEE": "atomic"}, "outbox.E001"),
    ({"MODE": "sometimes"}, "outbox.E001"),
    ({"KEY_TTL": -1}, "outbox.E001"),
    ({"SCOPE": "no.such.scope"}, "outbox.E001"),
    ({"STORED_HEADERS": ["content-type", "set-cookie"]}, "outbox.E001"),
    ({"DOORBELLS": "tests.test_django.ring"}, "outbox.E001"),
    ({"HANDLERS": "no-colon"}, "outbox.E001"),
    ({"LOCAL_TWINS": "yes"}, "outbox.E001"),
    ({"DATABASE": "nope"}, "outbox.E002"),
    ({"DATABASE": "sqlite"}, "outbox.E003"),
    ({"DATABASE": "manual"}, "outbox.E007"),
])
def test_system_checks_report_misconfiguration(dj: Engine, outbox: dict[str, Any],
                                              expected: str) -> None:
    from django.core.management import call_command
    from django.core.management.base import SystemCheckError
    from django.test import override_settings

    from outbox.contrib.django.checks import check_settings

    with override_settings(OUTBOX=outbox):
        assert expected in _ids(check_settings())
        with pytest.raises(SystemCheckError, match=expected.replace(".", r"\.")):
            call_command("check", stdout=io.StringIO(), stderr=io.StringIO())
    assert check_settings() == []


def test_checks_refuse_a_body_limit_django_enforces_first_and_phased_atomic_requests(
        dj: Engine) -> None:
    from django.conf import settings
    from django.test import override_settings

    from outbox.contrib.django.checks import check_settings

    with override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000):
        assert "outbox.E005" in _ids(check_settings())
    settings.DATABASES["default"]["ATOMIC_REQUESTS"] = True
    try:
        with override_settings(OUTBOX={"MODE": "phased"}):
            assert "outbox.E006" in _ids(check_settings())
        assert check_settings() == []  # atomic mode is fine inside ATOMIC_REQUESTS
    finally:
        settings.DATABASES["default"]["ATOMIC_REQUESTS"] = False


def test_the_database_check_finds_a_schema_behind_what_django_recorded(dj: Engine) -> None:
    from django.db import connection, transaction

    from outbox.contrib.django.checks import check_schema

    assert check_schema(databases=["default"]) == []
    assert check_schema() == []  # without --database it never touches the database
    with transaction.atomic():
        with connection.cursor() as cur:
            cur.execute("UPDATE outbox.alembic_version SET version_num = '0002'")
        assert _ids(check_schema(databases=["default"])) == {"outbox.E010"}
        with connection.cursor() as cur:
            cur.execute("DELETE FROM django_migrations WHERE app = 'outbox'")
            cur.execute("DELETE FROM outbox.alembic_version")
        assert _ids(check_schema(databases=["default"])) == {"outbox.W010"}
        transaction.set_rollback(True)
    assert check_schema(databases=["default"]) == []


# -- enqueue in transaction.atomic(), the doorbell, NOTIFY ---------------------------------


def test_enqueue_commits_with_the_block_and_rings_only_after_commit(dj: Engine) -> None:
    """A committed block: rows and effect together; doorbell and NOTIFY after COMMIT."""
    from django.db import connection, transaction

    from outbox import enqueue

    with psycopg.connect(libpq_dsn(), autocommit=True) as listener:
        listener.execute("LISTEN outbox_due")
        with transaction.atomic():
            with connection.cursor() as cur:
                cur.execute("INSERT INTO public.test_orders (amount) VALUES (1)")
            enqueue(connection, "psp.charge", {"n": 1}, queue="django-q")
            assert RINGS == []  # on_commit: not before the COMMIT
            assert list(listener.notifies(timeout=0.3, stop_after=1)) == []
            assert effects(dj) == 0  # not visible to anyone else yet
        assert RINGS == ["django-q"]
        got = list(listener.notifies(timeout=5, stop_after=1))
        assert [n.payload for n in got] == ["django-q"]
    assert orders(dj) == 1 and effects(dj) == 1


def test_a_rolled_back_block_writes_nothing_and_never_rings(dj: Engine) -> None:
    from django.db import connection, transaction

    from outbox import enqueue

    class Boom(Exception):
        pass

    with pytest.raises(Boom), transaction.atomic():
        with connection.cursor() as cur:
            cur.execute("INSERT INTO public.test_orders (amount) VALUES (1)")
        enqueue(connection, "psp.charge", {"n": 1})
        raise Boom
    with transaction.atomic():  # a savepoint rolled back takes its effect with it
        enqueue(connection, "psp.charge", {"n": 2}, queue="kept")
        with pytest.raises(Boom), transaction.atomic():
            enqueue(connection, "psp.charge", {"n": 3}, queue="dropped")
            raise Boom
    assert orders(dj) == 0
    with dj.connect() as conn:
        payloads = conn.execute(text("SELECT payload FROM outbox.effects")).scalars().all()
    assert payloads == [{"n": 2}]
    assert RINGS == ["kept"]


def test_the_guard_replays_on_djangos_connection(dj: Engine) -> None:
    """begin/complete inside atomic(); the replay's headers come back from jsonb."""
    from django.db import transaction

    from outbox import IdempotencyGuard, StoredResponse
    from outbox.contrib.django import outbox_db

    guard = IdempotencyGuard()
    first = StoredResponse(201, (("content-type", "application/json"),), b'{"ok":1}')
    with transaction.atomic():
        begun = guard.begin(outbox_db(), "tenant", "key-x", "fp")
        assert isinstance(begun, Claim)
        guard.complete(outbox_db(), begun, first)
    with transaction.atomic():
        assert guard.begin(outbox_db(), "tenant", "key-x", "fp") == first


def test_the_guard_replays_on_djangos_plain_connection(dj: Engine) -> None:
    """Django loads jsonb as text on its connection; the driver seam's cursors load it
    as JSON themselves, so `django.db.connection` works as the handle too."""
    from django.db import connection, transaction

    from outbox import IdempotencyGuard, StoredResponse

    guard = IdempotencyGuard()
    first = StoredResponse(201, (("content-type", "application/json"),), b'{"ok":2}')
    with transaction.atomic():
        begun = guard.begin(connection, "tenant", "key-plain", "fp")
        assert isinstance(begun, Claim)
        guard.complete(connection, begun, first)
    with transaction.atomic():
        assert guard.begin(connection, "tenant", "key-plain", "fp") == first
    with connection.cursor() as cur:  # Django's own decoding is left as it was
        cur.execute("SELECT '{\"a\": 1}'::jsonb")
        assert cur.fetchone()[0] == '{"a": 1}'


# -- the DRF decorator: the HTTP contract -----------------------------------------------


@pytest.mark.parametrize("path", ["/orders", "/orders-pydantic", "/orders-mixin",
                                  "/orders-fn"])
def test_created_then_replayed_byte_for_byte(dj: Engine, path: str) -> None:
    first = post(path, {"amount": 7}, key="order-1")
    assert first.status_code == 201, first.content
    assert first["Content-Type"] == "application/json"
    assert first["Location"].startswith("/orders/")
    assert "Idempotent-Replayed" not in first
    assert "X-Per-Caller" not in first  # not a stored header: never replayed, so not sent
    again = post(path, raw=b"{ \"amount\" :\n 7 }", key="order-1")  # other bytes
    assert again.status_code == 201
    assert again.content == first.content
    assert again["Idempotent-Replayed"] == "true"
    assert again["Location"] == first["Location"]
    assert orders(dj) == 1 and effects(dj) == 1
    with dj.connect() as conn:
        key = conn.execute(text("SELECT scope, status FROM outbox.idempotency_keys")).one()
    assert tuple(key) == ("user:tester", "completed")


@pytest.mark.parametrize("path", ["/orders", "/orders-phased"])
def test_effects_deferred_to_the_key_commit_with_it_and_ring_after_commit(
        dj: Engine, path: str) -> None:
    """`request.idempotency.claim.enqueue(...)`: the effect is written by the statement
    that completes the key, on Django's connection, and the doorbell rings from
    on_commit; a replay writes and rings nothing; a view that raises writes nothing."""
    FAIL["defer"] = True
    try:
        first = post(path, {"amount": 7}, key="deferred-1")
        assert first.status_code == 201, first.content
        assert RINGS == ["deferred"]
        assert post(path, {"amount": 7}, key="deferred-1").content == first.content
        assert RINGS == ["deferred"]
        FAIL["raise"] = True
        with pytest.raises(RuntimeError):
            post(path, {"amount": 7}, key="deferred-2")
    finally:
        FAIL.clear()
    assert orders(dj) == 1 and effects(dj) == 1
    with dj.connect() as conn:
        assert conn.execute(text("SELECT queue FROM outbox.effects")).scalar_one() == "deferred"


def test_a_refreshed_token_replays_and_another_client_is_its_own_request(dj: Engine) -> None:
    first = post("/orders", key="shared", HTTP_AUTHORIZATION="Bearer tok-a")
    refreshed = post("/orders", key="shared", HTTP_AUTHORIZATION="Bearer tok-b")
    other = post("/orders", key="shared", HTTP_AUTHORIZATION="Bearer tok-c")
    assert refreshed.content == first.content and refreshed["Idempotent-Replayed"] == "true"
    assert other.status_code == 201 and "Idempotent-Replayed" not in other
    assert orders(dj) == 2


@pytest.mark.parametrize(("name", "status", "code", "kwargs"), [
    ("missing key", 400, "invalid_idempotency_key", {"key": None}),
    ("empty key", 400, "invalid_idempotency_key", {"key": ""}),
    ("key of 256", 400, "invalid_idempotency_key", {"key": "k" * 256}),
    ("key list", 400, "invalid_idempotency_key", {"key": "a, b"}),
    ("control char", 400, "invalid_idempotency_key", {"key": "a\tb"}),
    ("not JSON", 400, "invalid_body", {"raw": b"amount=5"}),
    ("duplicate members", 400, "invalid_body", {"raw": b'{"amount":1,"amount":2}'}),
    ("NaN", 400, "invalid_body", {"raw": b'{"amount":NaN}'}),
    ("empty body", 400, "invalid_body", {"raw": b""}),
    ("too large", 413, "body_too_large", {"raw": b" " * (1_048_576 + 1)}),
    ("text/plain", 415, "unsupported_media_type", {"content_type": "text/plain"}),
    ("latin-1", 415, "unsupported_media_type",
     {"content_type": "application/json; charset=latin-1"}),
    ("gzip", 415, "unsupported_media_type", {"HTTP_CONTENT_ENCODING": "gzip"}),
    ("schema", 422, "validation_error", {"body": {"amount": 0}}),
    ("schema: missing", 422, "validation_error", {"body": {"note": "x"}}),
    ("schema: array", 422, "validation_error", {"raw": b"[1]"}),
    ("no token", 401, "unauthenticated", {"HTTP_AUTHORIZATION": ""}),
    ("bad token", 401, "unauthenticated", {"HTTP_AUTHORIZATION": "Bearer nope"}),
    ("bad tenant", 400, "invalid_tenant", {"HTTP_X_TENANT": "a\x01b"}),
])
def test_bad_requests_are_problems_and_write_nothing(dj: Engine, name: str, status: int,
                                                     code: str, kwargs: dict[str, Any]) -> None:
    body = problem_of(post("/orders", **kwargs), status)
    assert body["code"] == code
    if status == 401:
        assert post("/orders", **kwargs)["WWW-Authenticate"] == "Bearer"
    if code == "validation_error":
        assert body["errors"] and body["errors"][0]["loc"][0] == "body"
    assert orders(dj) == 0 and effects(dj) == 0
    assert count(dj, "SELECT count(*) FROM outbox.idempotency_keys") == 0


def test_schema_errors_match_outbox_http_for_a_pydantic_model(dj: Engine) -> None:
    body = problem_of(post("/orders-pydantic", {"amount": "5"}), 422)
    assert body["errors"] == [{"type": "int_type", "loc": ["body", "amount"],
                               "msg": "Input should be a valid integer"}]
    assert body["detail"] == "body.amount: Input should be a valid integer"


def test_same_key_other_request_is_422_and_the_first_answer_stays(dj: Engine) -> None:
    first = post("/orders", {"amount": 5}, key="reuse")
    assert problem_of(post("/orders", {"amount": 6}, key="reuse"), 422)["code"] == \
        "idempotency_key_reused"
    # the fingerprint covers the path too: the same key elsewhere is not a replay
    assert problem_of(post("/orders-mixin", {"amount": 5}, key="reuse"), 422)
    assert post("/orders", {"amount": 5}, key="reuse").content == first.content
    assert orders(dj) == 1


def test_anonymous_is_401_unless_the_view_opts_in(dj: Engine) -> None:
    assert problem_of(post("/orders", HTTP_AUTHORIZATION=""), 401)["code"] == "unauthenticated"
    public = post("/orders-public", HTTP_AUTHORIZATION="")
    plain = post("/orders-plain", HTTP_AUTHORIZATION="", key="plain-1")
    assert public.status_code == 201 and plain.status_code == 201
    assert plain["Content-Type"] == "application/json"
    assert post("/orders-plain", HTTP_AUTHORIZATION="", key="plain-1").content == plain.content
    with dj.connect() as conn:
        scopes = set(conn.execute(text("SELECT scope FROM outbox.idempotency_keys")).scalars())
    assert scopes == {"anonymous"}


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        from django.db import connections

        try:
            out.append(fn())
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


@pytest.mark.parametrize("local_twins", [True, False], ids=["local-twins", "database"])
@pytest.mark.parametrize("path", ["/orders", "/orders-phased"])
def test_a_twin_in_flight_gets_409_with_retry_after_then_the_replay(
        dj: Engine, path: str, local_twins: bool) -> None:
    """Both ways: the twin answered by this process (OUTBOX LOCAL_TWINS, the default)
    and by the database (the lock, or the phased claim's row)."""
    from django.test import override_settings

    with override_settings(OUTBOX={"LOCAL_TWINS": local_twins}):
        _twin_in_flight(dj, path)


def _twin_in_flight(dj: Engine, path: str) -> None:
    GATE["entered"], GATE["release"] = threading.Event(), threading.Event()
    thread, first = _in_thread(lambda: post(path, key="twin"))
    try:
        assert GATE["entered"].wait(20)
        twin = post(path, key="twin")
        body = problem_of(twin, 409)
        assert body["code"] == "request_in_progress" and twin["Retry-After"] == "1"
        if path == "/orders-phased":  # the claim is committed while the view runs
            assert count(dj, "SELECT count(*) FROM outbox.idempotency_keys "
                             "WHERE status = 'processing'") == 1
    finally:
        GATE["release"].set()
        thread.join(30)
    assert first[0].status_code == 201
    GATE.clear()
    assert post(path, key="twin").content == first[0].content
    assert orders(dj) == 1 and effects(dj) == 1


def test_a_key_held_by_another_transaction_is_409_without_waiting(dj: Engine) -> None:
    with dj.begin() as conn:
        conn.execute(text("SELECT pg_advisory_xact_lock(:id)"),
                     {"id": advisory_lock_id("user:tester", "held")})
        problem_of(post("/orders", key="held"), 409)
    assert post("/orders", key="held").status_code == 201


@pytest.mark.parametrize("path", ["/orders", "/orders-phased"])
def test_a_view_that_raises_stores_nothing_and_frees_the_key(dj: Engine, path: str) -> None:
    FAIL["raise"] = True
    with pytest.raises(RuntimeError):
        post(path, key="boom")
    assert orders(dj) == 0 and effects(dj) == 0
    assert count(dj, "SELECT count(*) FROM outbox.idempotency_keys") == 0
    FAIL.clear()
    assert post(path, key="boom").status_code == 201


def test_atomic_requests_the_key_commits_with_the_requests_transaction(dj: Engine) -> None:
    from django.conf import settings

    from outbox.errors import ConfigurationError

    settings.DATABASES["default"]["ATOMIC_REQUESTS"] = True
    try:
        first = post("/orders", key="in-request")
        assert first.status_code == 201
        assert post("/orders", key="in-request").content == first.content
        FAIL["raise"] = True
        with pytest.raises(RuntimeError):
            post("/orders", key="in-request-fails")
        FAIL.clear()
        with pytest.raises(ConfigurationError, match="phased"):
            post("/orders-phased", key="phased-in-request")
    finally:
        settings.DATABASES["default"]["ATOMIC_REQUESTS"] = False
    assert orders(dj) == 1
    assert count(dj, "SELECT count(*) FROM outbox.idempotency_keys") == 1


def _storm(path: str, key: str, n: int, amount: int = 5) -> list[int]:
    barrier = threading.Barrier(n)

    def one(_: int) -> int:
        from django.db import connections
        from django.test import Client

        client = Client(raise_request_exception=False)  # the naive view's 500s count too
        barrier.wait(30)
        try:
            return int(post(path, {"amount": amount}, key=key, client=client).status_code)
        finally:
            connections.close_all()

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_the_articles_storm_get_or_create_duplicates_the_guard_does_not(dj: Engine) -> None:
    """The control: the naive `get_or_create` view makes several payments for one key
    when parallel retries race; the same storm through @idempotent makes one."""
    duplicated = 0
    for round_ in range(5):
        naive = _storm("/naive", f"naive-{round_}", 20)
        duplicated = count(dj, "SELECT max(n) FROM (SELECT count(*) AS n FROM "
                               "payments.payments WHERE owner = 'naive' "
                               "GROUP BY idempotency_key) AS per_key")
        if duplicated > 1:
            break
    assert duplicated > 1, "the naive view never raced in 5 storms of 20"
    assert set(naive) <= {200, 201, 500}  # later retries: MultipleObjectsReturned
    from django.test import override_settings

    for round_, local_twins in enumerate((True, False)):  # twins answered here, or by SQL
        with override_settings(OUTBOX={"LOCAL_TWINS": local_twins}):
            statuses = _storm("/guarded", f"guarded-{round_}", 20)
        assert set(statuses) <= {201, 409} and 201 in statuses
        assert count(dj, "SELECT count(*) FROM payments.payments "
                         "WHERE owner = 'guarded'") == round_ + 1
        assert count(dj, "SELECT count(*) FROM outbox.effects "
                         "WHERE kind = 'psp.charge'") == round_ + 1


# -- the admin --------------------------------------------------------------------------------


def _effect(conn: Any, status: str, *, kind: str = "psp.charge", queue: str = "default",
            attempts: int = 0) -> int:
    lease = status == "in_flight"
    row = conn.execute(text(
        """
        INSERT INTO outbox.effects (effect_key, kind, payload, status, queue, attempts,
               lease_owner, lease_token, lease_expires_at, delivered_at, finished_at,
               last_error, headers)
        VALUES (:key, :kind, '{"amount": 5}', :status, :queue, :attempts,
                CASE WHEN :lease THEN 'worker-1' END,
                CASE WHEN :lease THEN gen_random_uuid() END,
                CASE WHEN :lease THEN now() + interval '30 seconds' END,
                CASE WHEN :status = 'delivered' THEN now() END,
                CASE WHEN :status IN ('delivered', 'failed', 'cancelled', 'needs_review')
                     THEN now() END,
                CASE WHEN :status = 'failed' THEN 'HTTP 500 from the PSP' END,
                '{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}')
        RETURNING id
        """), {"key": f"{kind}:{uuid.uuid4().hex}", "kind": kind, "status": status,
               "queue": queue, "attempts": attempts, "lease": lease}).scalar_one()
    return int(row)


@pytest.fixture
def admin_client(dj: Engine) -> Any:
    from django.contrib.auth import get_user_model
    from django.test import Client

    user_model = get_user_model()
    user = user_model.objects.filter(username="admin").first() or \
        user_model.objects.create_superuser("admin", "admin@example.com", "pw")
    client = Client()
    client.force_login(user)
    return client


def test_admin_pages_render_with_filters_attempts_and_trace_ids(admin_client: Any,
                                                                dj: Engine) -> None:
    with dj.begin() as conn:
        failed = _effect(conn, "failed", kind="email.receipt", queue="mail", attempts=2)
        _effect(conn, "pending")
        conn.execute(text(
            "INSERT INTO outbox.attempts (effect_id, attempt, worker, started_at, outcome, "
            "http_status, error, trace_id) VALUES (:id, 1, 'w1', now(), 'retry', 500, "
            "'HTTP 500', 'trace-one'), (:id, 2, 'w1', now(), 'failed', 400, 'HTTP 400', "
            "'trace-two')"), {"id": failed})
    post("/orders", key="admin-key")
    page = admin_client.get("/admin/outbox/effect/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "email.receipt" in html and "psp.charge" in html
    for query, shown, hidden in (("status__exact=failed", "email.receipt", "pending"),
                                 ("kind=psp.charge", "psp.charge", "email.receipt"),
                                 ("queue=mail", "email.receipt", "psp.charge")):
        listed = admin_client.get(f"/admin/outbox/effect/?{query}").content.decode()
        rows = re.findall(r'<tr>.*?</tr>', listed.split("<tbody>")[1], re.S)
        assert rows and all(shown in r for r in rows) and not any(hidden in r for r in rows)
    detail = admin_client.get(f"/admin/outbox/effect/{failed}/change/").content.decode()
    assert "trace-one" in detail and "trace-two" in detail
    assert "0af7651916cd43dd8448eb211c80319c" in detail  # the enqueue's trace
    attempts = admin_client.get("/admin/outbox/attempt/?outcome__exact=failed")
    assert attempts.status_code == 200 and "trace-two" in attempts.content.decode()
    keys = admin_client.get("/admin/outbox/idempotencykey/?status__exact=completed")
    assert keys.status_code == 200 and "admin-key" in keys.content.decode()
    with dj.connect() as conn:
        generation = conn.execute(text("SELECT generation FROM outbox.idempotency_keys")
                                  ).scalar_one()
    key_page = admin_client.get(f"/admin/outbox/idempotencykey/{generation}/change/")
    assert key_page.status_code == 200 and "user:tester" in key_page.content.decode()
    assert admin_client.get("/admin/outbox/effect/add/").status_code == 403


def _act(client: Any, action: str, ids: list[int]) -> str:
    resp = client.post("/admin/outbox/effect/", {"action": action,
                                                  "_selected_action": [str(i) for i in ids]},
                       follow=True)
    assert resp.status_code == 200
    return str(resp.content.decode()).lower()


def test_admin_retry_and_cancel_use_the_fenced_statements(admin_client: Any,
                                                          dj: Engine) -> None:
    with dj.begin() as conn:
        failed = _effect(conn, "failed", attempts=25)
        in_flight = _effect(conn, "in_flight", attempts=1)
        pending = _effect(conn, "pending")
        delivered = _effect(conn, "delivered", attempts=1)

    def status(effect_id: int) -> str:
        with dj.connect() as conn:
            return str(conn.execute(text("SELECT status FROM outbox.effects WHERE id = :i"),
                                    {"i": effect_id}).scalar_one())

    html = _act(admin_client, "cancel", [in_flight, pending, delivered])
    assert status(in_flight) == "in_flight"  # may already be applied: refused
    assert status(delivered) == "delivered"
    assert status(pending) == "cancelled"
    assert "cancelled 1 effect(s)" in html and "refused 2 effect(s)" in html
    html = _act(admin_client, "retry", [failed, pending, in_flight])
    assert status(failed) == "pending" and status(pending) == "pending"
    assert status(in_flight) == "in_flight"
    assert "requeued 2 effect(s)" in html and f"#{in_flight}" in html
    with dj.connect() as conn:
        row = conn.execute(text("SELECT attempts, finished_at, last_error FROM outbox.effects "
                                "WHERE id = :i"), {"i": failed}).one()
    assert tuple(row) == (0, None, None)  # a fresh set of attempts, as `outbox retry`


# -- management commands, import hygiene, the docs' example ---------------------------------


def test_outbox_status_and_outbox_migrate_commands(dj: Engine) -> None:
    from django.core.management import call_command

    with dj.begin() as conn:
        _effect(conn, "failed")
        _effect(conn, "pending")
    out = io.StringIO()
    call_command("outbox_status", "--json", stdout=out)
    snapshot = json.loads(out.getvalue())
    assert {k: snapshot[k] for k in ("pending", "in_flight", "delivered", "failed")} == \
        {"pending": 1, "in_flight": 0, "delivered": 0, "failed": 1}
    table = io.StringIO()
    call_command("outbox_status", stdout=table)
    assert "effects" in table.getvalue() and "idempotency keys" in table.getvalue()
    done = io.StringIO()
    call_command("outbox_migrate", stdout=done)
    assert "migrated" in done.getvalue()


def test_importing_the_app_never_imports_the_dispatcher(db_url: str) -> None:
    code = (
        "import os, sys, django\n"
        "os.environ['DJANGO_SETTINGS_MODULE'] = "
        "'dispatcher.examples.payments.django_app.settings'\n"
        "import outbox\n"
        "assert 'dispatcher' not in sys.modules\n"
        "django.setup()\n"
        "import outbox.contrib.django.drf, outbox.contrib.django.models\n"
        "import outbox.contrib.django.idempotency, outbox.contrib.django.checks\n"
        "import outbox.contrib.django.management.commands.outbox_worker\n"
        "import outbox.contrib.django.management.commands.outbox_status\n"
        "from django.core import checks; assert not checks.run_checks()\n"
        # The example's own settings live in dispatcher.examples: that package, and
        # the bare `dispatcher` above it (lazy, imports nothing), are expected.
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'dispatcher'\n"
        "             and m != 'dispatcher' and not m.startswith('dispatcher.examples')))\n")
    env = {**os.environ, "DATABASE_URL": db_url}
    env.pop("BROKER_URL", None)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_outbox_worker_defaults_are_the_dispatchers() -> None:
    """`manage.py outbox_worker` cannot import the dispatcher's constants (outbox/ never
    imports dispatcher/): its defaults are copies, kept equal here."""
    import argparse

    from dispatcher.cli import build_parser
    from dispatcher.producer import FULL_SCAN_EVERY
    from outbox.contrib.django.management.commands.outbox_worker import Command

    parser = argparse.ArgumentParser()
    Command().add_arguments(parser)
    ours = vars(parser.parse_args([]))
    cli = vars(build_parser().parse_args(["worker"]))
    assert ours["full_scan_every"] == FULL_SCAN_EVERY == cli["full_scan_every"]
    for name in ("concurrency", "queue", "lease", "poll", "grace"):
        assert ours[name] == cli[name], name


def test_the_docs_example_runs_as_written(dj: Engine) -> None:
    """docs/django.md's first Python block: a DRF view, served by the test client."""
    from django.urls import clear_url_caches, path

    block = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "django.md").read_text(),
                       re.S)[0]
    with dj.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS public.orders "
                          "(id bigserial PRIMARY KEY, amount int NOT NULL)"))
    namespace: dict[str, Any] = {}
    exec(compile(block, "docs/django.md", "exec"), namespace)
    urls = sys.modules["tests_django_urls"]
    urls.urlpatterns.append(path("docs-orders", namespace["OrdersView"].as_view()))  # type: ignore[attr-defined]
    clear_url_caches()
    try:
        first = post("/docs-orders", {"amount": 12}, key="docs-1")
        assert first.status_code == 201, first.content
        assert post("/docs-orders", {"amount": 12}, key="docs-1").content == first.content
        problem_of(post("/docs-orders", {"amount": 0}, key="docs-2"), 422)
        assert count(dj, "SELECT count(*) FROM public.orders") == 1
        assert count(dj, "SELECT count(*) FROM outbox.effects WHERE kind = 'psp.charge'") == 1
    finally:
        urls.urlpatterns.pop()  # type: ignore[attr-defined]
        clear_url_caches()
        with dj.begin() as conn:
            conn.execute(text("DROP TABLE IF EXISTS public.orders"))


def test_the_admin_finds_an_effect_and_its_attempts_by_key(admin_client: Any,
                                                           dj: Engine) -> None:
    """Search by exact effect key, on effects and on attempts: through outbox.effect_keys
    (effects have no key index since migration 0007), so a large table is not read."""
    for idem in ("admin-search", "admin-other"):
        assert post("/orders", key=idem).status_code == 201
    with dj.connect() as conn:
        effect_id, key = conn.execute(text(
            "SELECT id, effect_key FROM outbox.effects ORDER BY id LIMIT 1")).one()
        other = conn.execute(text(
            "SELECT effect_key FROM outbox.effects WHERE id <> :i"), {"i": effect_id}
        ).scalar_one()
    with dj.begin() as conn:
        conn.execute(text(
            "INSERT INTO outbox.attempts (effect_id, attempt, worker, started_at, outcome,"
            " error) VALUES (:id, 1, 'w1', now(), 'retry', 'HTTP 503')"), {"id": effect_id})
    found = admin_client.get(f"/admin/outbox/effect/?q={key}").content.decode()
    assert key in found and other not in found and "1 result" in found
    attempts = admin_client.get(f"/admin/outbox/attempt/?q={key}").content.decode()
    assert "HTTP 503" in attempts or "retry" in attempts
    assert f"#{effect_id} " in attempts
    nothing = admin_client.get("/admin/outbox/effect/?q=no-such-key").content.decode()
    assert "0 results" in nothing


def test_the_admin_shows_a_delivered_attempt_kept_on_its_effect_row(admin_client: Any,
                                                                    dj: Engine) -> None:
    """Migration 0006: a delivery is not an outbox.attempts row; the admin lists it from
    outbox.attempt_history (id = -effect id) and its page opens by that id."""
    assert post("/orders", key="admin-delivered").status_code == 201
    with dj.begin() as conn:
        effect_id = conn.execute(text("SELECT id FROM outbox.effects")).scalar_one()
        conn.execute(text(
            "UPDATE outbox.effects SET status = 'delivered', attempts = 1,"
            " delivered_at = now(), finished_at = now(), delivered_by = 'w-admin',"
            " delivered_started_at = now(), delivered_http_status = 201,"
            " delivered_trace_id = 'trace-delivered' WHERE id = :i"), {"i": effect_id})
    listed = admin_client.get("/admin/outbox/attempt/?outcome__exact=delivered")
    assert listed.status_code == 200 and "trace-delivered" in listed.content.decode()
    page = admin_client.get(f"/admin/outbox/attempt/{-effect_id}/change/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "w-admin" in html and "trace-delivered" in html
    assert admin_client.get("/admin/outbox/attempt/-999999/change/").status_code in (302, 404)
    with dj.begin() as conn:  # an outbox.attempts row opens by its own (positive) id
        retry_id = conn.execute(text(
            "INSERT INTO outbox.attempts (effect_id, attempt, worker, started_at, outcome,"
            " error, trace_id) VALUES (:i, 1, 'w-retry', now(), 'retry', 'HTTP 503',"
            " 'trace-retry') RETURNING id"), {"i": effect_id}).scalar_one()
    page = admin_client.get(f"/admin/outbox/attempt/{retry_id}/change/")
    assert page.status_code == 200 and "trace-retry" in page.content.decode()
