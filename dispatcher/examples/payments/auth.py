"""The example's authentication (DESIGN §8): bearer tokens mapped to client identities.

`EXAMPLE_API_TOKENS=tok-a=alice,tok-b=alice,tok-c=bob` names the tokens and the
identity each stands for: two tokens of one identity share its idempotency scope (as
after a token refresh), so a retry with the new token gets the replay. Unset, the
service runs in open demo mode (logged loudly at startup): any bearer token is its
own identity. No token, or an unknown one, is a 401 problem. `outbox.http.client_scope`
reads the identity from `request.user`; the token itself is never stored.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Mapping

from starlette.authentication import (
    AuthCredentials,
    AuthenticationBackend,
    AuthenticationError,
    BaseUser,
    SimpleUser,
)
from starlette.requests import HTTPConnection
from starlette.responses import Response

from outbox.errors import ConfigurationError
from outbox.http import problem_response

log = logging.getLogger("payments.auth")
MAX_TOKEN = 512


def parse_tokens(spec: str | None) -> dict[str, str] | None:
    """`tok-a=alice,tok-b=alice` -> {token: identity}; None (open mode) when unset."""
    if spec is None or not spec.strip():
        return None
    tokens: dict[str, str] = {}
    for item in spec.split(","):
        token, sep, identity = item.strip().partition("=")
        if not sep or not token.strip() or not identity.strip():
            raise ConfigurationError(f"EXAMPLE_API_TOKENS: {item!r} is not token=identity")
        tokens[token.strip()] = identity.strip()
    return tokens


class BearerTokens(AuthenticationBackend):
    """`Authorization: Bearer <token>` -> the identity the token stands for."""

    def __init__(self, tokens: Mapping[str, str] | None) -> None:
        self.tokens = dict(tokens) if tokens is not None else None
        if self.tokens is None:
            log.warning("EXAMPLE_API_TOKENS is unset: OPEN DEMO MODE, any bearer token is "
                        "accepted as its own identity. Never run this in production.")

    async def authenticate(self, conn: HTTPConnection
                           ) -> tuple[AuthCredentials, BaseUser] | None:
        values = conn.headers.getlist("authorization")
        if not values:
            return None  # the routes that need a client answer 401
        scheme, _, token = values[0].partition(" ")
        token = token.strip()
        if len(values) > 1 or scheme.lower() != "bearer" or not token \
                or len(token) > MAX_TOKEN or not all(0x21 <= ord(c) <= 0x7E for c in token):
            raise AuthenticationError("send one 'Authorization: Bearer <token>' header")
        if self.tokens is None:
            return AuthCredentials(["authenticated"]), SimpleUser(token)
        identity = self._lookup(token)
        if identity is None:
            raise AuthenticationError("unknown bearer token")
        return AuthCredentials(["authenticated"]), SimpleUser(identity)

    def _lookup(self, token: str) -> str | None:
        """Compare against every token in constant time (no early exit on a match)."""
        found = None
        for known, identity in self.tokens.items() if self.tokens else ():
            if hmac.compare_digest(known.encode(), token.encode()):
                found = identity
        return found


def backend_from_env() -> BearerTokens:
    return BearerTokens(parse_tokens(os.environ.get("EXAMPLE_API_TOKENS")))


def on_auth_error(conn: HTTPConnection, exc: Exception) -> Response:
    """A bad credential is a 401 problem, like every other error of the service."""
    return problem_response(401, str(exc), code="unauthenticated",
                            headers={"WWW-Authenticate": "Bearer"})
