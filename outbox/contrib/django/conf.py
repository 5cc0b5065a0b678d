"""`settings.OUTBOX`: the integration's settings, read once and re-read on change.

```python
OUTBOX = {
    "DATABASE": "default",       # the alias whose database holds the outbox schema
    "MODE": "atomic",            # @idempotent's default: "atomic" or "phased"
    "KEY_TTL": 60.0,             # phased claims: seconds before a retry may take over
    "KEY_RETENTION": 86400.0,    # seconds a completed key is replayed (then purgeable)
    "RETRY_AFTER": 1,            # the 409's Retry-After, seconds
    "LOCAL_TWINS": True,         # a twin of a request running in this process: 409 at once
    "MAX_BODY": 1048576,         # request bodies above this are a 413
    "MAX_STORED_BODY": 1048576,  # larger responses are replayed as a stand-in
    "STORED_HEADERS": [...],     # response headers kept for replays (outbox.http's list)
    "SCOPE": "outbox.contrib.django.client_scope",   # dotted path or callable
    "DOORBELLS": [],             # dotted paths of ring(queue) callables, after commit
    "HANDLERS": None,            # "module:registry" for manage.py outbox_worker
    "CONSOLE_URL": None,         # where the web console is served: the admin links to it
}
```

Every key is optional. Unknown keys and bad values are reported by the system checks
(outbox.E001-E009) instead of failing on the first request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed
from django.utils.module_loading import import_string

from outbox._canonical import DEFAULT_MAX_BODY
from outbox._web import DEFAULT_STORED_HEADERS, ReplayPolicy
from outbox.errors import ConfigurationError

DEFAULTS: dict[str, Any] = {
    "DATABASE": "default",
    "MODE": "atomic",
    "KEY_TTL": 60.0,
    "KEY_RETENTION": 86_400.0,
    "RETRY_AFTER": 1,
    "LOCAL_TWINS": True,
    "MAX_BODY": DEFAULT_MAX_BODY,
    "MAX_STORED_BODY": 1_048_576,
    "STORED_HEADERS": DEFAULT_STORED_HEADERS,
    "SCOPE": "outbox.contrib.django.idempotency.client_scope",
    "DOORBELLS": (),
    "HANDLERS": None,
    "CONSOLE_URL": None,
}


@dataclass(frozen=True, slots=True)
class OutboxSettings:
    database: str
    mode: str
    key_ttl: float
    key_retention: float
    retry_after: int
    local_twins: bool
    max_body: int
    max_stored_body: int
    stored_headers: tuple[str, ...]
    scope: Callable[[Any], str]
    doorbells: tuple[Callable[[str], None], ...]
    handlers: str | None
    console_url: str | None


def raw() -> dict[str, Any]:
    """`settings.OUTBOX` merged over the defaults (not validated)."""
    given = getattr(settings, "OUTBOX", None) or {}
    return {**DEFAULTS, **given} if isinstance(given, Mapping) else dict(DEFAULTS)


def _positive(name: str, value: Any, kind: type[int] | type[float]) -> str | None:
    number = isinstance(value, int | float) if kind is float else isinstance(value, int)
    ok = number and not isinstance(value, bool) and value > 0
    return None if ok else f"OUTBOX[{name!r}] must be a positive number, not {value!r}"


def problems() -> list[str]:
    """Every reason `settings.OUTBOX` is unusable; empty when it is fine."""
    given = getattr(settings, "OUTBOX", None)
    if given is None:
        return []
    if not isinstance(given, Mapping):
        return [f"settings.OUTBOX must be a dict, not {type(given).__name__}"]
    found = [f"unknown key OUTBOX[{k!r}] (known: {', '.join(sorted(DEFAULTS))})"
             for k in given if k not in DEFAULTS]
    merged = raw()
    if merged["MODE"] not in ("atomic", "phased"):
        found.append(f"OUTBOX['MODE'] is 'atomic' or 'phased', not {merged['MODE']!r}")
    for name in ("KEY_TTL", "KEY_RETENTION"):
        found.append(_positive(name, merged[name], float) or "")
    for name in ("RETRY_AFTER", "MAX_BODY", "MAX_STORED_BODY"):
        found.append(_positive(name, merged[name], int) or "")
    if not isinstance(merged["LOCAL_TWINS"], bool):
        found.append(f"OUTBOX['LOCAL_TWINS'] is True or False, not {merged['LOCAL_TWINS']!r}")
    if not isinstance(merged["DATABASE"], str):
        found.append("OUTBOX['DATABASE'] is a database alias (a string)")
    headers = merged["STORED_HEADERS"]
    if isinstance(headers, str) or not isinstance(headers, Iterable):
        found.append("OUTBOX['STORED_HEADERS'] is a list of header names")
    else:
        try:
            _stored_headers_policy(tuple(headers))
        except ConfigurationError as exc:
            found.append(f"OUTBOX['STORED_HEADERS']: {exc}")
    for name in ("SCOPE",):
        try:
            _callable(merged[name])
        except (ImportError, TypeError) as exc:
            found.append(f"OUTBOX[{name!r}]: {exc}")
    doorbells = merged["DOORBELLS"]
    if isinstance(doorbells, str) or not isinstance(doorbells, Iterable):
        found.append("OUTBOX['DOORBELLS'] is a list of dotted paths or callables")
    else:
        for bell in doorbells:
            try:
                _callable(bell)
            except (ImportError, TypeError) as exc:
                found.append(f"OUTBOX['DOORBELLS']: {exc}")
    handlers = merged["HANDLERS"]
    if handlers is not None and (not isinstance(handlers, str) or ":" not in handlers):
        found.append(f"OUTBOX['HANDLERS'] is 'module:registry', not {handlers!r}")
    console_url = merged["CONSOLE_URL"]
    if console_url is not None and (not isinstance(console_url, str) or not console_url):
        found.append(f"OUTBOX['CONSOLE_URL'] is a URL or path such as '/outbox/console/', "
                     f"not {console_url!r}")
    return [p for p in found if p]


def _stored_headers_policy(headers: tuple[str, ...]) -> Any:
    """outbox.http's header policy (refuses Set-Cookie & co.), reused as is."""
    return ReplayPolicy(stored_headers=headers)


