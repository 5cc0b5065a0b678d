"""The keys this process is running a request for right now: a storm's twins answered
409 without a round trip.

A flaky client's retries, or a hundred taps on "pay", arrive while the first request
still runs. Each twin would check out a connection, open a transaction, find the key's
lock taken and roll back, only to answer 409: in one Python process, a hundred of them
queue for its GIL and its pool, and the last answers after ~100 ms. A twin that finds
the same key *with the same fingerprint* in flight in this process, against the same
database, gets the same 409 at once.

The database stays the authority; this never answers what the database would not:
* a different fingerprint goes to the database (which answers 422 once the key is
  stored, 409 while it is not), as does every request of another process;
* an entry older than the guard's `ttl` is ignored (the database then decides,
  as it would for a claim past its TTL), so a hung handler blocks its twins no longer
  than it would through the database;
* between the first request's commit and its return, a twin gets 409 where the
  database would replay: a 409 says "try again", and the retry replays.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg


class InFlight:
    """(database, scope, key) -> (fingerprint, deadline) of the requests running here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[Hashable, str, str], tuple[str, float]] = {}

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
        mine = (fingerprint, now + ttl)
        with self._lock:
            held = self._held.get(slot)
            registered = held is None or held[1] <= now
            if registered:
                self._held[slot] = mine
            elif held is not None and held[0] == fingerprint:
                raise busy()
            # else another request's twin (other fingerprint): the database answers it
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
    """A name for the database `handle` talks to, or None where there is no cheap one.

    SQLAlchemy engines and connections: the engine's URL; a Session: its bind's;
    psycopg: host, port and database name; Django: the alias's settings.
    """
    if isinstance(handle, psycopg.Connection | psycopg.AsyncConnection):
        info = handle.info
        return ("psycopg", info.host, info.port, info.dbname)
    module = type(handle).__module__
    if module.startswith("sqlalchemy"):
        if hasattr(handle, "url"):  # Engine, AsyncEngine
            engine = handle
        elif hasattr(handle, "engine"):  # Connection, AsyncConnection
            engine = handle.engine
        else:  # Session, AsyncSession, scoped forms: the bind, if one is set
            bind = getattr(handle, "bind", None)
            engine = getattr(bind, "engine", bind)
        url = getattr(engine, "url", None)
        return None if url is None else ("sqlalchemy", url)
    settings = getattr(handle, "settings_dict", None)  # a Django connection
    if isinstance(settings, dict):
        return ("django", settings.get("HOST"), settings.get("PORT"), settings.get("NAME"))
    return None
