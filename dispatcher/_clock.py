"""The dispatcher's clock for a claim's age: seconds that keep counting while the host's
own kernel is suspended.

`time.monotonic()` stops while the host sleeps (a laptop's lid, a guest that suspends
itself); the database's clock does not. The dispatcher dates an attempt as the claim's
time (the database's) plus the time since the claim, and it checks that time against a
kind's key retention before sending (F24) and against `retry_until`. Measured on the
monotonic clock, a host that slept for an hour after a claim would find the claim one
second old and send past the retention. This clock counts the sleep: CLOCK_BOOTTIME on
Linux, CLOCK_MONOTONIC on macOS (where `time.monotonic()` is the one that stops), else
`time.monotonic()`. A hypervisor's pause or a live migration moves every guest clock
alike and is not seen here; the lease token still fences what such a host records.

Deadlines handed to handlers and to asyncio stay on the monotonic clock (asyncio's loop
clock, and what `EffectContext.deadline` documents): `to_monotonic` converts.
"""

from __future__ import annotations

import sys
import time

_COUNTS_SLEEP: int | None = getattr(time, "CLOCK_BOOTTIME", None)
if _COUNTS_SLEEP is None and sys.platform == "darwin":  # pragma: no cover - macOS
    _COUNTS_SLEEP = time.CLOCK_MONOTONIC


def now() -> float:
    """Seconds on this clock (an arbitrary origin; only differences mean anything)."""
    if _COUNTS_SLEEP is None:  # pragma: no cover - neither Linux nor macOS
        return time.monotonic()
    return time.clock_gettime(_COUNTS_SLEEP)


def to_monotonic(stamp: float) -> float:
    """`stamp` (this clock) on `time.monotonic()`'s scale, as of now."""
    return stamp - (now() - time.monotonic())
