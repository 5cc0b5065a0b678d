"""DRF pieces: problem+json for every error, and JSON-only content negotiation.

```python
REST_FRAMEWORK = {
    "EXCEPTION_HANDLER": "outbox.contrib.django.drf.problem_exception_handler",
}
```

`problem_exception_handler` renders what DRF's own handler handles (APIException,
Http404, PermissionDenied), outbox.http's `Problem` and the library's client errors
(`InvalidInput`, `IdempotencyConflict`) as RFC 9457 problem+json, the way outbox.http
renders them for FastAPI: `type`, `title`, `status`, `detail`, a `code`, and for a
serializer's errors an `errors` list of `{type, loc, msg}`. Anything else is left to
Django (a 500).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.http import HttpResponse
from rest_framework import exceptions
from rest_framework.negotiation import BaseContentNegotiation

if TYPE_CHECKING:
    from rest_framework.renderers import BaseRenderer
    from rest_framework.request import Request

from outbox._web import Problem
from outbox.contrib.django.idempotency import _drf_errors, problem, problem_response
from outbox.errors import IdempotencyConflict, InvalidInput

_KEPT_HEADERS = ("www-authenticate", "retry-after", "allow")


def problem_exception_handler(exc: Exception, context: dict[str, Any]) -> HttpResponse | None:
    """DRF's EXCEPTION_HANDLER: every error it knows as problem+json."""
    # Imported here: rest_framework.views reads api_settings at import, and the
    # settings name this module (JSONOnlyNegotiation), so importing it above is a cycle.
    from rest_framework.views import exception_handler

    if isinstance(exc, Problem | InvalidInput | IdempotencyConflict):
        return problem(exc)
    response = exception_handler(exc, context)
    if response is None:
        return None
    headers = {k: v for k, v in response.items() if k.lower() in _KEPT_HEADERS}
    if isinstance(exc, exceptions.NotAuthenticated | exceptions.AuthenticationFailed):
        headers.setdefault("WWW-Authenticate", "Bearer")
        return problem_response(401, str(exc.detail), code="unauthenticated",
                                headers=headers)
    if isinstance(exc, exceptions.ValidationError):
        errors = _drf_errors(exc.detail, ())
        first = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}"
                          for e in errors[:1])
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return problem_response(response.status_code, first + more or "invalid input",
                                code="validation_error", headers=headers, errors=errors)
    data = response.data
    detail = data.get("detail") if isinstance(data, dict) else data
    code = exc.get_codes() if isinstance(exc, exceptions.APIException) else None
    return problem_response(response.status_code, str(detail) if detail is not None else None,
                            code=code if isinstance(code, str) else None, headers=headers)


class JSONOnlyNegotiation(BaseContentNegotiation):
    """Ignore `Accept`: answer with the view's first renderer (JSON), as FastAPI does.

    An idempotent answer is stored once and replayed to every retry, so it cannot
    depend on one caller's `Accept`; a 406 for an unusual `Accept` would be a new
    failure mode for clients of the same contract.
    """

    def select_parser(self, request: Request, parsers: Any) -> Any:
        return parsers[0] if parsers else None

    def select_renderer(self, request: Request, renderers: Any, format_suffix: str | None = None
                        ) -> tuple[BaseRenderer, str]:
        renderer = renderers[0]
        return renderer, renderer.media_type
