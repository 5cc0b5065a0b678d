"""The example's authentication: who the client is, resolved once per request.

A stand-in for real token verification (OAuth introspection, a JWT's `sub`): a bearer
token `<client>.<anything>` names its client before the first dot. The token changes
when the client refreshes it; the client, and so the idempotency scope
(`outbox.http.client_scope` reads `request.user`), does not.
"""

from __future__ import annotations

from starlette.authentication import (
    AuthCredentials,
    AuthenticationBackend,
    AuthenticationError,
    BaseUser,
    SimpleUser,
)
from starlette.requests import HTTPConnection
from starlette.responses import Response

from outbox.http import problem_response

MAX_CLIENT = 200


class ClientTokens(AuthenticationBackend):
    """`Authorization: Bearer <client>[.<secret>]` -> the user `<client>`; none: anonymous."""

    async def authenticate(self, conn: HTTPConnection
                           ) -> tuple[AuthCredentials, BaseUser] | None:
        values = conn.headers.getlist("authorization")
        if not values:
            return None
        scheme, _, token = values[0].partition(" ")
        client = token.strip().split(".", 1)[0]
        if len(values) > 1 or scheme.lower() != "bearer" or not client \
                or len(client) > MAX_CLIENT or not all(0x21 <= ord(c) <= 0x7E for c in client):
            raise AuthenticationError("send one 'Authorization: Bearer <token>' header")
        return AuthCredentials(["authenticated"]), SimpleUser(client)


def on_auth_error(conn: HTTPConnection, exc: Exception) -> Response:
    """A bad credential is a 401 problem, like every other error of the service."""
    return problem_response(401, str(exc), code="unauthenticated",
                            headers={"WWW-Authenticate": "Bearer"})
