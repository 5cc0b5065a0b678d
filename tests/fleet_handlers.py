"""Handlers for the fleet tests' worker subprocesses (tests/test_fleet.py).

`tests.handlers_for_tests`'s kinds (psp.charge to the loopback receiver, noop, ...)
plus `slow`: sleeps `payload["sleep"]` seconds (0.02 by default), a backlog that takes
a known time to drain.
"""

from __future__ import annotations

import time
from typing import Any

from dispatcher.handlers import EffectContext, Registry
from tests.handlers_for_tests import registry as base_registry


def _slow(effect: EffectContext) -> dict[str, Any]:
    payload = effect.payload if isinstance(effect.payload, dict) else {}
    time.sleep(float(payload.get("sleep", 0.02)))
    return {"slept": effect.key}


def registry() -> Registry:
    reg = base_registry()
    reg.register("slow", _slow)
    return reg
