"""`AsyncHttpHandler`: HttpHandler's contract on aiohttp, on the dispatcher's event loop.

Why a second HTTP handler: a delivery's cost is mostly the HTTP client's own CPU, and
httpx's pure-Python stack (h11, httpcore, anyio) spends about 0.8-1.3 ms of it per
POST on this project's box, where aiohttp (its HTTP parser in C) spends about 0.2-0.4
ms (docs/benchmarks.md, "HTTP delivery"). Being async, a delivery also holds no
thread while it waits: the dispatcher awaits it on its one event loop.

The contract is HttpHandler's, clause by clause (tests run the same cases on both):
2xx delivered; 408/409/425/429 and 5xx retried, honouring Retry-After; other 4xx
permanent; a failure before anything was sent (connect refused or timed out) is a
plain retry; one after sending (timeout, reset, a broken reply) is ambiguous, so the
next attempt carries the same key, or the effect is parked when the kind is not retry
safe. `timeout` bounds the whole attempt (and so does the effect's deadline); past it
while the body arrives, the status decides and the body read so far is kept; only the
first `max_reply_bytes` are read. Credentials in the URL travel as Basic auth and
appear nowhere else.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import time
from typing import Any

import aiohttp
from opentelemetry import propagate
from yarl import URL

from dispatcher.handlers import MAX_REPLY_BYTES, EffectContext, classify_reply
from outbox._enqueue import check_effect_key
from outbox._redact import redact_secrets
from outbox._telemetry import tracing_enabled
from outbox.errors import (
    AmbiguousOutcome,
    ConfigurationError,
    DeliveryError,
    InvalidInput,
    PermanentFailure,
    TransientFailure,
)

#: Seconds before the effect's deadline at which the handler's own timer ends the
#: attempt: the dispatcher cancels an async handler at the deadline itself, and that
#: cancellation must not win the race (it would turn a 2xx whose body was still
#: arriving into an ambiguous outcome).
DEADLINE_MARGIN = 0.05


class _Sending:
    """Per request: whether aiohttp wrote the request's headers (from then on the
    receiver may act on it; before, a failure is a plain retry)."""

    __slots__ = ("sent",)

    def __init__(self) -> None:
        self.sent = False


_NO_TIMEOUT = aiohttp.ClientTimeout(total=None)  # ours is the attempt's one deadline


def _before_status(exc: Exception, sending: _Sending, after_sending: str) -> DeliveryError:
    """A failure before the status came back: a plain retry if nothing reached the
    receiver, else ambiguous (`after_sending` says how)."""
    if not sending.sent:
        return TransientFailure(redact_secrets(f"could not send the request: {exc!r}"))
    return AmbiguousOutcome(redact_secrets(f"{after_sending}: {exc!r}"))


async def _headers_sent(session: aiohttp.ClientSession, context: Any, params: Any) -> None:
    mark = context.trace_request_ctx
    if isinstance(mark, _Sending):
        mark.sent = True


def _sending_config() -> aiohttp.TraceConfig:
    config = aiohttp.TraceConfig()
    config.on_request_headers_sent.append(_headers_sent)
    return config


#: The bytes httpx sends for `json=` (compact, UTF-8): both handlers send one body for
#: one payload, so a receiver that fingerprints raw bytes sees a retry as the same.
_json = functools.partial(json.dumps, ensure_ascii=False, separators=(",", ":"),
                          allow_nan=False)


def _trace_configs() -> tuple[list[Any], bool]:
    """The maintained aiohttp-client instrumentation's trace config, when installed: a
    CLIENT span per request by the HTTP conventions, carrying the traceparent; only
    while spans are recorded (`tracing_enabled`), like HttpHandler's."""
    if not tracing_enabled():
        return [], False
    try:
        from opentelemetry.instrumentation.aiohttp_client import create_trace_config
    except ImportError:
        return [], False
    return [create_trace_config()], True


