"""The web console next to Django, in the same ASGI process, behind Django's login.

```python
# asgi.py
from outbox.contrib.django.console import console_app

application = console_app()     # Django's ASGI app, plus the console at /outbox/console/
```

`console_app(django_asgi_app=None, *, prefix="/outbox/console", using=None, **options)`:

* requests under `prefix` go to the console (`outbox.console.create_console_app`);
  everything else goes to `django_asgi_app` (by default `get_asgi_application()`);
* who may use the console is Django's session: the session cookie is resolved to a user
  with Django's session engine and `django.contrib.auth.get_user` (so a session whose
  password hash changed, or that was flushed at logout, is refused), and only an active
  staff user is admitted (else the console's 403). The operator name in the console's
  audit log is the user's username;
* the console reads and writes through an engine of its own on Django's database
  (`using`, else `OUTBOX["DATABASE"]`), built from `database_url(using)`;
* its CSRF/cookie key is derived from `settings.SECRET_KEY`, so every worker process
  accepts the forms the others rendered.

`options` are `create_console_app`'s (`mask`, `trace_url`, `read_only`, `page_size`).
Set `OUTBOX["CONSOLE_URL"]` to the same prefix for the admin's link to the console.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from importlib import import_module
from typing import Any

from asgiref.sync import sync_to_async
from starlette.requests import Request
from starlette.routing import Mount, Router

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_PREFIX = "/outbox/console"


def staff_operator(session_key: str | None) -> str | None:
    """The username of the active staff user this Django session belongs to, else None.

    Synchronous (Django's ORM): call it through `sync_to_async` from async code.
    """
    if not session_key:
        return None
    from django.conf import settings
    from django.contrib.auth import get_user
    from django.db import close_old_connections
    from django.http import HttpRequest

    close_old_connections()
    try:
        engine = import_module(settings.SESSION_ENGINE)
        request = HttpRequest()
        request.session = engine.SessionStore(session_key)
        user = get_user(request)
        if not (getattr(user, "is_active", False) and getattr(user, "is_staff", False)):
            return None
        return str(user.get_username())
    finally:
        close_old_connections()


_staff_operator_async = sync_to_async(staff_operator, thread_sensitive=True)


async def django_staff_auth(request: Request) -> str | None:
    """The console's `auth=`: Django's session cookie, active staff users only."""
    from django.conf import settings

    return await _staff_operator_async(request.cookies.get(settings.SESSION_COOKIE_NAME))


def _console_secret() -> bytes:
    from django.conf import settings

    return hmac.new(str(settings.SECRET_KEY).encode(), b"outbox.contrib.django.console",
                    hashlib.sha256).digest()


def console_app(django_asgi_app: Any = None, *, prefix: str = DEFAULT_PREFIX,
                using: str | None = None, engine: Any = None, **options: Any) -> ASGIApp:
    """Django's ASGI app with the outbox console mounted at `prefix` (see the module)."""
    if django_asgi_app is None:
        from django.core.asgi import get_asgi_application

        django_asgi_app = get_asgi_application()  # also django.setup()
    prefix = "/" + prefix.strip("/")
    if prefix == "/":
        raise ValueError("prefix must be a path below /, e.g. /outbox/console")
    from outbox._config import make_engine
    from outbox.console import create_console_app
    from outbox.contrib.django.db import database_url

    own_engine = engine is None
    if engine is None:
        engine = make_engine(database_url(using), application_name="outbox-console")
    console = create_console_app(engine, auth=django_staff_auth,
                                 secret=options.pop("secret", None) or _console_secret(),
                                 **options)
    router = Router(routes=[Mount(prefix, app=console)])
    django_app: ASGIApp = django_asgi_app

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":  # Django answers no lifespan: do it here
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    if own_engine:
                        engine.dispose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path: str = scope.get("path", "")
        root: str = scope.get("root_path", "") or ""
        local = path[len(root):] if root and path.startswith(root) else path
        if kind == "http" and (local == prefix or local.startswith(prefix + "/")):
            await router(scope, receive, send)
        else:
            await django_app(scope, receive, send)

    app.console = console  # type: ignore[attr-defined]
    app.engine = engine  # type: ignore[attr-defined]
    return app


__all__ = ["DEFAULT_PREFIX", "console_app", "django_staff_auth", "staff_operator"]
