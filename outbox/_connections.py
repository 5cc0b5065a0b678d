"""Database connections that cannot hang on a silent peer.

After a failover, a NAT or load-balancer idle timeout or a firewall change, a TCP
connection often goes *silent*: no FIN, no RST, nothing arrives. libpq then waits for
the kernel, which by default gives up after hours. Two layers bound that wait:

* **Kernel**: TCP keepalives and `tcp_user_timeout` (libpq parameters). They catch a
  peer that stops acknowledging (a dropped route, a dead host) on idle and busy
  connections alike, but not a middlebox that keeps acknowledging while forwarding
  nothing (a wedged proxy or pooler, our fault-test proxy), and not on Unix sockets.
* **Client deadline on every wait** (`BoundedConnection`): psycopg funnels every
  blocking step (execute, fetch, commit, rollback) through `Connection.wait`, which
  takes a timeout since psycopg 3.2. Ours passes `call_timeout` to every wait that has
  none; a wait that expires closes the connection (its protocol state is unknown)
  and raises `SilentConnection`, an `OperationalError`: SQLAlchemy sees a disconnect
  and drops the connection from its pool, and the caller's retry gets a fresh one.

A connection that is idle by design (LISTEN) has no wait to expire: its owner must
probe it (`probe()`), see dispatcher/worker.py.

The server has its own half: a silenced client's backend stays "idle in transaction",
holding its locks, until PostgreSQL ends it; `make_engine` sets
`idle_in_transaction_session_timeout` for that (`idle_in_transaction_timeout` below).
Defaults and the recovery times they imply: docs/network.md.
"""

from __future__ import annotations

import os
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.abc import PQGen
from psycopg.rows import TupleRow


def env_seconds(name: str, default: float) -> float | None:
    """Seconds from the environment; 0 or a negative value means None (no bound)."""
    raw = os.environ.get(name, "").strip()
    value = float(raw) if raw else default
    return value if value > 0 else None


# Every statement of the library takes milliseconds; a user's request transaction
# may take longer. Both must still end when the peer is gone. See docs/network.md.
DEFAULT_CALL_TIMEOUT = env_seconds("OUTBOX_DB_CALL_TIMEOUT", 30.0)
# Workers run only the library's own statements (claim, record, extend: milliseconds),
# so they may give up much sooner. It must stay below the dispatcher's retry budget
# for those statements (dispatcher/_core.py `_db_retry`, 10 s): a call that gives up
# after 5 s leaves time for one more try on a fresh connection, so a silent
# connection costs about 5 s, never a dropped outcome (whose effect would then wait
# for its lease to expire and be redelivered). It also stays below a third of the
# default lease (30 s), the interval at which leases are extended, so a failed
# extension is retried before the lease runs out.
DEFAULT_WORKER_CALL_TIMEOUT = env_seconds("OUTBOX_WORKER_DB_CALL_TIMEOUT", 5.0)
# How long PostgreSQL lets a session sit idle *inside* a transaction before it ends
# the session (`idle_in_transaction_session_timeout`): the server's half of the bound.
# A client whose connection went silent gives up after its call timeout, but the
# server still sees a session "idle in transaction" holding its locks (the atomic
# guard's advisory lock on the key: every retry would get 409) until the kernel
# notices, which may be never behind a middlebox that keeps acknowledging. Default:
# the call timeout + IDLE_IN_TRANSACTION_MARGIN; OUTBOX_DB_IDLE_IN_TRANSACTION_TIMEOUT
# sets it (0: leave the server's setting alone).
IDLE_IN_TRANSACTION_MARGIN = 5.0


def idle_in_transaction_timeout(call_timeout: float | None) -> float | None:
    """The default server-side bound for a client with this call timeout (or None)."""
    if os.environ.get("OUTBOX_DB_IDLE_IN_TRANSACTION_TIMEOUT", "").strip():
        return env_seconds("OUTBOX_DB_IDLE_IN_TRANSACTION_TIMEOUT", 0.0)
    base = call_timeout if call_timeout is not None else DEFAULT_CALL_TIMEOUT
    return None if base is None else base + IDLE_IN_TRANSACTION_MARGIN

# Kernel-level detection (seconds): first probe after 10 s idle, then every 5 s, dead
# after 3 unanswered ones; unacknowledged data for 20 s also kills the connection.
KEEPALIVE_ARGS: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 20_000,  # milliseconds
}


class SilentConnection(psycopg.OperationalError):
    """The server did not answer within the call timeout; the connection was closed."""


class BoundedConnection(psycopg.Connection[TupleRow]):
    """A psycopg connection whose every wait for the server ends within `call_timeout`."""

    call_timeout: float | None = DEFAULT_CALL_TIMEOUT

    def wait(self, gen: PQGen[Any], interval: float = 0.1,
             timeout: float | None = None) -> Any:
        if timeout is not None or self.call_timeout is None:
            # The caller bounds this wait itself (notifies(timeout=...), cancel) and
            # handles its expiry: nothing is wrong with the connection then.
            return super().wait(gen, interval=interval, timeout=timeout)
        try:
            return super().wait(gen, interval=interval, timeout=self.call_timeout)
        except pg_errors._WaitTimeout:
            self.close()  # mid-protocol: unusable, and the pool must not reuse it
            raise SilentConnection(
                f"no answer from PostgreSQL within {self.call_timeout:g} s; the "
                "connection was closed (call timeout: see docs/network.md)") from None

    def probe(self) -> None:
        """One bounded round trip: proves an idle connection (LISTEN) still works."""
        self.execute("SELECT 1")


def connect(conninfo: str = "", *, call_timeout: float | None = DEFAULT_CALL_TIMEOUT,
            **kwargs: Any) -> BoundedConnection:
    """`psycopg.connect` with the kernel settings above and a bounded wait."""
    for name, value in KEEPALIVE_ARGS.items():
        kwargs.setdefault(name, value)
    kwargs.setdefault("connect_timeout", 10)
    conn = BoundedConnection.connect(conninfo, **kwargs)
    conn.call_timeout = call_timeout
    return conn
