"""The keys this process is running a request for right now: a storm's twins answered
409 without a round trip.

A flaky client's retries, or a hundred taps on "pay", arrive while the first request
still runs. Each twin would check out a connection, open a transaction, find the key's
lock taken and roll back, only to answer 409: in one Python process, a hundred of them
queue for its GIL and its pool, and the last answers after ~100 ms. A twin that finds
the same key *with the same fingerprint* in flight in this process, against the same
database, gets the same 409 at once.

The database stays the authority; this only ever turns a request away, never lets one
run, and never for long:
* a different fingerprint goes to the database (which answers 422 once the key is
  stored, 409 while it is not), as does every request of another process;
* an entry answers for at most HORIZON seconds (or the guard's `ttl`, if shorter),
  by this process's monotonic clock; after that the database decides. A storm's twins
  arrive within that window; a handler hung for longer (whose session the server may
  have ended, freeing an atomic request's lock) delays its twins' turn by no more;
* between the first request's commit and its return, a twin gets 409 where the
  database would replay: a 409 says "try again", and the retry replays.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

#: The longest an entry answers for its twins (seconds).
HORIZON = 2.0


class InFlight:
    """(database, scope, key) -> (fingerprint, deadline) of the requests running here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[Hashable, str, str], tuple[str, float]] = {}
        # A child forked while a request was in flight (or while a thread held the
        # lock) must not inherit either: its requests start from nothing.
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._held = {}

    @contextmanager
    def hold(self, database: Hashable | None, scope: str, key: str, fingerprint: str,
             ttl: float, busy: Callable[[], Exception]) -> Iterator[None]:
        """Run the block as this key's request in flight, or raise `busy()` if a twin is.

        `database` None (a handle whose database we cannot name) runs the block
        unregistered: the database decides alone.
        """
        if database is None:
            yield
            return
        slot = (database, scope, key)
        now = time.monotonic()
        mine = (fingerprint, now + min(ttl, HORIZON))
        with self._lock:
            held = self._held.get(slot)
            if held is not None and held[1] > now:  # a request in flight, fresh
                if held[0] == fingerprint:
                    raise busy()
                registered = False  # another body: the database answers it
            else:
                self._held[slot] = mine
                registered = True
        try:
            yield
        finally:
            if registered:
                with self._lock:
                    if self._held.get(slot) is mine:
                        del self._held[slot]

    def __len__(self) -> int:
        return len(self._held)


#: One per process: every guard's requests, keyed by their database.
in_flight = InFlight()


def database_of(handle: Any) -> Hashable | None:
    """What names the database `handle` talks to, or None where nothing cheap does.

    SQLAlchemy: the engine's pool (shared by `execution_options` copies; a URL is not
    an identity when `creator=` or `connect_args` pick the database); psycopg: the
    host, port and database it is connected to; Django: the alias's settings,
    OPTIONS (a libpq `service`) included.
    """
    if isinstance(handle, psycopg.Connection | psycopg.AsyncConnection):
        info = handle.info
        return ("psycopg", info.host, info.port, info.dbname)
    module = type(handle).__module__
    if module.startswith("sqlalchemy"):
        if hasattr(handle, "pool"):  # Engine, AsyncEngine
            engine = handle
        elif hasattr(handle, "engine"):  # Connection, AsyncConnection
            engine = handle.engine
        else:  # Session, AsyncSession, scoped forms: the bind, if one is set
            bind = getattr(handle, "bind", None)
            engine = getattr(bind, "engine", bind)
        pool = getattr(getattr(engine, "sync_engine", engine), "pool", None)
        return None if pool is None else ("sqlalchemy", pool)
    settings = getattr(handle, "settings_dict", None)  # a Django connection
    if isinstance(settings, dict):
        return ("django", settings.get("HOST"), settings.get("PORT"), settings.get("NAME"),
                repr(settings.get("OPTIONS")))
    return None
