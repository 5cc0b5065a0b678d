"""The dispatcher's clock for a claim's age: seconds that keep counting while the host
is suspended.

`time.monotonic()` (CLOCK_MONOTONIC on Linux) stops while the host sleeps; the
database's clock does not. The dispatcher dates an attempt as the claim's time (the
database's) plus the time since the claim, and it checks that time against a kind's
key retention before sending (F24) and against `retry_until`. Measured on the
monotonic clock, a host that slept for an hour after a claim would find the claim one
second old and send past the retention. CLOCK_BOOTTIME counts the sleep (Linux); where
there is none, this is the monotonic clock.

Deadlines handed to handlers and to asyncio stay on the monotonic clock (asyncio's loop
clock, and what `EffectContext.deadline` documents): `to_monotonic` converts.
"""

from __future__ import annotations

import time

_BOOTTIME: int | None = getattr(time, "CLOCK_BOOTTIME", None)


def now() -> float:
    """Seconds on this clock (an arbitrary origin; only differences mean anything)."""
    if _BOOTTIME is None:
        return time.monotonic()
    return time.clock_gettime(_BOOTTIME)


def to_monotonic(stamp: float) -> float:
    """`stamp` (this clock) on `time.monotonic()`'s scale, as of now."""
    return stamp - (now() - time.monotonic())
