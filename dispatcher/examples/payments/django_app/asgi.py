"""The ASGI application: Django's, bounded for a server without a proxy in front.

* At most `EXAMPLE_API_CONCURRENCY` (16) requests run at once; the rest wait in the
  event loop, not in threads. Django's ASGI handler gives every request a thread and a
  database connection of its own, so without a bound a burst of N requests opens N
  connections (PostgreSQL's default limit is 100).
* Django's ASGI handler reads a whole body (to disk past 2.5 MB) before any view runs;
  a body above twice the example's limit is refused here with the same 413 problem,
  before it is read. Below that, the view answers (401, 400, 415, 413 in outbox.http's
  order).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from django.core.asgi import get_asgi_application

from outbox._canonical import DEFAULT_MAX_BODY
from outbox.contrib.django.idempotency import problem
from outbox.errors import RequestBodyTooLarge

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dispatcher.examples.payments.django_app.settings")

CEILING = 2 * DEFAULT_MAX_BODY
Scope = dict[str, Any]


class Bounded:
    def __init__(self, app: Any, concurrency: int, ceiling: int = CEILING) -> None:
        self.app = app
        self.concurrency = concurrency
        self.ceiling = ceiling
        self._slots: asyncio.Semaphore | None = None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.concurrency)
        if self._declared(scope) > self.ceiling:
            await self._too_large(send)
            return
        messages: list[dict[str, Any]] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > self.ceiling:
                await self._too_large(send)
                return
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replay() -> dict[str, Any]:
            return messages.pop(0) if messages else await receive()

        async with self._slots:
            await self.app(scope, replay, send)

    @staticmethod
    def _declared(scope: Scope) -> int:
        for name, value in scope.get("headers", []):
            if name.lower() == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return 0
        return 0

    async def _too_large(self, send: Any) -> None:
        answer = problem(RequestBodyTooLarge(f"the body is larger than {DEFAULT_MAX_BODY} "
                                             "bytes"))
        headers = [(k.lower().encode("latin-1"), v.encode("latin-1"))
                   for k, v in answer.items()]
        headers.append((b"content-length", str(len(answer.content)).encode()))
        await send({"type": "http.response.start", "status": answer.status_code,
                    "headers": headers})
        await send({"type": "http.response.body", "body": answer.content})


application = Bounded(get_asgi_application(),
                      int(os.environ.get("EXAMPLE_API_CONCURRENCY", "16")))
