"""The payments service's own table, in its own schema (not managed by Alembic).

The example owns its business table so the library's migrations stay about the outbox;
`ensure_schema` is idempotent and safe to call from several processes at once.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    Engine,
    Identity,
    MetaData,
    Table,
    Text,
    text,
)

SCHEMA = "payments"
CURRENCIES = ("EUR", "USD", "GBP", "CHF", "JPY")
MAX_AMOUNT = 10**12  # minor units; far below bigint, so no overflow can become a 500
MAX_CUSTOMER = 200

metadata = MetaData(schema=SCHEMA)

payments = Table(
    "payments",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("amount", BigInteger, nullable=False),
    Column("currency", Text, nullable=False),
    Column("customer", Text, nullable=False),
    Column("status", Text, nullable=False, server_default=text("'pending'")),
    Column("idempotency_key", Text),
    Column("owner", Text),  # the client identity that created it; only it may read it
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    CheckConstraint(f"amount > 0 AND amount <= {MAX_AMOUNT}", name="payments_amount_check"),
    CheckConstraint("currency ~ '^[A-Z]{3}$'", name="payments_currency_check"),
    CheckConstraint(f"length(customer) BETWEEN 1 AND {MAX_CUSTOMER}",
                    name="payments_customer_check"),
)

# Any constant works: it only serialises concurrent ensure_schema() calls.
_DDL_LOCK = 0x7061796D656E7473  # "payments"


def ensure_schema(engine: Engine) -> None:
    """Create schema `payments` and its table if missing (racing starters serialise)."""
    with engine.begin() as conn:
        conn.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": _DDL_LOCK})
        conn.execute(text(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}"))
        metadata.create_all(conn, checkfirst=True)
        # Tables created before payments had owners (an upgraded demo database).
        conn.execute(text(f"ALTER TABLE {SCHEMA}.payments ADD COLUMN IF NOT EXISTS owner text"))
