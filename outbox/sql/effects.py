"""Statements on `outbox.effects` and `outbox.attempts` outside the dispatch loop:
enqueue, inspect, repair and purge.

The enqueue statements are `Query`s run through the driver seam on the caller's own
handle, sync or async (outbox/_driver.py). The inspect/repair/purge statements run on
our own SQLAlchemy connections (CLI, console) and stay SQLAlchemy `text()` for now.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Row, text

from outbox._driver import Query, Result, nothing, sql
from outbox.errors import KEY_RETENTION_REFUSALS

_NOW = "coalesce(CAST(:now AS timestamptz), now())"

# The doorbell rides in the same statement: `bell` rings each queue that got a new row
# (`outbox.ring`, migration 0010: a NOTIFY, which PostgreSQL delivers only if the
# transaction commits and folds repeats, unless a worker keeps watch over the queue:
# dispatcher/watch.py), and the one-time filter on it makes the planner run it once.
# One round trip per enqueue.
# The rows travel as ONE jsonb parameter (`jsonb_to_recordset`), not nine arrays:
# dumping parallel arrays cost ~200 µs of client CPU per enqueue in psycopg, a JSON
# string built by the C encoder a few µs; payloads ride in it as JSON, not as text.
# Uniqueness (migration 0007): the key goes into outbox.effect_keys first, with the id
# it reserves for the effect (nextval in the rows' order: effects of one ordering key
# run in the order given); only a key that was new there gets its effect row. The rows
# of one call have distinct keys (the caller folds repeats, `_enqueue._rows_for`).
# The rows, their keys, their effects and the doorbell, as CTEs: `{gate}` is a condition
# on the source rows, so a statement that writes an idempotency key can carry the
# effects of its request and write them only if the key was written
# (keys.with_effects: `EXISTS (SELECT 1 FROM written)`).
# The effects' own clock (`enqueue(clock=...)`), apart from a key write's `:now` when the
# two share a statement.
_EFFECT_NOW = "coalesce(CAST(:effect_now AS timestamptz), now())"
EFFECT_CTES = f"""
    t AS MATERIALIZED (
        SELECT * FROM jsonb_to_recordset(CAST(:rows AS jsonb))
          AS t(k text, kind text, p jsonb, h jsonb, ok text, q text, m int, d float8,
                ru float8)
         WHERE {{gate}}
    ), keyed AS (
        INSERT INTO outbox.effect_keys (effect_key, effect_id)
        SELECT k, nextval('outbox.effects_id_seq') FROM t
        ON CONFLICT (effect_key) DO NOTHING
        RETURNING effect_key, effect_id
    ), ins AS (
        INSERT INTO outbox.effects
               (id, effect_key, kind, payload, headers, ordering_key, queue, max_attempts,
                available_at, retry_until)
        SELECT keyed.effect_id, t.k, t.kind, t.p, t.h, t.ok, t.q, t.m,
               {_EFFECT_NOW} + make_interval(secs => t.d),
               CASE WHEN t.ru IS NULL THEN NULL
                    ELSE {_EFFECT_NOW} + make_interval(secs => t.ru) END
          FROM t JOIN keyed ON keyed.effect_key = t.k
        RETURNING id, effect_key, queue
    ), bell AS (
        SELECT outbox.ring(:channel, queue) FROM (SELECT DISTINCT queue FROM ins) AS d
    )
