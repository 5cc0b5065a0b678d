"""`Authorization: Bearer <token>` for the Django example: EXAMPLE_API_TOKENS, as in auth.py.

A middleware, like Starlette's AuthenticationMiddleware in the FastAPI example, so a
bad credential is a 401 on every route; it runs the FastAPI example's own backend
(dispatcher/examples/payments/auth.py `BearerTokens`: the same parsing, constant-time lookup,
messages and open demo mode). DRF then takes the middleware's user (`FromMiddleware`),
and `outbox.contrib.django.client_scope` scopes idempotency keys by its identity.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from django.http import HttpRequest, HttpResponse
from rest_framework.authentication import BaseAuthentication
from rest_framework.request import Request
from starlette.authentication import AuthenticationError
from starlette.requests import HTTPConnection

from dispatcher.examples.payments.auth import BearerTokens, backend_from_env
from outbox.contrib.django.idempotency import _HeaderView, problem_response


def authenticate(backend: BearerTokens, request: HttpRequest) -> Any:
    """Run `BearerTokens.authenticate` (it reads only the headers and never awaits)."""
    coroutine = backend.authenticate(cast(HTTPConnection, _HeaderView(request)))
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("BearerTokens.authenticate awaited")


class BearerTokenMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response
        self.backend = backend_from_env()  # logs loudly in open demo mode

    def __call__(self, request: HttpRequest) -> HttpResponse:
        try:
            found = authenticate(self.backend, request)
        except AuthenticationError as exc:
            return problem_response(401, str(exc), code="unauthenticated",
                                    headers={"WWW-Authenticate": "Bearer"})
        request.user = found[1] if found else None  # type: ignore[assignment]
        return self.get_response(request)


class FromMiddleware(BaseAuthentication):
    """DRF's `request.user` is the middleware's (None: unauthenticated)."""

    def authenticate(self, request: Request) -> tuple[Any, None] | None:
        user = getattr(request._request, "user", None)
        return (user, None) if user is not None else None
