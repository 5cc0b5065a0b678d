"""Statements of the web console (outbox/console/): overview, effect list, one effect's
origin, the bulk redrive and the audit of console actions.

Single-effect retry and cancel reuse `effects.requeue` and `effects.cancel` (the CLI's
fenced statements). The list and the redrive are composed from the fixed fragments
below, one statement text per combination of filters (never from input: values are
always bound parameters), so each combination gets a plan of its own instead of one
generic plan full of `:x IS NULL OR ...` branches.

Indexes they rely on (migration 0004): `effects_console_idx` (status, id) over the
statuses an operator lists (everything but in-flight and delivered rows), a BRIN index
on `attempts.finished_at` for the per-minute chart, and `idempotency_keys_processing_idx`
for stale claims. docs/console.md has the plans and timings on a million effects.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Row, TextClause, text

_NOW = "coalesce(CAST(:now AS timestamptz), now())"

# Statuses with an index that yields ids in order (the partial `effects_console_idx`);
# in-flight rows are few (bounded by the workers' slots) and delivered rows are the
# bulk, where the primary key's order finds matches quickly.
INDEXED_STATUSES = ("pending", "failed", "needs_review", "cancelled")


@dataclass(frozen=True, slots=True)
class EffectFilter:
    """What the effect list (and the bulk redrive) select; None or () is "any"."""

    statuses: tuple[str, ...] = ()
    kind: str | None = None
    queue: str | None = None
    ordering_key: str | None = None
    key_prefix: str | None = None
    older_than: float | None = None   # created at least this many seconds ago
    newer_than: float | None = None   # created at most this many seconds ago

    def params(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind, "queue": self.queue, "ordering_key": self.ordering_key,
            "prefix": self.key_prefix, "older": self.older_than, "newer": self.newer_than,
        }
        if self.key_prefix:
            out["prefix_end"] = prefix_upper_bound(self.key_prefix)
        for i, status in enumerate(self.statuses):
            out[f"status_{i}"] = status
        return out


def prefix_upper_bound(prefix: str) -> str | None:
    """The least string above every string that starts with `prefix`, in code point
    order; None when there is none (a prefix of U+10FFFF only)."""
    chars = list(prefix)
    while chars:
        last = ord(chars.pop()) + 1
        if 0xD800 <= last <= 0xDFFF:  # surrogates are not text in PostgreSQL
            last = 0xE000
        if last <= 0x10FFFF:
            return "".join(chars) + chr(last)
    return None


_COLUMNS = (
    "id, effect_key, kind, status, queue, ordering_key, attempts, max_attempts,"
    " available_at, created_at, finished_at, left(last_error, 300) AS last_error"
)

# Fragments of the WHERE clause, by filter. Only their presence varies.
_WHERE = {
    "kind": "kind = :kind",
    "queue": "queue = :queue",
    "ordering_key": "ordering_key = :ordering_key",
    # starts_with is exact; the range lets outbox.effect_keys' primary key find the
    # rows, and is only added where the column sorts by code point (C, POSIX,
    # C.UTF-8): under a linguistic collation the range would not be a prefix.
    "prefix": "starts_with(effect_key, :prefix)",
    "prefix_range": "id IN (SELECT effect_id FROM outbox.effect_keys"
                    " WHERE effect_key >= :prefix AND effect_key < :prefix_end)",
    "prefix_from": "id IN (SELECT effect_id FROM outbox.effect_keys"
                   " WHERE effect_key >= :prefix)",
    "older": f"created_at <= {_NOW} - make_interval(secs => :older)",
    "newer": f"created_at >= {_NOW} - make_interval(secs => :newer)",
    "before": "id < :before",
    "after": "id > :after",
    "max_id": "id <= :max_id",
}


def _conditions(names: Sequence[str]) -> str:
    return " AND ".join(_WHERE[n] for n in names) or "true"


def _filter_names(f: EffectFilter, bytewise_keys: bool) -> list[str]:
    names = [n for n, v in (("kind", f.kind), ("queue", f.queue),
                            ("ordering_key", f.ordering_key), ("prefix", f.key_prefix),
                            ("older", f.older_than), ("newer", f.newer_than))
             if v is not None and v != ""]
    if f.key_prefix and bytewise_keys:
        names.append("prefix_range" if prefix_upper_bound(f.key_prefix) else "prefix_from")
    return names


@functools.lru_cache(maxsize=512)
def _list_statement(n_statuses: int, names: tuple[str, ...], descending: bool) -> TextClause:
    """One SELECT per status, merged: each uses its own index range in id order."""
    order = "DESC" if descending else "ASC"
    where = _conditions(names)
    if n_statuses == 0:
        return text(f"SELECT {_COLUMNS} FROM outbox.effects WHERE {where}"
                    f" ORDER BY id {order} LIMIT :limit")
    parts = [f"(SELECT {_COLUMNS} FROM outbox.effects WHERE status = :status_{i}"
             f" AND {where} ORDER BY id {order} LIMIT :limit)" for i in range(n_statuses)]
    if n_statuses == 1:
        return text(parts[0])
    return text(f"SELECT * FROM ({' UNION ALL '.join(parts)}) AS u"
                f" ORDER BY id {order} LIMIT :limit")


def list_statement(f: EffectFilter, *, limit: int, before: int | None = None,
                   after: int | None = None, bytewise_keys: bool = False,
                   now: datetime | None = None) -> tuple[TextClause, dict[str, Any]]:
    """The effect list's statement and parameters (bench/bench_console.py EXPLAINs it)."""
    names = _filter_names(f, bytewise_keys)
    if before is not None:
        names.append("before")
    if after is not None:
        names.append("after")
    stmt = _list_statement(len(f.statuses), tuple(names), after is None)
    params = f.params() | {"limit": limit, "before": before, "after": after, "now": now}
    return stmt, params


