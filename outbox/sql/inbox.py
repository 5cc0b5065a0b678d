"""Statements on `outbox.inbox`, `outbox.inbox_conflicts` and `outbox.entity_versions`.

Keys travel as parallel arrays through `unnest(...) WITH ORDINALITY ... ORDER BY n`:
one statement per step whatever the batch size, and rows are locked in the order the
caller sorted them, so two overlapping batches cannot deadlock on each other's keys.

An `UPDATE ... FROM unnest(...)` locks rows in whatever order its join produces (a
2-key and a 500-key batch get different plans), so the inbox rows an ingestion
updates are first locked together by `lock_events`, whose ORDER BY sits below the
row locking. The caller's transaction therefore takes its locks in one order: new
keys (INSERT, sorted), then existing inbox rows (`lock_events`, sorted), then
entities (`apply_versions`, sorted); after that it only writes rows it holds or
inserted itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, text

_NOW = "coalesce(CAST(:now AS timestamptz), now())"

Key = tuple[str, str]


@dataclass(frozen=True, slots=True)
class NewEvent:
    """One inbox row to insert; `payload` is JSON text."""

    source: str
    event_id: str
    fingerprint: str
    version: int | None
    entity: str | None
    payload: str


@dataclass(frozen=True, slots=True)
class AppliedVersion:
    """The version of an entity in force, and the event that set it."""

    version: int
    event_id: str
    fingerprint: str


# One round trip for the common cases: a new key is inserted, or a key committed before
# this statement began is read back in the same statement. A twin committed while our
# INSERT waited for it is not in the statement's snapshot: then no row comes back and
# the caller reads it with `get_fingerprint`, a new statement.
_INSERT_EVENT = text(
    f"""
    WITH ins AS (
        INSERT INTO outbox.inbox
               (source, event_id, fingerprint, version, entity, payload, received_at,
                processed_at)
        VALUES (:source, :event_id, :fingerprint, :version, :entity,
                CAST(:payload AS jsonb), {_NOW},
                CASE WHEN CAST(:processed AS boolean) THEN {_NOW} END)
        ON CONFLICT (source, event_id) DO NOTHING
        RETURNING fingerprint
    )
    SELECT true AS inserted, fingerprint FROM ins
    UNION ALL
    SELECT false, fingerprint FROM outbox.inbox
     WHERE source = :source AND event_id = :event_id AND NOT EXISTS (SELECT FROM ins)
    """
)


def insert_event(conn: Connection, event: NewEvent, *, processed: bool,
                 now: datetime | None = None) -> tuple[bool, str | None]:
    """Record one event: (True, ours) if new, else (False, the stored fingerprint or None).

    None: the row is not in this statement's snapshot (a twin committed while we waited
    on it, or a purge removed it); read again in a new statement.
    """
    params: dict[str, Any] = {
        "source": event.source, "event_id": event.event_id,
        "fingerprint": event.fingerprint, "version": event.version, "entity": event.entity,
        "payload": event.payload, "processed": processed, "now": now,
    }
    row = conn.execute(_INSERT_EVENT, params).first()
    if row is None:
        return False, None
    return bool(row.inserted), str(row.fingerprint)


_INSERT_EVENTS = text(
    f"""
    INSERT INTO outbox.inbox
           (source, event_id, fingerprint, version, entity, payload, received_at,
            processed_at)
    SELECT s, e, f, v, en, CAST(p AS jsonb), {_NOW},
           CASE WHEN CAST(:processed AS boolean) THEN {_NOW} END
      FROM unnest(CAST(:sources AS text[]), CAST(:event_ids AS text[]),
                  CAST(:fingerprints AS text[]), CAST(:versions AS bigint[]),
                  CAST(:entities AS text[]), CAST(:payloads AS text[]))
           WITH ORDINALITY AS t(s, e, f, v, en, p, n)
     ORDER BY n
    ON CONFLICT (source, event_id) DO NOTHING
    RETURNING source, event_id
    """
)


def insert_events(conn: Connection, events: Sequence[NewEvent], *, processed: bool,
                  now: datetime | None = None) -> set[Key]:
    """Record many events in one statement; keys must be unique (the caller dedupes).

    Returns the keys inserted. Duplicate keys inside one statement would be harmless
    for DO NOTHING, but then nobody could tell which copy was stored.
    """
    params: dict[str, Any] = {
        "sources": [e.source for e in events],
        "event_ids": [e.event_id for e in events],
        "fingerprints": [e.fingerprint for e in events],
        "versions": [e.version for e in events],
        "entities": [e.entity for e in events],
        "payloads": [e.payload for e in events],
        "processed": processed,
        "now": now,
    }
    return {(r.source, r.event_id) for r in conn.execute(_INSERT_EVENTS, params)}


# A new statement, so READ COMMITTED shows the row a twin committed while our INSERT
# waited for it.
_GET_FINGERPRINT = text(
    "SELECT fingerprint FROM outbox.inbox WHERE source = :source AND event_id = :event_id"
)


def get_fingerprint(conn: Connection, source: str, event_id: str) -> str | None:
    """The stored fingerprint of one event, or None if it is not (or no longer) there."""
    row = conn.execute(_GET_FINGERPRINT, {"source": source, "event_id": event_id}).first()
    return None if row is None else str(row.fingerprint)


_GET_FINGERPRINTS = text(
    """
    SELECT i.source, i.event_id, i.fingerprint
      FROM unnest(CAST(:sources AS text[]), CAST(:event_ids AS text[])) AS k(s, e)
      JOIN outbox.inbox i ON i.source = k.s AND i.event_id = k.e
    """
)


def get_fingerprints(conn: Connection, keys: Sequence[Key]) -> dict[Key, str]:
    params = {"sources": [k[0] for k in keys], "event_ids": [k[1] for k in keys]}
    return {(r.source, r.event_id): r.fingerprint
            for r in conn.execute(_GET_FINGERPRINTS, params)}


# ORDER BY is applied below the row locks (LockRows runs on sorted rows), so the rows
# are locked one after another in the caller's order. NO KEY UPDATE is the lock the
# counters' UPDATEs take anyway; the purge's FOR UPDATE SKIP LOCKED skips them.
_LOCK_EVENTS = text(
    """
    SELECT i.source, i.event_id
      FROM unnest(CAST(:sources AS text[]), CAST(:event_ids AS text[]))
           WITH ORDINALITY AS k(s, e, n)
      JOIN outbox.inbox i ON i.source = k.s AND i.event_id = k.e
     ORDER BY k.n
       FOR NO KEY UPDATE OF i
    """
)


def lock_events(conn: Connection, keys: Sequence[Key]) -> set[Key]:
    """Lock the stored rows of `keys` until commit, in sorted key order; returns those found.

    Called before `record_conflicts`/`count_duplicates` update several rows: each of
    those statements alone is one order, but two of them in a row (conflicts, then
    duplicates) would lock x then y in one batch and y then x in a batch with the
    roles swapped: a deadlock (40P01).
    """
    ordered = sorted(keys)
    params = {"sources": [k[0] for k in ordered], "event_ids": [k[1] for k in ordered]}
    return {(r.source, r.event_id) for r in conn.execute(_LOCK_EVENTS, params)}


# Opt-in: the UPDATE locks the row until the caller commits, so every further copy of
# a hot key queues behind it (docs/ingestion.md has the measurement).
_COUNT_DUPLICATES = text(
    """
    UPDATE outbox.inbox i SET duplicates = i.duplicates + t.c
      FROM unnest(CAST(:sources AS text[]), CAST(:event_ids AS text[]),
                  CAST(:counts AS int[])) AS t(s, e, c)
     WHERE i.source = t.s AND i.event_id = t.e
    """
)


def count_duplicates(conn: Connection, counts: dict[Key, int]) -> None:
    """Add to the in-row duplicate tallies; several rows: `lock_events` them first."""
    keys = sorted(counts)
    params = {"sources": [k[0] for k in keys], "event_ids": [k[1] for k in keys],
              "counts": [counts[k] for k in keys]}
    conn.execute(_COUNT_DUPLICATES, params)


# The counter is updated first: its row lock serialises the recorders of one event, and
# RETURNING gives the count as it was before this statement (re-read after any wait), so
# only the first :max_copies conflicts of an event keep their payload, however many
# copies arrive and however concurrently. A row purged meanwhile counts from zero.
_RECORD_CONFLICTS = text(
    f"""
    WITH t AS (
        SELECT s, e, f, p, n, row_number() OVER (PARTITION BY s, e ORDER BY n) AS k
          FROM unnest(CAST(:sources AS text[]), CAST(:event_ids AS text[]),
                      CAST(:fingerprints AS text[]), CAST(:payloads AS text[]))
               WITH ORDINALITY AS t(s, e, f, p, n)
    ), per_key AS (
        SELECT s, e, count(*) AS c FROM t GROUP BY s, e
    ), counted AS (
        UPDATE outbox.inbox i SET conflicts = i.conflicts + per_key.c
          FROM per_key
         WHERE i.source = per_key.s AND i.event_id = per_key.e
        RETURNING i.source, i.event_id, i.conflicts - per_key.c AS before
    )
    INSERT INTO outbox.inbox_conflicts (source, event_id, fingerprint, payload, received_at)
    SELECT t.s, t.e, t.f, CAST(t.p AS jsonb), {_NOW}
      FROM t LEFT JOIN counted ON counted.source = t.s AND counted.event_id = t.e
     WHERE coalesce(counted.before, 0) + t.k <= :max_copies
     ORDER BY t.n
    """
)


def record_conflicts(conn: Connection, conflicts: Sequence[NewEvent], max_copies: int,
                     now: datetime | None = None) -> None:
    """Count each refused copy on the stored event's row; keep the first `max_copies`.

    The counting UPDATE's lock order follows its plan: lock several rows with
    `lock_events` first (rows this transaction inserted need no lock).
    """
    rows = sorted(conflicts, key=lambda e: (e.source, e.event_id))
    params: dict[str, Any] = {
        "sources": [e.source for e in rows],
        "event_ids": [e.event_id for e in rows],
        "fingerprints": [e.fingerprint for e in rows],
        "payloads": [e.payload for e in rows],
        "max_copies": max_copies,
        "now": now,
    }
    conn.execute(_RECORD_CONFLICTS, params)


# The row is locked even when the WHERE is false, so the follow-up read of a refused
# version sees a value nobody can change before we commit.
_APPLY_VERSIONS = text(
    f"""
    INSERT INTO outbox.entity_versions AS ev
           (source, entity, version, event_id, fingerprint, updated_at)
    SELECT s, en, v, e, f, {_NOW}
      FROM unnest(CAST(:sources AS text[]), CAST(:entities AS text[]),
                  CAST(:versions AS bigint[]), CAST(:event_ids AS text[]),
                  CAST(:fingerprints AS text[]))
           WITH ORDINALITY AS t(s, en, v, e, f, n)
     ORDER BY n
    ON CONFLICT (source, entity) DO UPDATE
       SET version = EXCLUDED.version, event_id = EXCLUDED.event_id,
           fingerprint = EXCLUDED.fingerprint, updated_at = EXCLUDED.updated_at
     WHERE ev.version < EXCLUDED.version
    RETURNING ev.source, ev.entity
    """
)


def apply_versions(conn: Connection, candidates: Sequence[NewEvent],
                   now: datetime | None = None) -> set[Key]:
    """Move each entity to the candidate's version iff it is newer; returns those moved.

    At most one candidate per (source, entity): two would raise "ON CONFLICT DO UPDATE
    command cannot affect row a second time".
    """
    rows = sorted(candidates, key=lambda e: (e.source, e.entity or ""))
    params: dict[str, Any] = {
        "sources": [e.source for e in rows],
        "entities": [e.entity for e in rows],
        "versions": [e.version for e in rows],
        "event_ids": [e.event_id for e in rows],
        "fingerprints": [e.fingerprint for e in rows],
        "now": now,
    }
    return {(r.source, r.entity) for r in conn.execute(_APPLY_VERSIONS, params)}


_GET_VERSIONS = text(
    """
    SELECT ev.source, ev.entity, ev.version, ev.event_id, ev.fingerprint
      FROM unnest(CAST(:sources AS text[]), CAST(:entities AS text[])) AS k(s, en)
      JOIN outbox.entity_versions ev ON ev.source = k.s AND ev.entity = k.en
    """
)


def get_versions(conn: Connection, keys: Sequence[Key]) -> dict[Key, AppliedVersion]:
    """The applied version of each (source, entity) that has one."""
    params = {"sources": [k[0] for k in keys], "entities": [k[1] for k in keys]}
    return {(r.source, r.entity): AppliedVersion(r.version, r.event_id, r.fingerprint)
            for r in conn.execute(_GET_VERSIONS, params)}


_MARK_PROCESSED = text(
    f"""
    UPDATE outbox.inbox SET processed_at = {_NOW}
     WHERE source = :source AND event_id = :event_id AND processed_at IS NULL
    RETURNING 1
    """
)


def mark_processed(conn: Connection, source: str, event_id: str,
                   now: datetime | None = None) -> bool:
    """Flag an event recorded with processed=False as done; False if absent or done."""
    params = {"source": source, "event_id": event_id, "now": now}
    return conn.execute(_MARK_PROCESSED, params).first() is not None


# By primary key, never ctid: a row an ingestion updated (a conflict counted) after
# this statement's snapshot is locked at its new version, whose ctid the DELETE's
# snapshot cannot see, so a ctid match deleted nothing and ended the purge early (seen
# under load). SKIP LOCKED leaves rows an ingesting transaction holds for a later
# batch instead of waiting.
# What a purge of processed events deletes; a skipped row still matches it (`_REMAIN`).
_PROCESSED_OLD = f"""received_at < {_NOW} - make_interval(secs => :older_than)
              AND processed_at IS NOT NULL"""
_PURGE_PROCESSED = text(
    f"""
    DELETE FROM outbox.inbox
     WHERE (source, event_id) IN (
           SELECT source, event_id FROM outbox.inbox
            WHERE {_PROCESSED_OLD}
            ORDER BY received_at
            LIMIT :batch
              FOR UPDATE SKIP LOCKED)
    """
)


def purge_processed_events(conn: Connection, older_than_seconds: float, batch: int,
                           now: datetime | None = None) -> int:
    """Delete up to `batch` processed events received before the window; oldest first."""
    params = {"older_than": older_than_seconds, "batch": batch, "now": now}
    return conn.execute(_PURGE_PROCESSED, params).rowcount


# A plain read, no lock: it sees the rows a purge batch skipped because an ingestion
# held them (their committed version is still there).
_PROCESSED_EVENTS_REMAIN = text(
    f"""
    SELECT EXISTS (SELECT 1 FROM outbox.inbox WHERE {_PROCESSED_OLD})
    """
)


def processed_events_remain(conn: Connection, older_than_seconds: float,
                            now: datetime | None = None) -> bool:
    """Whether a processed event received before the window is still stored."""
    params = {"older_than": older_than_seconds, "now": now}
    return bool(conn.execute(_PROCESSED_EVENTS_REMAIN, params).scalar_one())


# Conflict copies are evidence, not state: nothing reads them back. Walking the primary
# key (ids grow with time) finds the old rows first without an index on received_at.
_CONFLICT_OLD = f"received_at < {_NOW} - make_interval(secs => :older_than)"
_PURGE_CONFLICTS = text(
    f"""
    DELETE FROM outbox.inbox_conflicts
     WHERE id = ANY(ARRAY(
           SELECT id FROM outbox.inbox_conflicts
            WHERE {_CONFLICT_OLD}
            ORDER BY id
            LIMIT :batch
              FOR UPDATE SKIP LOCKED))
    """
)


def purge_conflicts(conn: Connection, older_than_seconds: float, batch: int,
                    now: datetime | None = None) -> int:
    """Delete up to `batch` conflict copies received before the window; oldest first."""
    params = {"older_than": older_than_seconds, "batch": batch, "now": now}
    return conn.execute(_PURGE_CONFLICTS, params).rowcount


_CONFLICTS_REMAIN = text(
    f"""
    SELECT EXISTS (SELECT 1 FROM outbox.inbox_conflicts WHERE {_CONFLICT_OLD})
    """
)


def conflicts_remain(conn: Connection, older_than_seconds: float,
                     now: datetime | None = None) -> bool:
    """Whether a conflict copy received before the window is still stored."""
    params = {"older_than": older_than_seconds, "now": now}
    return bool(conn.execute(_CONFLICTS_REMAIN, params).scalar_one())


# One page of the primary key per call (keyset: `> after`), so the whole purge reads the
# table once, whatever its size, without an index on updated_at. Rows an ingestion holds
# (its upsert locks the row) are skipped; a row moved since the page was read is
# re-checked under its lock (READ COMMITTED) and kept.
_PURGE_VERSIONS = text(
    f"""
    WITH page AS (
        SELECT source, entity FROM outbox.entity_versions
         WHERE (source, entity) > (CAST(:after_source AS text), CAST(:after_entity AS text))
         ORDER BY source, entity
         LIMIT :batch
    ), gone AS (
        DELETE FROM outbox.entity_versions
         WHERE (source, entity) IN (
               SELECT ev.source, ev.entity FROM outbox.entity_versions ev
                 JOIN page ON ev.source = page.source AND ev.entity = page.entity
                WHERE ev.updated_at < {_NOW} - make_interval(secs => :older_than)
                  FOR UPDATE OF ev SKIP LOCKED)
        RETURNING 1
    ), last AS (
        SELECT source, entity FROM page ORDER BY source DESC, entity DESC LIMIT 1
    )
    SELECT (SELECT count(*) FROM gone) AS deleted, (SELECT count(*) FROM page) AS scanned,
           last.source, last.entity
      FROM (SELECT 1) AS one LEFT JOIN last ON true
    """
)


def purge_versions(conn: Connection, older_than_seconds: float, batch: int,
                   after: Key = ("", ""), now: datetime | None = None
                   ) -> tuple[int, Key | None]:
    """Delete the versions not moved within the window among the next `batch` entities.

    Returns (deleted, the last key read, or None once the table is exhausted).
    """
    params = {"older_than": older_than_seconds, "batch": batch, "after_source": after[0],
              "after_entity": after[1], "now": now}
    row = conn.execute(_PURGE_VERSIONS, params).one()
    last = None if row.scanned < batch else (str(row.source), str(row.entity))
    return int(row.deleted), last
