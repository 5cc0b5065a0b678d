"""Test hook (research H3): `OUTBOX_CRASH_AT=name[,name...]` SIGKILLs this process when
it reaches a named point, so a test can kill a real process exactly there.

Points: `after_claim`, `after_deliver_before_record` (a worker), and
`after_commit_before_response` (an API process using outbox.http: the request's
transaction committed, its answer not sent). Read once, at import: the hook is set in
a test process's environment before it starts (a lookup of os.environ per delivery
cost ~2 % of a no-op delivery).
"""

from __future__ import annotations

import os
import signal

_CRASH_AT = frozenset(filter(None, os.environ.get("OUTBOX_CRASH_AT", "").split(",")))


def crashpoint(name: str) -> None:
    """SIGKILL this process here if `OUTBOX_CRASH_AT` names `name`."""
    if name in _CRASH_AT:
        os.kill(os.getpid(), signal.SIGKILL)
