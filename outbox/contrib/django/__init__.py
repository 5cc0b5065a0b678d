"""pg-outbox for Django and Django REST framework (`pip install pg-outbox[django]`).

```python
INSTALLED_APPS = [..., "outbox.contrib.django"]     # label "outbox"
OUTBOX = {"DATABASE": "default"}                     # optional, see conf.py
REST_FRAMEWORK = {"EXCEPTION_HANDLER": "outbox.contrib.django.drf.problem_exception_handler"}
```

* `manage.py migrate` creates the outbox schema (Django migrations that run the
  Alembic revisions, migrations_support.py); system checks report misconfiguration.
* `outbox.enqueue(connection, ...)` inside `transaction.atomic()`: the rows commit or
  roll back with the block; the doorbell rings from `connection.on_commit`.
* `@idempotent` / `IdempotentMixin` (idempotency.py): the HTTP contract of
  outbox.http for Django and DRF views, atomic inside the view's transaction.
* The admin (effects, attempts, keys; retry/cancel with the CLI's fenced statements)
  and `manage.py outbox_worker`, `outbox_status`, `outbox_migrate`.

Names are imported lazily: listing the app in INSTALLED_APPS imports nothing of DRF.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Idempotency": "idempotency", "IdempotentMixin": "idempotency",
    "IdempotentRequest": "idempotency", "idempotent": "idempotency",
    "idempotency_of": "idempotency",
    "client_scope": "idempotency", "anonymous_scope": "idempotency",
    "shared_scope": "idempotency", "header_scope": "idempotency",
    "problem_response": "idempotency", "outbox_db": "db", "database_url": "db",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"{__name__}.{module}"), name)
