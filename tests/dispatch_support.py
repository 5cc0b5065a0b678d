"""Helpers shared by the dispatcher tests: enqueue, read state back, wait on conditions."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import psycopg
from sqlalchemy import Engine, Row, text

from outbox import Effect, enqueue_many
from outbox._driver import sync_db

if TYPE_CHECKING:
    from dispatcher import Dispatcher


def db_now(engine: Engine) -> datetime:
    with engine.connect() as conn:
        value: datetime = conn.execute(text("SELECT now()")).scalar_one()
        return value


def add_effects(engine: Engine, keys: Sequence[str], *, kind: str = "noop",
                payload: Callable[[int, str], Any] | None = None,
                ordering_key: Callable[[int, str], str | None] | None = None,
                chunk: int = 5000, **options: Any) -> list[int]:
    """Enqueue one effect per key (in chunks of `chunk` rows per transaction)."""
    ids: list[int] = []
    for start in range(0, len(keys), chunk):
        part = keys[start:start + chunk]
        effects = [
            Effect(kind, payload(start + i, k) if payload else {"n": start + i, "key": k},
                   key=k, ordering_key=ordering_key(start + i, k) if ordering_key else None,
                   **options)
            for i, k in enumerate(part)]
        with engine.begin() as conn:
            ids.extend(e.id for e in enqueue_many(conn, effects))
    return ids


def effect_row(engine: Engine, key: str) -> Row[Any]:
    with engine.connect() as conn:
        return conn.execute(text("SELECT * FROM outbox.effects WHERE effect_key = :k"),
                            {"k": key}).one()


def attempts_of(engine: Engine, effect_id: int) -> list[Row[Any]]:
    with engine.connect() as conn:
        return list(conn.execute(text(
            "SELECT * FROM outbox.attempt_history WHERE effect_id = :i ORDER BY attempt, id"),
            {"i": effect_id}))


def status_counts(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {r.status: int(r.n) for r in conn.execute(text(
            "SELECT status, count(*) AS n FROM outbox.effects GROUP BY status"))}


def outcome_counts(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {r.outcome: int(r.n) for r in conn.execute(text(
            "SELECT outcome, count(*) AS n FROM outbox.attempt_history GROUP BY outcome"))}


def wait_until(condition: Callable[[], Any], timeout: float, *, interval: float = 0.1,
               message: str | Callable[[], str] = "condition") -> Any:
    """Poll `condition` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            text_ = message() if callable(message) else message
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {text_}")
        time.sleep(interval)


def keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i:06d}" for i in range(n)]


def summarize(values: Iterable[float]) -> dict[str, float]:
    data = sorted(values)
    if not data:
        return {}

    def pct(p: float) -> float:
        return data[min(len(data) - 1, int(p * (len(data) - 1) + 0.5))]

    return {"n": len(data), "p50": pct(0.5), "p99": pct(0.99), "max": data[-1]}


class CountingDriver:
    """Runs a guard flow on a real connection, counting the statements it sends."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.db = sync_db(conn)
        self.statements: list[str] = []

    def drive(self, flow: Any) -> Any:
        try:
            query = next(flow)
            while True:
                self.statements.append(query.statement.sql.split()[0])
                query = flow.send(query.parse(self.db.execute(query.statement, query.params)))
        except StopIteration as done:
            return done.value


def drain_then_shut_down(d: Dispatcher, budget: float) -> None:
    """One drain; the Dispatcher is shut down after it whatever the drain did."""
    try:
        d.drain(budget=budget)
    finally:
        d.shutdown(0)
