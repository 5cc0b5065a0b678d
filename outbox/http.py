"""Idempotency-Key for Starlette and FastAPI, with RFC 9457 problem+json errors.

The pieces, smallest first:

* `Idempotency(Model)` is a FastAPI dependency (and a plain async callable for
  Starlette). Before any database work it validates the `Idempotency-Key` header
  (400), the tenant scope, the media type (415), the body size (413), the JSON syntax
  (400: NaN, duplicate members, NUL, lone surrogates, 5,000-digit numbers, deep
  nesting...) and the body's schema (422). It returns an `IdempotentRequest`.
* `IdempotentRequest.run(work)` runs `work(conn, claim) -> Response` through
  `IdempotencyGuard.run` in one transaction and answers with the stored response, or
  replays the first answer byte for byte with `Idempotent-Replayed: true`; 409 +
  `Retry-After` while a twin is in flight, 422 when the key was used for another
  request (method, path, query or body).
* `install_problem_handlers(app)` renders every HTTP error (ours, FastAPI's
  validation errors, 404/405, and 500s) as `application/problem+json` with `type`,
  `title`, `status`, `detail` and, for ours, a machine-readable `code`.

Key syntax (B1-B11): one header, 1-255 printable ASCII characters, case-sensitive,
no minimum length (short keys only risk the client's own collisions, inside its own
scope); an sf-string `"abc"` is the same key as the bare token `abc`. Bodies (B17-B27):
strict UTF-8 JSON, at most `max_body` bytes; a non-JSON media type, another charset or
any `Content-Encoding` is a 415 (bodies are fingerprinted as parsed, never inflated).

Keys are scoped by client (`client_scope`: the identity your authentication resolved,
and `X-Tenant`), never by credential and not by endpoint: the fingerprint
covers method and path, so the same key sent to another endpoint is a 422, never a
silent second execution.

Replays contain exactly the headers in `stored_headers` (content-type, location, ...).
Both the first answer and every replay are built from the stored form, so a retry
sees what the first caller saw. The first caller's other headers (e.g. Set-Cookie)
are dropped: they are per-caller and must not be replayed to someone else. Some are
never stored whatever the configuration says (`DENIED_STORED_HEADERS`: Set-Cookie,
WWW-Authenticate, Authentication-Info, every `Proxy-*`, the hop-by-hop and framing
headers); naming one in `stored_headers` is a `ConfigurationError` at construction,
never a silent drop, and headers a response names in its `Connection` are not stored.

Cap on the cached response (B28): bodies above `max_stored_body` (1 MiB by default)
are sent to the first caller in full, but the key stores the status and headers with
a small problem+json body instead (type `.../response_not_stored`, the original
status and size, `Location` kept) and the header `Idempotent-Replay-Omitted: body`.
The work is committed either way, so a retry still never executes it twice; it is
told to fetch the resource instead. Storing a truncated body would replay corrupt
JSON, and refusing the work would turn a success into an error.

Responses that carry secrets (an API key shown once, a card token): `store_body=False`
keeps no body of that endpoint at rest, and `store_body=unless_no_store` (or any
predicate) decides per response, here from the response's own `Cache-Control:
no-store`. The first caller gets the full response; the key stores the same stand-in
as above (status, `Location`, `response_not_stored`, `Idempotent-Replay-Omitted:
body`, no size), so a replay tells the client to fetch the resource. An empty body
(204) has nothing to withhold and is stored as is.

Errors raised by `work` roll the transaction back and are not stored (validation
failures are never cached); a response `work` returns, 4xx included, is stored.

The same business request under another key (issue 15): `same_request=` maps the
validated body to its business identity (for a payment: customer, amount, currency);
a first execution whose identity another key of the same scope had within
`same_request_window` is counted and logged by the guard, and with
`suspect_header=True` answered with `Idempotency-Suspected-Duplicate: <n>` (how many
other keys, of this client's own scope only). The request itself is never refused.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast
from urllib.parse import quote

import psycopg
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from pydantic import TypeAdapter, ValidationError
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError, OperationalError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ExceptionHandler
from tenacity import AsyncRetrying, Retrying

from outbox import _web
from outbox._canonical import DEFAULT_MAX_BODY, fingerprint, parse_idempotency_key, parse_json_body
from outbox._crash import crashpoint
from outbox._idempotency import (
    Claim,
    IdempotencyGuard,
    Mode,
    Result,
    StoredResponse,
    _retrying,
    sqlstate,
)
from outbox._web import (
    DEFAULT_MAX_STORED_BODY,
    DEFAULT_STORED_HEADERS,
    DENIED_STORED_HEADERS,
    OMITTED_HEADER,
    PROBLEM_MEDIA_TYPE,
    REPLAYED_HEADER,
    SUSPECTED_DUPLICATE_HEADER,
    ReplayPolicy,
    _encoded,
    _phrase,
    _plain_errors,
    _summarise,
    _with_tenant,
    check_json_media_type,
    header_scope,
    problem_type,
    shared_scope,
    unless_no_store,
)
from outbox._web import MAX_TENANT_LENGTH as MAX_TENANT_LENGTH  # re-exported, as before
from outbox._web import PROBLEM_TYPE_BASE as PROBLEM_TYPE_BASE
from outbox.errors import (
    ConfigurationError,
    IdempotencyConflict,
    InvalidInput,
    InvalidRequestBody,
    InvalidTenant,
    RequestBodyTooLarge,
    Unauthenticated,
    UnsupportedMediaType,
)

__all__ = [
    "DEFAULT_MAX_STORED_BODY",
    "DEFAULT_STORED_HEADERS",
    "DENIED_STORED_HEADERS",
    "OMITTED_HEADER",
    "PROBLEM_MEDIA_TYPE",
    "REPLAYED_HEADER",
    "SUSPECTED_DUPLICATE_HEADER",
    "Idempotency",
    "IdempotentRequest",
    "InvalidTenant",
    "Problem",
    "ProblemResponse",
    "UnsupportedMediaType",
    "anonymous_scope",
    "check_json_media_type",
    "client_scope",
    "header_scope",
    "inline_refs",
    "install_problem_handlers",
    "problem_openapi",
    "problem_response",
    "problem_type",
    "read_body",
    "shared_scope",
    "tenant_scope",
    "to_response",
    "unless_no_store",
]

M = TypeVar("M")

class ProblemResponse(JSONResponse):
    """A JSON response with the RFC 9457 media type."""

    media_type = PROBLEM_MEDIA_TYPE


def problem_response(status: int, detail: Any = None, *, code: str | None = None,
                     title: str | None = None, headers: Mapping[str, str] | None = None,
                     **members: Any) -> Response:
    """An RFC 9457 body: type, title, status, detail (always present) and extras."""
    phrase = _phrase(status)
    if status in (204, 304):  # these carry no body
        return Response(status_code=status, headers=dict(headers or {}))
    body: dict[str, Any] = {
        "type": problem_type(code),
        "title": title or phrase,
        "status": status,
        "detail": phrase if detail is None else detail,
    }
    if code:
        body["code"] = code
    body.update(members)
    return ProblemResponse(jsonable_encoder(body), status_code=status, headers=dict(headers or {}))


class Problem(HTTPException, _web.Problem):
    """An HTTP error with a problem code; without our handlers it is still `{"detail"}`.

    Also the framework-free `outbox._web.Problem`, so code shared with the Django
    integration catches it.
    """

    def __init__(self, status: int, detail: str, *, code: str | None = None,
                 title: str | None = None, headers: Mapping[str, str] | None = None,
                 **members: Any) -> None:
        HTTPException.__init__(self, status_code=status, detail=detail, headers=headers)
        self.code = code
        self.title = title
        self.members = members

    def response(self) -> Response:
        return problem_response(self.status_code, self.detail, code=self.code,
                                title=self.title, headers=self.headers, **self.members)


# -- exception handlers ---------------------------------------------------------------


def _http_exception_handler(request: Request, exc: Exception) -> Response:
    if isinstance(exc, Problem):
        return exc.response()
    assert isinstance(exc, HTTPException)
    detail: Any = exc.detail
    return problem_response(exc.status_code, detail, headers=exc.headers)


def _validation_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = _plain_errors(exc.errors())
    return problem_response(422, _summarise(errors), code="validation_error", errors=errors)


def _library_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, InvalidInput | IdempotencyConflict)
    return Problem.from_error(exc).response()


def _server_error_handler(request: Request, exc: Exception) -> Response:
    # Starlette still re-raises the exception after this response, so it gets logged.
    return problem_response(500, "the server failed to handle this request",
                            code="internal_error")


def install_problem_handlers(app: Any) -> None:
    """Render every error of a Starlette/FastAPI `app` as problem+json (RFC 9457)."""
    handlers: dict[type[Exception], ExceptionHandler] = {
        HTTPException: _http_exception_handler,
        RequestValidationError: _validation_handler,
        InvalidInput: _library_error_handler,
        IdempotencyConflict: _library_error_handler,
        Exception: _server_error_handler,
    }
    for exc_class, handler in handlers.items():
        app.add_exception_handler(exc_class, handler)


# -- request parsing ------------------------------------------------------------------


def _user_identity(request: Request) -> str | None:
    """The identity the application resolved (Starlette's `request.user`), if any."""
    user = request.scope.get("user")
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    for attr in ("identity", "display_name"):
        try:
            value = getattr(user, attr)
        except NotImplementedError:
            continue
        if isinstance(value, str) and value:
            return value
    return None


def client_scope(request: Request) -> str:
    """Default key scope: who the client is, never its credential, never the endpoint.

    The identity is the one your authentication resolved: an authenticated
    `request.user` (Starlette's `AuthenticationMiddleware`, or any middleware that sets
    `scope["user"]`). A client that refreshes its token and retries is the same client,
    so it gets the replay (hashing the raw credential ran such a retry twice). A request
    with no identity is a 401: a shared key space lets one client replay another's
    response or block its keys. `X-Tenant`, when sent, narrows the client's own scope.
    Each part is percent-encoded, so no header value can forge another scope.

    Choose another scope explicitly when that is what you mean: `anonymous_scope`
    (identity if any, else one shared `anonymous` space: only with unguessable keys),
    `header_scope("X-Client-Id")` behind a gateway that sets it, or your own callable.
    """
    identity = _user_identity(request)
    if identity is None:
        raise Unauthenticated("authenticate first: idempotency keys are scoped by client")
    return _with_tenant(request, _encoded("user", identity))


def anonymous_scope(request: Request) -> str:
    """`client_scope`, but a request without identity shares the `anonymous` space.

    The explicit opt-in for a public endpoint: anyone who guesses a key there can
    replay its response or claim it first, so clients must send random keys (UUIDv4).
    """
    identity = _user_identity(request)
    return _with_tenant(request, _encoded("user", identity) if identity else "anonymous")


tenant_scope = anonymous_scope  # the pre-issue-8 name and behaviour, minus the credential


async def read_body(request: Request, max_bytes: int = DEFAULT_MAX_BODY) -> bytes:
    """Read at most `max_bytes` (413 beyond), without buffering an oversized body first."""
    lengths = request.headers.getlist("content-length")
    if lengths:
        try:
            declared = int(lengths[0])
        except ValueError:
            raise InvalidRequestBody("Content-Length is not a number") from None
        if declared > max_bytes:
            raise RequestBodyTooLarge(f"the body is larger than {max_bytes} bytes")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > max_bytes:
            raise RequestBodyTooLarge(f"the body is larger than {max_bytes} bytes")
    raw = bytes(buf)
    request._body = raw  # later `await request.body()` calls get the same bytes
    return raw


def _request_path(request: Request) -> str:
    """Path plus the sorted, decoded query, re-encoded: part of the fingerprint.

    Each name and value is percent-encoded again (`&`, `=` and `%` included), so
    `?a=b&c=d` and `?a=b%26c%3Dd` (one parameter whose value holds `&`) differ, and a
    second request with the other query is a 422, not the first one's replay.
    """
    query = sorted(request.query_params.multi_items())
    if not query:
        return request.url.path
    return request.url.path + "?" + "&".join(
        f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in query)


def inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """Inline `$defs` so the schema stands alone inside an OpenAPI operation."""
    defs = schema.pop("$defs", {})

    def resolve(node: Any, depth: int = 0) -> Any:
        if depth > 32:
            return {}
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(defs.get(ref.rsplit("/", 1)[-1], {}), depth + 1)
            return {k: resolve(v, depth) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v, depth) for v in node]
        return node

    return cast(dict[str, Any], resolve(schema))


_PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "title", "status", "detail"],
    "properties": {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {},
        "code": {"type": "string"},
        "errors": {"type": "array", "items": {"type": "object"}},
    },
}


def problem_openapi(description: str) -> dict[str, Any]:
    """An OpenAPI response object for a problem+json answer."""
    return {"description": description,
            "content": {PROBLEM_MEDIA_TYPE: {"schema": _PROBLEM_SCHEMA}}}


# -- the dependency -------------------------------------------------------------------

Work = Callable[[Connection, Claim], "Response | StoredResponse"]
#: `arun_in`'s work: awaited with the caller's async handle (e.g. an AsyncSession).
AsyncWork = Callable[[Any, Claim], Awaitable["Response | StoredResponse"]]
#: Whether a response's body may be kept for replays; called with everything `work`
#: returned (status, all its headers, body).
StoreBody = Callable[[StoredResponse], bool]


class Idempotency(Generic[M]):
    """FastAPI dependency for a JSON endpoint that requires an `Idempotency-Key`.

    `model` validates the parsed body (a pydantic model, dataclass, TypedDict, or `dict`
    for any JSON object); schema errors are a 422 with the pydantic `errors`. The
    engine defaults to `request.app.state.engine`. Use `openapi` as the route's
    `openapi_extra` so the documented body, header and errors match the behaviour.

    `same_request(body) -> str | None` (default: the guard's own `same_request`) names
    the request's business identity; `same_request_window` seconds (default: the
    guard's) is how far back another key with it counts; `suspect_header` adds
    `Idempotency-Suspected-Duplicate` to such answers. See the module docstring.
    """

    def __init__(
        self,
        model: type[M],
        *,
        engine: Engine | Callable[[Request], Engine] | None = None,
        guard: IdempotencyGuard | None = None,
        mode: Mode = "atomic",
        scope: Callable[[Request], str] = client_scope,
        max_body: int = DEFAULT_MAX_BODY,
        max_stored_body: int = DEFAULT_MAX_STORED_BODY,
        stored_headers: Iterable[str] = DEFAULT_STORED_HEADERS,
        fingerprint_headers: Iterable[str] = (),
        store_body: bool | StoreBody = True,
        same_request: Callable[[M], str | None] | None = None,
        same_request_window: float | None = None,
        suspect_header: bool = False,
    ) -> None:
        self.model = model
        self.adapter: TypeAdapter[M] = TypeAdapter(model)
        self.engine = engine
        self.guard = guard or IdempotencyGuard()
        self.mode: Mode = mode
        self.scope = scope
        self.max_body = max_body
        self.policy = ReplayPolicy(stored_headers=stored_headers,
                                   max_stored_body=max_stored_body)
        if not isinstance(store_body, bool) and not callable(store_body):
            raise ConfigurationError("store_body takes True, False or a predicate")
        self.store_body = store_body
        self.fingerprint_headers = tuple(h.lower() for h in fingerprint_headers)
        self.same_request = same_request
        self.same_request_window = same_request_window
        self.suspect_header = suspect_header

    @property
    def stored_headers(self) -> frozenset[str]:
        """The headers kept for replays (lowercase); never one of DENIED_STORED_HEADERS."""
        return self.policy.stored_headers

    @stored_headers.setter
    def stored_headers(self, names: Iterable[str]) -> None:
        self.policy.stored_headers = names

    @property
    def max_stored_body(self) -> int:
        """Bytes of a response body kept for replays at most (a stand-in beyond)."""
        return self.policy.max_stored_body

    @max_stored_body.setter
    def max_stored_body(self, value: int) -> None:
        self.policy.max_stored_body = value

    async def __call__(self, request: Request) -> IdempotentRequest[M]:
        """Validate everything a client can get wrong; no database work happens here."""
        try:
            scope = self.scope(request)  # who first: a 401 before any other complaint
            key = parse_idempotency_key(request.headers.getlist("idempotency-key"))
            assert key is not None
            check_json_media_type(request)
            raw = await read_body(request, self.max_body)
            document = parse_json_body(raw, max_bytes=self.max_body)
        except InvalidInput as exc:
            raise Problem.from_error(exc) from None
        try:
            body = self.adapter.validate_python(document)
        except ValidationError as exc:
            errors = _plain_errors(
                {**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False))
            raise Problem(422, _summarise(errors), code="validation_error",
                          errors=errors) from None
        headers = {h: ",".join(request.headers.getlist(h)) for h in self.fingerprint_headers}
        digest = fingerprint(request.method, _request_path(request), document, headers)
        return IdempotentRequest(key=key, scope=scope, fingerprint=digest, body=body,
                                 document=document, engine=self._engine(request),
                                 config=self,
                                 business_key=self.guard.business_key(body, self.same_request))

    def _engine(self, request: Request) -> Engine:
        if isinstance(self.engine, Engine):
            return self.engine
        if self.engine is not None:
            return self.engine(request)
        engine = getattr(request.app.state, "engine", None)
        if not isinstance(engine, Engine):
            raise RuntimeError("set app.state.engine or pass engine= to Idempotency")
        return engine

    @property
    def openapi(self) -> dict[str, Any]:
        """`openapi_extra` for the route: the JSON body, the header and the errors."""
        schema = inline_refs(self.adapter.json_schema())
        return {
            "parameters": [{
                "name": "Idempotency-Key",
                "in": "header",
                "required": True,
                "description": "Printable ASCII, 1-255 characters, unique per request; "
                               "a retry sends the same key and gets the same answer.",
                # Printable ASCII minus '"' and ',' (a bare token, one key).
                "schema": {"type": "string", "minLength": 1, "maxLength": 255,
                           "pattern": "^[!#-+\\--~]+$"},
            }],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": schema}},
            },
            "responses": {
                "400": problem_openapi("Missing or malformed Idempotency-Key, or a body "
                                       "that is not strict JSON"),
                "409": problem_openapi("A request with this key is in progress; "
                                       "retry after `Retry-After` seconds"),
                "413": problem_openapi(f"The body is larger than {self.max_body} bytes"),
                "415": problem_openapi("The body is not UTF-8 application/json"),
                "422": problem_openapi("The body does not match the schema, or the key "
                                       "was used for a different request"),
                "503": problem_openapi("The database is unavailable; the outcome is "
                                       "unknown, retry with the same key"),
            },
        }

    # -- responses -------------------------------------------------------------------

    def to_stored(self, response: Response | StoredResponse) -> StoredResponse:
        """The storable form of what `work` returned: status, kept headers, body."""
        if isinstance(response, StoredResponse):
            return self.policy.to_stored(response)
        body = getattr(response, "body", None)
        if not isinstance(body, bytes):
            raise TypeError("idempotent work must return a Response with a body "
                            "(not a streaming response) or a StoredResponse")
        # Headers the response itself declares hop-by-hop (RFC 9110 §7.6.1).
        hop = frozenset(t.strip().lower() for v in response.headers.getlist("connection")
                        for t in v.split(","))
        return StoredResponse(response.status_code,
                              self.policy.keep_headers(response.headers.items(), hop), body)

    def keeps_body(self, response: Response | StoredResponse) -> bool:
        """Whether `store_body` lets this response's body be kept at rest for replays."""
        if isinstance(self.store_body, bool):
            return self.store_body
        if isinstance(response, StoredResponse):
            whole = StoredResponse(response.status,
                                   tuple((k.lower(), v) for k, v in response.headers),
                                   response.body)
        else:
            body = getattr(response, "body", b"")
            whole = StoredResponse(response.status_code, tuple(response.headers.items()),
                                   body if isinstance(body, bytes) else b"")
        return bool(self.store_body(whole))

    def replayable(self, full: StoredResponse, *, keep_body: bool = True) -> StoredResponse:
        """`full` itself, or the documented stand-in when its body is withheld or too big."""
        return self.policy.replayable(full, keep_body=keep_body)


