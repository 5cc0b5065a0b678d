"""Round trips counted on the wire: libpq's trace of one connection."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def counting_round_trips(pgconn: Any, tmp: Path) -> Iterator[list[int]]:
    """Trace `pgconn` inside the block; then the list holds one number: the
    ReadyForQuery messages PostgreSQL sent, one per round trip."""
    trace = tmp / f"trace-{uuid.uuid4().hex}"
    counted: list[int] = []
    with trace.open("w") as f:
        pgconn.trace(f.fileno())
        try:
            yield counted
        finally:
            pgconn.untrace()
    counted.append(trace.read_text().count("ReadyForQuery"))
