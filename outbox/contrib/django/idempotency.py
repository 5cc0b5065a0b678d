"""Idempotency-Key for Django and DRF views: outbox.http's contract (DESIGN §4), in Django.

```python
class PaymentsView(APIView):
    @idempotent(serializer=PaymentSerializer)      # or model=<pydantic model>, or neither
    def post(self, request):
        claim = request.idempotency.claim
        payment = Payment.objects.create(**request.idempotency.body)
        enqueue(connection, "psp.charge", {"payment_id": payment.id}, claim=claim)
        return Response({"id": payment.id}, status=201)
```

Before any database work, in this order: the scope (401 without an identity), the
`Idempotency-Key` (400 missing or malformed), the media type (415), the body size
(413), strict JSON (400) and the schema (422, with `errors`). Then, in atomic mode (the
default), ONE `transaction.atomic()` holds the key's advisory lock, the view, its
rows, its `enqueue`s and the completed key: a twin gets 409 + `Retry-After`, the same
key with another request 422, a finished key its first answer byte for byte with
`Idempotent-Replayed: true`. Inside a request-wide transaction (`ATOMIC_REQUESTS`)
the block is a savepoint and the key commits with the request. Errors are RFC 9457
problem+json, rendered exactly as outbox.http renders them.

What is reused from the framework-free core rather than written again: key syntax and
strict JSON (outbox/_canonical.py), the guard's protocol (outbox/_idempotency.py), the
problem codes and statuses (outbox/errors.py, `Problem.from_error`), the tenant and
header scopes and the media-type rule (outbox/http.py, fed a header view of the
Django request), and the stored-header / replay-size policy (outbox.http.Idempotency
applied to `StoredResponse`s).

Responses: a DRF `Response` is always rendered as JSON here (a stored answer must not
depend on the first caller's `Accept`); any Django `HttpResponse` with a body works.
Both the first answer and every replay are built from the stored form: the headers in
`STORED_HEADERS` and the body; cookies and other per-caller headers are not replayed.
A view that raises stores nothing (its transaction rolls back); a response it returns,
4xx included, is stored.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast
from urllib.parse import quote

import psycopg
from django.db import DatabaseError, transaction
from django.db import OperationalError as DjangoOperationalError
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.template.response import SimpleTemplateResponse
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from outbox import _web
from outbox._canonical import fingerprint, parse_idempotency_key, parse_json_body
from outbox._driver import drive
from outbox._idempotency import Claim, IdempotencyGuard, Mode, StoredResponse, ring_deferred
from outbox._web import (
    PROBLEM_MEDIA_TYPE,
    REPLAYED_HEADER,
    Problem,
    ReplayPolicy,
    problem_type,
)
from outbox.contrib.django import conf
from outbox.contrib.django.db import alias, connection_for, outbox_db, raw_connection
from outbox.errors import (
    ClaimLost,
    ConfigurationError,
    IdempotencyConflict,
    InvalidInput,
    InvalidRequestBody,
    RequestBodyTooLarge,
    Unauthenticated,
)

__all__ = [
    "Headers",
    "Idempotency",
    "IdempotentMixin",
    "IdempotentRequest",
    "anonymous_scope",
    "client_scope",
    "header_scope",
    "idempotency_of",
    "idempotent",
    "problem",
    "problem_response",
    "shared_scope",
    "to_response",
]

log = logging.getLogger("outbox.django")
V = TypeVar("V", bound=Callable[..., Any])


# -- requests -----------------------------------------------------------------------------


def _http_request(request: Any) -> HttpRequest:
    """Django's HttpRequest under a DRF Request (or the request itself)."""
    inner = getattr(request, "_request", None)
    return inner if isinstance(inner, HttpRequest) else cast(HttpRequest, request)


