"""The handler registry that dispatcher worker subprocesses load in the tests.

`outbox worker --handlers tests.handlers_for_tests:registry` (cwd = the project root)
and, for Celery workers, `OUTBOX_HANDLERS=tests.handlers_for_tests:registry`.

Kinds:
  psp.charge   POST $PSP_URL/charges  (the fake PSP dedupes on Idempotency-Key)
  psp.event    POST $PSP_URL/events   (payload carries ordering_key + seq: F31)
  psp.unsafe   POST $PSP_URL/charges, declared not retry-safe (ambiguous -> review)
  psp.retained POST $PSP_URL/charges, a receiver that keeps keys for 1 h (key_retention)
  noop         returns at once, touches nothing
`OUTBOX_HTTP_TIMEOUT` (seconds, default 2) bounds each HTTP call.
"""

from __future__ import annotations

import os
from typing import Any

from dispatcher.handlers import EffectContext, HttpHandler, Registry


def _noop(effect: EffectContext) -> dict[str, Any]:
    return {"noop": effect.key}


def registry() -> Registry:
    base = os.environ.get("PSP_URL", "http://127.0.0.1:9").rstrip("/")
    timeout = float(os.environ.get("OUTBOX_HTTP_TIMEOUT", "2"))
    reg = Registry()
    reg.register("psp.charge", HttpHandler(f"{base}/charges", timeout=timeout))
    reg.register("psp.event", HttpHandler(f"{base}/events", timeout=timeout))
    reg.register("psp.unsafe", HttpHandler(f"{base}/charges", timeout=timeout),
                 retry_safe=False)
    reg.register("psp.retained", HttpHandler(f"{base}/charges", timeout=timeout),
                 key_retention=3600)
    reg.register("noop", _noop)
    return reg
