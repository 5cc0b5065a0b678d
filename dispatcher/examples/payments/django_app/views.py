"""The payments service's views in DRF: the routes and answers of the FastAPI example.

Each answer is built to be the FastAPI example's, byte for byte where a client could
tell: the same pydantic body model (dispatcher/examples/payments/app.py `PaymentIn`, hence the
same 422 `errors`), the same problem+json for every error (outbox.contrib.django),
the same 405 (`Allow`, no HEAD/OPTIONS), 404, 307 for a trailing slash, 401 rules.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

from django.db import DatabaseError, connections
from django.http import HttpRequest, HttpResponse
from pydantic import Field, TypeAdapter, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView
from sqlalchemy import Engine

from dispatcher.examples.payments.app import MAX_BIGINT, PaymentIn, _ingest_in_transaction
from dispatcher.examples.payments.django_app.models import Payment
from dispatcher.examples.payments.webhooks import sources_from_env
from outbox import enqueue, ingest, ingest_many, parse_event, parse_event_batch
from outbox._canonical import DEFAULT_MAX_BODY
from outbox._config import make_engine
from outbox._web import Problem, _plain_errors, _summarise, check_json_media_type
from outbox.contrib.django.db import database_url
from outbox.contrib.django.idempotency import (
    Headers,
    _header_view,
    idempotency_of,
    idempotent,
    problem,
    problem_response,
    read_body,
)
from outbox.webhooks import WebhookSources

PAYMENT_ID: TypeAdapter[int] = TypeAdapter(Annotated[int, Field(ge=1, le=MAX_BIGINT)])


def identity(request: Request) -> str | None:
    user = request.user
    return getattr(user, "identity", None) if user is not None else None


class ExampleView(APIView):
    """FastAPI's routing answers: no automatic HEAD or OPTIONS, a problem+json 405."""

    http_method_names = ["get", "post"]

    @property
    def default_response_headers(self) -> dict[str, str]:
        return {}  # FastAPI sends no `Allow` on a success

    def http_method_not_allowed(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        allowed = ", ".join(m.upper() for m in self.http_method_names if hasattr(self, m))
        raise Problem(405, "Method Not Allowed", headers={"Allow": allowed})


class PaymentsView(ExampleView):
    @idempotent(PaymentIn)
    def post(self, request: Request) -> Response:
        """One payment row and two effects, in the view's transaction with the key."""
        idem = idempotency_of(request)
        body: PaymentIn = idem.body
        claim = idem.claim
        assert claim is not None
        payment = Payment.objects.create(
            amount=body.amount, currency=body.currency, customer=body.customer,
            idempotency_key=claim.key, owner=identity(request))
        conn = connections[idem.using]
        enqueue(conn, "psp.charge", {"payment_id": payment.id, "amount": payment.amount,
                                     "currency": payment.currency}, claim=claim, name="charge")
        enqueue(conn, "email.receipt", {"payment_id": payment.id,
                                        "customer": payment.customer},
                claim=claim, name="receipt")
        return Response(payment.as_json(), status=201,
                        headers={"Location": f"/payments/{payment.id}"})


class PaymentView(ExampleView):
    def get(self, request: Request, payment_id: str) -> Response:
        try:
            pid = PAYMENT_ID.validate_python(payment_id)
        except ValidationError as exc:
            errors = _plain_errors({**e, "loc": ("path", "payment_id", *e["loc"])}
                                   for e in exc.errors(include_url=False))
            raise Problem(422, _summarise(errors), code="validation_error",
                          errors=errors) from None
        owner = identity(request)
        payment = Payment.objects.filter(id=pid, owner=owner).first()
        if payment is None:  # another client's payment is indistinguishable from none
            raise Problem(401 if owner is None else 404,
                          "authenticate first" if owner is None
                          else f"payment {pid} does not exist",
                          code="unauthenticated" if owner is None else "not_found")
        return Response(payment.as_json())


@functools.cache
def _engine() -> Engine:
    """Ingestion runs on SQLAlchemy (outbox.ingest takes a SQLAlchemy Connection)."""
    return make_engine(database_url(), application_name="payments-api-django",
                       pool_size=10, max_overflow=20)


@functools.cache
def _sources() -> WebhookSources:
    return sources_from_env()


def verified_body(source: str, request: Request) -> bytes:
    """dispatcher/examples/payments/webhooks.py `verified_body`, on a Django request: 404, 413,
    401, 415, in that order, before anything is parsed or stored."""
    sources = _sources()
    sources.check_source(source)
    body = read_body(request, DEFAULT_MAX_BODY)
    sources.verify(source, Headers(request), body)
    check_json_media_type(_header_view(request))
    return body


class WebhookView(ExampleView):
    def post(self, request: Request, source: str) -> Response:
        event = parse_event(source, verified_body(source, request))
        outcome = _ingest_in_transaction(_engine(), lambda conn: ingest(
            conn, event.source, event.event_id, event.payload, event.version,
            event.entity).outcome.value)
        return Response({"outcome": outcome})


class WebhookBatchView(ExampleView):
    def post(self, request: Request, source: str) -> Response:
        events = parse_event_batch(source, verified_body(source, request))
        outcomes = _ingest_in_transaction(_engine(), lambda conn: [
            r.outcome.value for r in ingest_many(conn, events, count_duplicates=True)])
        return Response({"outcomes": outcomes})


class HealthView(ExampleView):
    def get(self, request: Request) -> Response:
        try:
            with connections["default"].cursor() as cur:
                cur.execute("SELECT to_regclass('outbox.effects') IS NOT NULL")
                row = cur.fetchone()
        except DatabaseError:
            raise Problem(503, "the database does not answer", code="database_unavailable",
                          headers={"Retry-After": "5"}) from None
        if not row or not row[0]:
            raise Problem(503, "the outbox tables are missing: run `outbox migrate`",
                          code="not_migrated", headers={"Retry-After": "5"})
        return Response({"status": "ok"})


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """404, or Starlette's 307 to the same path without its trailing slash."""
    from django.urls import Resolver404, resolve

    path = request.path_info
    if path.endswith("/") and len(path) > 1:
        try:
            resolve(path.rstrip("/"))
        except Resolver404:
            pass
        else:
            target = path.rstrip("/")
            query = request.META.get("QUERY_STRING")
            response = HttpResponse(status=307)
            del response["Content-Type"]
            response["Location"] = request.build_absolute_uri(
                target + (f"?{query}" if query else ""))
            return response
    return problem_response(404)


def server_error(request: HttpRequest) -> HttpResponse:
    return problem(Problem(500, "the server failed to handle this request",
                           code="internal_error"))
