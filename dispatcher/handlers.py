"""Effect handlers: a registry by kind, and the built-in HTTP handler.

A handler receives an `EffectContext` and returns a JSON-able summary (stored on the
effect) or raises: `RetryAfter`, `PermanentFailure`, `TransientFailure`,
`AmbiguousOutcome` from `outbox.errors`; any other exception is retried with backoff.
A handler may be `async def` (or return any awaitable): the dispatcher awaits it on its
own event loop and classifies the result the same way (dispatcher/_core.py `_await`).
"""

from __future__ import annotations

import importlib
import math
import os
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Any

import httpcore
import httpx
from opentelemetry import propagate

from outbox._enqueue import check_effect_key
from outbox._redact import redact_secrets
from outbox._telemetry import tracing_enabled
from outbox.errors import (
    AmbiguousOutcome,
    ConfigurationError,
    InvalidInput,
    PermanentFailure,
    RetryAfter,
    TransientFailure,
)


@dataclass(frozen=True, slots=True)
class EffectContext:
    """One attempt at one effect, as a handler sees it."""

    id: int
    key: str          # send this as the receiver's Idempotency-Key
    kind: str
    payload: Any
    attempt: int      # 1 for the first attempt
    max_attempts: int
    deadline: float   # time.monotonic() by which the handler must have returned
    #                   (an async handler still running then is cancelled: ambiguous)
    created_at: datetime
    ordering_key: str | None = None


# Sync, or async: an awaitable result is awaited before the delivery is recorded.
Handler = Callable[[EffectContext], Any] | Callable[[EffectContext], Awaitable[Any]]


# A retry is sent only within this share of the receiver's key retention: the rest is
# the margin for the clocks and the attempt's own time on the way.
KEY_RETENTION_SHARE = 0.9


@dataclass(slots=True)
class Registration:
    handler: Handler
    retry_safe: bool = True  # False: the receiver cannot deduplicate on our key
    # Seconds the receiver remembers an Idempotency-Key (Stripe: 24 h); None: forever.
    key_retention: float | None = None

    def retry_until(self, first_claimed_at: datetime, retry_until: datetime | None
                    ) -> datetime | None:
        """The effect's `retry_until`, or sooner: an attempt must reach the receiver
        while it still knows the key. Counted from the effect's first claim, the
        earliest the receiver can have seen the key, so never late; at most
        KEY_RETENTION_SHARE of the retention."""
        if self.key_retention is None:
            return retry_until
        horizon = first_claimed_at + timedelta(
            seconds=KEY_RETENTION_SHARE * self.key_retention)
        return horizon if retry_until is None else min(horizon, retry_until)


@dataclass
class Registry:
    """Handlers by effect kind."""

    handlers: dict[str, Registration] = field(default_factory=dict)

    def register(self, kind: str, handler: Handler, *, retry_safe: bool = True,
                 key_retention: float | None = None) -> None:
        """`retry_safe=False` parks ambiguous outcomes (`needs_review`) instead of retrying.

        `key_retention`: how long the receiver remembers an Idempotency-Key, in seconds
        (Stripe: 86 400). Past it a retry is a new request to the receiver, which would
        apply the effect again if an earlier attempt was applied. No attempt of this
        kind is scheduled or sent later than 90 % of it after the effect's first claim
        (lease rescues and bulk redrives included): a retry that would be is never
        scheduled (dead letter); one due later is not sent, and the effect is parked
        for review (`KeyRetentionPassed`), for an operator to check with the receiver
        before `outbox retry <id>`, which then sends it as a first contact. A first
        attempt is sent however old the effect: the retention counts from its claim.

        `handler` may be a coroutine function: the dispatcher awaits it on its event
        loop, so a delivery is recorded only once the body has run.
        """
        if key_retention is not None and (
                isinstance(key_retention, bool) or not isinstance(key_retention, int | float)
                or not 0 < key_retention < math.inf):
            raise ValueError("key_retention is a positive number of seconds, or None")
        self.handlers[kind] = Registration(
            handler, retry_safe, None if key_retention is None else float(key_retention))

    def handler(self, kind: str, *, retry_safe: bool = True,
                key_retention: float | None = None) -> Callable[[Handler], Handler]:
        def decorate(fn: Handler) -> Handler:
            self.register(kind, fn, retry_safe=retry_safe, key_retention=key_retention)
            return fn
        return decorate

    def get(self, kind: str) -> Registration | None:
        return self.handlers.get(kind)