class Headers(Mapping[str, str]):
    """A request's headers by lowercase name (first value), plus `getlist` for all of them.

    Under ASGI the raw header list is read, so two `Idempotency-Key` or `X-Tenant`
    headers stay two (outbox.http's rules refuse them); under WSGI the server has
    already joined repeated headers with commas, and a joined key is refused as a list.
    """

    _META_NAMES: Mapping[str, str] = {"content-type": "CONTENT_TYPE",
                                      "content-length": "CONTENT_LENGTH"}

    def __init__(self, request: Any) -> None:
        inner = _http_request(request)
        scope = getattr(inner, "scope", None)
        self._raw: list[tuple[str, str]] | None = None
        self._meta = inner.META
        if isinstance(scope, dict) and isinstance(scope.get("headers"), list | tuple):
            self._raw = [(bytes(k).decode("latin-1").lower(), bytes(v).decode("latin-1"))
                         for k, v in scope["headers"]]

    def getlist(self, name: str) -> list[str]:
        name = name.lower()
        if self._raw is not None:
            return [v for k, v in self._raw if k == name]
        key = self._META_NAMES.get(name, "HTTP_" + name.upper().replace("-", "_"))
        value = self._meta.get(key)
        return [] if value is None or (value == "" and name in self._META_NAMES) else [value]

    def _names(self) -> list[str]:
        if self._raw is not None:
            return list(dict.fromkeys(k for k, _ in self._raw))
        names = [k for k in self._META_NAMES if self.getlist(k)]
        return names + [k[5:].lower().replace("_", "-") for k in self._meta
                        if k.startswith("HTTP_")]

    def __getitem__(self, name: str) -> str:
        values = self.getlist(name)
        if not values:
            raise KeyError(name)
        return values[0]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())


class _HeaderView:
    """What outbox.http's framework-free helpers read from a request: its headers."""

    def __init__(self, request: Any) -> None:
        self.headers = Headers(request)


def _header_view(request: Any) -> _web.HasHeaders:
    """The request as outbox._web's helpers read it."""
    return _HeaderView(request)


# -- scopes -------------------------------------------------------------------------------


def _identity(request: Any) -> str | None:
    """Who the client is: `request.user` as your authentication resolved it.

    A user object with a string `identity` (a token-based principal) gives that; a
    Django user its primary key (stable when the username changes); otherwise the
    username. Anonymous and unauthenticated users have none.
    """
    user = getattr(request, "user", None)
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    identity = getattr(user, "identity", None)
    if isinstance(identity, str) and identity:
        return identity
    pk = getattr(user, "pk", None)
    if pk is not None:
        return str(pk)
    get_username = getattr(user, "get_username", None)
    name = get_username() if callable(get_username) else None
    return name if isinstance(name, str) and name else None


def client_scope(request: Any) -> str:
    """The default scope: the client's identity (401 without one), narrowed by X-Tenant.

    The same rules as `outbox.http.client_scope`: never the credential (a refreshed
    token retrying gets the replay), never the endpoint (the fingerprint covers the
    path), each part percent-encoded.
    """
    identity = _identity(request)
    if identity is None:
        raise Unauthenticated("authenticate first: idempotency keys are scoped by client")
    return _web._with_tenant(_header_view(request), _web._encoded("user", identity))


def anonymous_scope(request: Any) -> str:
    """The explicit opt-in for public endpoints: no identity shares `anonymous`.

    Anyone who guesses a key there can replay its answer or claim it first: clients
    must send random keys (UUIDv4).
    """
    identity = _identity(request)
    return _web._with_tenant(_header_view(request),
                              _web._encoded("user", identity) if identity else "anonymous")


def shared_scope(request: Any) -> str:
    """One key space for every client."""
    return "shared"


def header_scope(name: str) -> Callable[[Any], str]:
    """Scope by a header your gateway sets after authenticating (400 without it)."""
    inner = _web.header_scope(name)
    return lambda request: inner(_header_view(request))


# -- problems -----------------------------------------------------------------------------


