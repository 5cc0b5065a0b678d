"""Effect handlers: a registry by kind, and the built-in HTTP handler.

A handler receives an `EffectContext` and returns a JSON-able summary (stored on the
effect) or raises: `RetryAfter`, `PermanentFailure`, `TransientFailure`,
`AmbiguousOutcome` from `outbox.errors`; any other exception is retried with backoff.
A handler may be `async def` (or return any awaitable): the dispatcher awaits it on its
own event loop and classifies the result the same way (dispatcher/_core.py `_await`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
from opentelemetry import propagate

from outbox.errors import (
    AmbiguousOutcome,
    ConfigurationError,
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


@dataclass(slots=True)
class Registration:
    handler: Handler
    retry_safe: bool = True  # False: the receiver cannot deduplicate on our key


@dataclass
class Registry:
    """Handlers by effect kind."""

    handlers: dict[str, Registration] = field(default_factory=dict)

    def register(self, kind: str, handler: Handler, *, retry_safe: bool = True) -> None:
        """`retry_safe=False` parks ambiguous outcomes (`needs_review`) instead of retrying.

        `handler` may be a coroutine function: the dispatcher awaits it on its event
        loop, so a delivery is recorded only once the body has run.
        """
        self.handlers[kind] = Registration(handler, retry_safe)

    def handler(self, kind: str, *, retry_safe: bool = True) -> Callable[[Handler], Handler]:
        def decorate(fn: Handler) -> Handler:
            self.register(kind, fn, retry_safe=retry_safe)
            return fn
        return decorate

    def get(self, kind: str) -> Registration | None:
        return self.handlers.get(kind)


def _retry_after_seconds(value: str | None) -> float | None:
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
    return max(0.0, (when - datetime.now(when.tzinfo)).total_seconds())


RETRYABLE_STATUSES = frozenset({408, 409, 425, 429})


def _summary(response: httpx.Response) -> dict[str, Any]:
    text = response.text
    return {"status": response.status_code, "body": text[:512]}


class HttpHandler:
    """POST the payload as JSON with `Idempotency-Key: <effect key>`.

    2xx: delivered. 408/409/425/429 and 5xx: retried (honouring Retry-After).
    Other 4xx: permanent. A timeout or reset after the request was sent is ambiguous:
    the receiver may have applied it, so it is retried with the same key.
    """

    def __init__(self, url: str, *, timeout: float = 10.0,
                 headers: dict[str, str] | None = None,
                 client: httpx.Client | None = None) -> None:
        self.url = url
        self.timeout = timeout
        self.headers = dict(headers or {})
        self.client = client or httpx.Client(
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=32))

    def __call__(self, effect: EffectContext) -> Any:
        import time

        headers = dict(self.headers)
        headers["Idempotency-Key"] = effect.key
        headers["X-Outbox-Attempt"] = str(effect.attempt)
        propagate.inject(headers)  # traceparent of the current deliver span
        remaining = effect.deadline - time.monotonic()
        timeout = max(0.1, min(self.timeout, remaining))
        try:
            response = self.client.post(self.url, json=effect.payload, headers=headers,
                                        timeout=timeout)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise TransientFailure(f"could not connect: {exc!r}") from exc
        except (httpx.TimeoutException, httpx.RemoteProtocolError, httpx.ReadError) as exc:
            raise AmbiguousOutcome(f"no answer after sending: {exc!r}") from exc
        except httpx.HTTPError as exc:
            raise AmbiguousOutcome(f"HTTP error after sending: {exc!r}") from exc
        status = response.status_code
        summary = _summary(response)
        if 200 <= status < 300:
            return summary
        message = f"HTTP {status} from {self.url}"
        if status in RETRYABLE_STATUSES or status >= 500:
            delay = _retry_after_seconds(response.headers.get("Retry-After"))
            if delay is not None:
                raise RetryAfter(delay, message, http_status=status, detail=summary)
            raise TransientFailure(message, http_status=status, detail=summary)
        raise PermanentFailure(message, http_status=status, detail=summary)


def load_registry(spec: str | None = None) -> Registry:
    """Import `module:attribute` (a Registry, or a function returning one).

    Default: `$OUTBOX_HANDLERS`, else the payments example's registry, which routes
    `psp.charge` and `email.receipt` to `$PSP_URL`.
    """
    spec = spec or os.environ.get("OUTBOX_HANDLERS") or "examples.payments.handlers:registry"
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
