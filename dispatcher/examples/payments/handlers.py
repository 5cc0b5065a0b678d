"""The payments example's effect handlers: everything goes to the (fake) PSP."""

from __future__ import annotations

import os
from typing import Any

from dispatcher.handlers import HttpHandler, Registry
from outbox.errors import ConfigurationError


def http_handler_class() -> Any:
    """`OUTBOX_HTTP_CLIENT`: `aiohttp` (AsyncHttpHandler, the default: about a quarter
    of the CPU per delivery) or `httpx` (HttpHandler). Both keep one contract."""
    choice = os.environ.get("OUTBOX_HTTP_CLIENT", "aiohttp").strip().lower()
    if choice == "httpx":
        return HttpHandler
    if choice != "aiohttp":
        raise ConfigurationError(f"OUTBOX_HTTP_CLIENT is aiohttp or httpx, not {choice!r}")
    from dispatcher.http_async import AsyncHttpHandler

    return AsyncHttpHandler


def registry() -> Registry:
    """`psp.charge` → `$PSP_URL/charges`, `email.receipt` → `$PSP_URL/emails`."""
    base = os.environ.get("PSP_URL", "http://127.0.0.1:8081").rstrip("/")
    timeout = float(os.environ.get("OUTBOX_HTTP_TIMEOUT", "10"))
    cls = http_handler_class()
    reg = Registry()
    # The PSP remembers an Idempotency-Key for 24 h, as Stripe does: no retry after that.
    reg.register("psp.charge", cls(f"{base}/charges", timeout=timeout), key_retention=86_400)
    reg.register("email.receipt", cls(f"{base}/emails", timeout=timeout))
    reg.register("webhook", cls(f"{base}/hooks", timeout=timeout))
    return reg
