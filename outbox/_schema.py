"""The tables, as SQLAlchemy Core metadata; migrations must produce exactly this.

State machines are explicit: every status column has a Python `StrEnum` and a CHECK
constraint that holds the status to it and ties each status to the columns it needs
(a lease only while in flight, a response only once completed). See
docs/architecture.md.
"""

from __future__ import annotations

from enum import StrEnum

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID

SCHEMA = "outbox"

metadata = MetaData(
    schema=SCHEMA,
    naming_convention={
        "ix": "%(table_name)s_%(column_0_N_name)s_idx",
        "uq": "%(table_name)s_%(column_0_name)s_key",
        "ck": "%(table_name)s_%(constraint_name)s_check",
        "fk": "%(table_name)s_%(column_0_name)s_fkey",
        "pk": "%(table_name)s_pkey",
    },
)


class KeyStatus(StrEnum):
    PROCESSING = "processing"
    COMPLETED = "completed"


class EffectStatus(StrEnum):
    PENDING = "pending"
    IN_FLIGHT = "in_flight"
    DELIVERED = "delivered"
    FAILED = "failed"
    CANCELLED = "cancelled"
    NEEDS_REVIEW = "needs_review"


class AttemptOutcome(StrEnum):
    DELIVERED = "delivered"
    RETRY = "retry"
    FAILED = "failed"
    LEASE_LOST = "lease_lost"
    AMBIGUOUS = "ambiguous"


def _in(column: str, values: type[StrEnum]) -> str:
    return f"{column} IN ({', '.join(repr(v.value) for v in values)})"


# Each table's rules are one CHECK calling a PL/pgSQL function of these columns
# (migration 0013): PostgreSQL re-parses and re-plans every CHECK expression for each
# statement that writes the table, a call node is cheap to rebuild, and the function
# keeps its compiled rules for the session (docs/architecture.md, "Row rules").
EFFECT_RULE_COLUMNS = ("status", "effect_key", "attempts", "max_attempts", "lease_token",
                       "lease_expires_at", "lease_owner", "delivered_at", "finished_at",
                       "delivered_by", "delivered_started_at")
KEY_RULE_COLUMNS = ("status", "key", "lock_token", "locked_at", "lock_expires_at",
                    "response_status", "completed_at")

TS = DateTime(timezone=True)
NOW = text("now()")