"""

_INSERT_EFFECTS = sql(
    "WITH" + EFFECT_CTES.format(gate="true")
    + "SELECT id, effect_key FROM ins WHERE (SELECT count(*) FROM bell) >= 0",
    tuples=True,
)


def effect_params(rows: Sequence[dict[str, Any]], channel: str,
                  now: datetime | None = None) -> dict[str, Any]:
    """The parameters of EFFECT_CTES for these rows (`now`: None, the database's)."""
    return {"rows": _rows_json(rows), "channel": channel, "effect_now": now}


def _rows_json(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as one JSON array; each payload (already JSON text) spliced in as is."""
    parts = []
    for r in rows:
        head = json.dumps({"k": r["key"], "kind": r["kind"], "ok": r["ordering_key"],
                           "q": r["queue"], "m": r["max_attempts"], "d": r["delay"],
                           "ru": r["retry_for"]}, separators=(",", ":"))
        parts.append(f'{head[:-1]},"p":{r["payload"]},"h":{r["headers"]}}}')
    return "[" + ",".join(parts) + "]"


def insert_effects(rows: Sequence[dict[str, Any]], channel: str,
                   now: datetime | None = None) -> Query[dict[str, int]]:
    """Insert effects and ring `channel` in one statement; {effect_key: id} of new rows.

    Each row: key, kind, payload (JSON text), headers (the trace context, JSON text),
    ordering_key, queue, max_attempts, delay (s), retry_for (s|None).
    """
    return Query(_INSERT_EFFECTS, effect_params(rows, channel, now), _ids_by_key)


def _ids_by_key(result: Result) -> dict[str, int]:
    return {effect_key: id_ for id_, effect_key in result}


# Ids come from a sequence at INSERT, visibility at COMMIT: two transactions enqueueing
# for one ordering key could commit out of id order, and the claim's head check (lower
# ids only) then let the later id run first and both be in flight at once. Holding a
# per-key lock until commit makes ids of one ordering key follow commit order. The
# two-int form is a key space of its own (the idempotency guard uses the bigint form);
# a hashtext collision only makes two keys' producers wait on each other.
_LOCK_ORDERING_KEYS = sql(
    """
    SELECT count(pg_advisory_xact_lock(1869640047, h))
      FROM (SELECT DISTINCT hashtext(k) AS h FROM unnest(CAST(:keys AS text[])) AS u(k)
             ORDER BY h) AS s
    """
)


def lock_ordering_keys(ordering_keys: Sequence[str]) -> Query[None]:
    """Wait for (then hold until commit) the producer lock of each ordering key."""
    return Query(_LOCK_ORDERING_KEYS, {"keys": sorted(set(ordering_keys))}, nothing)


_MATCH_EXISTING = sql(
    """
    SELECT e.effect_key, e.id,
           (e.kind = v.kind AND e.payload = CAST(v.p AS jsonb) AND e.queue = v.q
            AND e.ordering_key IS NOT DISTINCT FROM v.ok AND e.max_attempts = v.m) AS same
      FROM unnest(CAST(:keys AS text[]), CAST(:kinds AS text[]), CAST(:payloads AS text[]),
                  CAST(:queues AS text[]), CAST(:ordering_keys AS text[]),
                  CAST(:max_attempts AS int[]))
           AS v(k, kind, p, q, ok, m)
      JOIN outbox.effect_keys ek ON ek.effect_key = v.k
      JOIN outbox.effects e ON e.id = ek.effect_id
    """
)


def match_existing_effects(rows: Sequence[dict[str, Any]]
                           ) -> Query[dict[str, tuple[int, bool]]]:
    """{effect_key: (id, the same effect)} for rows whose key exists already.

    Only the conflicting rows of an enqueue come here (off the hot path). The same
    effect: kind, payload (jsonb equality: key order and spacing do not count), queue,
    ordering key and attempts cap; anything else would be dropped silently.
    """
    params = {"keys": [r["key"] for r in rows], "kinds": [r["kind"] for r in rows],
              "payloads": [r["payload"] for r in rows], "queues": [r["queue"] for r in rows],
              "ordering_keys": [r["ordering_key"] for r in rows],
              "max_attempts": [r["max_attempts"] for r in rows]}
    return Query(_MATCH_EXISTING, params,
                 lambda result: {r.effect_key: (r.id, bool(r.same)) for r in result})


_COUNT_BY_STATUS = text("SELECT status, count(*) AS n FROM outbox.effects GROUP BY status")


def count_effects(conn: Connection) -> dict[str, int]:
    return {r.status: r.n for r in conn.execute(_COUNT_BY_STATUS)}


_HEALTH = text(
    f"""
    SELECT
      (SELECT extract(epoch FROM {_NOW} - min(available_at))
         FROM outbox.effects WHERE status = 'pending' AND available_at <= {_NOW})
        AS oldest_due_age,
      (SELECT count(*) FROM outbox.effects
        WHERE status = 'pending' AND available_at <= {_NOW}) AS due,
      (SELECT count(*) FROM outbox.effects
        WHERE status = 'in_flight' AND lease_expires_at < {_NOW}) AS expired_leases
    """
)


def effect_health(conn: Connection, now: datetime | None = None) -> dict[str, float]:
    """Oldest due age (s), due count and expired leases: what an operator alerts on."""
    row = conn.execute(_HEALTH, {"now": now}).one()
    return {
        "oldest_due_age_seconds": float(row.oldest_due_age or 0.0),
        "due": int(row.due),
        "expired_leases": int(row.expired_leases),
    }


_BLOCKED_KEYS = text(
    """
    SELECT DISTINCT ON (ordering_key) ordering_key, id, status, attempts, last_error
      FROM outbox.effects
     WHERE ordering_key IS NOT NULL
       AND status IN ('pending', 'in_flight', 'failed', 'needs_review')
     ORDER BY ordering_key, id
    """
)


def blocked_ordering_keys(conn: Connection, limit: int = 50) -> list[Row[Any]]:
    """Ordering keys whose head is dead-lettered, parked or retrying: they wait on it."""
    rows = conn.execute(_BLOCKED_KEYS).all()
    blocked = [r for r in rows if r.status in ("failed", "needs_review") or r.attempts > 0]
    return blocked[:limit]


#: The effect of a key, as a subquery with one `%s` (Django's RawSQL: the admin's
#: search by key goes through outbox.effect_keys' primary key, migration 0007).
EFFECT_ID_BY_KEY = "SELECT effect_id FROM outbox.effect_keys WHERE effect_key = %s"
#: The effect of an outbox.attempts row, as a subquery with one `%s` (the admin opens
#: an attempt of outbox.attempt_history by it: both halves of the view by an index).
EFFECT_ID_OF_ATTEMPT = "SELECT effect_id FROM outbox.attempts WHERE id = %s"


_GET_EFFECT = text(
    """
    SELECT * FROM outbox.effects
     WHERE id = CAST(:id AS bigint)
        OR id = (SELECT effect_id FROM outbox.effect_keys WHERE effect_key = :key)
     ORDER BY id LIMIT 1
    """
)


def get_effect(conn: Connection, ident: str) -> Row[Any] | None:
    """An effect by numeric id or by effect key."""
    as_id = int(ident) if ident.isdigit() and len(ident) < 19 else None
    return conn.execute(_GET_EFFECT, {"id": as_id, "key": ident}).first()


_ATTEMPTS = text(
    "SELECT * FROM outbox.attempt_history WHERE effect_id = :effect_id"
    " ORDER BY attempt, finished_at, id"
)


def attempts_of(conn: Connection, effect_id: int) -> list[Row[Any]]:
    return list(conn.execute(_ATTEMPTS, {"effect_id": effect_id}))


_LIST_EFFECTS = text(
    """
    SELECT id, effect_key, kind, status, attempts, max_attempts, available_at,
           ordering_key, last_error
      FROM outbox.effects WHERE status = :status ORDER BY id LIMIT :limit
    """
)


def list_effects(conn: Connection, status: str, limit: int) -> list[Row[Any]]:
    return list(conn.execute(_LIST_EFFECTS, {"status": status, "limit": limit}))


_REQUEUE = text(
    f"""
    UPDATE outbox.effects
       SET status = 'pending', available_at = {_NOW}, attempts = 0,
           finished_at = NULL, last_error = NULL,
           first_claimed_at = CASE WHEN status = 'needs_review'
                                        AND last_error LIKE ANY(
                                            CAST(:key_retention_passed AS text[]))
                                   THEN NULL ELSE first_claimed_at END
     WHERE status IN ('failed', 'needs_review', 'cancelled')
       AND (id = ANY(CAST(:ids AS bigint[])) OR CAST(:all_failed AS boolean))
       AND (NOT CAST(:all_failed AS boolean) OR status = 'failed')
    RETURNING id
    """
)


def requeue(conn: Connection, ids: Sequence[int], all_failed: bool = False,
            now: datetime | None = None) -> list[int]:
    """Give dead-lettered, parked or cancelled effects a fresh set of attempts.

    Each keeps its first claim, from which its receiver's key retention counts, but an
    effect parked because that retention had passed (`KeyRetentionPassed`): retried by
    id, after the check the runbook asks for, its next attempt is a first contact."""
    params = {"ids": list(ids), "all_failed": all_failed, "now": now,
              "key_retention_passed": [f"{name}:%" for name in KEY_RETENTION_REFUSALS]}
    return [r.id for r in conn.execute(_REQUEUE, params)]


_CANCEL = text(
    f"""
    UPDATE outbox.effects SET status = 'cancelled', finished_at = {_NOW}
     WHERE id = ANY(CAST(:ids AS bigint[])) AND status IN ('pending', 'failed', 'needs_review')
    RETURNING id
    """
)


def cancel(conn: Connection, ids: Sequence[int], now: datetime | None = None) -> list[int]:
    """Cancel effects that are not in flight (an in-flight one may already be applied)."""
    return [r.id for r in conn.execute(_CANCEL, {"ids": list(ids), "now": now})]


# The status test is repeated on the DELETE itself: READ COMMITTED re-checks only the
# DELETE's own WHERE on a row changed since the snapshot, so an `outbox retry` of a
# cancelled effect committed meanwhile (now pending) must fail it, not be deleted.
# The effects' keys and attempts go with them (the statement-level trigger of migration
# 0008, one set-based DELETE each): the key may be enqueued again afterwards, as before
# (a new effect).
_PURGE_FINISHED = text(
    f"""
    DELETE FROM outbox.effects
     WHERE id = ANY(ARRAY(
           SELECT id FROM outbox.effects
            WHERE finished_at < {_NOW} - make_interval(secs => :older_than)
              AND status IN ('delivered', 'cancelled')
            ORDER BY finished_at
            LIMIT :batch))
       AND status IN ('delivered', 'cancelled')
       AND finished_at < {_NOW} - make_interval(secs => :older_than)
    """
)


def purge_finished_effects(conn: Connection, older_than_seconds: float, batch: int,
                           now: datetime | None = None) -> int:
    """Delete up to `batch` delivered/cancelled effects (their keys and attempts with them).

    Dead letters are kept: they are evidence until an operator retries or cancels them.
    """
    params = {"older_than": older_than_seconds, "batch": batch, "now": now}
    return conn.execute(_PURGE_FINISHED, params).rowcount


# --- by filter: `outbox cancel --kind/--queue/--older-than ... [--dry-run]` (issue 12) --
#
# The filter fragments are the console's (outbox/sql/console.py: kind, queue, ordering
# key, key prefix, created before/after), composed the same way: one statement text per
# combination of filters, values always bound. Fenced like `cancel`: the UPDATE tests
# the status again (READ COMMITTED re-checks only its own WHERE), so a row a worker
# claimed since the inner SELECT (now in flight: it may already be applied) is left
# alone; `max_id` keeps the set to what the count (or the dry run) saw.

#: What `cancel` may cancel (an in-flight effect may already be applied).
CANCELLABLE = ("pending", "failed", "needs_review")


def _cancellable(statuses: Sequence[str]) -> list[str]:
    return [s for s in (statuses or CANCELLABLE) if s in CANCELLABLE]


def _matching_where(f: Any) -> str:
    from outbox.sql.console import _conditions, _filter_names

    return _conditions(_filter_names(f, False))


def count_cancellable(conn: Connection, f: Any, *, cap: int,
                      now: datetime | None = None) -> tuple[int, int | None]:
    """(effects matching the console filter `f` that `cancel_matching` would cancel, up
    to `cap`; the highest id among them). `f.statuses` narrows CANCELLABLE."""
    stmt = text(
        f"""
        SELECT count(*) AS n, max(id) AS max_id FROM (
          SELECT id FROM outbox.effects
           WHERE status = ANY(CAST(:statuses AS text[])) AND {_matching_where(f)}
           ORDER BY id LIMIT :cap) AS s
        """
    )
    params = f.params() | {"statuses": _cancellable(f.statuses), "cap": cap, "now": now}
    row = conn.execute(stmt, params).one()
    return int(row.n), row.max_id


def cancel_matching(conn: Connection, f: Any, *, max_id: int, limit: int,
                    now: datetime | None = None) -> list[int]:
    """Cancel up to `limit` effects matching the console filter `f` with ids <= `max_id`
    that are not in flight, oldest first; the ids cancelled."""
    stmt = text(
        f"""
        UPDATE outbox.effects SET status = 'cancelled', finished_at = {_NOW}
         WHERE id = ANY(ARRAY(
               SELECT id FROM outbox.effects
                WHERE status = ANY(CAST(:statuses AS text[])) AND {_matching_where(f)}
                  AND id <= :max_id
                ORDER BY id LIMIT :limit))
           AND status = ANY(CAST(:statuses AS text[]))
        RETURNING id
        """
    )
    params = f.params() | {"statuses": _cancellable(f.statuses), "max_id": max_id,
                           "limit": limit, "now": now}
    return sorted(r.id for r in conn.execute(stmt, params))
