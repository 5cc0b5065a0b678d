"""The payments example's effect handlers: everything goes to the (fake) PSP."""

from __future__ import annotations

import os

from dispatcher.handlers import HttpHandler, Registry


def registry() -> Registry:
    """`psp.charge` → `$PSP_URL/charges`, `email.receipt` → `$PSP_URL/emails`."""
    base = os.environ.get("PSP_URL", "http://127.0.0.1:8081").rstrip("/")
    timeout = float(os.environ.get("OUTBOX_HTTP_TIMEOUT", "10"))
    reg = Registry()
    reg.register("psp.charge", HttpHandler(f"{base}/charges", timeout=timeout))
    reg.register("email.receipt", HttpHandler(f"{base}/emails", timeout=timeout))
    reg.register("webhook", HttpHandler(f"{base}/hooks", timeout=timeout))
    return reg