def list_effects(conn: Connection, f: EffectFilter, *, limit: int, before: int | None = None,
                 after: int | None = None, bytewise_keys: bool = False,
                 now: datetime | None = None) -> list[Row[Any]]:
    """One page of effects, newest first, by keyset on `id`.

    `before`: the page after a row (ids below it); `after`: the page before a row (ids
    above it, returned newest first too). Rows inserted meanwhile get higher ids, so
    paging on never repeats or skips a row that existed when the first page was read.
    """
    stmt, params = list_statement(f, limit=limit, before=before, after=after,
                                  bytewise_keys=bytewise_keys, now=now)
    rows = list(conn.execute(stmt, params))
    return rows if after is None else rows[::-1]


_KEY_ORDER = text(
    """
    SELECT CASE
             WHEN c.oid IS NOT NULL AND c.collname IN ('C', 'POSIX', 'ucs_basic') THEN true
             WHEN c.oid IS NOT NULL AND c.collname <> 'default' THEN false
             WHEN d.datlocprovider = 'i' THEN false
             ELSE d.datcollate IN ('C', 'POSIX', 'C.UTF-8', 'C.utf8')
           END AS bytewise
      FROM pg_attribute a
      JOIN pg_database d ON d.datname = current_database()
      LEFT JOIN pg_collation c ON c.oid = a.attcollation
     WHERE a.attrelid = 'outbox.effect_keys'::regclass AND a.attname = 'effect_key'
    """
)


def effect_keys_sort_bytewise(conn: Connection) -> bool:
    """Does `effect_key` sort by code point (so a prefix is an index range)?"""
    return bool(conn.execute(_KEY_ORDER).scalar_one())


_SET_STATEMENT_TIMEOUT = text("SELECT set_config('statement_timeout', :timeout, true)")

