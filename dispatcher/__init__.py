"""Delivers committed effects: claim with SKIP LOCKED, deliver, record fenced outcomes.

The names below are imported on first use: `outbox migrate` (this package's CLI) must
run on a bare install, without the extras a worker needs (httpx for HttpHandler).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dispatcher._core import Dispatcher
    from dispatcher.handlers import EffectContext, HttpHandler, Registry, load_registry
    from dispatcher.http_async import AsyncHttpHandler
    from dispatcher.policy import Decision, RetryPolicy

_WHERE = {
    "AsyncHttpHandler": "dispatcher.http_async",
    "Dispatcher": "dispatcher._core",
    "EffectContext": "dispatcher.handlers",
    "HttpHandler": "dispatcher.handlers",
    "Registry": "dispatcher.handlers",
    "load_registry": "dispatcher.handlers",
    "Decision": "dispatcher.policy",
    "RetryPolicy": "dispatcher.policy",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'dispatcher' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "AsyncHttpHandler",
    "Decision",
    "Dispatcher",
    "EffectContext",
    "HttpHandler",
    "Registry",
    "RetryPolicy",
    "load_registry",
]