def _flag_suspect(response: Response, config: Idempotency[Any], suspects: int) -> Response:
    """The opt-in header on a first execution that matched other keys; never stored."""
    if config.suspect_header and suspects > 0:
        response.headers[SUSPECTED_DUPLICATE_HEADER] = str(suspects)
    return response


def to_response(stored: StoredResponse, *, replayed: bool) -> Response:
    """Build the HTTP response from the stored form (the same bytes every time)."""
    response = Response(content=stored.body, status_code=stored.status)
    response.raw_headers.extend(
        (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in stored.headers)
    if replayed:
        response.raw_headers.append((REPLAYED_HEADER.lower().encode(), b"true"))
    return response


def _database_problem(exc: DBAPIError | psycopg.Error) -> Problem | None:
    """Transient database failures become retryable answers; anything else stays a 500.

    A lock timeout or an exhausted serialization retry rolled back (409: retry, the
    key is free). A lost connection may have lost the COMMIT's answer (503: retry with
    the same key; it resolves to a replay or to one execution). SQLAlchemy's wrapped
    errors and psycopg's own (a psycopg handle in `run_in`) alike.
    """
    if sqlstate(exc) in ("55P03", "40001", "40P01"):
        return Problem(409, "the request collided with a concurrent one and was rolled "
                       "back; retry", code="transaction_conflict", headers={"Retry-After": "1"})
    if isinstance(exc, OperationalError | psycopg.OperationalError) or (
            isinstance(exc, DBAPIError) and exc.connection_invalidated):
        return Problem(503, "the database is unavailable; the outcome is unknown, retry "
                       "with the same Idempotency-Key", code="outcome_unknown",
                       headers={"Retry-After": "1"})
    return None


@dataclass(frozen=True, slots=True)
class IdempotentRequest(Generic[M]):
    """A validated request: its key, scope, fingerprint and typed body."""

    key: str
    scope: str
    fingerprint: str
    body: M
    document: Any
    engine: Engine
    config: Idempotency[M]
    # The hash of the body's business identity (`same_request`), if one is declared.
    business_key: str | None = None

    def run(self, work: Work) -> Response:
        """Run `work(conn, claim)` at most once for this key; blocking (use in `def`).

        `work` writes business rows and `enqueue(conn, ..., claim=claim)` effects and
        returns the response to store. Raising from `work` rolls everything back and
        stores nothing.
        """
        cfg = self.config
        sent: list[tuple[StoredResponse, Response | StoredResponse]] = []

        def guarded(conn: Connection, claim: Claim) -> StoredResponse:
            original = work(conn, claim)
            full = cfg.to_stored(original)
            sent[:] = [(full, original)]
            return cfg.replayable(full, keep_body=cfg.keeps_body(original))

        try:
            result = cfg.guard.run(self.engine, self.scope, self.key, self.fingerprint,
                                   guarded, mode=cfg.mode, business_key=self.business_key,
                                   same_request_window=cfg.same_request_window)
        except IdempotencyConflict as exc:
            raise Problem.from_error(exc) from None
        except DBAPIError as exc:
            problem = _database_problem(exc)
            if problem is None:
                raise
            raise problem from exc
        crashpoint("after_commit_before_response")
        if result.replayed or not sent:
            return to_response(result.response, replayed=result.replayed)
        full, original = sent[0]
        response = to_response(full, replayed=False)
        if isinstance(original, Response):
            response.background = original.background  # runs once, after the first answer
        return _flag_suspect(response, cfg, result.suspected_duplicates)

    async def arun(self, work: Work) -> Response:
        """`run` in a worker thread, for `async def` endpoints."""
        return await run_in_threadpool(self.run, work)

    # -- in the application's own transaction (atomic mode) ---------------------------

    def _finish(self, result: Result,
                sent: list[tuple[StoredResponse, Response | StoredResponse]]) -> Response:
        crashpoint("after_commit_before_response")
        if result.replayed or not sent:
            return to_response(result.response, replayed=result.replayed)
        full, original = sent[0]
        response = to_response(full, replayed=False)
        if isinstance(original, Response):
            response.background = original.background
        return response

    def _problem(self, exc: Exception) -> Exception:
        if isinstance(exc, IdempotencyConflict):
            return Problem.from_error(exc)
        if isinstance(exc, DBAPIError | psycopg.Error):
            return _database_problem(exc) or exc
        return exc

    def run_in(self, handle: Any, work: Work) -> Response:
        """Run `work(handle, claim)` at most once, in YOUR session or connection.

        `handle` is the application's own `Session` / `Connection` / psycopg
        `Connection` (FastAPI dependency injection as usual): the key, the business
        rows and the effects commit together in its transaction, which this method
        commits before answering (an answer sent before the commit could promise a
        payment that then rolls back). Atomic mode; serialization failures and
        deadlocks roll back and run again (5 tries).
        """
        cfg = self.config
        sent: list[tuple[StoredResponse, Response | StoredResponse]] = []
        held = False
        try:
            with cfg.guard.in_flight(handle, self.scope, self.key, self.fingerprint):
                held = True
                return self._run_in(handle, work, sent)
        except Exception as exc:
            if not held:  # a twin runs here: the session is left as the database path
                handle.rollback()  # leaves it, rolled back
            mapped = self._problem(exc)
            if mapped is exc:
                raise
            raise mapped from exc

    def _run_in(self, handle: Any, work: Work,
                sent: list[tuple[StoredResponse, Response | StoredResponse]]) -> Response:
        """`run_in`'s transaction, retried, once the key is held as in flight here."""
        cfg = self.config
        for attempt in Retrying(**_retrying()):
            with attempt:
                try:
                    begun = cfg.guard.begin(
                        handle, self.scope, self.key, self.fingerprint,
                        business_key=self.business_key,
                        same_request_window=cfg.same_request_window)
                    if isinstance(begun, StoredResponse):
                        handle.commit()
                        return self._finish(Result(begun, replayed=True), sent)
                    original = work(handle, begun)
                    full = cfg.to_stored(original)
                    stored = cfg.replayable(full, keep_body=cfg.keeps_body(original))
                    cfg.guard.complete(handle, begun, stored)
                    handle.commit()
                except BaseException:
                    handle.rollback()
                    raise
                sent[:] = [(full, original)]
                return _flag_suspect(self._finish(Result(stored, replayed=False), sent),
                                     cfg, begun.suspected_duplicates)
        raise AssertionError("unreachable")  # pragma: no cover

    async def arun_in(self, handle: Any, work: AsyncWork) -> Response:
        """`run_in` for `async def` endpoints: the app's `AsyncSession`, SQLAlchemy
        `AsyncConnection` or psycopg `AsyncConnection`; `work` is awaited."""
        cfg = self.config
        sent: list[tuple[StoredResponse, Response | StoredResponse]] = []
        held = False
        try:
            with cfg.guard.in_flight(handle, self.scope, self.key, self.fingerprint):
                held = True
                return await self._arun_in(handle, work, sent)
        except Exception as exc:
            if not held:
                await handle.rollback()
            mapped = self._problem(exc)
            if mapped is exc:
                raise
            raise mapped from exc

    async def _arun_in(self, handle: Any, work: AsyncWork,
                       sent: list[tuple[StoredResponse, Response | StoredResponse]]
                       ) -> Response:
        """`arun_in`'s transaction, retried, once the key is held as in flight here."""
        cfg = self.config
        async for attempt in AsyncRetrying(**_retrying()):
            with attempt:
                try:
                    begun = await cfg.guard.abegin(
                        handle, self.scope, self.key, self.fingerprint,
                        business_key=self.business_key,
                        same_request_window=cfg.same_request_window)
                    if isinstance(begun, StoredResponse):
                        await handle.commit()
                        return self._finish(Result(begun, replayed=True), sent)
                    original = await work(handle, begun)
                    full = cfg.to_stored(original)
                    stored = cfg.replayable(full, keep_body=cfg.keeps_body(original))
                    await cfg.guard.acomplete(handle, begun, stored)
                    await handle.commit()
                except BaseException:
                    await handle.rollback()
                    raise
                sent[:] = [(full, original)]
                return _flag_suspect(self._finish(Result(stored, replayed=False), sent),
                                     cfg, begun.suspected_duplicates)
        raise AssertionError("unreachable")  # pragma: no cover
