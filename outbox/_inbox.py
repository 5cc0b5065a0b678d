"""Idempotent ingestion: each incoming event is recorded and processed once per
(source, event_id), and a replay whose payload changed is caught, never applied.

Everything runs in the caller's transaction (READ COMMITTED) and never commits. The
primary key decides between concurrent copies: `INSERT ... ON CONFLICT DO NOTHING`
makes every twin wait for the first copy's transaction, so a twin answers "duplicate"
only once the first copy is committed, and takes over if it rolls back.
Out-of-order events of one entity go through a conditional upsert on
`entity_versions`: only a newer version is applied. See docs/ingestion.md.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

from outbox._canonical import DEFAULT_MAX_BODY, _check_strings, json_fingerprint, parse_json_body
from outbox._idempotency import Clock, Connectable, database_clock
from outbox._schema import InboxOutcome
from outbox._telemetry import (
    inbox_events,
    inbox_write_duration,
    register_source_label,
    source_label,
    tracer,
)
from outbox.errors import (
    ConfigurationError,
    InvalidEvent,
    InvalidRequestBody,
    OutboxError,
    RequestBodyTooLarge,
    RetentionTooShort,
)
from outbox.sql import inbox as sql

MAX_ID_LENGTH = 255
# The default bound: the largest integer every JSON implementation (JavaScript's
# Number.MAX_SAFE_INTEGER, I-JSON) keeps exact, and below which the fingerprint's
# canonical form folds `1.0` into `1`. A version above it is a 400: a forged 2^63-1
# would otherwise make every later event of its entity stale for good.
MAX_VERSION = 2**53 - 1
BIGINT_MAX = 2**63 - 1  # the column's limit: the most `max_version=` may allow
MAX_BATCH = 10_000
# Each stored event keeps the payloads of its first conflicts only: a sender (or an
# attacker) repeating 1 MiB conflicting copies must not grow the table without bound.
# `inbox.conflicts` and the `outbox.inbox.events` counter still count every copy.
MAX_CONFLICT_COPIES = 10
DEFAULT_PURGE_BATCH = 500
# How long a purge keeps looking for rows its batches skipped because an ingestion held
# them, and how often: an ingestion holds a row for one short transaction.
PURGE_SETTLE = 0.5
PURGE_SETTLE_POLL = 0.02
_INSERT_ATTEMPTS = 5

Key = tuple[str, str]


@dataclass(frozen=True, slots=True)
class IncomingEvent:
    """One event as a sender delivered it; `payload` is what gets fingerprinted."""

    source: str
    event_id: str
    payload: Any
    version: int | None = None
    entity: str | None = None


@dataclass(frozen=True, slots=True)
class IngestResult:
    """What `ingest` decided for one event.

    `recorded`: this call inserted the inbox row (true for `inserted`, and for `stale`
    or version `conflict` events seen for the first time). `within_batch`: an earlier
    copy of the same key in the same batch decided the outcome. `stored_fingerprint`:
    what the inbox holds for the key. `applied_version`: the entity's version in force
    after this call, for recorded events with an entity (a copy of a known key does not
    read it: duplicates stay one cheap read).
    """

    outcome: InboxOutcome
    source: str
    event_id: str
    fingerprint: str
    version: int | None = None
    entity: str | None = None
    recorded: bool = False
    within_batch: bool = False
    stored_fingerprint: str | None = None
    applied_version: int | None = None

    @property
    def is_new(self) -> bool:
        """True when the caller must process the event now (and only then)."""
        return self.outcome is InboxOutcome.INSERTED


# -- validation --------------------------------------------------------------------


def _check_identifier(name: str, value: object) -> str:
    """1-255 printable ASCII characters, like an Idempotency-Key (no NFC/NFD twins)."""
    if not isinstance(value, str) or not value:
        raise InvalidEvent(f"{name} is required and must be a non-empty string")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidEvent(f"{name} is longer than {MAX_ID_LENGTH} characters")
    if not all(0x21 <= ord(c) <= 0x7E for c in value):
        raise InvalidEvent(f"{name} may contain printable ASCII characters only")
    return value


def _check_bound(max_version: int) -> int:
    if isinstance(max_version, bool) or not isinstance(max_version, int) \
            or not 0 <= max_version <= BIGINT_MAX:
        raise ConfigurationError(f"max_version must be an integer in 0..{BIGINT_MAX}")
    return max_version


def _check_version(value: object, max_version: int = MAX_VERSION) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidEvent("version must be an integer")
    if not 0 <= value <= max_version:
        raise InvalidEvent(f"version must be between 0 and {max_version}")
    return value


def _prepare(event: IncomingEvent, max_version: int = MAX_VERSION) -> sql.NewEvent:
    """Validate before any SQL: a bad event must be a 400, never a 500 mid-transaction."""
    source = _check_identifier("source", event.source)
    event_id = _check_identifier("event id", event.event_id)
    version = _check_version(event.version, _check_bound(max_version))
    entity = None if event.entity is None else _check_identifier("entity", event.entity)
    try:
        _check_strings(event.payload)
        payload = json.dumps(event.payload, allow_nan=False, separators=(",", ":"))
        fp = json_fingerprint({"payload": event.payload, "version": version, "entity": entity})
    except InvalidRequestBody as exc:
        raise InvalidEvent(f"payload: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise InvalidEvent(f"payload is not JSON-serialisable: {exc}") from None
    return sql.NewEvent(source, event_id, fp, version, entity, payload)


def _event_from_object(source: str, body: object, max_version: int) -> IncomingEvent:
    if not isinstance(body, dict):
        raise InvalidEvent("an event is a JSON object")
    event_id = _check_identifier("id", body.get("id"))
    kind = body.get("type")
    if not isinstance(kind, str) or not 1 <= len(kind) <= MAX_ID_LENGTH:
        raise InvalidEvent(f"type is required: a string of 1-{MAX_ID_LENGTH} characters")
    version = _check_version(body.get("version"), max_version)
    entity = body.get("entity")
    if entity is not None:
        _check_identifier("entity", entity)
    if not isinstance(body.get("data"), dict):
        raise InvalidEvent("data is required and must be a JSON object")
    # The id is the key (stored in its own column); leaving it out of the payload lets
    # a resend of the same state under a new id compare equal at the same version.
    payload = {k: v for k, v in body.items() if k != "id"}
    return IncomingEvent(source, event_id, payload, version, entity)


def _parse_body(source: str, raw_body: bytes, max_bytes: int) -> Any:
    _check_identifier("source", source)
    try:
        return parse_json_body(raw_body, max_bytes=max_bytes)
    except RequestBodyTooLarge:
        raise
    except InvalidRequestBody as exc:
        raise InvalidEvent(str(exc)) from None


def parse_event(source: str, raw_body: bytes, *, max_bytes: int = DEFAULT_MAX_BODY,
                max_version: int = MAX_VERSION) -> IncomingEvent:
    """Validate a webhook body `{"id", "type", "version"?, "entity"?, "data"}`.

    Raises `InvalidEvent` (400) for every refusal except a body over `max_bytes`
    (`RequestBodyTooLarge`, 413); nothing is stored for a refused body. The payload
    is the body without its `id`. Unknown top-level members are kept. A version above
    `max_version` (default 2^53-1, at most 2^63-1) is refused. Verify the signature
    of `raw_body` first (outbox.webhooks): this only checks its shape.
    """
    bound = _check_bound(max_version)
    return _event_from_object(source, _parse_body(source, raw_body, max_bytes), bound)


def parse_event_batch(source: str, raw_body: bytes, *, max_bytes: int = DEFAULT_MAX_BODY,
                      max_events: int = 1_000, max_version: int = MAX_VERSION
                      ) -> list[IncomingEvent]:
    """Validate a JSON array of events; repeated ids are allowed (`ingest_many` folds them)."""
    bound = _check_bound(max_version)
    body = _parse_body(source, raw_body, max_bytes)
    if not isinstance(body, list) or not body:
        raise InvalidEvent("a batch is a non-empty JSON array of events")
    if len(body) > max_events:
        raise InvalidEvent(f"a batch holds at most {max_events} events")
    return [_event_from_object(source, item, bound) for item in body]


# -- ingestion ---------------------------------------------------------------------


def _conn(target: Connectable) -> Connection:
    return target.connection() if isinstance(target, Session) else target


def _insert_all(conn: Connection, uniques: list[sql.NewEvent], processed: bool,
                now: datetime | None) -> tuple[set[Key], dict[Key, str]]:
    """Insert; read back what was there. A row purged in between is inserted again."""
    inserted: set[Key] = set()
    stored: dict[Key, str] = {}
    pending = uniques
    for _ in range(_INSERT_ATTEMPTS):
        if len(pending) == 1:
            e = pending[0]
            key = (e.source, e.event_id)
            new, fp = sql.insert_event(conn, e, processed=processed, now=now)
            if new:
                inserted.add(key)
                return inserted, stored
            if fp is not None:  # the hot path of a retry: one statement
                stored[key] = fp
                return inserted, stored
            got_in: set[Key] = set()
        else:
            got_in = sql.insert_events(conn, pending, processed=processed, now=now)
        inserted |= got_in
        rest = [e for e in pending if (e.source, e.event_id) not in got_in]
        if not rest:
            return inserted, stored
        if len(rest) == 1:
            fp = sql.get_fingerprint(conn, rest[0].source, rest[0].event_id)
            found = {} if fp is None else {(rest[0].source, rest[0].event_id): fp}
        else:
            found = sql.get_fingerprints(conn, [(e.source, e.event_id) for e in rest])
        stored.update(found)
        pending = [e for e in rest if (e.source, e.event_id) not in found]
        if not pending:
            return inserted, stored
    raise OutboxError("inbox rows kept vanishing between INSERT and SELECT; retry")


def _ingest(conn: Connection, prepared: Sequence[sql.NewEvent], *, processed: bool,
            count_duplicates: bool, clock: Clock) -> list[IngestResult]:
    if not prepared:
        return []
    now = clock()
    first: dict[Key, int] = {}
    for i, p in enumerate(prepared):
        first.setdefault((p.source, p.event_id), i)
    # Sorted: every transaction locks keys in the same order (no deadlock between
    # overlapping batches).
    uniques = sorted((prepared[i] for i in first.values()),
                     key=lambda e: (e.source, e.event_id))
    inserted, stored = _insert_all(conn, uniques, processed, now)
    for key in inserted:
        stored[key] = prepared[first[key]].fingerprint

    outcomes: list[InboxOutcome | None] = [None] * len(prepared)
    dup_counts: dict[Key, int] = {}
    key_conflicts: list[sql.NewEvent] = []
    for i, p in enumerate(prepared):
        key = (p.source, p.event_id)
        if key in inserted and first[key] == i:
            continue  # new: decided by its version below
        if p.fingerprint == stored[key]:
            outcomes[i] = InboxOutcome.DUPLICATE
            dup_counts[key] = dup_counts.get(key, 0) + 1
        else:
            outcomes[i] = InboxOutcome.CONFLICT
            key_conflicts.append(p)
    # Counters lock existing rows: all of them at once, in key order, before any
    # entity lock. Two counting statements each sorted on its own would not do: a
    # batch counting a conflict on x and a duplicate on y locks x then y, and one
    # with the roles swapped y then x (40P01).
    counted = {(p.source, p.event_id) for p in key_conflicts}
    if count_duplicates:
        counted |= dup_counts.keys()
    if len(counted) > 1:
        sql.lock_events(conn, sorted(counted))
    if key_conflicts:
        sql.record_conflicts(conn, key_conflicts, MAX_CONFLICT_COPIES, now=now)
    if count_duplicates and dup_counts:
        sql.count_duplicates(conn, dup_counts)

    applied = _decide_versions(conn, prepared, first, inserted, outcomes, now)

    results: list[IngestResult] = []
    for i, p in enumerate(prepared):
        key = (p.source, p.event_id)
        outcome = outcomes[i]
        assert outcome is not None
        recorded = key in inserted and first[key] == i
        current = applied.get((p.source, p.entity)) if recorded and p.entity else None
        results.append(IngestResult(
            outcome=outcome, source=p.source, event_id=p.event_id, fingerprint=p.fingerprint,
            version=p.version, entity=p.entity,
            recorded=recorded,
            within_batch=first[key] != i,
            stored_fingerprint=stored[key],
            applied_version=current.version if current is not None else None,
        ))
        inbox_events.add(1, {"source": source_label(p.source), "outcome": outcome.value})
    return results


def _decide_versions(conn: Connection, prepared: Sequence[sql.NewEvent],
                     first: dict[Key, int],
                     inserted: set[Key], outcomes: list[InboxOutcome | None],
                     now: datetime | None) -> dict[Key, sql.AppliedVersion]:
    """Outcomes of newly recorded events: the newest per entity is applied, if newer.

    Returns the version in force per (source, entity) touched by the call.
    """
    versioned: dict[Key, list[int]] = {}
    for key in inserted:
        i = first[key]
        p = prepared[i]
        if p.version is None or p.entity is None:
            outcomes[i] = InboxOutcome.INSERTED
        else:
            versioned.setdefault((p.source, p.entity), []).append(i)
    in_force: dict[Key, sql.AppliedVersion] = {}
    if not versioned:
        return in_force
    # One candidate per entity (the highest version, first in input order on a tie):
    # two rows for one entity in the upsert would raise SQLSTATE 21000.
    candidates: dict[Key, int] = {}
    for ent, idxs in versioned.items():
        idxs.sort()
        candidates[ent] = max(idxs, key=lambda i: (prepared[i].version or 0, -i))
    moved = sql.apply_versions(conn, [prepared[i] for i in candidates.values()], now=now)
    for ent, i in candidates.items():
        if ent in moved:
            p = prepared[i]
            assert p.version is not None
            in_force[ent] = sql.AppliedVersion(p.version, p.event_id, p.fingerprint)
    refused = [ent for ent in candidates if ent not in moved]
    if refused:
        in_force.update(sql.get_versions(conn, refused))
    version_conflicts: list[sql.NewEvent] = []
    for ent, idxs in versioned.items():
        cur = in_force[ent]
        for i in idxs:
            p = prepared[i]
            if ent in moved and candidates[ent] == i:
                outcomes[i] = InboxOutcome.INSERTED
            elif p.version == cur.version and p.fingerprint != cur.fingerprint:
                outcomes[i] = InboxOutcome.CONFLICT
                version_conflicts.append(p)
            else:
                outcomes[i] = InboxOutcome.STALE
    if version_conflicts:
        # Rows this transaction inserted: no other transaction can hold their locks,
        # so counting them after the entity locks adds no lock-order edge.
        sql.record_conflicts(conn, version_conflicts, MAX_CONFLICT_COPIES, now=now)
    return in_force


def ingest(target: Connectable, source: str, event_id: str, payload: Any,
           version: int | None = None, entity: str | None = None, *,
           processed: bool = True, count_duplicates: bool = False,
           max_version: int = MAX_VERSION, clock: Clock = database_clock) -> IngestResult:
    """Record one event in the caller's transaction; never commits.

    Outcomes: `inserted` (new: process it now, in this transaction), `duplicate` (same
    key, same fingerprint), `conflict` (same key with another payload, or the entity's
    current version with another payload: recorded, counted, never applied), `stale`
    (the entity already has this version or a newer one). A twin delivered
    concurrently waits until this transaction ends. `processed=False` leaves the row
    for `mark_processed` (retention purges processed rows only). `count_duplicates`
    keeps an exact in-row tally at the price of a row lock held until commit. A version
    above `max_version` (default 2^53-1) is refused with `InvalidEvent`.
    """
    event = _prepare(IncomingEvent(source, event_id, payload, version, entity), max_version)
    with tracer.start_as_current_span("outbox.ingest") as span:
        t0 = time.perf_counter()
        result = _ingest(_conn(target), [event], processed=processed,
                         count_duplicates=count_duplicates, clock=clock)[0]
        inbox_write_duration.record(time.perf_counter() - t0, {"source": source_label(source)})
        span.set_attribute("outbox.source", source)
        span.set_attribute("outbox.outcome", result.outcome.value)
        return result


def ingest_many(target: Connectable, events: Iterable[IncomingEvent], *,
                processed: bool = True, count_duplicates: bool = False,
                max_version: int = MAX_VERSION,
                clock: Clock = database_clock) -> list[IngestResult]:
    """Record a batch in the caller's transaction: one INSERT, outcomes in input order.

    Repeated keys are folded before the INSERT (the first copy is stored; later copies
    are duplicates or conflicts, `within_batch=True`), so a batch never fails with
    "cannot affect row a second time". Of several new versions of one entity only the
    newest is applied; the others are `stale`, as if they had arrived first.
    """
    batch = list(events)
    if len(batch) > MAX_BATCH:
        raise InvalidEvent(f"a batch holds at most {MAX_BATCH} events")
    prepared = [_prepare(e, max_version) for e in batch]
    with tracer.start_as_current_span("outbox.ingest_many") as span:
        span.set_attribute("outbox.events", len(batch))
        t0 = time.perf_counter()
        results = _ingest(_conn(target), prepared, processed=processed,
                          count_duplicates=count_duplicates, clock=clock)
        took = time.perf_counter() - t0
        for source in {e.source for e in prepared}:  # the batch's write, once per source
            inbox_write_duration.record(took, {"source": source_label(source)})
        return results


def mark_processed(target: Connectable, source: str, event_id: str, *,
                   clock: Clock = database_clock) -> bool:
    """Flag an event recorded with `processed=False` as done (so retention may purge it)."""
    return sql.mark_processed(_conn(target), source, event_id, now=clock())


# -- consumer ----------------------------------------------------------------------

Handler = Callable[[Any, IncomingEvent], object]
H = TypeVar("H", bound=Handler)


class Inbox:
    """Handlers per source, run once per new event, inside the inbox insert's savepoint.

    A handler's exception rolls back the inbox row and the handler's writes together
    (even if the caller then commits), and propagates: answer non-2xx so the sender
    redelivers, and the redelivery is processed again. A twin waiting on the same key
    takes over at once.
    """

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}
        self.horizons: dict[str, float] = {}

    def handler(self, source: str, *, redelivery_horizon: float | timedelta | None = None
                ) -> Callable[[H], H]:
        """Register `fn(target, event)` for `source`; `target` is what `process` got.

        `redelivery_horizon`: how long the sender may redeliver (Stripe: 3 days);
        `purge` refuses a shorter retention. The source becomes a metric label.
        """
        _check_identifier("source", source)
        register_source_label(source)

        def register(fn: H) -> H:
            if source in self._handlers:
                raise ConfigurationError(f"an inbox handler for {source!r} already exists")
            self._handlers[source] = fn
            if redelivery_horizon is not None:
                self.horizons[source] = _seconds(redelivery_horizon)
            return fn

        return register

    @property
    def sources(self) -> frozenset[str]:
        return frozenset(self._handlers)

    def process(self, target: Connectable, source: str, event_id: str, payload: Any,
                version: int | None = None, entity: str | None = None, *,
                max_version: int = MAX_VERSION, clock: Clock = database_clock
                ) -> IngestResult:
        """Ingest and, only if the event is new (or newer), run its handler; never commits."""
        return self.process_event(target, IncomingEvent(source, event_id, payload, version,
                                                        entity),
                                  max_version=max_version, clock=clock)

    def process_event(self, target: Connectable, event: IncomingEvent, *,
                      max_version: int = MAX_VERSION,
                      clock: Clock = database_clock) -> IngestResult:
        """`process` for an event from `parse_event`."""
        fn = self._handlers.get(event.source)
        if fn is None:
            raise ConfigurationError(f"no inbox handler for source {event.source!r}")
        # A refused event must not even open the savepoint.
        prepared = _prepare(event, max_version)
        with tracer.start_as_current_span("outbox.inbox.process") as span:
            span.set_attribute("outbox.source", event.source)
            with target.begin_nested():
                result = _ingest(_conn(target), [prepared], processed=True,
                                 count_duplicates=False, clock=clock)[0]
                if result.is_new:
                    fn(target, event)
            span.set_attribute("outbox.outcome", result.outcome.value)
            return result

    def purge(self, engine: Engine, older_than: float | timedelta, *,
              batch: int = DEFAULT_PURGE_BATCH) -> int:
        """`purge_inbox` with the horizons declared on the handlers."""
        return purge_inbox(engine, older_than, self.horizons, batch=batch)


# -- retention ---------------------------------------------------------------------


def _seconds(value: float | timedelta) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


_CONSEQUENCES = {
    "inbox": "its redeliveries would be processed twice",
    "inbox_conflicts": "the evidence would go before the copies stop coming",
    "entity_versions": "an older event could still arrive and be applied",
}


def check_retention(what: str, window: float, batch: int,
                    source_horizons: Mapping[str, float | timedelta] | None) -> None:
    """Refuse a `what` ("inbox", "inbox_conflicts", "entity_versions") window shorter
    than a declared redelivery horizon: `RetentionTooShort`, before any delete."""
    if window <= 0 or batch < 1:
        raise ConfigurationError("older_than must be positive and batch at least 1")
    for source, horizon in sorted((source_horizons or {}).items()):
        if window < _seconds(horizon):
            raise RetentionTooShort(
                f"{what} retention {window:g}s is shorter than the redelivery horizon "
                f"{_seconds(horizon):g}s of source {source!r}: {_CONSEQUENCES[what]}")


def _purge_batches(engine: Engine, step: Callable[[Connection], int],
                   remain: Callable[[Connection], bool], batch: int, pause: float,
                   settle: float = PURGE_SETTLE) -> int:
    """Delete batch after batch until none is left, then look again for skipped rows.

    A batch skips the rows an ingestion holds, so a short batch does not prove the
    window empty. A held row is held for one short transaction: while an old row is
    still there the purge tries again for up to `settle` seconds, and only a row held
    longer than that is left to the next run.
    """
    total = 0
    give_up: float | None = None
    while True:
        with engine.begin() as conn:
            deleted = step(conn)
            full = deleted >= batch
            left = full or remain(conn)  # a held row is still visible: it was skipped
        total += deleted
        if full:
            if pause > 0:
                time.sleep(pause)
            continue
        if not left:
            return total
        now = time.monotonic()
        give_up = now + settle if give_up is None else give_up
        if now >= give_up:
            return total
        time.sleep(PURGE_SETTLE_POLL)


def purge_inbox(engine: Engine, older_than: float | timedelta,
                source_horizons: Mapping[str, float | timedelta] | None = None, *,
                batch: int = DEFAULT_PURGE_BATCH, pause: float = 0.0,
                clock: Clock = database_clock) -> int:
    """Delete processed events received more than `older_than` (seconds) ago.

    One short transaction per `batch` rows, skipping rows an ingestion holds, so
    ingestion never queues behind the purge. A purged event that is redelivered is
    processed again: retention must exceed every source's redelivery horizon, and a
    shorter one raises `RetentionTooShort` before anything is deleted. Versioned
    entities stay protected while their `entity_versions` row is kept
    (`purge_entity_versions`).
    """
    window = _seconds(older_than)
    check_retention("inbox", window, batch, source_horizons)
    return _purge_batches(
        engine, lambda conn: sql.purge_processed_events(conn, window, batch, now=clock()),
        lambda conn: sql.processed_events_remain(conn, window, now=clock()), batch, pause)


def purge_inbox_conflicts(engine: Engine, older_than: float | timedelta,
                          source_horizons: Mapping[str, float | timedelta] | None = None,
                          *, batch: int = DEFAULT_PURGE_BATCH, pause: float = 0.0,
                          clock: Clock = database_clock) -> int:
    """Delete conflicting copies (`inbox_conflicts`) received more than `older_than` ago.

    They are evidence, never read back by ingestion: deleting one changes no outcome
    (the stored event and its `conflicts` count stay). The evidence of a copy must
    outlive the sender's redeliveries of it, so a window shorter than a declared
    horizon raises `RetentionTooShort` before anything is deleted.
    """
    window = _seconds(older_than)
    check_retention("inbox_conflicts", window, batch, source_horizons)
    return _purge_batches(
        engine, lambda conn: sql.purge_conflicts(conn, window, batch, now=clock()),
        lambda conn: sql.conflicts_remain(conn, window, now=clock()), batch, pause)


def purge_entity_versions(engine: Engine, older_than: float | timedelta,
                          source_horizons: Mapping[str, float | timedelta] | None = None,
                          *, batch: int = DEFAULT_PURGE_BATCH, pause: float = 0.0,
                          clock: Clock = database_clock) -> int:
    """Delete the applied version of entities that have not moved for `older_than`.

    A version row is what refuses an older event as `stale`. Every event with a
    version up to the stored one was created before the stored one arrived
    (`updated_at`), so once `updated_at` is older than every sender's redelivery
    horizon none of them can arrive any more, and the row guards nothing: the
    entity's next event is newer and starts a new row. A window shorter than a
    declared horizon raises `RetentionTooShort` before anything is deleted. Walks the
    primary key once, `batch` entities per short transaction, skipping rows an
    ingestion holds. See docs/ingestion.md, "Retention".
    """
    window = _seconds(older_than)
    check_retention("entity_versions", window, batch, source_horizons)
    total = 0
    after: Key | None = ("", "")
    while after is not None:
        with engine.begin() as conn:
            deleted, after = sql.purge_versions(conn, window, batch, after, now=clock())
        total += deleted
        if after is not None and pause > 0:
            time.sleep(pause)
    return total