# psycopg prepares a statement after a few runs, and PostgreSQL may then plan it once
# for any parameters: a key-prefix range planned without its bounds, or a status
# planned without knowing it is rare, would pick the wrong index. The console's
# statements are cheap to plan; plan each for its own parameters.
_CONFIGURE = text(
    "SELECT set_config('statement_timeout', :timeout, true),"
    " set_config('plan_cache_mode', 'force_custom_plan', true)"
)


def configure_console_transaction(conn: Connection, timeout_milliseconds: int) -> None:
    """For the rest of this transaction: a statement timeout, and custom plans only."""
    conn.execute(_CONFIGURE, {"timeout": f"{int(timeout_milliseconds)}ms"})


def set_local_statement_timeout(conn: Connection, milliseconds: int) -> None:
    """Bound every statement of this transaction: a console page never runs away."""
    conn.execute(_SET_STATEMENT_TIMEOUT, {"timeout": f"{int(milliseconds)}ms"})


_EFFECT = text("SELECT * FROM outbox.effects WHERE id = :id")


def get_effect_by_id(conn: Connection, effect_id: int) -> Row[Any] | None:
    return conn.execute(_EFFECT, {"id": effect_id}).first()


# --- overview ---------------------------------------------------------------------

# Both halves are index-only scans of partial indexes (console, in-flight): the rows an
# operator counts, never the delivered bulk.
_UNFINISHED_COUNTS = text(
    """
    SELECT queue, status, count(*) AS n FROM outbox.effects
     WHERE status IN ('pending', 'failed', 'needs_review', 'cancelled')
     GROUP BY queue, status
    UNION ALL
    SELECT queue, 'in_flight', count(*) FROM outbox.effects
     WHERE status = 'in_flight' GROUP BY queue
    """
)


def count_unfinished(conn: Connection) -> list[Row[Any]]:
    """(queue, status, n) for every status but `delivered`."""
    return list(conn.execute(_UNFINISHED_COUNTS))


_DELIVERED_COUNTS = text(
    "SELECT queue, count(*) AS n FROM outbox.effects WHERE status = 'delivered' GROUP BY queue"
)


def count_delivered(conn: Connection) -> dict[str, int]:
    """Exact delivered counts by queue: a full scan, for small tables only."""
    return {r.queue: int(r.n) for r in conn.execute(_DELIVERED_COUNTS)}


_ESTIMATED_ROWS = text(
    "SELECT reltuples::bigint FROM pg_class WHERE oid = 'outbox.effects'::regclass"
)


def estimated_effect_rows(conn: Connection) -> int | None:
    """The planner's row estimate (last VACUUM/ANALYZE); None if never analyzed."""
    value = conn.execute(_ESTIMATED_ROWS).scalar_one()
    return None if value is None or value < 0 else int(value)


_PENDING_BY_QUEUE = text(
    f"""
    SELECT queue,
           count(*) FILTER (WHERE available_at <= {_NOW}) AS due,
           count(*) FILTER (WHERE available_at > {_NOW}) AS later,
           extract(epoch FROM {_NOW} - min(available_at)
                   FILTER (WHERE available_at <= {_NOW})) AS oldest_due_age
      FROM outbox.effects WHERE status = 'pending'
     GROUP BY queue
    """
)


def pending_by_queue(conn: Connection, now: datetime | None = None) -> list[Row[Any]]:
    """Per queue: pending rows due now, due later, and the oldest due row's wait (s)."""
    return list(conn.execute(_PENDING_BY_QUEUE, {"now": now}))


_EXPIRED_LEASES = text(
    f"""
    SELECT queue, count(*) AS n FROM outbox.effects
     WHERE status = 'in_flight' AND lease_expires_at < {_NOW} GROUP BY queue
    """
)


def expired_leases_by_queue(conn: Connection, now: datetime | None = None) -> dict[str, int]:
    """In-flight rows whose lease ran out: a worker died; the next claim rescues them."""
    return {r.queue: int(r.n) for r in conn.execute(_EXPIRED_LEASES, {"now": now})}


