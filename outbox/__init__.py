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
from outbox._config import bound_calls, database_url, libpq_dsn, make_engine
from outbox._enqueue import (
    Effect,
    Enqueued,
    add_doorbell,
    aenqueue,
    aenqueue_many,
    enqueue,
    enqueue_many,
    remove_doorbell,
)
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
    purge_entity_versions,
    purge_inbox,
    purge_inbox_conflicts,
)
from outbox._schema import AttemptOutcome, EffectStatus, InboxOutcome, KeyStatus
from outbox.webhooks import (
    GitHubSignature,
    StandardWebhooks,
    StripeSignature,
    WebhookSources,
)

__all__ = [
    "AttemptOutcome",
    "Claim",
    "Effect",
    "EffectStatus",
    "Enqueued",
    "GitHubSignature",
    "IdempotencyGuard",
    "Inbox",
    "InboxOutcome",
    "IncomingEvent",
    "IngestResult",
    "KeyStatus",
    "Result",
    "StandardWebhooks",
    "StoredResponse",
    "StripeSignature",
    "WebhookSources",
    "add_doorbell",
    "aenqueue",
    "aenqueue_many",
    "bound_calls",
    "canonical_json",
    "database_url",
    "enqueue",
    "enqueue_many",
    "fingerprint",
    "ingest",
    "ingest_many",
    "libpq_dsn",
    "make_engine",
    "mark_processed",
    "parse_event",
    "parse_event_batch",
    "parse_idempotency_key",
    "parse_json_body",
    "purge_entity_versions",
    "purge_inbox",
    "purge_inbox_conflicts",
    "remove_doorbell",
]
