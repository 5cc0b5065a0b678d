"""The example payments service (DESIGN.md §8): the contract external tests rely on.

* `POST /payments` with `Idempotency-Key`: one `payments.payments` row, one
  `psp.charge` and one `email.receipt` effect, all in the same transaction as the
  key's stored response (`outbox.http.Idempotency`, atomic mode). 201 + Location.
* `GET /payments/{id}`: 200, or a 404/422 problem (never a 500 for any id).
* `POST /webhooks/{source}`: idempotent ingestion keyed by (source, id), signed the
  Standard Webhooks way with the source's secret from `EXAMPLE_WEBHOOK_SECRETS`
  (dispatcher/examples/payments/webhooks.py: unknown source 404, missing/bad/stale signature 401,
  nothing stored; unset, unsigned events are accepted). 200 with
  `{"outcome": "inserted"|"duplicate"|"stale"|"conflict"}`. A conflict (same id,
  other payload) is also a 200: it is recorded in `outbox.inbox_conflicts` and
  counted (`outbox.inbox.events{outcome=conflict}`), never applied; a non-2xx would
  only make the sender redeliver the same bad copy for days (Stripe: 3) and hide
  real failures in the retry noise. `POST /webhooks/{source}/batch` takes an array
  (one signature over the whole array).
* Clients are identified by `Authorization: Bearer <client>.<secret>`
  (dispatcher/examples/payments/auth.py); keys are scoped by client, so a retry with a
  refreshed token replays, and another client's same key is its own request.
* `GET /healthz`: 200 when the database answers and is migrated, else a 503 problem.

Every error is an RFC 9457 problem+json with a `detail` member. Schema errors in a
body are 422 (FastAPI's convention); a bad `Idempotency-Key` or non-JSON body is 400.
"""

# No `from __future__ import annotations`: FastAPI resolves the endpoints' annotations
# at runtime, and they refer to a dependency local to `create_app`.
import argparse
import logging
import signal
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import FrameType
from typing import Annotated, Any, Literal, TypeVar, get_args

from fastapi import Depends, FastAPI, Path, Request
from pydantic import BaseModel, Field
from sqlalchemy import Connection, Engine, insert, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.concurrency import run_in_threadpool
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.responses import JSONResponse, Response

from dispatcher.examples.payments.auth import BearerTokens, backend_from_env, on_auth_error
from dispatcher.examples.payments.schema import (
    CURRENCIES,
    MAX_AMOUNT,
    MAX_CUSTOMER,
    ensure_schema,
    payments,
)
from dispatcher.examples.payments.webhooks import sources_from_env, verified_body
from outbox import enqueue
from outbox._canonical import DEFAULT_MAX_BODY
from outbox._config import make_engine
from outbox._idempotency import Claim, Mode
from outbox._inbox import (
    MAX_VERSION,
    IncomingEvent,
    ingest,
    ingest_many,
    parse_event,
    parse_event_batch,
)
from outbox.http import (
    Idempotency,
    IdempotentRequest,
    Problem,
    inline_refs,
    install_problem_handlers,
    problem_openapi,
)
from outbox.telemetry_setup import instrument_fastapi
from outbox.webhooks import WebhookSources

MAX_BIGINT = 2**63 - 1
Currency = Literal["EUR", "USD", "GBP", "CHF", "JPY"]
assert set(get_args(Currency)) == set(CURRENCIES)
IDENTIFIER = "^[!-~]{1,255}$"  # printable ASCII, no spaces (outbox._inbox's rule)


class PaymentIn(BaseModel):
    """A payment to create. Strict types: `"100"`, `100.0` and `true` are not amounts."""

    amount: Annotated[int, Field(strict=True, gt=0, le=MAX_AMOUNT,
                                 description="Minor units (cents)")]
    currency: Currency
    customer: Annotated[str, Field(strict=True, min_length=1, max_length=MAX_CUSTOMER)]