_ATTEMPTS_PER_MINUTE = text(
    f"""
    SELECT date_trunc('minute', finished_at) AS minute,
           count(*) FILTER (WHERE outcome = 'delivered') AS delivered,
           count(*) FILTER (WHERE outcome <> 'delivered') AS failed
      FROM outbox.attempt_history
     WHERE finished_at >= date_trunc('minute', {_NOW}) - make_interval(mins => :minutes - 1)
     GROUP BY 1 ORDER BY 1
    """
)


def attempts_per_minute(conn: Connection, minutes: int, now: datetime | None = None
                        ) -> list[Row[Any]]:
    """Deliveries and failed attempts (retry, failed, ambiguous, lease lost) per minute
    over the last `minutes` minutes; minutes without attempts are absent."""
    return list(conn.execute(_ATTEMPTS_PER_MINUTE, {"minutes": minutes, "now": now}))


_DB_NOW = text(f"SELECT date_trunc('minute', {_NOW}) AS minute, {_NOW} AS now")


def database_now(conn: Connection, now: datetime | None = None) -> Row[Any]:
    """(minute, now) by the database clock: the console's times are the database's."""
    return conn.execute(_DB_NOW, {"now": now}).one()


_STALE_KEYS = text(
    f"""
    SELECT scope, key, locked_at, lock_expires_at,
           extract(epoch FROM {_NOW} - lock_expires_at) AS overdue
      FROM outbox.idempotency_keys
     WHERE status = 'processing' AND lock_expires_at <= {_NOW}
     ORDER BY lock_expires_at LIMIT :limit
    """
)

_PROCESSING_KEYS = text(
    f"""
    SELECT count(*) AS processing,
           count(*) FILTER (WHERE lock_expires_at <= {_NOW}) AS stale
      FROM outbox.idempotency_keys WHERE status = 'processing'
    """
)


def stale_processing_keys(conn: Connection, limit: int, now: datetime | None = None
                          ) -> tuple[int, int, list[Row[Any]]]:
    """(processing claims, stale ones, the `limit` most overdue): a phased claim past
    its holder's TTL (`lock_expires_at`) means a request died mid-work."""
    counts = conn.execute(_PROCESSING_KEYS, {"now": now}).one()
    rows = list(conn.execute(_STALE_KEYS, {"limit": limit, "now": now}))
    return int(counts.processing), int(counts.stale), rows


# --- where an effect came from ----------------------------------------------------

# Effects store no reference to the key record. An atomic-mode request writes its key
# and its effects in one transaction: `created_at` of both is that transaction's now()
# (a phased request's effects share `completed_at` instead). No index serves this (the
# guard's hot path would pay for it), so the console runs it on demand, time-bounded.
_KEYS_WRITTEN_AT = text(
    """
    SELECT scope, key, status, fingerprint, generation, created_at, completed_at,
           expires_at, response_status
      FROM outbox.idempotency_keys
     WHERE created_at = :at OR completed_at = :at
     LIMIT :limit
    """
)


def keys_written_at(conn: Connection, at: datetime, limit: int = 20) -> list[Row[Any]]:
    """Key records created or completed at exactly `at` (an effect's transaction time)."""
    return list(conn.execute(_KEYS_WRITTEN_AT, {"at": at, "limit": limit}))


# --- bulk redrive ------------------------------------------------------------------

@functools.lru_cache(maxsize=256)
def _redrivable_statement(names: tuple[str, ...]) -> TextClause:
    return text(
        f"""
        SELECT count(*) AS n, max(id) AS max_id, min(id) AS min_id FROM (
          SELECT id FROM outbox.effects
           WHERE status = 'failed' AND {_conditions(names)}
           ORDER BY id LIMIT :cap) AS s
        """
    )