def _callable(value: Any) -> Callable[..., Any]:
    if isinstance(value, str):
        try:
            value = import_string(value)
        except ImportError as exc:
            raise ImportError(f"cannot import {value!r}: {exc}") from None
    if not callable(value):
        raise TypeError(f"{value!r} is not callable")
    return value  # type: ignore[no-any-return]


_cache: list[OutboxSettings] = []


def get() -> OutboxSettings:
    """The validated settings; a ConfigurationError names the first problem."""
    if _cache:
        return _cache[0]
    found = problems()
    if found:
        raise ConfigurationError(found[0])
    merged = raw()
    loaded = OutboxSettings(
        database=merged["DATABASE"], mode=merged["MODE"], key_ttl=float(merged["KEY_TTL"]),
        key_retention=float(merged["KEY_RETENTION"]), retry_after=int(merged["RETRY_AFTER"]),
        local_twins=merged["LOCAL_TWINS"],
        max_body=int(merged["MAX_BODY"]), max_stored_body=int(merged["MAX_STORED_BODY"]),
        stored_headers=tuple(merged["STORED_HEADERS"]), scope=_callable(merged["SCOPE"]),
        doorbells=tuple(_callable(b) for b in merged["DOORBELLS"]),
        handlers=merged["HANDLERS"], console_url=merged["CONSOLE_URL"])
    _cache[:] = [loaded]
    return loaded


def _reset(*, setting: str, **_: Any) -> None:
    if setting == "OUTBOX":
        _cache.clear()


setting_changed.connect(_reset, dispatch_uid="outbox.contrib.django.conf")