class Payment(BaseModel):
    """A payment as stored; `status` is `pending` until the PSP's answer is processed."""

    id: int
    amount: int
    currency: str
    customer: str
    status: str


class Outcome(BaseModel):
    outcome: Literal["inserted", "duplicate", "stale", "conflict"]


class Outcomes(BaseModel):
    outcomes: list[Literal["inserted", "duplicate", "stale", "conflict"]]


class WebhookEvent(BaseModel):
    """Documentation only: `outbox._inbox.parse_event` validates (400 on refusal)."""

    id: Annotated[str, Field(pattern=IDENTIFIER)]
    type: Annotated[str, Field(min_length=1, max_length=255)]
    version: Annotated[int | None, Field(ge=0, le=MAX_VERSION)] = None
    entity: Annotated[str | None, Field(pattern=IDENTIFIER)] = None
    data: dict[str, Any]


def _body_schema(model: type[BaseModel], *, array: bool = False) -> dict[str, Any]:
    schema = inline_refs(model.model_json_schema())
    if array:
        schema = {"type": "array", "minItems": 1, "maxItems": 1000, "items": schema}
    signature = [{"name": name, "in": "header", "required": False, "description": text,
                  "schema": {"type": "string"}} for name, text in (
        ("webhook-id", "Standard Webhooks: the delivery's id (signed)"),
        ("webhook-timestamp", "Standard Webhooks: unix seconds, within 5 minutes of now"),
        ("webhook-signature", "Standard Webhooks: `v1,<base64 HMAC-SHA256 over "
         "'{webhook-id}.{webhook-timestamp}.{raw body}'>`, space-separated"))]
    return {
        "parameters": signature,
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {
            "400": problem_openapi("Not strict JSON, or not a valid event"),
            "401": problem_openapi("The signature is missing, bad or stale (when "
                                   "EXAMPLE_WEBHOOK_SECRETS is set); nothing was stored"),
            "404": problem_openapi("The source is not in EXAMPLE_WEBHOOK_SECRETS; nothing "
                                   "was stored"),
            "413": problem_openapi(f"The body is larger than {DEFAULT_MAX_BODY} bytes"),
            "415": problem_openapi("The body is not UTF-8 application/json"),
            "422": problem_openapi("A parameter FastAPI rejects (events themselves get 400)"),
            "503": problem_openapi("The database failed or was too busy; send the event "
                                   "again after `Retry-After` seconds (a copy that was "
                                   "recorded is answered as a duplicate)"),
        },
    }


T = TypeVar("T")
log = logging.getLogger(__name__)
# PostgreSQL rolled the whole transaction back, and nothing of it is left: running it
# again is exactly the sender's redelivery, only sooner.
RETRIED_ONCE = frozenset({"40P01", "40001"})  # deadlock, serialization failure
# The database works but made us wait too long: lock_timeout, statement_timeout.
BUSY = RETRIED_ONCE | {"55P03", "57014"}


def _ingestion_problem(exc: DBAPIError | PoolTimeout) -> Problem:
    """A database error at a webhook endpoint: 503 + Retry-After, never a 500.

    A 500 says the receiver has a bug; this is a transient failure, and resending
    is safe whatever failed: ingestion is idempotent.
    """
    sqlstate = getattr(getattr(exc, "orig", None), "sqlstate", None)
    log.warning("webhook ingestion failed (SQLSTATE %s): %s", sqlstate, exc)
    if isinstance(exc, PoolTimeout) or sqlstate in BUSY:
        return Problem(503, "the database was too busy to record the event (a lock wait "
                       "or a deadlock); nothing was recorded: send it again",
                       code="database_busy", headers={"Retry-After": "1"})
    return Problem(503, "the database failed while recording the event; it may or may "
                   "not be recorded: send it again (a recorded copy is answered as a "
                   "duplicate)", code="database_unavailable", headers={"Retry-After": "5"})


