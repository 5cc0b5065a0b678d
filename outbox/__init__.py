"""Idempotency keys, a transactional outbox and idempotent ingestion for PostgreSQL.

Everything here runs inside the caller's transaction and never commits it; the
`dispatcher` package delivers the effects afterwards.
"""

from outbox._canonical import (
    canonical_json,
    fingerprint,
    parse_idempotency_key,
    parse_json_body,
)
from outbox._config import database_url, make_engine
from outbox._enqueue import Effect, Enqueued, add_doorbell, enqueue, enqueue_many, remove_doorbell
from outbox._idempotency import Claim, IdempotencyGuard, Result, StoredResponse
from outbox._inbox import (
    Inbox,
    IncomingEvent,
    IngestResult,
    ingest,
    ingest_many,
    mark_processed,
    parse_event,
    parse_event_batch,
    purge_inbox,
)
from outbox._schema import AttemptOutcome, EffectStatus, InboxOutcome, KeyStatus

__all__ = [
    "AttemptOutcome",
    "Claim",
    "Effect",
    "EffectStatus",
    "Enqueued",
    "IdempotencyGuard",
    "Inbox",
    "InboxOutcome",
    "IncomingEvent",
    "IngestResult",
    "KeyStatus",
    "Result",
    "StoredResponse",
    "add_doorbell",
    "canonical_json",
    "database_url",
    "enqueue",
    "enqueue_many",
    "fingerprint",
    "ingest",
    "ingest_many",
    "make_engine",
    "mark_processed",
    "parse_event",
    "parse_event_batch",
    "parse_idempotency_key",
    "parse_json_body",
    "purge_inbox",
    "remove_doorbell",
]