def _json_bytes(body: Any) -> bytes:
    """The exact bytes Starlette's JSONResponse (and DRF's JSONRenderer) produce."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False, indent=None,
                      separators=(",", ":")).encode("utf-8")


def problem_response(status: int, detail: Any = None, *, code: str | None = None,
                     title: str | None = None, headers: Mapping[str, str] | None = None,
                     **members: Any) -> HttpResponse:
    """An RFC 9457 problem+json answer, byte for byte as outbox.http renders it."""
    if status in (204, 304):
        response = HttpResponse(status=status)
        del response["Content-Type"]
    else:
        phrase = _web._phrase(status)
        body: dict[str, Any] = {"type": problem_type(code), "title": title or phrase,
                                "status": status, "detail": phrase if detail is None else detail}
        if code:
            body["code"] = code
        body.update(members)
        response = HttpResponse(_json_bytes(body), status=status,
                                content_type=PROBLEM_MEDIA_TYPE)
    for name, value in (headers or {}).items():
        response[name] = value
    return response


def problem(exc: Problem | InvalidInput | IdempotencyConflict) -> HttpResponse:
    """The answer for an outbox.http `Problem` or a library client error."""
    if not isinstance(exc, Problem):
        exc = Problem.from_error(exc)
    return problem_response(exc.status_code, exc.detail, code=exc.code, title=exc.title,
                            headers=exc.headers, **exc.members)


def _sqlstate(exc: BaseException) -> str | None:
    for err in (exc, exc.__cause__):
        code = getattr(err, "sqlstate", None)
        if isinstance(code, str):
            return code
    return None


def _is_transient(exc: BaseException) -> bool:
    return _sqlstate(exc) in ("40001", "40P01")


def _database_problem(exc: BaseException) -> Problem | None:
    """outbox.http's mapping: a collision is a 409 to retry, a lost connection a 503."""
    if _sqlstate(exc) in ("55P03", "40001", "40P01"):
        return Problem(409, "the request collided with a concurrent one and was rolled "
                       "back; retry", code="transaction_conflict", headers={"Retry-After": "1"})
    if isinstance(exc, psycopg.OperationalError | DjangoOperationalError):
        return Problem(503, "the database is unavailable; the outcome is unknown, retry "
                       "with the same Idempotency-Key", code="outcome_unknown",
                       headers={"Retry-After": "1"})
    return None


# -- responses ----------------------------------------------------------------------------


def to_response(stored: StoredResponse, *, replayed: bool) -> HttpResponse:
    """The answer built from the stored form: the same bytes every time."""
    response = HttpResponse(stored.body, status=stored.status)
    del response["Content-Type"]
    for name, value in stored.headers:
        response[name] = f"{response[name]}, {value}" if name in response else value
    if replayed:
        response[REPLAYED_HEADER] = "true"
    return response


def _render_drf(response: Any, request: Any) -> bool:
    """Render a DRF Response as JSON; False if it is none (DRF is optional)."""
    try:
        from rest_framework.renderers import JSONRenderer
        from rest_framework.response import Response as DRFResponse
    except ImportError:  # plain Django views need no DRF
        return False
    if not isinstance(response, DRFResponse):
        return False
    drf: Any = response
    drf.accepted_renderer = JSONRenderer()
    drf.accepted_media_type = JSONRenderer.media_type
    drf.renderer_context = {"request": request, "response": response}
    drf.render()
    return True


def _render(response: Any, request: Any) -> HttpResponseBase:
    """Render a DRF Response (as JSON) or a template response; plain ones as they are."""
    if not _render_drf(response, request) and isinstance(response, SimpleTemplateResponse):
        response.render()
    if not isinstance(response, HttpResponseBase):
        raise TypeError(f"an idempotent view must return an HttpResponse, not "
                        f"{type(response).__name__}")
    if response.streaming:
        raise TypeError("an idempotent view cannot return a streaming response: its body "
                        "must be stored for replays")
    return response


# -- the request --------------------------------------------------------------------------


@dataclass(slots=True)
class IdempotentRequest:
    """A validated request, as `request.idempotency` inside the view.

    `claim` is what `enqueue(..., claim=...)` derives stable effect keys from; `body`
    is the validated body (pydantic model, serializer's `validated_data`, or the JSON
    document), `document` the parsed JSON as sent.
    """

    key: str
    scope: str
    fingerprint: str
    body: Any
    document: Any
    using: str
    claim: Claim | None = None
    # The hash of the body's business identity (`same_request=`), if one is declared.
    business_key: str | None = None


def _request_path(request: HttpRequest) -> str:
    """Path plus the sorted, re-encoded query (outbox.http's `_request_path`)."""
    query = sorted((k, v) for k, values in request.GET.lists() for v in values)
    if not query:
        return request.path
    return request.path + "?" + "&".join(
        f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in query)


def read_body(request: Any, max_bytes: int) -> bytes:
    """The raw body, refusing (413) a declared or actual size above `max_bytes`."""
    lengths = Headers(request).getlist("content-length")
    if lengths:
        try:
            declared = int(lengths[0])
        except ValueError:
            raise InvalidRequestBody("Content-Length is not a number") from None
        if declared > max_bytes:
            raise RequestBodyTooLarge(f"the body is larger than {max_bytes} bytes")
    raw = _http_request(request).body
    if len(raw) > max_bytes:
        raise RequestBodyTooLarge(f"the body is larger than {max_bytes} bytes")
    return raw


