"""Lock waits on the outbox schema's tables, from PostgreSQL's own lock table.

What a hot key or a long transaction does to the writers (issue 15): sessions that wait
for a heavyweight lock (`pg_locks.granted = false`), attributed to one of our tables,
and how long the longest of them has waited (`waitstart`, PostgreSQL 14+).

Read from `pg_locks` alone, once (a MATERIALIZED CTE: each read of the view takes every
lock-manager partition briefly). `pg_stat_activity`'s `wait_event_type`/`wait_event`
say the same thing (`Lock` / the lock type) but are NULL for other roles' sessions
unless the reader has `pg_read_all_stats`; `pg_locks` is readable by every role.

A waiter is counted under a table of ours when
1. the lock it waits for is on that table or one of its indexes (a relation, page or
   tuple lock: the second and later waiters for one row queue on its tuple lock), else
2. it holds a tuple lock on that table (the first waiter for a row holds the tuple
   lock and waits for the holder's transaction id), else
3. its transaction has that table open (a unique-key insert waits for the transaction
   that inserted the same key: no tuple lock; the first of its tables by name when it
   has several open).
Waits of sessions with none of our tables open are not ours and are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from outbox._driver import Query, Result, sql

_LOCK_WAITS = sql(
    """
    WITH locks AS MATERIALIZED (
        SELECT pid, locktype, relation, database, granted, waitstart
          FROM pg_locks
         WHERE pid <> pg_backend_pid()),
    ours AS (
        SELECT c.oid, coalesce(t.relname, c.relname) AS tbl
          FROM pg_class c
          JOIN pg_namespace n ON n.oid = c.relnamespace
          LEFT JOIN pg_index i ON i.indexrelid = c.oid
          LEFT JOIN pg_class t ON t.oid = i.indrelid
         WHERE n.nspname = 'outbox' AND c.relkind IN ('r', 'p', 'i', 'I')),
    here AS (
        SELECT l.*, o.tbl
          FROM locks l
          LEFT JOIN ours o
            ON o.oid = l.relation
           AND l.database = (SELECT oid FROM pg_database
                              WHERE datname = current_database())),
    waiting AS (
        SELECT w.pid,
               coalesce(w.tbl,
                        (SELECT min(h.tbl) FROM here h
                          WHERE h.pid = w.pid AND h.granted AND h.locktype = 'tuple'),
                        (SELECT min(h.tbl) FROM here h
                          WHERE h.pid = w.pid AND h.granted)) AS tbl,
               coalesce(extract(epoch FROM clock_timestamp() - w.waitstart), 0) AS waited
          FROM here w
         WHERE NOT w.granted)
    SELECT tbl, count(DISTINCT pid) AS sessions, max(waited)::float8 AS longest
      FROM waiting
     WHERE tbl IS NOT NULL
     GROUP BY tbl
    """
)


@dataclass(frozen=True, slots=True)
class LockWaits:
    """Sessions waiting for a lock now, and the longest wait so far, per table of ours."""

    sessions: int
    longest_seconds: float


def lock_waits() -> Query[dict[str, LockWaits]]:
    """{table: LockWaits} for the outbox tables with at least one waiter right now."""
    return Query(_LOCK_WAITS, {}, _by_table)


def _by_table(result: Result) -> dict[str, LockWaits]:
    return {row.tbl: LockWaits(int(row.sessions), float(row.longest)) for row in result}