def _retry_after_seconds(value: str | None, date: str | None = None) -> float | None:
    """Retry-After as seconds. An HTTP-date is measured against the reply's own `Date`
    (both the receiver's clock), not this host's clock, which may be off (F32); only a
    reply without a usable `Date` falls back on ours."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    reference: datetime | None = None
    if date:
        try:
            reference = parsedate_to_datetime(date)
        except (TypeError, ValueError):
            reference = None
    # An HTTP-date is GMT; a form parsed without a zone (asctime) is taken as UTC too.
    when = when if when.tzinfo is not None else when.replace(tzinfo=UTC)
    if reference is None:
        reference = datetime.now(UTC)
    elif reference.tzinfo is None:
        reference = reference.replace(tzinfo=UTC)
    return max(0.0, (when - reference).total_seconds())


RETRYABLE_STATUSES = frozenset({408, 409, 425, 429})


# -- the attempt's deadline, enforced on every socket operation ---------------------
#
# httpx's timeout bounds each read, write and connect on its own: a receiver trickling
# one byte every 0.5 s never trips a 1 s timeout, and kept an attempt running (and its
# worker slot taken) for as long as it liked. The handler sets the attempt's deadline
# for its thread; the network backend below gives every socket operation of that
# thread at most the time left, and refuses one past it (an httpcore timeout, which
# httpx maps to its own). Without a deadline set it changes nothing.

_deadline = threading.local()


def _bounded(timeout: float | None, error: type[Exception]) -> float | None:
    at: float | None = getattr(_deadline, "at", None)
    if at is None:
        return timeout
    left = at - time.monotonic()
    if left <= 0:
        raise error("the attempt's deadline passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _bounded(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _bounded(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.start_tls(
            ssl_context, server_hostname, _bounded(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self, inner: httpcore.NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.connect_tcp(
            host, port, _bounded(timeout, httpcore.ConnectTimeout), local_address,
            socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None
                            ) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.connect_unix_socket(
            path, _bounded(timeout, httpcore.ConnectTimeout), socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def instrument_client(client: httpx.Client) -> bool:
    """Give `client` the maintained httpx instrumentation when it is installed
    (`pg-outbox[otel]`) and spans are recorded in this process (`tracing_enabled`: its
    wrapper costs ~0.45 ms of CPU per request even when every span is a no-op): a
    CLIENT span per request by the HTTP conventions, and the traceparent of that span
    in the request. True when requests through `client` are traced that way (httpx
    instrumented globally counts); False: the caller injects the traceparent itself.
    """
    if not tracing_enabled():
        return False
    try:
        from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
    except ImportError:
        return False
    if HTTPXClientInstrumentor().is_instrumented_by_opentelemetry:
        return True  # HTTPXClientInstrumentor().instrument(): every transport is wrapped
    if not getattr(client, "_is_instrumented_by_opentelemetry", False):
        HTTPXClientInstrumentor.instrument_client(client)
    return True


def install_deadlines(client: httpx.Client) -> bool:
    """Make `client`'s connections honour the attempt deadline `HttpHandler` sets.

    Wraps the network backend of each of its httpx transports (proxies included);
    True if every one was reached. A custom transport (a MockTransport, say) is left
    alone: then only the reply's body is bounded by the deadline, between chunks.
    """
    ok = True
    for transport in (client._transport, *client._mounts.values()):
        if transport is None:
            continue
        pool = getattr(transport, "_pool", None)
        backend = getattr(pool, "_network_backend", None)
        if not isinstance(backend, httpcore.NetworkBackend):
            ok = False
            continue
        if not isinstance(backend, _DeadlineBackend):
            pool._network_backend = _DeadlineBackend(backend)  # type: ignore[union-attr]
    return ok


#: Bytes of a reply read at most; the rest is never read (the connection is closed).
MAX_REPLY_BYTES = 64 * 1024
#: Characters of the reply kept in the stored summary.
SUMMARY_CHARS = 512


def _summary(status: int, body: str, truncated: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"status": status, "body": body[:SUMMARY_CHARS]}
    if truncated:
        out["truncated"] = True
    return out


def classify_reply(status: int, body: str, truncated: bool, retry_after: str | None,
                   shown_url: str, date: str | None = None) -> dict[str, Any]:
    """The receiver's answer as an outcome, for every HTTP handler: 2xx returns the
    stored summary; 408/409/425/429 and 5xx raise a retry (RetryAfter when the reply
    says when); any other status raises PermanentFailure."""
    summary = _summary(status, body, truncated)
    if 200 <= status < 300:
        return summary
    message = f"HTTP {status} from {shown_url}"
    if status in RETRYABLE_STATUSES or status >= 500:
        delay = _retry_after_seconds(retry_after, date)
        if delay is not None:
            raise RetryAfter(delay, message, http_status=status, detail=summary)
        raise TransientFailure(message, http_status=status, detail=summary)
    raise PermanentFailure(message, http_status=status, detail=summary)


class HttpHandler:
    """POST the payload as JSON with `Idempotency-Key: <effect key>`.

    2xx: delivered. 408/409/425/429 and 5xx: retried (honouring Retry-After).
    Other 4xx: permanent. A timeout or reset after the request was sent is ambiguous:
    the receiver may have applied it, so it is retried with the same key (or parked
    for review when the kind is not retry-safe).

    `timeout` bounds the whole attempt, not each read: connect, send, the status and
    headers and the reply's body must all fit in it (and in the effect's deadline).
    Past it before the status line and headers are complete, the attempt is
    ambiguous; past it while the body arrives, the status decides and the body read so
    far is kept. Only the first `max_reply_bytes` of a reply are read (then the
    connection is closed): a huge reply costs no memory. Credentials in the URL
    (`https://user:pass@host/...`) are sent as an `Authorization: Basic` header and
    appear nowhere else: not in errors, attempts, spans or logs.
    """

    def __init__(self, url: str, *, timeout: float = 10.0,
                 headers: dict[str, str] | None = None,
                 client: httpx.Client | None = None,
                 max_reply_bytes: int = MAX_REPLY_BYTES) -> None:
        if timeout <= 0 or max_reply_bytes < 0:
            raise ConfigurationError("timeout must be > 0 and max_reply_bytes >= 0")
        parsed = httpx.URL(url)
        self._auth: httpx.Auth | None = None
        if parsed.userinfo:
            self._auth = httpx.BasicAuth(parsed.username, parsed.password)
            parsed = parsed.copy_with(username=None, password=None)
            url = str(parsed)
        self.url = url  # never holds credentials
        self._shown_url = redact_secrets(url)
        self.timeout = timeout
        self.max_reply_bytes = max_reply_bytes
        self.headers = dict(headers or {})
        self.client = client or httpx.Client(
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=32))
        install_deadlines(self.client)
        # Our own client gets the httpx instrumentation; a client the caller passes is
        # theirs to instrument (we only notice whether it is).
        self._traced = (instrument_client(self.client) if client is None else
                        getattr(self.client, "_is_instrumented_by_opentelemetry", False))

    def __repr__(self) -> str:
        return f"HttpHandler({self._shown_url!r}, timeout={self.timeout:g})"

    def __call__(self, effect: EffectContext) -> Any:
        try:
            check_effect_key(effect.key)
        except InvalidInput as exc:  # a row written before enqueue checked keys
            raise PermanentFailure(str(exc)) from None
        headers = dict(self.headers)
        headers["Idempotency-Key"] = effect.key
        headers["X-Outbox-Attempt"] = str(effect.attempt)
        headers["Accept-Encoding"] = "identity"  # a prefix of the raw bytes is readable
        if not self._traced:  # else the instrumentation's CLIENT span injects its own
            propagate.inject(headers)  # traceparent of the current deliver span
        deadline = min(effect.deadline, time.monotonic() + self.timeout)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransientFailure("the attempt's deadline passed before sending")
        previous = getattr(_deadline, "at", None)
        _deadline.at = deadline if previous is None else min(previous, deadline)
        auth: Any = self._auth if self._auth is not None else httpx.USE_CLIENT_DEFAULT
        try:
            with self.client.stream("POST", self.url, json=effect.payload, headers=headers,
                                    timeout=remaining, auth=auth) as response:
                status = response.status_code
                body, truncated = self._read_prefix(response, deadline)
                retry_after = response.headers.get("Retry-After")
                date = response.headers.get("Date")
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise TransientFailure(redact_secrets(f"could not connect: {exc!r}")) from exc
        except (httpx.TimeoutException, httpx.RemoteProtocolError, httpx.ReadError) as exc:
            why = "no answer after sending"
            if time.monotonic() >= deadline - 0.01:
                why = f"no answer by the attempt's deadline ({self.timeout:g} s at most)"
            raise AmbiguousOutcome(redact_secrets(f"{why}: {exc!r}")) from exc
        except httpx.HTTPError as exc:
            raise AmbiguousOutcome(redact_secrets(f"HTTP error after sending: {exc!r}")
                                   ) from exc
        finally:
            _deadline.at = previous
        return classify_reply(status, body, truncated, retry_after, self._shown_url, date)

    def _read_prefix(self, response: httpx.Response, deadline: float) -> tuple[str, bool]:
        """The reply's first `max_reply_bytes`, decoded; True if more was left unread.

        The status and headers are in: from here on the receiver has answered, so a
        deadline or a broken connection while the body arrives only cuts the body.
        """
        prefix = bytearray()
        truncated = False
        try:
            for chunk in response.iter_raw():
                room = self.max_reply_bytes - len(prefix)
                prefix += chunk[:room]
                if len(chunk) > room or time.monotonic() >= deadline:
                    truncated = True
                    break
        except httpx.StreamConsumed:  # a transport that hands over a read body (mocks)
            prefix = bytearray(response.content[:self.max_reply_bytes])
            truncated = len(response.content) > self.max_reply_bytes
        except (httpx.TimeoutException, httpx.TransportError):
            truncated = True
        encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            return f"<{encoding}-encoded reply, {len(prefix)} bytes read>", truncated
        try:
            text = bytes(prefix).decode(response.encoding or "utf-8", errors="replace")
        except LookupError:
            text = bytes(prefix).decode("utf-8", errors="replace")
        return text, truncated


def load_registry(spec: str | None = None) -> Registry:
    """Import `module:attribute` (a Registry, or a function returning one).

    Default: `$OUTBOX_HANDLERS`, else the payments example's registry, which routes
    `psp.charge` and `email.receipt` to `$PSP_URL`.
    """
    spec = (spec or os.environ.get("OUTBOX_HANDLERS")
            or "dispatcher.examples.payments.handlers:registry")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
        obj = getattr(module, attr or "registry")
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"cannot load handlers {spec!r}: {exc}") from None
    registry = obj() if callable(obj) and not isinstance(obj, Registry) else obj
    if not isinstance(registry, Registry):
        raise ConfigurationError(f"{spec!r} is not a dispatcher.handlers.Registry")
    return registry