def _drf_errors(detail: Any, loc: tuple[str | int, ...] = ("body",)) -> list[dict[str, Any]]:
    """DRF serializer errors as outbox.http's `errors`: type, loc, msg."""
    out: list[dict[str, Any]] = []
    if isinstance(detail, Mapping):
        for name, inner in detail.items():
            here = loc if name in ("non_field_errors", "__all__") else (*loc, str(name))
            out += _drf_errors(inner, here)
    elif isinstance(detail, list | tuple):
        for index, inner in enumerate(detail):
            if isinstance(inner, Mapping | list | tuple):
                out += _drf_errors(inner, (*loc, index))
            else:
                out += _drf_errors(inner, loc)
    else:
        out.append({"type": str(getattr(detail, "code", None) or "invalid"),
                    "loc": list(loc), "msg": str(detail)})
    return out


def _schema_problem(errors: list[dict[str, Any]]) -> Problem:
    return Problem(422, _web._summarise(errors), code="validation_error", errors=errors)


# -- the configuration and the decorator --------------------------------------------------


class Idempotency:
    """One endpoint's idempotency: what `@idempotent(...)` builds.

    `model`: anything pydantic validates (a model, dataclass, TypedDict, `dict`), with
    the same 422 `errors` as outbox.http; `serializer`: a DRF serializer class instead.
    Neither: any JSON document is accepted. Other options default to `settings.OUTBOX`
    (read per request, so `override_settings` works): `mode`, `scope`, `using`,
    `max_body`, `max_stored_body`, `stored_headers`; `fingerprint_headers` adds request
    headers to the fingerprint.

    `same_request(body) -> str | None` (the validated body; default: the guard's own)
    declares the request's business identity, e.g. customer + amount + currency, and
    `same_request_window` (seconds; default: the guard's, 600) how far back another key
    of the same scope with it makes this request a suspected duplicate (issue 15):
    counted (`outbox.idempotency.suspected_duplicates`), a span event and a WARNING on
    the `outbox.idempotency` logger, never refused. Passed through to
    `IdempotencyGuard` as in outbox.http's `Idempotency` (which also offers the
    opt-in `Idempotency-Suspected-Duplicate` header).
    """

    def __init__(self, model: Any = None, *, serializer: Any = None, mode: Mode | None = None,
                 scope: Callable[[Any], str] | None = None, using: str | None = None,
                 guard: IdempotencyGuard | None = None, max_body: int | None = None,
                 max_stored_body: int | None = None,
                 stored_headers: Iterable[str] | None = None,
                 fingerprint_headers: Iterable[str] = (),
                 same_request: Callable[[Any], str | None] | None = None,
                 same_request_window: float | None = None) -> None:
        if model is not None and serializer is not None:
            raise ConfigurationError("pass model= or serializer=, not both")
        if inspect.isfunction(model) or inspect.ismethod(model):
            raise ConfigurationError("@idempotent takes a body model, not the view: write "
                                     "@idempotent() with parentheses")
        if mode not in (None, "atomic", "phased"):
            raise ConfigurationError(f"mode is 'atomic' or 'phased', not {mode!r}")
        self.adapter: Any = None  # a pydantic TypeAdapter when `model` is given
        if model is not None:
            from pydantic import TypeAdapter  # only `model=` needs pydantic

            self.adapter = TypeAdapter(model)
        self.serializer = serializer
        self.mode = mode
        self.scope = scope
        self.using = using
        self._guard = guard
        self.max_body = max_body
        self.max_stored_body = max_stored_body
        self.stored_headers = tuple(stored_headers) if stored_headers is not None else None
        if self.stored_headers is not None:  # refuse Set-Cookie & co. now, not per request
            ReplayPolicy(stored_headers=self.stored_headers)
        self.fingerprint_headers = tuple(h.lower() for h in fingerprint_headers)
        self.same_request = same_request
        self.same_request_window = same_request_window
        self._policies: dict[tuple[Any, ...], ReplayPolicy] = {}

    # -- settings, per request -------------------------------------------------------

    def _settings(self) -> conf.OutboxSettings:
        return conf.get()

    def guard(self) -> IdempotencyGuard:
        if self._guard is not None:
            return self._guard
        s = self._settings()
        return IdempotencyGuard(ttl=s.key_ttl, retention=s.key_retention,
                                retry_after=s.retry_after, local_twins=s.local_twins)

    def policy(self) -> ReplayPolicy:
        """outbox.http's stored-header and replay-size policy, for these settings."""
        s = self._settings()
        headers = self.stored_headers if self.stored_headers is not None else s.stored_headers
        cap = self.max_stored_body or s.max_stored_body
        found = self._policies.get((headers, cap))
        if found is None:
            found = ReplayPolicy(stored_headers=headers, max_stored_body=cap)
            self._policies = {(headers, cap): found}
        return found

    # -- validation (no database work) -----------------------------------------------

    def validate(self, request: Any) -> IdempotentRequest:
        """Everything a client can get wrong, in outbox.http's order; raises Problem."""
        s = self._settings()
        max_body = self.max_body or s.max_body
        headers = Headers(request)
        try:
            scope = (self.scope or s.scope)(request)  # who first: 401 before the rest
            key = parse_idempotency_key(headers.getlist("idempotency-key"))
            assert key is not None
            _web.check_json_media_type(_header_view(request))
            raw = read_body(request, max_body)
            document = parse_json_body(raw, max_bytes=max_body)
        except InvalidInput as exc:
            raise Problem.from_error(exc) from None
        body = self._validated(document)
        extra = {h: ",".join(headers.getlist(h)) for h in self.fingerprint_headers}
        inner = _http_request(request)
        digest = fingerprint(inner.method or "POST", _request_path(inner), document, extra)
        return IdempotentRequest(key=key, scope=scope, fingerprint=digest, body=body,
                                 document=document, using=alias(self.using or s.database),
                                 business_key=self.guard().business_key(body,
                                                                        self.same_request))

    def _validated(self, document: Any) -> Any:
        if self.adapter is not None:
            try:
                return self.adapter.validate_python(document)
            except Exception as exc:
                from pydantic import ValidationError

                if not isinstance(exc, ValidationError):
                    raise
                raise _schema_problem(_web._plain_errors(
                    {**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False))
                ) from None
        if self.serializer is not None:
            serializer = self.serializer(data=document)
            if not serializer.is_valid():
                raise _schema_problem(_drf_errors(serializer.errors))
            return serializer.validated_data
        return document

    # -- running the view --------------------------------------------------------------

    def _stored(self, response: Any, request: Any) -> tuple[StoredResponse, StoredResponse]:
        """(what the first caller gets, what the key stores)."""
        rendered = _render(response, request)
        content = getattr(rendered, "content", b"")
        whole = StoredResponse(rendered.status_code, tuple(rendered.items()), bytes(content))
        policy = self.policy()
        full = policy.to_stored(whole)
        return full, policy.replayable(full)

    def _attempts(self, using: str) -> Iterator[Any]:
        """Retry a deadlock or serialization failure, unless an outer transaction is ours
        only in part (ATOMIC_REQUESTS: the request's transaction is already aborted)."""
        if connection_for(using).in_atomic_block:
            yield _NoRetry()
            return
        yield from Retrying(retry=retry_if_exception(_is_transient), stop=stop_after_attempt(5),
                            wait=wait_random_exponential(multiplier=0.01, max=0.2),
                            reraise=True)

    def run(self, request: Any, view: Callable[[], Any]) -> HttpResponse:
        """Validate, then run `view()` at most once for this key; always an answer."""
        try:
            prepared = self.validate(request)
        except Problem as exc:
            return problem(exc)
        mode = self.mode or self._settings().mode
        try:
            guard = self.guard()
            with guard.in_flight(connection_for(prepared.using), prepared.scope,
                                 prepared.key, prepared.fingerprint):
                if mode == "phased":
                    full, replayed = self._run_phased(request, prepared, view, guard)
                else:
                    full, replayed = self._run_atomic(request, prepared, view, guard)
        except IdempotencyConflict as exc:
            return problem(exc)
        except (DatabaseError, psycopg.Error) as exc:
            found = _database_problem(exc)
            if found is None:
                raise
            log.warning("idempotent request failed in the database: %s", exc)
            return problem(found)
        return to_response(full, replayed=replayed)

    def _run_atomic(self, request: Any, prepared: IdempotentRequest, view: Callable[[], Any],
                    guard: IdempotencyGuard) -> tuple[StoredResponse, bool]:
        using = prepared.using
        outcome: tuple[StoredResponse, bool] | None = None
        for attempt in self._attempts(using):
            with attempt, transaction.atomic(using=using):
                db = outbox_db(using)
                begun = guard.begin(db, prepared.scope, prepared.key, prepared.fingerprint,
                                    business_key=prepared.business_key,
                                    same_request_window=self.same_request_window)
                if isinstance(begun, StoredResponse):
                    outcome = (begun, True)
                else:
                    prepared.claim = begun
                    request.idempotency = prepared
                    full, kept = self._stored(view(), request)
                    guard.complete(db, begun, kept)
                    ring_deferred(connection_for(using), begun)  # on_commit
                    outcome = (full, False)
        assert outcome is not None
        return outcome

    def _run_phased(self, request: Any, prepared: IdempotentRequest, view: Callable[[], Any],
                    guard: IdempotencyGuard) -> tuple[StoredResponse, bool]:
        """The claim commits first (twins see it), the work in one atomic block after.

        Run with the guard's own flows on Django's connection: `IdempotencyGuard.claim`
        opens its transaction on an Engine or psycopg connection, and Django's psycopg
        connection loads jsonb as text, which the replay path reads (see db.py).
        """
        using = prepared.using
        if connection_for(using).in_atomic_block:
            raise ConfigurationError(
                "phased mode commits its claim before the view runs: the view must not be "
                "inside a transaction (ATOMIC_REQUESTS off, or @transaction.non_atomic_requests)")
        raw = raw_connection(using)
        with raw.transaction():
            raw.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            claimed = drive(outbox_db(using), guard._claim(
                prepared.scope, prepared.key, prepared.fingerprint, prepared.business_key,
                guard._window(self.same_request_window)))
        if isinstance(claimed, StoredResponse):
            return claimed, True
        prepared.claim = claimed
        request.idempotency = prepared
        try:
            outcome: tuple[StoredResponse, bool] | None = None
            for attempt in self._attempts(using):
                with attempt:
                    claimed._reset()
                    with transaction.atomic(using=using):
                        full, kept = self._stored(view(), request)
                        guard.complete(outbox_db(using), claimed, kept)
                        ring_deferred(connection_for(using), claimed)  # on_commit
                    outcome = (full, False)
            assert outcome is not None
            return outcome
        except ClaimLost:
            raise
        except BaseException:
            try:
                with raw.transaction():
                    raw.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
                    drive(outbox_db(using), guard._release(claimed))
            except Exception:  # the TTL heals it; the original error matters more
                log.exception("could not release the idempotency claim %r", prepared.key)
            raise

    # -- decorating ------------------------------------------------------------------

    def __call__(self, view: V) -> V:
        """Decorate a view function `(request, ...)` or method `(self, request, ...)`."""

        @functools.wraps(view)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            index = 0 if args and _is_request(args[0]) else 1
            if len(args) <= index or not _is_request(args[index]):
                raise TypeError("@idempotent decorates a view: (request, ...) or "
                                "(self, request, ...)")
            return self.run(args[index], lambda: view(*args, **kwargs))

        wrapper.idempotency = self  # type: ignore[attr-defined]
        return cast(V, wrapper)


