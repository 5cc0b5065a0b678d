"""Who may use the console, and proof that a POST came from its own page.

Three modes, chosen by `create_console_app`:

- `auth=callable`: the embedding application decides (its session, its users); the
  callable returns the operator's name, or None to refuse (403).
- `token=...`: `Authorization: Bearer <token>`, or the login form, which sets an
  HttpOnly, SameSite=Strict cookie signed with a key derived from the token (changing
  the token logs everyone out). No server-side session state.
- neither: loopback only. Requests from a non-loopback address, or with a Host header
  that is not a loopback name (DNS rebinding: a web page that resolves its own name to
  127.0.0.1), are refused.

CSRF: every POST carries a form field that is an HMAC of a random per-browser cookie
(HttpOnly, SameSite=Strict) under the app's secret: a page of another origin can
neither read the cookie nor compute the field. A POST whose Origin header names
another host is refused as well.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import secrets
import time
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response

SESSION_COOKIE = "outbox_console_session"
CSRF_COOKIE = "outbox_console_csrf"
SESSION_SECONDS = 12 * 3600

_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


def is_loopback_host(host: str) -> bool:
    """A bind address or Host-header name that only this machine can reach."""
    host = host.strip().strip("[]").lower()
    if host in _LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def client_is_loopback(request: Request) -> bool:
    client = request.client
    return client is not None and is_loopback_host(client.host)


def host_header_is_loopback(request: Request) -> bool:
    host = request.headers.get("host", "")
    name = urlsplit(f"//{host}").hostname or ""
    return is_loopback_host(name)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


class Keys:
    """The app's signing keys: from the token when there is one (every process that
    shares the token accepts the others' cookies), else from `secret`, else random."""

    def __init__(self, token: str | None, secret: str | bytes | None) -> None:
        if isinstance(secret, str):
            secret = secret.encode()
        base = secret or (token.encode() if token else secrets.token_bytes(32))
        self.session = hmac.new(base, b"outbox-console session", hashlib.sha256).digest()
        self.csrf = hmac.new(base, b"outbox-console csrf", hashlib.sha256).digest()
        self.token = token

    # -- token ---------------------------------------------------------------------
    def token_matches(self, given: str) -> bool:
        return self.token is not None and hmac.compare_digest(
            given.encode(), self.token.encode())

    def new_session(self, now: float | None = None) -> str:
        expires = int((now or time.time()) + SESSION_SECONDS)
        sig = hmac.new(self.session, f"session:{expires}".encode(), hashlib.sha256)
        return f"{expires}.{_b64(sig.digest())}"

    def session_valid(self, value: str | None, now: float | None = None) -> bool:
        if not value or "." not in value:
            return False
        expires, _, sig = value.partition(".")
        if not expires.isdigit() or int(expires) < (now or time.time()):
            return False
        want = hmac.new(self.session, f"session:{expires}".encode(), hashlib.sha256)
        return hmac.compare_digest(sig, _b64(want.digest()))

    def authenticated(self, request: Request) -> bool:
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() == "bearer" and given.strip():
            return self.token_matches(given.strip())
        return self.session_valid(request.cookies.get(SESSION_COOKIE))

    # -- CSRF ----------------------------------------------------------------------
    def csrf_field(self, cookie: str) -> str:
        return _b64(hmac.new(self.csrf, cookie.encode(), hashlib.sha256).digest())

    def csrf_ok(self, request: Request, field: str | None) -> bool:
        cookie = request.cookies.get(CSRF_COOKIE)
        if not cookie or not field:
            return False
        if not hmac.compare_digest(field, self.csrf_field(cookie)):
            return False
        origin = request.headers.get("origin")
        if origin and origin != "null":
            host = request.headers.get("host", "")
            if urlsplit(origin).netloc.lower() != host.lower():
                return False
        return True


def csrf_cookie(request: Request) -> tuple[str, bool]:
    """(this browser's CSRF cookie value, whether it is new and must be set)."""
    value = request.cookies.get(CSRF_COOKIE)
    if value and 20 <= len(value) <= 100:
        return value, False
    cached = getattr(request.state, "new_csrf", None)
    if isinstance(cached, str):
        return cached, True
    value = _b64(secrets.token_bytes(24))
    request.state.new_csrf = value
    return value, True


def cookie_path(request: Request) -> str:
    return (request.scope.get("root_path") or "").rstrip("/") + "/"


def set_cookie(request: Request, response: Response, name: str, value: str,
               max_age: int | None = None) -> None:
    response.set_cookie(name, value, max_age=max_age, path=cookie_path(request),
                        httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