def _ingest_in_transaction(db: Engine, work: Callable[[Connection], T]) -> T:
    """Run `work` in one transaction, once more after a deadlock or serialization failure.

    The inbox takes its row locks in one order, so two ingestions never deadlock each
    other; other transactions on the same rows still can (one that locks inbox rows
    itself, a handler's own rows, a purge racing a re-insert). One immediate retry
    turns that into a normal answer; a second failure, and any other database error,
    is a 503 problem. A lost connection is not retried: the database is likely down.
    """
    try:
        try:
            with db.begin() as conn:
                return work(conn)
        except DBAPIError as exc:
            if getattr(exc.orig, "sqlstate", None) not in RETRIED_ONCE:
                raise
            log.info("webhook ingestion rolled back (%s); retrying once", exc.orig)
        with db.begin() as conn:
            return work(conn)
    except (DBAPIError, PoolTimeout) as exc:
        raise _ingestion_problem(exc) from exc


SourceParam = Annotated[str, Path(
    description="Who sent the event: 1-255 printable ASCII characters (else 400)",
    json_schema_extra={"pattern": IDENTIFIER})]


def _identity(request: Request) -> str | None:
    user = request.scope.get("user")
    return user.identity if user is not None and user.is_authenticated else None


def _payment_json(row: Any) -> dict[str, Any]:
    return {"id": row.id, "amount": row.amount, "currency": row.currency,
            "customer": row.customer, "status": row.status}