class _NoRetry:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _is_request(value: Any) -> bool:
    return isinstance(value, HttpRequest) or isinstance(getattr(value, "_request", None),
                                                       HttpRequest)


def idempotent(model: Any = None, **options: Any) -> Idempotency:
    """`@idempotent()`, `@idempotent(Model)`, `@idempotent(serializer=S, mode="phased")`."""
    return Idempotency(model, **options)


def idempotency_of(request: Any) -> IdempotentRequest:
    """`request.idempotency`, typed: the key, scope, claim and validated body."""
    found = getattr(request, "idempotency", None)
    if not isinstance(found, IdempotentRequest):
        raise RuntimeError("no idempotent request here: decorate the view with @idempotent")
    return found


class IdempotentMixin:
    """For class-based views (DRF's APIView or Django's View): the listed handlers get
    `@idempotent(**idempotency_options)`.

    ```python
    class PaymentsView(IdempotentMixin, APIView):
        idempotency_options = {"serializer": PaymentSerializer}
        def post(self, request): ...
    ```
    """

    idempotent_methods: tuple[str, ...] = ("post",)
    idempotency_options: Mapping[str, Any] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in cls.idempotent_methods:
            handler = cls.__dict__.get(name)
            if handler is not None and not hasattr(handler, "idempotency"):
                setattr(cls, name, Idempotency(**dict(cls.idempotency_options))(handler))
