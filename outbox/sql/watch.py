"""A busy worker's watch over its queue, which silences the enqueue's doorbell.

The protocol and why it is safe: migration 0010 (`outbox.ring`) and dispatcher/watch.py.
The lock keys here must be the ones `outbox.ring` uses: the two-int advisory form, a key
space apart from the guard's bigint locks; (ENQUEUING, hashtext(queue)) is held shared
by every transaction that rang, or skipped ringing, for the queue; (SLOTS[i],
hashtext(queue)) is held by the i-th watcher of the queue, for its session.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from outbox._driver import Query, Result, sync_db
from outbox._driver import sql as _sql

ENQUEUING = 0x6F757463
SLOTS = tuple(range(0x6F757464, 0x6F757468))  # outbox.ring looks at these four

_TAKE_SLOT = _sql(
    "SELECT pg_try_advisory_lock(CAST(:slot AS int4), hashtext(:queue))")
_GIVE_SLOT = _sql(
    "SELECT pg_advisory_unlock(CAST(:slot AS int4), hashtext(:queue))")

# pg_locks shows a two-int advisory lock as (classid, objid) = the two keys as oids,
# objsubid = 2; hashtext's int4 is read as an unsigned oid there.
_ENQUEUERS = _sql(
    f"""
    SELECT coalesce(array_agg(virtualtransaction), CAST('{{}}' AS text[]))
      FROM pg_locks
     WHERE locktype = 'advisory' AND objsubid = 2 AND granted
       AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
       AND classid = CAST({ENQUEUING} AS oid)
       AND objid = CAST((CAST(hashtext(:queue) AS int8) + 4294967296) % 4294967296 AS oid)
       AND (CAST(:among AS text[]) IS NULL OR virtualtransaction = ANY(:among)
            OR virtualtransaction LIKE '-1/%')
    """
)


# A watcher's session is named `<worker's application_name>-watch:<queue>`, so that an
# operator (pg_stat_activity, `outbox status`, the `outbox.queue.watchers` gauge) can
# tell which queue a slot silences. The name is checked against the lock's hashtext:
# one cut at 63 bytes, or with non-ASCII replaced by the server, gives no queue.
_WATCH_NAME = "-watch:"

# The granted advisory locks on the watch slots in this database (`l`), by the mode the
# caller adds: ExclusiveLock is a watcher, ShareLock what `outbox.ring` takes.
_SLOT_LOCKS = f"""
       l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
       AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
       AND l.classid BETWEEN CAST({SLOTS[0]} AS oid) AND CAST({SLOTS[-1]} AS oid)"""

_WATCHERS = _sql(
    f"""
    SELECT l.pid, CAST(l.classid AS int8) - {SLOTS[0]} AS slot,
           CAST(l.objid AS int8) AS queue_hash, a.application_name,
           CASE WHEN (CAST(hashtext(substring(a.application_name
                                              FROM '{_WATCH_NAME}(.*)$')) AS int8)
                      + 4294967296) % 4294967296 = CAST(l.objid AS int8)
                THEN substring(a.application_name FROM '{_WATCH_NAME}(.*)$') END AS queue
      FROM pg_locks AS l LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
     WHERE {_SLOT_LOCKS} AND l.mode = 'ExclusiveLock'
     ORDER BY queue, slot, l.pid
    """,
    tuples=True,
)


@dataclass(frozen=True, slots=True)
class Watcher:
    """A session holding a watch slot: while it does, `outbox.ring` skips the NOTIFY for
    its queue. `queue` is None when the session's name does not tell it (see
    `application_name`); `queue_hash` (hashtext, as an unsigned oid) always does."""

    queue: str | None
    slot: int
    pid: int
    application_name: str | None
    queue_hash: int

    @property
    def label(self) -> str:
        """The queue's name, or `#<hashtext>` when the session's name does not tell it."""
        return self.queue if self.queue is not None else f"#{self.queue_hash}"


# A session that holds a slot *shared* while idle: `outbox.ring` takes a slot shared for
# an instant and gives it back in the same call; a cancel (statement_timeout,
# pg_cancel_backend) landing between the two leaves it held by the session, which may
# be a pooled connection that lives for days. A watcher can then never take that slot.
_STUCK_SLOTS = _sql(
    f"""
    SELECT l.pid, CAST(l.classid AS int8) - {SLOTS[0]} AS slot,
           CAST(l.objid AS int8) AS queue_hash, a.application_name
      FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
     WHERE {_SLOT_LOCKS} AND l.mode = 'ShareLock' AND a.state = 'idle'
     ORDER BY l.pid, slot
    """,
    tuples=True,
)


@dataclass(frozen=True, slots=True)
class StuckSlot:
    """An idle session holding a watch slot shared: a watcher of that queue has one
    slot fewer until the session ends."""

    pid: int
    slot: int
    queue_hash: int
    application_name: str | None


def stuck_slots() -> Query[list[StuckSlot]]:
    """Sessions left holding a watch slot shared by a cancelled `outbox.ring`."""
    return Query(_STUCK_SLOTS, {}, _stuck)


def _stuck(result: Result) -> list[StuckSlot]:
    return [StuckSlot(int(pid), int(slot), int(queue_hash), name)
            for pid, slot, queue_hash, name in result]


def application_name(base: str, queue: str) -> str:
    """The application_name of a watch session: names the queue it silences."""
    return f"{base}{_WATCH_NAME}{queue}"


def watchers() -> Query[list[Watcher]]:
    """The sessions keeping watch in this database now (pg_locks, every queue)."""
    return Query(_WATCHERS, {}, _watchers)


def _watchers(result: Result) -> list[Watcher]:
    return [Watcher(queue, int(slot), int(pid), name, int(queue_hash))
            for pid, slot, queue_hash, name, queue in result]


def take_slot(conn: Any, queue: str) -> int | None:
    """Take a free watch slot of `queue` for this session, without waiting; its index."""
    db = sync_db(conn)
    for index, slot in enumerate(SLOTS):
        if db.execute(_TAKE_SLOT, {"slot": slot, "queue": queue}).scalar():
            return index
    return None


def give_slot(conn: Any, queue: str, index: int) -> bool:
    """Give the slot back: transactions that look at it from now on ring the bell.
    False if this session did not hold it."""
    return bool(sync_db(conn).execute(_GIVE_SLOT, {"slot": SLOTS[index],
                                                   "queue": queue}).scalar())


def enqueuers(conn: Any, queue: str, among: Sequence[str] | None = None) -> list[str]:
    """The transactions (virtual ids) now enqueueing for `queue`, or those of `among`
    still at it: a transaction in it may have skipped the bell for a row not committed
    yet. A prepared transaction (two-phase: its locks pass to a virtual id '-1/xid')
    counts as still at it, listed or not. Reads pg_locks, which takes every
    lock-manager partition briefly."""
    params = {"queue": queue, "among": None if among is None else list(among)}
    return list(sync_db(conn).execute(_ENQUEUERS, params).scalar() or [])