idempotency_keys = Table(
    "idempotency_keys",
    metadata,
    Column("scope", Text, nullable=False),
    Column("key", Text, nullable=False),
    Column("fingerprint", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("lock_token", UUID(as_uuid=True)),
    Column("locked_at", TS),
    Column("lock_expires_at", TS),  # the claim's own TTL (migration 0002)
    Column("response_status", Integer),
    Column("response_headers", JSONB),
    Column("response_body", LargeBinary),
    Column("created_at", TS, nullable=False, server_default=NOW),
    Column("completed_at", TS),
    Column("expires_at", TS, nullable=False),
    # Effect keys derive from it: new on insert, kept by a take-over (migration 0002).
    Column("generation", UUID(as_uuid=True)),
    # A hash of the request's business identity, when the application declares one
    # (`same_request=`): the same request under another key is reported (migration 0005).
    Column("business_hash", Text),
    PrimaryKeyConstraint("scope", "key"),
    # The rules (migration 0013, outbox.key_row_ok): status in KeyStatus; key 1-255
    # characters; a processing row has its lock (token, taken, expiry) and no response,
    # a completed one its response and completion time and no lock expiry.
    CheckConstraint(f"outbox.key_row_ok({', '.join(KEY_RULE_COLUMNS)})", name="row"),
    Index("idempotency_keys_expires_at_idx", "expires_at"),
    # Phased claims only, for the console's stale-claim count (migration 0004).
    Index("idempotency_keys_processing_idx", "lock_expires_at",
          postgresql_where=text("status = 'processing'")),
    # The newest keys of one business identity per scope (migration 0005).
    Index("idempotency_keys_business_idx", "scope", "business_hash", "created_at",
          postgresql_where=text("business_hash IS NOT NULL")),
)

# Storage settings (fillfactor 80, aggressive autovacuum) are set by migration 0001:
# SQLAlchemy has no table option for them. tests/test_schema.py checks they are there.
effects = Table(
    "effects",
    metadata,
    Column("id", BigInteger, Identity(always=False), primary_key=True),
    Column("effect_key", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("payload", JSONB, nullable=False),
    Column("headers", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("ordering_key", Text),
    Column("queue", Text, nullable=False, server_default=text("'default'")),
    Column("status", Text, nullable=False, server_default=text("'pending'")),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("max_attempts", Integer, nullable=False, server_default=text("25")),
    Column("available_at", TS, nullable=False, server_default=NOW),
    Column("retry_until", TS),
    Column("lease_owner", Text),
    Column("lease_token", UUID(as_uuid=True)),
    Column("lease_expires_at", TS),
    Column("created_at", TS, nullable=False, server_default=NOW),
    Column("delivered_at", TS),
    Column("finished_at", TS),
    Column("last_error", Text),
    Column("result", JSONB),
    # The delivered attempt (migration 0006): written by the record UPDATE instead of an
    # outbox.attempts row; outbox.attempt_history shows it with the other attempts.
    Column("delivered_by", Text),
    Column("delivered_started_at", TS),
    Column("delivered_http_status", Integer),
    Column("delivered_trace_id", Text),
    # The first claim (migration 0011): the earliest the receiver can have seen the
    # key, from which a kind's key_retention counts (F24). Kept by later claims.
    Column("first_claimed_at", TS),
    # Unique through outbox.effect_keys (migration 0007), not an index here: the claim
    # and the record would add an entry to it at every update.
    # The rules (migration 0013, outbox.effect_row_ok): status in EffectStatus; key
    # 1-255 characters; attempts >= 0, max_attempts >= 1; a lease (token, owner,
    # expiry, all or none) iff in flight; delivered_at iff delivered; the delivered
    # attempt's columns only on a delivered row; finished_at iff finished.
    CheckConstraint(f"outbox.effect_row_ok({', '.join(EFFECT_RULE_COLUMNS)})", name="row"),
    # The claim's hot path: due pending rows per queue, oldest first.
    Index(
        "effects_pending_idx",
        "queue",
        "available_at",
        "id",
        postgresql_where=text("status = 'pending'"),
    ),
    # Lease rescue scans only in-flight rows (a set bounded by the workers' slots).
    Index("effects_in_flight_idx", "queue", postgresql_where=text("status = 'in_flight'")),
    # Per-key ordering: the head of each key among unfinished rows.
    Index(
        "effects_ordering_idx",
        "ordering_key",
        "id",
        postgresql_where=text(
            "ordering_key IS NOT NULL"
            " AND status IN ('pending', 'in_flight', 'failed', 'needs_review')"),
    ),
    # Retention: finished rows by age.
    Index(
        "effects_finished_at_idx",
        "finished_at",
        postgresql_where=text("finished_at IS NOT NULL"),
    ),
    # The console's list and counts, per status in id order; no entry for in-flight or
    # delivered rows, so claims and deliveries never write to it (migration 0004).
    Index(
        "effects_console_idx",
        "status",
        "id",
        postgresql_include=["queue"],
        postgresql_where=text("status IN ('pending', 'failed', 'needs_review', 'cancelled')"),
    ),
)

# The arbiter of effect-key uniqueness (migration 0007): one row per effect, written
# by the enqueue that creates the effect and deleted with it (a statement-level trigger
# on outbox.effects, migration 0008: one set-based DELETE per statement, where a foreign
# key's cascade ran one per row). Never updated, so the dispatcher's updates of
# outbox.effects touch no key index.
effect_keys = Table(
    "effect_keys",
    metadata,
    Column("effect_key", Text, primary_key=True),
    Column("effect_id", BigInteger, nullable=False),
    CheckConstraint("length(effect_key) BETWEEN 1 AND 255", name="effect_key_length"),
    Index("effect_keys_effect_id_idx", "effect_id"),
)

attempts = Table(
    "attempts",
    metadata,
    Column("id", BigInteger, Identity(always=False), primary_key=True),
    # Deleted with its effect by the same trigger as the key (migration 0008).
    Column("effect_id", BigInteger, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("worker", Text, nullable=False),
    Column("started_at", TS, nullable=False),
    Column("finished_at", TS, nullable=False, server_default=NOW),
    Column("outcome", Text, nullable=False),
    Column("http_status", Integer),
    Column("error", Text),
    Column("trace_id", Text),
    CheckConstraint(_in("outcome", AttemptOutcome), name="outcome"),
    Index("attempts_effect_id_idx", "effect_id", "attempt"),
    # Appended in time order: a BRIN index finds the last hour for the console's chart.
    Index("attempts_finished_at_idx", "finished_at", postgresql_using="brin",
          postgresql_with={"pages_per_range": 32}),
)


class ConsoleAction(StrEnum):
    RETRY = "retry"
    CANCEL = "cancel"
    REDRIVE = "redrive"


class ConsoleOutcome(StrEnum):
    DONE = "done"
    REFUSED = "refused"


# The console's audit: who asked for which retry, cancel or redrive, and what changed.
console_actions = Table(
    "console_actions",
    metadata,
    Column("id", BigInteger, Identity(always=False), primary_key=True),
    Column("at", TS, nullable=False, server_default=NOW),
    Column("actor", Text, nullable=False),
    Column("action", Text, nullable=False),
    Column("outcome", Text, nullable=False),
    Column("effect_ids", ARRAY(BigInteger), nullable=False,
           server_default=text("'{}'::bigint[]")),
    Column("request", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    CheckConstraint(_in("action", ConsoleAction), name="action"),
    CheckConstraint(_in("outcome", ConsoleOutcome), name="outcome"),
)


class InboxOutcome(StrEnum):
    INSERTED = "inserted"
    DUPLICATE = "duplicate"
    CONFLICT = "conflict"
    STALE = "stale"


inbox = Table(
    "inbox",
    metadata,
    Column("source", Text, nullable=False),
    Column("event_id", Text, nullable=False),
    Column("fingerprint", Text, nullable=False),
    Column("version", BigInteger),
    Column("entity", Text),
    Column("payload", JSONB, nullable=False),
    Column("received_at", TS, nullable=False, server_default=NOW),
    Column("processed_at", TS),
    Column("duplicates", Integer, nullable=False, server_default=text("0")),
    Column("conflicts", Integer, nullable=False, server_default=text("0")),
    PrimaryKeyConstraint("source", "event_id"),
    CheckConstraint("length(event_id) BETWEEN 1 AND 255", name="event_id_length"),
    CheckConstraint("length(source) BETWEEN 1 AND 255", name="source_length"),
    CheckConstraint("version IS NULL OR version >= 0", name="version"),
    Index("inbox_received_at_idx", "received_at"),
)

# A conflicting replay (same event id, other payload) is never applied; it is kept here.
inbox_conflicts = Table(
    "inbox_conflicts",
    metadata,
    Column("id", BigInteger, Identity(always=False), primary_key=True),
    Column("source", Text, nullable=False),
    Column("event_id", Text, nullable=False),
    Column("fingerprint", Text, nullable=False),
    Column("payload", JSONB, nullable=False),
    Column("received_at", TS, nullable=False, server_default=NOW),
    Index("inbox_conflicts_source_idx", "source", "event_id"),
)

# The newest applied version per (source, entity): the guard against stale events.
entity_versions = Table(
    "entity_versions",
    metadata,
    Column("source", Text, nullable=False),
    Column("entity", Text, nullable=False),
    Column("version", BigInteger, nullable=False),
    Column("event_id", Text, nullable=False),
    Column("fingerprint", Text, nullable=False),
    Column("updated_at", TS, nullable=False, server_default=NOW),
    PrimaryKeyConstraint("source", "entity"),
    CheckConstraint("version >= 0", name="version"),
)
