"""Table health: what an operator needs to see bloat coming (issue 12).

The known way a PostgreSQL queue dies: a long transaction elsewhere (or a replication
slot, or a forgotten prepared transaction) holds the xmin horizon, VACUUM cannot remove
the rows our workers delete and update, and every claim scans more dead ones. Two reads:

- `table_health()`: live and dead tuples and the last (auto)vacuum of each table in the
  `outbox` schema, from `pg_stat_user_tables`. Cumulative statistics: a session's
  changes show up when it reports them (at the latest about a second after it commits
  and goes idle), and VACUUM resets `n_dead_tup` to what it could not remove.
- `xmin_horizon()`: per kind of holder, the oldest xmin in this database in
  transactions (`age()`), and how long its transaction has been open where PostgreSQL
  knows it (sessions: `xact_start`, which other roles' sessions hide unless the reader
  has `pg_read_all_stats`; prepared transactions: `prepared`; slots: never).
  `backend_xid`/`backend_xmin` are visible to every role. Only sessions of this
  database (and WAL senders, whose hot-standby feedback holds every database) hold
  our tables' horizon (PostgreSQL 14+); the reading session itself is left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from outbox._driver import Query, Result, sql

_TABLE_HEALTH = sql(
    """
    SELECT relname AS tbl, n_live_tup, n_dead_tup,
           extract(epoch FROM now() - last_autovacuum)::float8 AS since_autovacuum,
           extract(epoch FROM now() - greatest(last_vacuum, last_autovacuum))::float8
               AS since_vacuum
      FROM pg_stat_user_tables
     WHERE schemaname = 'outbox'
    """
)


@dataclass(frozen=True, slots=True)
class TableHealth:
    """One table's tuples and vacuum ages (None: never vacuumed since stats reset)."""

    live_tuples: int
    dead_tuples: int
    since_autovacuum: float | None
    since_vacuum: float | None  # manual or automatic, whichever was later


def table_health() -> Query[dict[str, TableHealth]]:
    """{table: TableHealth} for the tables of the `outbox` schema."""
    return Query(_TABLE_HEALTH, {}, _tables)


def _tables(result: Result) -> dict[str, TableHealth]:
    return {r.tbl: TableHealth(int(r.n_live_tup), int(r.n_dead_tup), r.since_autovacuum,
                               r.since_vacuum) for r in result}


#: The kinds of xmin holders, as reported (a bounded `holder` label).
HOLDERS = ("session", "replication_slot", "prepared_xact")

_XMIN_HORIZON = sql(
    """
    WITH holders AS (
        SELECT 'session' AS holder,
               greatest(age(backend_xid), age(backend_xmin)) AS xid_age,
               extract(epoch FROM now() - xact_start) AS seconds
          FROM pg_stat_activity
         WHERE pid <> pg_backend_pid()
           AND (backend_xid IS NOT NULL OR backend_xmin IS NOT NULL)
           AND (datname = current_database() OR backend_type = 'walsender')
        UNION ALL
        SELECT 'replication_slot', age(xmin), NULL
          FROM pg_replication_slots
         WHERE xmin IS NOT NULL
           AND (database IS NULL OR database = current_database())
        UNION ALL
        SELECT 'prepared_xact', age(transaction), extract(epoch FROM now() - prepared)
          FROM pg_prepared_xacts
         WHERE database = current_database())
    SELECT holder, count(*) AS holders, max(xid_age)::bigint AS xid_age,
           max(seconds)::float8 AS seconds
      FROM holders
     GROUP BY holder
    """
)


@dataclass(frozen=True, slots=True)
class HorizonHolder:
    """The oldest xmin of one kind of holder: its age in transactions, and in seconds
    where PostgreSQL knows when its transaction began (None otherwise)."""

    holders: int
    xid_age: int
    seconds: float | None


_IDLE_IN_TRANSACTION_TIMEOUT = sql("SHOW idle_in_transaction_session_timeout")


def idle_in_transaction_timeout() -> Query[str | None]:
    """The session's `idle_in_transaction_session_timeout` (run on a plain connection
    it is what the server, database and role give other clients)."""
    return Query(_IDLE_IN_TRANSACTION_TIMEOUT, {}, _setting)


def _setting(result: Result) -> str | None:
    value = result.scalar()
    return None if value is None else str(value)


def xmin_horizon() -> Query[dict[str, HorizonHolder]]:
    """{holder kind: HorizonHolder} for the kinds holding an xmin in this database now."""
    return Query(_XMIN_HORIZON, {}, _holders)


def _holders(result: Result) -> dict[str, HorizonHolder]:
    return {r.holder: HorizonHolder(int(r.holders), int(r.xid_age or 0), r.seconds)
            for r in result}
