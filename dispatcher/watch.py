"""`Watch`: a busy worker keeps watch over its queue, and enqueuers stop ringing.

A NOTIFY serializes commits (migration 0010 says how much): under load, the doorbell
itself caps how many enqueueing transactions the database commits. A worker that is
claiming rows anyway does not need it. Once its claims took `START_ROWS` rows within
`WINDOW` seconds (1 000 effects/s), the worker takes a watch slot (a session advisory
lock on a connection of its own); while one is held, `outbox.ring` skips the NOTIFY
and the worker claims every `POLL` seconds instead of waiting to be rung. When its
claims of the last `WINDOW` took fewer than `STOP_ROWS` rows it gives the slot back and
lists the transactions enqueueing for the queue at that moment (each took a shared
lock before it looked at the slots): any of them may have skipped the bell, so the
worker claims again (behind its watermark) each time some of them end, until none is
left. Below 1 000 effects/s no watch is kept and every enqueue rings, as before: a
NOTIFY wakes a worker sooner than a poll every 2 ms does (at 200/s the watch added
0.7 ms to the median start, bench/bench_dispatch.py's latency section).

Up to four workers of one queue keep watch at once (`outbox.sql.watch.SLOTS`); the
others keep waiting to be rung or to poll. A failure of the watch connection drops the
watch and the list: its session's end gives the slot back, and the listed rows are
found by polling, as after a lost NOTIFY. So is a row whose bell was skipped when the
loop ends (shutdown) before its transaction commits. `OUTBOX_WATCH=0` turns it off.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import psycopg

from outbox._connections import BoundedConnection
from outbox.sql import watch as sql

log = logging.getLogger("outbox.watch")

T = TypeVar("T")

WINDOW = 0.05  # seconds of claims the rate is read over
START_ROWS = 50  # rows claimed within WINDOW to start watching (1 000/s)
STOP_ROWS = 25  # fewer rows than this within WINDOW stop it (500/s)
POLL = 0.002  # seconds between claims while it keeps watch
LOOK_MAX = 0.05  # the longest gap between two looks at the listed transactions
PROBE_EVERY = 2.0  # a watch connection idle this long while watching is probed
NO_SLOT_BACKOFF = 1.0  # seconds before a worker with no slot, or behind, asks again
KEEP_FOR = 30.0  # a watch connection unused this long is closed (reopening costs ms)
IDLE_SESSION_TIMEOUT_MS = 60_000  # the server ends a watch session gone silent


class Watch:
    """The watch of one worker over one queue; driven by `Dispatcher._loop`.

    `connect` opens an autocommit connection of its own: a session lock must not go
    back to a pool.
    """

    def __init__(self, queue: str, connect: Callable[[], BoundedConnection], *,
                 start_rows: int = START_ROWS, stop_rows: int = STOP_ROWS,
                 window: float = WINDOW, poll: float = POLL) -> None:
        self.queue = queue
        self._connect = connect
        self.start_rows = start_rows
        self.stop_rows = stop_rows
        self.window = window
        self.poll = poll
        self._recent: deque[tuple[float, int]] = deque()  # (when, rows) within window
        self._rows = 0  # their sum
        self._last_short = -math.inf  # the last claim that took all that was due
        self._conn: BoundedConnection | None = None
        self._slot: int | None = None
        self._last_used = 0.0
        self._no_slot_until = 0.0  # all four slots taken: do not ask again before
        self._waiting: list[str] = []  # enqueuers listed when the watch ended
        self._owed = False  # a claim is owed (the watch ended, or a listed one did)
        self._next_look = 0.0
        self._look_gap = poll
        self.watches = 0  # watches kept so far (a counter for tests and stats)

    @property
    def watching(self) -> bool:
        return self._slot is not None

    @property
    def waiting(self) -> int:
        """Transactions listed at the watch's end and not yet seen to end."""
        return len(self._waiting)

    def after_claim(self, took: int, short: bool, now: float) -> None:
        """After a claim statement that took `took` rows (`short`: fewer than it
        asked for, so it took all that was due): start or stop watching."""
        self._owed = False  # this claim began after whatever owed it
        recent = self._recent
        if took > 0:
            recent.append((now, took))
            self._rows += took
        while recent and recent[0][0] <= now - self.window:
            self._rows -= recent.popleft()[1]
        if short:
            self._last_short = now
        if self._slot is None:
            # Only a worker that keeps up alone: with a backlog the others are needed,
            # and they are woken by the bell.
            if self._rows >= self.start_rows and short and now >= self._no_slot_until:
                self._start(now)
        elif self._rows < self.stop_rows:
            self._stop(now)
        elif self._behind(now):
            self._stop_behind(now)

    def claim_failed(self) -> None:
        """A claim statement failed (the database unreachable): nothing is owed any
        more, or the loop would retry at once; polling finds the rows once it is back."""
        self._owed = False

    def due(self, now: float) -> bool:
        """Whether the loop should claim now although nobody rang: while watching (its
        wait is `timeout()`), once after the watch ended, and when some of the
        transactions listed then ended. True until a claim statement has run
        (`after_claim`): a claim the loop could not make (no free slot) stays owed."""
        if self._slot is not None:
            if self._behind(now):  # no free slot for a window: let the others be rung
                self._stop_behind(now)
            elif now - self._last_used >= PROBE_EVERY:
                self._use(lambda conn: conn.probe(), now)
            if self._slot is not None:
                return True
        if self._waiting and now >= self._next_look:
            left = self._use(lambda conn: sql.enqueuers(conn, self.queue, self._waiting),
                             now)
            if left is not None:
                ended = len(left) < len(self._waiting)
                self._waiting = left
                self._owed = self._owed or ended
                self._look_gap = self.poll if ended else min(self._look_gap * 2, LOOK_MAX)
                self._next_look = now + self._look_gap
        elif (not self._waiting and self._conn is not None
              and now - self._last_used >= KEEP_FOR):
            self.close()  # no session kept idle for nothing
        return self._owed

    def timeout(self, now: float) -> float | None:
        """The longest the loop may wait before `due` may say yes; None: no limit."""
        if self._owed or self._slot is not None:
            return self.poll  # an owed claim the loop could not make: look again soon
        if self._waiting:
            return max(0.0, self._next_look - now)
        return None

    def close(self) -> None:
        """Give the slot back (closing the session gives back its locks)."""
        conn, self._conn, self._slot, self._waiting = self._conn, None, None, []
        if conn is not None:
            conn.close()

    # -- inside ------------------------------------------------------------------------

    def _behind(self, now: float) -> bool:
        """No claim took all that was due for a whole window: a backlog."""
        return now - self._last_short >= self.window

    def _start(self, now: float) -> None:
        slot = self._use(lambda conn: sql.take_slot(conn, self.queue), now)
        if slot is None:
            self._no_slot_until = now + NO_SLOT_BACKOFF
            return
        self._slot = slot
        self.watches += 1
        log.debug("queue %s: keeping watch (slot %d)", self.queue, slot)

    def _stop_behind(self, now: float) -> None:
        """Stop, fallen behind; no new watch for NO_SLOT_BACKOFF seconds, or a worker at
        its capacity would start and stop several times a second."""
        self._stop(now)
        self._recent.clear()
        self._rows = 0
        self._no_slot_until = now + NO_SLOT_BACKOFF

    def _stop(self, now: float) -> None:
        slot = self._slot
        assert slot is not None
        # The slot first, the list after: a transaction that looked at the slot while it
        # was held took its lock before, so it is on the list or committed; and one
        # more claim (owed) sees what committed before the list was read.
        self._owed = True
        if self._use(lambda conn: sql.give_slot(conn, self.queue, slot), now) is None:
            return
        self._slot = None
        listed = self._use(lambda conn: sql.enqueuers(conn, self.queue), now)
        self._waiting = listed or []
        self._look_gap = self.poll
        self._next_look = now + self.poll
        log.debug("queue %s: watch ended, %d enqueuers to outlast", self.queue,
                  len(self._waiting))

    def _use(self, step: Callable[[BoundedConnection], T], now: float) -> T | None:
        """Run `step` on the watch connection; on any failure drop the watch (None).

        A connection kept idle (no slot, no list) that the server ended meanwhile
        (`idle_session_timeout` under a long `--poll`) is replaced once, quietly."""
        idle = self._slot is None and not self._waiting
        try:
            result = self._run(step)
        except (psycopg.Error, OSError) as exc:
            self.close()
            if not idle:
                self._failed(exc)
                return None
            try:
                result = self._run(step)
            except (psycopg.Error, OSError) as again:
                self.close()
                self._failed(again)
                return None
        self._last_used = now
        return result

    def _run(self, step: Callable[[BoundedConnection], T]) -> T:
        if self._conn is None or self._conn.closed:
            self._conn = self._open()
        return step(self._conn)

    def _failed(self, exc: BaseException) -> None:
        log.warning("queue %s: the watch connection failed (%s); the doorbell rings again "
                    "and polling finds what it silenced", self.queue, exc)
        self._owed = True  # one look at least, at once

    def _open(self) -> BoundedConnection:
        conn = self._connect()
        try:
            if conn.info.server_version >= 140000:
                # A worker whose host vanished keeps no slot (and no silence) for long.
                conn.execute(f"SET idle_session_timeout = {IDLE_SESSION_TIMEOUT_MS}")
        except BaseException:
            conn.close()
            raise
        return conn