def create_app(engine: Engine | None = None, *, idempotency_mode: Mode = "atomic",
               auth: BearerTokens | None = None,
               webhooks: WebhookSources | None = None) -> FastAPI:
    """The service; without `engine` it connects to `DATABASE_URL` (and disposes on exit).

    `auth` maps bearer tokens to identities (default: `EXAMPLE_API_TOKENS`, see auth.py).
    `webhooks`: the accepted sources and their signatures (default:
    `EXAMPLE_WEBHOOK_SECRETS`, see webhooks.py).

    The `payments` schema is created at startup (`ensure_schema`); the outbox schema
    comes from `outbox migrate`.
    """
    owned = engine is None
    db = engine if engine is not None else make_engine(
        application_name="payments-api", pool_size=10, max_overflow=20)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await run_in_threadpool(ensure_schema, db)
        yield
        if owned:
            db.dispose()

    app = FastAPI(title="Payments example", version="1.0",
                  description=__doc__, lifespan=lifespan)
    app.state.engine = db
    install_problem_handlers(app)
    # Who the client is: the idempotency scope (outbox.http.client_scope) reads it.
    app.add_middleware(AuthenticationMiddleware, backend=auth or backend_from_env(),
                       on_error=on_auth_error)
    guarded = Idempotency(PaymentIn, mode=idempotency_mode)

    @app.post("/payments", status_code=201, response_model=Payment,
              openapi_extra=guarded.openapi,
              responses={201: {"description": "Created (or the replay of the first "
                                              "answer, with `Idempotent-Replayed: true`)"}})
    def create_payment(
        request: Annotated[IdempotentRequest[PaymentIn], Depends(guarded)],
        http: Request,
    ) -> Response:
        body = request.body
        owner = _identity(http)

        def work(conn: Connection, claim: Claim) -> Response:
            row = conn.execute(
                insert(payments)
                .values(amount=body.amount, currency=body.currency, customer=body.customer,
                        idempotency_key=claim.key, owner=owner)
                .returning(*payments.c)).one()
            enqueue(conn, "psp.charge", {"payment_id": row.id, "amount": row.amount,
                                         "currency": row.currency},
                    claim=claim, name="charge")
            enqueue(conn, "email.receipt", {"payment_id": row.id, "customer": row.customer},
                    claim=claim, name="receipt")
            return JSONResponse(_payment_json(row), status_code=201,
                                headers={"Location": f"/payments/{row.id}"})

        return request.run(work)

    @app.get("/payments/{payment_id}", response_model=Payment,
             responses={404: problem_openapi("No such payment"),
                        422: problem_openapi("The id is not an integer in 1..2^63-1")})
    def get_payment(payment_id: Annotated[int, Path(ge=1, le=MAX_BIGINT)],
                    request: Request) -> dict[str, Any]:
        owner = _identity(request)
        with db.connect() as conn:
            row = conn.execute(select(payments).where(
                payments.c.id == payment_id, payments.c.owner == owner)).first()
        if row is None:  # another client's payment is indistinguishable from none
            raise Problem(401 if owner is None else 404,
                          "authenticate first" if owner is None
                          else f"payment {payment_id} does not exist",
                          code="unauthenticated" if owner is None else "not_found")
            raise Problem(404, f"payment {payment_id} does not exist", code="not_found")
        return _payment_json(row)

    sources = webhooks if webhooks is not None else sources_from_env()

    def _ingest_one(event: IncomingEvent) -> str:
        return _ingest_in_transaction(db, lambda conn: ingest(
            conn, event.source, event.event_id, event.payload, event.version,
            event.entity).outcome.value)

    def _ingest_batch(events: list[IncomingEvent]) -> list[str]:
        return _ingest_in_transaction(db, lambda conn: [
            r.outcome.value for r in ingest_many(conn, events, count_duplicates=True)])

    @app.post("/webhooks/{source}", response_model=Outcome,
              openapi_extra=_body_schema(WebhookEvent))
    async def receive_event(source: SourceParam, request: Request) -> dict[str, str]:
        event = parse_event(source, await verified_body(sources, source, request))
        return {"outcome": await run_in_threadpool(_ingest_one, event)}

    @app.post("/webhooks/{source}/batch", response_model=Outcomes,
              openapi_extra=_body_schema(WebhookEvent, array=True))
    async def receive_events(source: SourceParam, request: Request) -> dict[str, list[str]]:
        """Several events in one transaction; repeated ids are folded (one row each).

        One signature covers the whole raw array (its own `webhook-id`).
        """
        events = parse_event_batch(source, await verified_body(sources, source, request))
        return {"outcomes": await run_in_threadpool(_ingest_batch, events)}

    @app.get("/healthz", responses={
        503: problem_openapi("The database does not answer, or is not migrated")})
    def healthz() -> dict[str, str]:
        try:
            with db.connect() as conn:
                migrated = conn.execute(text(
                    "SELECT to_regclass('outbox.effects') IS NOT NULL")).scalar_one()
        except DBAPIError:
            raise Problem(503, "the database does not answer", code="database_unavailable",
                          headers={"Retry-After": "5"}) from None
        if not migrated:
            raise Problem(503, "the outbox tables are missing: run `outbox migrate`",
                          code="not_migrated", headers={"Retry-After": "5"})
        return {"status": "ok"}

    # A SERVER span per request (the maintained FastAPI instrumentation, when tracing
    # is on): the trace of a payment starts at its request, not at `enqueue`.
    instrument_fastapi(app)
    return app


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def serve(host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the service with uvicorn until SIGTERM/SIGINT; SIGTERM exits with status 0.

    uvicorn drains connections (10 s at most), then re-raises the signal it caught;
    our SIGTERM handler turns that into a normal exit, so `lifespan` cleanup has run.
    """
    import os

    import uvicorn

    from dispatcher.metrics import configure_metrics
    from outbox.telemetry_setup import configure

    configure("outbox-example-api")
    configure_metrics("outbox-example-api")
    if os.environ.get("BROKER_URL"):
        # With Celery, ring a drain after each commit instead of waiting for the sweep.
        from dispatcher.celery_app import install_doorbell

        install_doorbell()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_cleanly)
    uvicorn.run(create_app(), host=host, port=port, timeout_graceful_shutdown=10,
                log_level="info")


def main(argv: list[str] | None = None) -> None:
    """`python -m dispatcher.examples.payments.app [--host H] [--port P]`
    (the same as `outbox example-api`)."""
    parser = argparse.ArgumentParser(description="Run the example payments API.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    serve(args.host, args.port)


if __name__ == "__main__":
    main()