def count_redrivable(conn: Connection, f: EffectFilter, *, cap: int,
                     bytewise_keys: bool = False, now: datetime | None = None
                     ) -> tuple[int, int | None]:
    """(dead letters matching `f`, up to `cap`; the highest id among them)."""
    names = tuple(_filter_names(f, bytewise_keys))
    row = conn.execute(_redrivable_statement(names),
                       f.params() | {"cap": cap, "now": now}).one()
    return int(row.n), row.max_id


# Fenced like `effects.requeue`: the status is tested again by the UPDATE itself
# (READ COMMITTED re-checks only its own WHERE), so a row retried, cancelled or
# redriven by someone else since the inner SELECT is left alone. `max_id` keeps the
# set to what the operator confirmed: dead letters that appear later are not included.
@functools.lru_cache(maxsize=256)
def _redrive_statement(names: tuple[str, ...]) -> TextClause:
    return text(
        f"""
        UPDATE outbox.effects
           SET status = 'pending', available_at = {_NOW}, attempts = 0,
               finished_at = NULL, last_error = NULL
         WHERE id = ANY(ARRAY(
               SELECT id FROM outbox.effects
                WHERE status = 'failed' AND {_conditions(names)}
                ORDER BY id LIMIT :limit))
           AND status = 'failed'
        RETURNING id
        """
    )


def redrive_dead_letters(conn: Connection, f: EffectFilter, *, max_id: int, limit: int,
                         bytewise_keys: bool = False, now: datetime | None = None
                         ) -> list[int]:
    """Give up to `limit` failed effects matching `f` (ids <= `max_id`) a fresh set of
    attempts, oldest first; the ids changed. Parked (`needs_review`) effects are never
    redriven in bulk: their last attempt may have been applied."""
    names = (*_filter_names(f, bytewise_keys), "max_id")
    params = f.params() | {"max_id": max_id, "limit": limit, "now": now}
    return sorted(r.id for r in conn.execute(_redrive_statement(names), params))


# --- audit -------------------------------------------------------------------------

_RECORD_ACTION = text(
    f"""
    INSERT INTO outbox.console_actions (at, actor, action, effect_ids, request, outcome)
    VALUES ({_NOW}, :actor, :action, CAST(:ids AS bigint[]), CAST(:request AS jsonb),
            :outcome)
    RETURNING id
    """
)


def record_action(conn: Connection, *, actor: str, action: str, effect_ids: Sequence[int],
                  request: str, outcome: str, now: datetime | None = None) -> int:
    """Write one audit row (in the action's own transaction): who, what, which ids."""
    params = {"actor": actor, "action": action, "ids": list(effect_ids),
              "request": request, "outcome": outcome, "now": now}
    return int(conn.execute(_RECORD_ACTION, params).scalar_one())


_RECENT_ACTIONS = text(
    """
    SELECT id, at, actor, action, outcome, request, cardinality(effect_ids) AS n,
           effect_ids[1:20] AS some_ids
      FROM outbox.console_actions
     WHERE CAST(:before AS bigint) IS NULL OR id < :before
     ORDER BY id DESC LIMIT :limit
    """
)


def recent_actions(conn: Connection, limit: int, before: int | None = None) -> list[Row[Any]]:
    return list(conn.execute(_RECENT_ACTIONS, {"limit": limit, "before": before}))


_ACTIONS_ON = text(
    """
    SELECT id, at, actor, action, outcome FROM outbox.console_actions
     WHERE effect_ids @> ARRAY[CAST(:id AS bigint)] OR request @> jsonb_build_object('ids',
           jsonb_build_array(CAST(:id AS bigint)))
     ORDER BY id DESC LIMIT :limit
    """
)


def actions_on_effect(conn: Connection, effect_id: int, limit: int = 20) -> list[Row[Any]]:
    """Console actions that changed, or were asked to change, this effect."""
    return list(conn.execute(_ACTIONS_ON, {"id": effect_id, "limit": limit}))