class AsyncHttpHandler:
    """POST the payload as JSON with `Idempotency-Key: <effect key>`, on aiohttp.

    A drop-in for `HttpHandler` (same arguments but the client, same outcomes); the
    dispatcher awaits it on its event loop. One aiohttp session per event loop, made
    on first use there (a session belongs to the loop it was made on); `limit` caps
    its connections.
    """

    def __init__(self, url: str, *, timeout: float = 10.0,
                 headers: dict[str, str] | None = None,
                 max_reply_bytes: int = MAX_REPLY_BYTES, limit: int = 64) -> None:
        if timeout <= 0 or max_reply_bytes < 0 or limit < 1:
            raise ConfigurationError("timeout must be > 0, max_reply_bytes >= 0, limit >= 1")
        parsed = URL(url)
        self._authorization: str | None = None  # from URL credentials, never logged
        if parsed.user is not None:
            pair = f"{parsed.user}:{parsed.password or ''}"
            try:
                raw = pair.encode("latin-1")
            except UnicodeEncodeError:
                raw = pair.encode("utf-8")
            self._authorization = "Basic " + base64.b64encode(raw).decode("ascii")
            parsed = parsed.with_user(None)
        self._url = parsed  # parsed once, not per request; never holds credentials
        self._shown_url = redact_secrets(str(parsed))
        self.timeout = timeout
        self.headers = dict(headers or {})
        self.max_reply_bytes = max_reply_bytes
        self.limit = limit
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
        self._traced = False

    @property
    def url(self) -> str:
        """Where deliveries go (credentials removed)."""
        return str(self._url)

    def __repr__(self) -> str:
        return f"AsyncHttpHandler({self._shown_url!r}, timeout={self.timeout:g})"

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            configs, self._traced = _trace_configs()
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.limit), auto_decompress=False,
                trace_configs=[_sending_config(), *configs], json_serialize=_json)
            self._sessions[loop] = session
        return session

    async def aclose(self) -> None:
        """Close the session of the running loop (tests; a worker's loop ends with it)."""
        session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.close()

    async def __call__(self, effect: EffectContext) -> Any:
        try:
            check_effect_key(effect.key)
        except InvalidInput as exc:  # a row written before enqueue checked keys
            raise PermanentFailure(str(exc)) from None
        session = self._session()
        headers = dict(self.headers)
        headers["Idempotency-Key"] = effect.key
        headers["X-Outbox-Attempt"] = str(effect.attempt)
        headers["Accept-Encoding"] = "identity"  # a prefix of the raw bytes is readable
        if self._authorization is not None:
            headers["Authorization"] = self._authorization
        if not self._traced:  # else the instrumentation's CLIENT span injects its own
            propagate.inject(headers)  # traceparent of the current deliver span
        deadline = min(effect.deadline - DEADLINE_MARGIN, time.monotonic() + self.timeout)
        if deadline <= time.monotonic():
            raise TransientFailure("the attempt's deadline passed before sending")
        # One deadline for the whole request (connection, pool wait, send, status,
        # headers, body), one timer: whether it ended before or after the headers went
        # out decides; once the status is in, it only cuts the body.
        sending = _Sending()
        response: aiohttp.ClientResponse | None = None
        prefix = bytearray()
        truncated = False
        try:
            # Relative, so that no loop clock is assumed (the deadline is monotonic).
            async with asyncio.timeout(deadline - time.monotonic()):
                try:
                    response = await session.post(
                        self._url, json=effect.payload, headers=headers,
                        allow_redirects=False, timeout=_NO_TIMEOUT, trace_request_ctx=sending)
                except aiohttp.ClientError as exc:
                    raise _before_status(exc, sending, "no answer after sending") from exc
                truncated = await self._read_prefix(response, prefix)
        except TimeoutError as exc:
            if response is None:
                raise _before_status(exc, sending, "no answer by the attempt's deadline "
                                     f"({self.timeout:g} s at most)") from exc
            truncated = True  # the deadline came while the body arrived
        finally:
            if response is not None:
                response.close()  # an unread rest is never read: the connection is dropped
        return classify_reply(response.status, self._text(response, prefix), truncated,
                              response.headers.get("Retry-After"), self._shown_url,
                              response.headers.get("Date"))

    async def _read_prefix(self, response: aiohttp.ClientResponse, prefix: bytearray
                           ) -> bool:
        """Read the reply's first `max_reply_bytes` into `prefix`; True if more was left
        unread. The receiver has answered: a broken connection while the body arrives
        only cuts the body (as the deadline does, in the caller)."""
        try:
            while True:
                room = self.max_reply_bytes - len(prefix)
                chunk = await response.content.read(max(room, 1))
                if not chunk:
                    return False
                prefix += chunk[:room]
                if len(chunk) > room:
                    return True
                if response.content.at_eof():  # all of it: no read for the EOF
                    return False
        except aiohttp.ClientError:
            return True

    @staticmethod
    def _text(response: aiohttp.ClientResponse, prefix: bytearray) -> str:
        """The prefix read, decoded by the reply's charset (or a note, if encoded)."""
        encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            return f"<{encoding}-encoded reply, {len(prefix)} bytes read>"
        charset = response.charset or "utf-8"
        try:
            return bytes(prefix).decode(charset, errors="replace")
        except LookupError:
            return bytes(prefix).decode("utf-8", errors="replace")
