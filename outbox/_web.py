"""The web contract of the idempotency layer, free of any web framework.

What outbox.http (FastAPI/Starlette) and outbox.contrib.django share: problem+json
codes and constants, the stored-header and replay-size policy, the key scopes read
from headers, the JSON media-type rule and validation-error summaries. It imports no
framework, so `pg-outbox[django]` works without FastAPI and Starlette installed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from http import HTTPStatus
from typing import Any, Protocol, Self
from urllib.parse import quote

from outbox._idempotency import StoredResponse
from outbox.errors import (
    ClaimLost,
    ConfigurationError,
    IdempotencyConflict,
    InvalidInput,
    InvalidTenant,
    RequestInProgress,
    Unauthenticated,
    UnsupportedMediaType,
)


class HasHeaders(Protocol):
    """A request as the helpers here read it: Starlette's, or a Django request's view."""

    @property
    def headers(self) -> Any: ...


PROBLEM_MEDIA_TYPE = "application/problem+json"
REPLAYED_HEADER = "Idempotent-Replayed"
OMITTED_HEADER = "Idempotent-Replay-Omitted"
#: Opt-in (`suspect_header=True`): on a first execution, how many other keys of the same
#: scope carried the same business request within the window. Never stored or replayed.
SUSPECTED_DUPLICATE_HEADER = "Idempotency-Suspected-Duplicate"
DEFAULT_MAX_STORED_BODY = 1_048_576
DEFAULT_STORED_HEADERS: tuple[str, ...] = (
    "content-type", "content-language", "content-location", "location", "etag",
    "last-modified", "link", "cache-control",
)
#: Never stored or replayed, and refused in `stored_headers` (a ConfigurationError, not
#: a silent drop): per-caller credentials and challenges, which replayed would hand one
#: client's session to another; hop-by-hop headers (RFC 9110 §7.6.1), which belong to
#: one connection; framing, recomputed for every answer; and the library's own
#: replay markers. Every `proxy-*` header is refused too (`_denied_reason`).
DENIED_STORED_HEADERS: frozenset[str] = frozenset({
    "set-cookie", "set-cookie2", "www-authenticate", "authentication-info",
    "connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade",
    "content-length", REPLAYED_HEADER.lower(), OMITTED_HEADER.lower(),
})
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9a-z-]+$")  # an RFC 9110 token, lowercased
# A tag URI (RFC 4151) is absolute without pretending a web page exists at it; clients
# must not dereference problem types anyway (RFC 9457 §3.1.1). `code` carries the same.
PROBLEM_TYPE_BASE = "tag:pg-outbox,2025:problem:"
MAX_TENANT_LENGTH = 200


def problem_type(code: str | None) -> str:
    """The `type` URI for a problem code; `about:blank` for a plain HTTP status."""
    return f"{PROBLEM_TYPE_BASE}{code}" if code else "about:blank"


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"

class Problem(Exception):
    """An HTTP error with a problem code (RFC 9457), whatever framework answers it.

    outbox.http's `Problem` is this and Starlette's HTTPException at once; the Django
    integration renders this one itself.
    """

    def __init__(self, status: int, detail: str, *, code: str | None = None,
                 title: str | None = None, headers: Mapping[str, str] | None = None,
                 **members: Any) -> None:
        super().__init__(detail)
        self.status_code = status
        self.detail = detail
        self.headers: Mapping[str, str] | None = dict(headers) if headers is not None else None
        self.code = code
        self.title = title
        self.members = members

    @classmethod
    def from_error(cls, exc: InvalidInput | IdempotencyConflict) -> Self:
        """Map a library error (each carries `.status` and `.code`) to a Problem."""
        headers: dict[str, str] = {}
        if isinstance(exc, RequestInProgress):
            headers["Retry-After"] = str(exc.retry_after)
        elif isinstance(exc, ClaimLost):
            headers["Retry-After"] = "1"
        elif isinstance(exc, UnsupportedMediaType):
            headers["Accept-Encoding"] = "identity"
        elif isinstance(exc, Unauthenticated):
            headers["WWW-Authenticate"] = "Bearer"
        return cls(exc.status, str(exc), code=exc.code, headers=headers or None)


def _plain_errors(errors: Iterable[Any]) -> list[dict[str, Any]]:
    """Pydantic errors without `input`/`ctx`: they may echo huge or unserialisable data."""
    out: list[dict[str, Any]] = []
    for err in errors:
        if isinstance(err, Mapping):
            out.append({"type": str(err.get("type", "value_error")),
                        "loc": [p if isinstance(p, int) else str(p) for p in err.get("loc", ())],
                        "msg": str(err.get("msg", ""))})
    return out


def _summarise(errors: list[dict[str, Any]]) -> str:
    if not errors:
        return "the request is invalid"
    first = errors[0]
    where = ".".join(str(p) for p in first["loc"])
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {first['msg']}{more}" if where else f"{first['msg']}{more}"


# -- scopes and media type (read from headers) ----------------------------------------


def _tenant_part(request: HasHeaders) -> str | None:
    tenants = request.headers.getlist("x-tenant")
    if len(tenants) > 1:
        raise InvalidTenant("send at most one X-Tenant header")
    if not tenants:
        return None
    tenant = tenants[0].strip()
    if not tenant or len(tenant) > MAX_TENANT_LENGTH or not all(
            0x20 <= ord(c) <= 0x7E for c in tenant):
        raise InvalidTenant(
            f"X-Tenant must be 1-{MAX_TENANT_LENGTH} printable ASCII characters")
    return _encoded("tenant", tenant)


def _encoded(kind: str, value: str) -> str:
    """`kind:value` with `value` percent-encoded: no part can spell a `|` or a `:`."""
    return f"{kind}:{quote(value, safe='')}"


def _with_tenant(request: HasHeaders, scope: str) -> str:
    tenant = _tenant_part(request)
    return f"{tenant}|{scope}" if tenant else scope


def shared_scope(request: HasHeaders) -> str:
    """One key space for every client: the explicit choice of an app with no identity."""
    return "shared"


def header_scope(name: str) -> Callable[[Any], str]:
    """Scope by a header your gateway sets after authenticating (never a client's own).

    A request without it is a 400: silently sharing a scope is how one client's key
    replays another client's response.
    """
    header = name.lower()

    def scope(request: HasHeaders) -> str:
        values = request.headers.getlist(header)
        if len(values) != 1 or not values[0].strip() or len(values[0]) > MAX_TENANT_LENGTH \
                or not all(0x20 <= ord(c) <= 0x7E for c in values[0]):
            raise InvalidTenant(f"send exactly one {name} header of 1-{MAX_TENANT_LENGTH}"
                                " printable ASCII characters")
        return _encoded(header, values[0].strip())

    return scope


def check_json_media_type(request: HasHeaders) -> None:
    """JSON only, UTF-8 only, no content coding: anything else is a 415 (B27)."""
    ctype = request.headers.get("content-type")
    if ctype is not None:
        media, _, params = ctype.partition(";")
        media = media.strip().lower()
        if media != "application/json" and not (
                media.startswith("application/") and media.endswith("+json")):
            raise UnsupportedMediaType(f"send application/json, not {media or 'nothing'!r}")
        for param in params.split(";"):
            name, _, value = param.partition("=")
            if name.strip().lower() == "charset" and \
                    value.strip().strip('"').lower() not in ("utf-8", "utf8"):
                raise UnsupportedMediaType("JSON bodies must be UTF-8")
    for coding in request.headers.getlist("content-encoding"):
        if coding.strip().lower() not in ("", "identity"):
            raise UnsupportedMediaType("compressed request bodies are not accepted")


# -- what a key keeps for replays -------------------------------------------------------


def _denied_reason(name: str) -> str | None:
    """Why a (lowercased) header must never be stored, or None."""
    if name in ("set-cookie", "set-cookie2", "www-authenticate", "authentication-info"):
        return "it belongs to one caller's session or credentials"
    if name.startswith("proxy-"):
        return "Proxy-* headers belong to one caller and one hop"
    if name in (REPLAYED_HEADER.lower(), OMITTED_HEADER.lower()):
        return "the library sets it on every answer"
    if name in DENIED_STORED_HEADERS:
        return "hop-by-hop and framing headers belong to one connection"
    return None


def _checked_stored_headers(names: Iterable[str]) -> frozenset[str]:
    """`names` lowercased, or a ConfigurationError naming every header refused."""
    if isinstance(names, str):
        raise ConfigurationError("stored_headers takes a list of header names, not one string")
    kept: set[str] = set()
    refused: list[str] = []
    for raw in names:
        name = raw.strip().lower() if isinstance(raw, str) else ""
        if not _HEADER_NAME.match(name):
            raise ConfigurationError(f"stored_headers: {raw!r} is not a header name")
        reason = _denied_reason(name)
        if reason is not None:
            refused.append(f"{name} ({reason})")
        kept.add(name)
    if refused:
        raise ConfigurationError(
            "stored_headers: never stored or replayed to another caller, remove "
            + "; ".join(sorted(refused)))
    return frozenset(kept)


def unless_no_store(response: StoredResponse) -> bool:
    """`store_body=` policy: keep the body unless the response says `Cache-Control: no-store`.

    Lets one endpoint decide per answer: the response that reveals a secret marks
    itself `no-store` (which also keeps it out of HTTP caches) and is not kept at rest.
    """
    for name, value in response.headers:
        if name.lower() == "cache-control" and any(
                d.strip().split("=", 1)[0].strip().lower() == "no-store"
                for d in value.split(",")):
            return False
    return True


class ReplayPolicy:
    """Which response headers a key keeps for replays, and how big a body may be.

    `to_stored` keeps only `stored_headers` (never one of DENIED_STORED_HEADERS: a
    ConfigurationError names any asked for); `replayable` swaps a withheld or oversized
    body for a documented problem note, status and kept headers unchanged.
    """

    def __init__(self, *, stored_headers: Iterable[str] = DEFAULT_STORED_HEADERS,
                 max_stored_body: int = DEFAULT_MAX_STORED_BODY) -> None:
        self._stored_headers = _checked_stored_headers(stored_headers)
        self.max_stored_body = max_stored_body

    @property
    def stored_headers(self) -> frozenset[str]:
        """The headers kept for replays (lowercase); never one of DENIED_STORED_HEADERS."""
        return self._stored_headers

    @stored_headers.setter
    def stored_headers(self, names: Iterable[str]) -> None:
        self._stored_headers = _checked_stored_headers(names)

    def keep_headers(self, headers: Sequence[tuple[str, str]],
                     hop: frozenset[str] = frozenset()) -> tuple[tuple[str, str], ...]:
        """The kept (lowercased) headers, minus those the response declared hop-by-hop."""
        return tuple((k.lower(), v) for k, v in headers
                     if k.lower() in self._stored_headers and k.lower() not in hop)

    def to_stored(self, response: StoredResponse) -> StoredResponse:
        """The storable form of a response: status, kept headers, body."""
        return StoredResponse(response.status, self.keep_headers(response.headers),
                              response.body)

    def replayable(self, full: StoredResponse, *, keep_body: bool = True) -> StoredResponse:
        """`full` itself, or the documented stand-in when its body is withheld or too big."""
        if not keep_body and full.body:
            return self._stand_in(
                full, f"the request was processed with status {full.status}; its response "
                "body is not kept for replays (it may carry secrets), fetch the resource "
                "instead")
        if len(full.body) <= self.max_stored_body:
            return full
        return self._stand_in(
            full, f"the request succeeded with status {full.status}, but its "
            f"{len(full.body)}-byte response exceeds the {self.max_stored_body}-byte "
            "replay limit; fetch the resource instead", original_size=len(full.body))

    @staticmethod
    def _stand_in(full: StoredResponse, detail: str, **members: Any) -> StoredResponse:
        """What a replay gets instead of the body: status, kept headers, a problem note."""
        note = {
            "type": problem_type("response_not_stored"),
            "title": "Response not stored",
            "status": full.status,
            "detail": detail,
            "code": "response_not_stored",
            "original_status": full.status,
            **members,
        }
        headers = tuple((k, v) for k, v in full.headers if k != "content-type")
        return StoredResponse(
            full.status,
            (*headers, ("content-type", PROBLEM_MEDIA_TYPE), (OMITTED_HEADER.lower(), "body")),
            json.dumps(note, separators=(",", ":")).encode())
