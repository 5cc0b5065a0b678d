"""A fake payment provider (PSP) on loopback that proves exactly-once delivery by counting.

The dispatcher can only promise at-least-once delivery with a stable ``Idempotency-Key``;
exactly-once *effects* need a receiver that deduplicates on that key (DESIGN.md §9). This
module is that receiver, made observable: every delivery is written to a ledger and every
application is counted per key, so a test asserts "applied exactly once" from data rather
than assuming it. It deduplicates like Stripe does: first request applies and stores its
response, a retry with the same body replays it byte for byte, a different body gets 422,
a retry while the first is still running gets 409, no key gets 400.

It can misbehave on demand (research/anchors-reliability.md H7, failure cases F19-F24):
apply then hang past the client's timeout, apply then 500, apply then reset the
connection, 500 without applying, any status with ``Retry-After``, slow processing, and
forgetting old keys. Rules can target one key or prefix, fire only N times or with a
seeded probability, so one poison key among thousands can fail while the rest flow.

The ledger lives in SQLite (WAL) so several receiver processes, or a receiver restarted
mid-test, share one truth. Standard library only, so it starts in milliseconds in a test
thread and runs as its own process::

    python -m dispatcher.examples.payments.psp --host 127.0.0.1 --port 0 --db /tmp/psp.sqlite3

which prints one line ``{"url": "http://127.0.0.1:PORT"}`` once it is listening and exits
cleanly on SIGTERM or SIGINT.

HTTP interface: ``POST /<any path>`` is a delivery (JSON body, ``Idempotency-Key``
header). Control: ``POST /_control`` (add a rule, or ``{"mode": "normal"}`` to clear),
``GET``/``DELETE /_control``, ``GET /_stats``, ``GET /_ledger[?key=K]``, ``GET /_applied``,
``POST /_reset``; and ``GET /_health``.

The control endpoints answer loopback peers only (403 for anyone else): they can make
every charge fail, wipe the ledger or list every key, so listening on ``0.0.0.0`` (as in
docker-compose) exposes deliveries and ``/_health``, never control. Inside a container,
``docker compose exec psp python -c "..."`` on 127.0.0.1 still reaches them;
``--remote-control`` opens them to every peer, for a private test network only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import ipaddress
import json
import os
import queue
import random
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Self, cast
from urllib.parse import parse_qs, urlencode, urlsplit

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

_tracer = trace.get_tracer("outbox.examples.psp")

__all__ = [
    "MODES",
    "ApplyResult",
    "Ledger",
    "Receiver",
    "ReceiverClient",
    "ReceiverProcess",
    "Rule",
    "main",
]

#: Per-request behaviours a rule can select.
MODES = frozenset({
    "normal", "apply_then_timeout", "apply_then_500", "fail_500", "status", "slow", "reset",
})
#: Not a per-request mode: sets the key-retention window (Stripe forgets keys after ~24 h).
FORGET = "forget"

_DEFAULT_DELAY = {"apply_then_timeout": 10.0, "slow": 1.0}
_RULE_FIELDS = frozenset({
    "mode", "key", "key_prefix", "path", "times", "probability", "seed", "delay", "status",
    "retry_after",
})
_MAX_BODY = 10 * 1024 * 1024

_SCHEMA = """
CREATE TABLE IF NOT EXISTS psp_keys (
    key            TEXT PRIMARY KEY,
    path           TEXT NOT NULL,
    fingerprint    TEXT NOT NULL,
    state          TEXT NOT NULL,          -- in_progress | done
    status         INTEGER NOT NULL,
    response       TEXT NOT NULL,
    request        TEXT NOT NULL,
    ordering_key   TEXT,
    seq,
    application_id INTEGER NOT NULL,
    applied_at     REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS psp_applications (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    key          TEXT NOT NULL,
    path         TEXT NOT NULL,
    ordering_key TEXT,
    seq,
    applied_at   REAL NOT NULL,
    pid          INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS psp_applications_key ON psp_applications (key);
CREATE TABLE IF NOT EXISTS psp_deliveries (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    key         TEXT,
    path        TEXT NOT NULL,
    n           INTEGER,
    outcome     TEXT NOT NULL,
    status      INTEGER,
    mode        TEXT NOT NULL,
    rule_id     INTEGER,
    traceparent TEXT,
    attempt     TEXT,
    received_at REAL NOT NULL,
    pid         INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS psp_deliveries_key ON psp_deliveries (key);
CREATE TABLE IF NOT EXISTS psp_rules (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    spec      TEXT NOT NULL,
    remaining INTEGER,
    fired     INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS psp_settings (
    name  TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""


# --------------------------------------------------------------------------- rules


def _opt_str(spec: Mapping[str, object], name: str) -> str | None:
    value = spec.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")
    return value


def _opt_number(spec: Mapping[str, object], name: str) -> float | None:
    value = spec.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number")
    return float(value)


def _opt_int(spec: Mapping[str, object], name: str) -> int | None:
    value = spec.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer")
    return value


@dataclasses.dataclass(frozen=True)
class Rule:
    """One misbehaviour: which requests it matches and what it does to them.

    Validated up front so a typo in a test (``"time": 2``) fails loudly instead of
    silently leaving the receiver in normal mode.
    """

    mode: str
    key: str | None = None
    key_prefix: str | None = None
    path: str | None = None
    times: int | None = None
    probability: float | None = None
    seed: int = 0
    delay: float = 0.0
    status: int = 503
    retry_after: str | None = None
    id: int = 0

    @classmethod
    def from_spec(cls, spec: Mapping[str, object]) -> Rule:
        """Parse a ``/_control`` body; raises ValueError with a readable reason."""
        unknown = set(spec) - _RULE_FIELDS - {"id"}
        if unknown:
            raise ValueError(f"unknown rule fields: {sorted(unknown)}")
        mode = spec.get("mode", "normal")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {sorted(MODES | {FORGET})}, got {mode!r}")
        times = _opt_int(spec, "times")
        if times is not None and times < 1:
            raise ValueError("times must be >= 1")
        probability = _opt_number(spec, "probability")
        if probability is not None and not 0.0 <= probability <= 1.0:
            raise ValueError("probability must be within [0, 1]")
        delay = _opt_number(spec, "delay")
        if delay is None:
            delay = _DEFAULT_DELAY.get(str(mode), 0.0)
        if delay < 0:
            raise ValueError("delay must be >= 0")
        status = _opt_int(spec, "status")
        if status is None:
            status = 503
        if not 100 <= status <= 599:
            raise ValueError("status must be an HTTP status code")
        retry_after = spec.get("retry_after")
        if retry_after is not None:
            if isinstance(retry_after, bool) or not isinstance(retry_after, str | int | float):
                raise ValueError("retry_after must be a string or a number")
            retry_after = str(retry_after)
        return cls(
            mode=str(mode),
            key=_opt_str(spec, "key"),
            key_prefix=_opt_str(spec, "key_prefix"),
            path=_opt_str(spec, "path"),
            times=times,
            probability=probability,
            seed=_opt_int(spec, "seed") or 0,
            delay=delay,
            status=status,
            retry_after=retry_after,
            id=_opt_int(spec, "id") or 0,
        )

    @property
    def is_clear_all(self) -> bool:
        """An unfiltered ``normal`` rule means "back to normal" rather than a new rule."""
        return (self.mode == "normal" and self.key is None and self.key_prefix is None
                and self.path is None and self.times is None and self.probability is None)

    def to_json(self) -> dict[str, Any]:
        """The spec without defaults that were not asked for (readable in ``/_control``)."""
        noise = {"id"}
        if self.mode != "status":
            noise.add("status")
        if self.probability is None:
            noise.add("seed")
        if not self.delay:
            noise.add("delay")
        return {k: v for k, v in dataclasses.asdict(self).items()
                if v is not None and k not in noise}

    def matches(self, key: str, path: str) -> bool:
        """Filters only; ``times`` and ``probability`` are decided by the ledger."""
        if self.key is not None and key != self.key:
            return False
        if self.key_prefix is not None and not key.startswith(self.key_prefix):
            return False
        return self.path is None or path == self.path

    def draws(self, key: str, n: int) -> bool:
        """Seeded coin for the n-th delivery of a key: reproducible whatever the interleaving."""
        if self.probability is None:
            return True
        return random.Random(f"{self.seed}:{key}:{n}").random() < self.probability


# --------------------------------------------------------------------------- ledger


@dataclasses.dataclass(frozen=True)
class Delivery:
    """A received request, numbered per key, with the rule chosen for it."""

    id: int
    n: int
    rule: Rule | None


@dataclasses.dataclass(frozen=True)
class ApplyResult:
    """What dedup decided: applied, replayed, mismatch or in_progress, and the answer."""

    outcome: str
    status: int
    body: bytes


def _dump(obj: object) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def fingerprint(method: str, path: str, payload: object) -> str:
    """Hash of the request that does not depend on key order or whitespace."""
    return hashlib.sha256(f"{method} {path} {_dump(payload)}".encode()).hexdigest()


def _sqlite_value(value: object) -> object:
    """``seq`` may be any JSON; keep scalars as they are so ``ORDER BY`` and tests work."""
    if value is None or isinstance(value, int | float | str):
        return value
    return _dump(value)


def _object_name(path: str) -> tuple[str, str]:
    segment = path.rstrip("/").rsplit("/", 1)[-1] or "object"
    name = segment[:-1] if segment.endswith("s") and len(segment) > 1 else segment
    return name, (segment[:2] or "ob")


class Ledger:
    """The receiver's durable memory: keys, applications, deliveries and rules in SQLite.

    One connection behind a lock per process; cross-process safety comes from SQLite
    itself (WAL, ``BEGIN IMMEDIATE``, busy timeout). Applying is one transaction whose
    ``INSERT ... ON CONFLICT DO NOTHING`` decides the single winner for a key.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *,
                 busy_timeout: float = 30.0) -> None:
        self.path = None if path is None else os.fspath(path)
        self._lock = threading.RLock()
        self._conn = sqlite3.connect(self.path or ":memory:", timeout=busy_timeout,
                                     isolation_level=None, check_same_thread=False)
        self._conn.row_factory = sqlite3.Row
        if self.path is not None:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
        with self._write() as cur:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    cur.execute(statement)

    # -- plumbing

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Cursor]:
        """Serialise writers across threads (lock) and processes (BEGIN IMMEDIATE)."""
        with self._lock:
            cur = self._conn.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                yield cur
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT")

    @contextlib.contextmanager
    def _read(self) -> Iterator[sqlite3.Cursor]:
        """One snapshot for all the counters of a report."""
        with self._lock:
            cur = self._conn.cursor()
            cur.execute("BEGIN")
            try:
                yield cur
            finally:
                cur.execute("COMMIT")

    def close(self) -> None:
        """Close the connection (an in-memory ledger is gone afterwards)."""
        with self._lock:
            self._conn.close()

    # -- rules

    def add_rule(self, rule: Rule) -> int:
        """Store a rule; newer rules take precedence over older ones."""
        with self._write() as cur:
            cur.execute("INSERT INTO psp_rules (spec, remaining) VALUES (?, ?)",
                        (_dump(rule.to_json()), rule.times))
            return int(cast(int, cur.lastrowid))

    def clear_rules(self) -> None:
        """Back to normal: no rules, no retention window."""
        with self._write() as cur:
            cur.execute("DELETE FROM psp_rules")
            cur.execute("DELETE FROM psp_settings WHERE name = 'retention'")

    def set_retention(self, seconds: float | None) -> None:
        """Forget applied keys older than this many seconds (None: remember forever)."""
        with self._write() as cur:
            if seconds is None:
                cur.execute("DELETE FROM psp_settings WHERE name = 'retention'")
            else:
                cur.execute("INSERT INTO psp_settings (name, value) VALUES ('retention', ?) "
                            "ON CONFLICT (name) DO UPDATE SET value = excluded.value",
                            (repr(float(seconds)),))

    def rules(self) -> list[dict[str, Any]]:
        """Active rules, newest first, with how often each fired and has left."""
        with self._read() as cur:
            rows = cur.execute("SELECT id, spec, remaining, fired FROM psp_rules "
                               "ORDER BY id DESC").fetchall()
            retention = cur.execute(
                "SELECT value FROM psp_settings WHERE name = 'retention'").fetchone()
        out = [{**json.loads(r["spec"]), "id": r["id"], "remaining": r["remaining"],
                "fired": r["fired"]} for r in rows]
        if retention is not None:
            out.append({"mode": FORGET, "older_than": float(retention["value"])})
        return out

    # -- deliveries

    def open_delivery(self, key: str, path: str, traceparent: str | None,
                      attempt: str | None) -> Delivery:
        """Count the delivery and choose its rule in one transaction, so ``times`` is exact."""
        now = time.time()
        with self._write() as cur:
            n = int(cur.execute("SELECT count(*) FROM psp_deliveries WHERE key = ?",
                                (key,)).fetchone()[0]) + 1
            chosen: Rule | None = None
            for row in cur.execute("SELECT id, spec, remaining FROM psp_rules "
                                   "WHERE remaining IS NULL OR remaining > 0 "
                                   "ORDER BY id DESC").fetchall():
                rule = Rule.from_spec({**json.loads(row["spec"]), "id": row["id"]})
                if rule.matches(key, path) and rule.draws(key, n):
                    chosen = rule
                    cur.execute("UPDATE psp_rules SET fired = fired + 1, "
                                "remaining = remaining - 1 WHERE id = ?", (row["id"],))
                    break
            cur.execute(
                "INSERT INTO psp_deliveries (key, path, n, outcome, mode, rule_id, traceparent,"
                " attempt, received_at, pid) VALUES (?, ?, ?, 'received', ?, ?, ?, ?, ?, ?)",
                (key, path, n, chosen.mode if chosen else "normal",
                 chosen.id if chosen else None, traceparent, attempt, now, os.getpid()))
            return Delivery(int(cast(int, cur.lastrowid)), n, chosen)

    def finish_delivery(self, delivery_id: int, outcome: str, status: int | None) -> None:
        """Record how a delivery ended when nothing was applied (injected failures)."""
        with self._write() as cur:
            cur.execute("UPDATE psp_deliveries SET outcome = ?, status = ? WHERE id = ?",
                        (outcome, status, delivery_id))

    def reject(self, path: str, key: str | None, reason: str, status: int,
               traceparent: str | None, attempt: str | None) -> None:
        """Log a request refused before dedup (no key, bad JSON) so nothing goes unseen."""
        with self._write() as cur:
            cur.execute(
                "INSERT INTO psp_deliveries (key, path, n, outcome, status, mode, traceparent,"
                " attempt, received_at, pid) VALUES (?, ?, NULL, ?, ?, 'normal', ?, ?, ?, ?)",
                (key, path, reason, status, traceparent, attempt, time.time(), os.getpid()))

    def apply(self, delivery: Delivery, *, key: str, path: str, fingerprint: str,
              request: str, ordering_key: str | None, seq: object, mode: str,
              complete: bool = True) -> ApplyResult:
        """Apply the key once, or tell why not; the whole decision is one transaction.

        With ``complete=False`` the key stays ``in_progress`` (slow mode) until
        :meth:`complete`, and concurrent deliveries of it get 409 meanwhile.
        """
        now = time.time()
        with self._write() as cur:
            retention = cur.execute(
                "SELECT value FROM psp_settings WHERE name = 'retention'").fetchone()
            if retention is not None:
                cur.execute("DELETE FROM psp_keys WHERE key = ? AND state = 'done' "
                            "AND applied_at < ?", (key, now - float(retention["value"])))
            cur.execute(
                "INSERT INTO psp_keys (key, path, fingerprint, state, status, response,"
                " request, ordering_key, seq, application_id, applied_at)"
                " VALUES (?, ?, ?, ?, 201, '', ?, ?, ?, 0, ?) ON CONFLICT (key) DO NOTHING",
                (key, path, fingerprint, "done" if complete else "in_progress", request,
                 ordering_key, _sqlite_value(seq), now))
            if cur.rowcount == 1:
                # This delivery won the key: the one and only application.
                cur.execute("INSERT INTO psp_applications (key, path, ordering_key, seq,"
                            " applied_at, pid) VALUES (?, ?, ?, ?, ?, ?)",
                            (key, path, ordering_key, _sqlite_value(seq), now, os.getpid()))
                app_id = int(cast(int, cur.lastrowid))
                name, prefix = _object_name(path)
                body = _dump({"id": f"{prefix}_{app_id}", "object": name, "key": key,
                              "applied_at": now})
                cur.execute("UPDATE psp_keys SET response = ?, application_id = ? WHERE key = ?",
                            (body, app_id, key))
                result = ApplyResult("applied", 201, body.encode())
            else:
                row = cur.execute("SELECT fingerprint, state, status, response FROM psp_keys "
                                  "WHERE key = ?", (key,)).fetchone()
                if row["fingerprint"] != fingerprint:
                    result = ApplyResult("mismatch", 422, _dump({
                        "error": "idempotency_key_reused",
                        "message": "this Idempotency-Key was used with a different request",
                    }).encode())
                elif row["state"] != "done":
                    result = ApplyResult("in_progress", 409, _dump({
                        "error": "idempotency_key_in_use",
                        "message": "a request with this Idempotency-Key is still in progress",
                    }).encode())
                else:
                    result = ApplyResult("replayed", int(row["status"]),
                                         str(row["response"]).encode())
            sent = {"apply_then_500": 500, "reset": None}.get(mode, result.status)
            cur.execute("UPDATE psp_deliveries SET outcome = ?, status = ? WHERE id = ?",
                        (result.outcome, sent, delivery.id))
            return result

    def complete(self, key: str) -> None:
        """End a slow application: later deliveries of the key replay instead of 409."""
        with self._write() as cur:
            cur.execute("UPDATE psp_keys SET state = 'done' WHERE key = ?", (key,))

    def reset(self) -> None:
        """Forget everything: ledger, rules, retention."""
        with self._write() as cur:
            for table in ("psp_keys", "psp_applications", "psp_deliveries", "psp_rules",
                          "psp_settings"):
                cur.execute(f"DELETE FROM {table}")

    # -- reports

    def stats(self) -> dict[str, Any]:
        """Counters computed from the ledger rows, never kept on the side."""
        with self._read() as cur:
            def one(sql: str) -> int:
                return int(cur.execute(sql).fetchone()[0] or 0)

            outcomes = {r[0]: int(r[1]) for r in cur.execute(
                "SELECT outcome, count(*) FROM psp_deliveries GROUP BY outcome")}
            per_path = {r[0]: int(r[1]) for r in cur.execute(
                "SELECT path, count(DISTINCT key) FROM psp_applications GROUP BY path "
                "ORDER BY path")}
            return {
                "requests": one("SELECT count(*) FROM psp_deliveries"),
                "deliveries": one("SELECT count(*) FROM psp_deliveries WHERE key IS NOT NULL"),
                "applied": one("SELECT count(DISTINCT key) FROM psp_applications"),
                "applications": one("SELECT count(*) FROM psp_applications"),
                "replayed": outcomes.get("replayed", 0),
                "mismatches": outcomes.get("mismatch", 0),
                "conflicts": outcomes.get("in_progress", 0),
                "injected": outcomes.get("injected", 0),
                "rejected": outcomes.get("missing_key", 0) + outcomes.get("bad_request", 0),
                "in_progress": one("SELECT count(*) FROM psp_keys WHERE state = 'in_progress'"),
                "max_applied_per_key": one(
                    "SELECT max(c) FROM (SELECT count(*) AS c FROM psp_applications "
                    "GROUP BY key)"),
                "keys_delivered_more_than_once": one(
                    "SELECT count(*) FROM (SELECT key FROM psp_deliveries WHERE key IS NOT NULL"
                    " GROUP BY key HAVING count(*) > 1)"),
                "per_path": per_path,
            }

    def applied_counts(self) -> dict[str, int]:
        """Applications per key: the number that must be exactly 1."""
        with self._read() as cur:
            return {r[0]: int(r[1]) for r in cur.execute(
                "SELECT key, count(*) FROM psp_applications GROUP BY key")}

    def ledger(self, key: str | None = None) -> dict[str, Any]:
        """Everything, or one key: per-key counts, applications in order, each delivery."""
        one_key = (key, key)  # "(? IS NULL OR key = ?)": all keys, or just this one
        with self._read() as cur:
            keys = [dict(r) for r in cur.execute(
                "SELECT d.key, d.deliveries, coalesce(a.applied, 0) AS applied, k.path,"
                " k.state, k.status, k.ordering_key, k.seq, k.applied_at"
                " FROM (SELECT key, count(*) AS deliveries, min(id) AS first"
                "       FROM psp_deliveries WHERE key IS NOT NULL AND (? IS NULL OR key = ?)"
                "       GROUP BY key) d"
                " LEFT JOIN (SELECT key, count(*) AS applied FROM psp_applications GROUP BY key)"
                "   a ON a.key = d.key"
                " LEFT JOIN psp_keys k ON k.key = d.key"
                " ORDER BY d.first", one_key)]
            applications = [dict(r) for r in cur.execute(
                "SELECT id AS apply_seq, key, path, ordering_key, seq, applied_at, pid"
                " FROM psp_applications WHERE (? IS NULL OR key = ?) ORDER BY id", one_key)]
            deliveries = [dict(r) for r in cur.execute(
                "SELECT id, key, path, n, outcome, status, mode, rule_id, traceparent, attempt,"
                " received_at, pid FROM psp_deliveries WHERE (? IS NULL OR key = ?)"
                " ORDER BY id", one_key)]
        ordering: dict[str, list[Any]] = {}
        for app in applications:
            if app["ordering_key"] is not None:
                ordering.setdefault(app["ordering_key"], []).append(app["seq"])
        return {"keys": keys, "applications": applications, "ordering": ordering,
                "deliveries": deliveries}


# --------------------------------------------------------------------------- HTTP


class _Server(ThreadingHTTPServer):
    """Threaded server that can cut idle keep-alive connections when it stops."""

    daemon_threads = True
    request_queue_size = 256  # 50 clients connecting at once must not hit SYN retries

    def __init__(self, address: tuple[str, int], ledger: Ledger, *,
                 remote_control: bool = False) -> None:
        self.ledger = ledger
        self.remote_control = remote_control
        self.stopping = threading.Event()
        self.connections: set[socket.socket] = set()
        self.conn_lock = threading.Lock()
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Clients that hang up (timeouts, resets) are part of the job, not errors."""
        exc = sys.exc_info()[1]
        if self.stopping.is_set() or isinstance(exc, ConnectionError | TimeoutError):
            return
        super().handle_error(request, client_address)

    def cut_connections(self) -> None:
        """Stop means stop: pooled client connections must not reach a stopped receiver."""
        with self.conn_lock:
            conns = list(self.connections)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "FakePSP/1.0"
    timeout = 120

    @property
    def srv(self) -> _Server:
        return cast(_Server, self.server)

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in two writes; without this, Nagle plus the client's
        # delayed ACK add ~40 ms to every response.
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.srv.conn_lock:
            self.srv.connections.add(self.connection)

    def finish(self) -> None:
        with self.srv.conn_lock:
            self.srv.connections.discard(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: thousands of deliveries would drown the test output."""

    # -- I/O helpers

    def _read_body(self) -> bytes | None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunk = self.rfile.read(size)
                if len(chunk) != size:
                    return None  # the sender died mid-chunk
                chunks.append(chunk)
                self.rfile.readline()
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            return None
        if length < 0 or length > _MAX_BODY:
            return None
        body = self.rfile.read(length) if length else b""
        # A client killed mid-request leaves a short body: refuse it, never apply it.
        return body if len(body) == length else None

    def _send(self, status: int, body: bytes, headers: Mapping[str, str] | None = None) -> None:
        self.sent_status = status
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            if self.srv.stopping.is_set():
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            self.close_connection = True

    def _send_json(self, status: int, obj: object,
                   headers: Mapping[str, str] | None = None) -> None:
        self._send(status, _dump(obj).encode(), headers)

    def _reset_connection(self) -> None:
        """Close with SO_LINGER 0 so the client sees a TCP RST, not a polite FIN."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                       struct.pack("ii", 1, 0))
        with contextlib.suppress(OSError):
            # The fd only closes once the makefile() objects are gone; the stdlib still
            # flushes wfile after the handler, so leave it a harmless stand-in.
            self.rfile.close()
            self.wfile.close()
            self.wfile = io.BytesIO()
            self.connection.close()

    # -- routing

    def _control_refused(self, path: str) -> bool:
        """Answer 403 to a control request from a non-loopback peer (see the module doc)."""
        if not path.startswith("/_") or path == "/_health" or self.srv.remote_control:
            return False
        try:
            peer = ipaddress.ip_address(str(self.client_address[0]).split("%", 1)[0])
        except ValueError:
            peer = None
        if isinstance(peer, ipaddress.IPv6Address) and peer.ipv4_mapped is not None:
            peer = peer.ipv4_mapped
        if peer is not None and peer.is_loopback:
            return False
        self._send_json(403, {"error": "forbidden",
                              "message": "control endpoints answer loopback clients only"})
        return True

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        ledger = self.srv.ledger
        if self._control_refused(url.path):
            return
        if url.path == "/_stats":
            self._send_json(200, ledger.stats())
        elif url.path == "/_ledger":
            key = parse_qs(url.query).get("key", [None])[0]
            self._send_json(200, ledger.ledger(key))
        elif url.path == "/_applied":
            self._send_json(200, ledger.applied_counts())
        elif url.path == "/_control":
            self._send_json(200, {"rules": ledger.rules()})
        elif url.path == "/_health":
            self._send_json(200, {"ok": True, "pid": os.getpid()})
        else:
            self._send_json(404, {"error": "not_found"})

    def do_DELETE(self) -> None:
        if self._control_refused(urlsplit(self.path).path):
            return
        if urlsplit(self.path).path == "/_control":
            self.srv.ledger.clear_rules()
            self._send_json(200, {"rules": []})
        else:
            self._send_json(404, {"error": "not_found"})

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        body = self._read_body()
        if body is None:
            self.close_connection = True
            self._send_json(400, {"error": "bad_request", "message": "bad Content-Length"})
        elif self._control_refused(path):
            return
        elif path == "/_control":
            self._control(body)
        elif path == "/_reset":
            self.srv.ledger.reset()
            self._send_json(200, {"reset": True})
        elif path.startswith("/_"):
            self._send_json(404, {"error": "not_found"})
        else:
            self._traced_deliver(path, body)

    def _traced_deliver(self, path: str, body: bytes) -> None:
        """`_deliver` in a SERVER span continuing the caller's traceparent (the HTTP
        conventions' attributes), as a real receiver's framework instrumentation would:
        the trace of a payment runs from the API request to this request."""
        parent = propagate.extract({k.lower(): v for k, v in self.headers.items()})
        with _tracer.start_as_current_span(
                "POST", context=parent, kind=SpanKind.SERVER,
                attributes={"http.request.method": "POST", "url.path": path,
                            "url.scheme": "http", "network.protocol.version": "1.1"}
        ) as span:
            self.sent_status = 0
            self._deliver(path, body)
            if self.sent_status:
                span.set_attribute("http.response.status_code", self.sent_status)
                if self.sent_status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
                    span.set_attribute("error.type", str(self.sent_status))

    def _control(self, body: bytes) -> None:
        ledger = self.srv.ledger
        try:
            spec = json.loads(body or b"{}")
            if not isinstance(spec, dict):
                raise ValueError("the control body must be a JSON object")
            if spec.get("mode") == FORGET:
                older_than = _opt_number(spec, "older_than")
                if set(spec) - {"mode", "older_than"} or older_than is None or older_than < 0:
                    raise ValueError('forget takes only "older_than" (seconds >= 0)')
                ledger.set_retention(older_than)
                self._send_json(200, {"rules": ledger.rules()})
                return
            rule = Rule.from_spec(spec)
        except ValueError as exc:
            self._send_json(400, {"error": "bad_rule", "message": str(exc)})
            return
        if rule.is_clear_all:
            ledger.clear_rules()
            self._send_json(200, {"rules": []})
        else:
            rule_id = ledger.add_rule(rule)
            self._send_json(200, {"rule_id": rule_id, "rules": ledger.rules()})

    def _deliver(self, path: str, body: bytes) -> None:
        ledger = self.srv.ledger
        keys = [k.strip() for k in self.headers.get_all("Idempotency-Key") or []]
        trace = self.headers.get("traceparent")
        attempt = self.headers.get("X-Outbox-Attempt")
        if len(keys) != 1 or not keys[0]:
            ledger.reject(path, None, "missing_key", 400, trace, attempt)
            self._send_json(400, {"error": "missing_idempotency_key",
                                  "message": "send exactly one non-empty Idempotency-Key"})
            return
        key = keys[0]
        try:
            payload: object = json.loads(body) if body.strip() else {}
        except ValueError:
            ledger.reject(path, key, "bad_request", 400, trace, attempt)
            self._send_json(400, {"error": "bad_request", "message": "the body must be JSON"})
            return
        ordering_key: str | None = None
        seq: object = None
        if isinstance(payload, dict):
            raw_ok = payload.get("ordering_key")
            ordering_key = None if raw_ok is None else str(raw_ok)
            seq = payload.get("seq")

        delivery = ledger.open_delivery(key, path, trace, attempt)
        rule = delivery.rule
        mode = rule.mode if rule is not None else "normal"
        if rule is not None and mode in ("fail_500", "status"):
            status = 500 if mode == "fail_500" else rule.status
            ledger.finish_delivery(delivery.id, "injected", status)
            headers = {"Retry-After": rule.retry_after} if rule.retry_after else {}
            self._send_json(status, {"error": "injected", "mode": mode}, headers)
            return

        result = ledger.apply(delivery, key=key, path=path,
                              fingerprint=fingerprint("POST", path, payload),
                              request=_dump(payload), ordering_key=ordering_key, seq=seq,
                              mode=mode, complete=mode != "slow")
        headers = {"X-Psp-Outcome": result.outcome}
        if result.outcome == "replayed":
            headers["Idempotent-Replayed"] = "true"
        if rule is not None and mode == "slow":
            self.srv.stopping.wait(rule.delay)
            if result.outcome == "applied":
                ledger.complete(key)
        if (rule is not None and mode == "apply_then_timeout"
                and self.srv.stopping.wait(rule.delay)):
            self._reset_connection()  # stopped while hanging: drop it
            return
        if mode == "apply_then_500":
            self._send_json(500, {"error": "injected_after_apply"}, headers)
        elif mode == "reset":
            self._reset_connection()
        else:
            self._send(result.status, result.body, headers)


# --------------------------------------------------------------------------- test API


class ReceiverClient:
    """Talk to a running receiver over HTTP (any process, any host)."""

    def __init__(self, url: str, *, timeout: float = 30.0) -> None:
        self._url = url.rstrip("/")
        self.timeout = timeout
        # Loopback must never go through an HTTP proxy picked up from the environment.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234``; deliveries go to ``url + "/charges"``."""
        return self._url

    def _call(self, method: str, path: str, payload: object = None) -> Any:
        data = None if payload is None else _dump(payload).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with self._opener.open(req, timeout=self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            if exc.code == 400:
                raise ValueError(detail) from None
            raise RuntimeError(f"{method} {path} -> {exc.code}: {detail}") from None

    def stats(self) -> dict[str, Any]:
        """See :meth:`Ledger.stats`."""
        return cast(dict[str, Any], self._call("GET", "/_stats"))

    def ledger(self, key: str | None = None) -> dict[str, Any]:
        """See :meth:`Ledger.ledger`."""
        suffix = "" if key is None else "?" + urlencode({"key": key})
        return cast(dict[str, Any], self._call("GET", "/_ledger" + suffix))

    def applied_counts(self) -> dict[str, int]:
        """See :meth:`Ledger.applied_counts`."""
        return cast(dict[str, int], self._call("GET", "/_applied"))

    def rules(self) -> list[dict[str, Any]]:
        """Active rules, newest first."""
        return cast(list[dict[str, Any]], self._call("GET", "/_control")["rules"])

    def set_mode(self, mode: str = "normal", **options: object) -> int | None:
        """Add a rule (``set_mode("fail_500", key="k1", times=2)``); returns its id.

        ``set_mode()`` / ``set_mode("normal")`` clears all rules;
        ``set_mode("forget", older_than=T)`` makes the receiver forget keys after T s.
        """
        reply = self._call("POST", "/_control", {"mode": mode, **options})
        return cast("int | None", reply.get("rule_id"))

    def clear_modes(self) -> None:
        """Back to normal behaviour for every key."""
        self._call("DELETE", "/_control")

    def reset(self) -> None:
        """Empty the ledger and the rules (between test phases)."""
        self._call("POST", "/_reset")

    def assert_exactly_once(self, expected_keys: Iterable[str], *,
                            allow_extra: bool = True) -> dict[str, Any]:
        """Fail listing lost keys and keys applied more than once; return the stats.

        ``allow_extra=False`` also fails on applied keys nobody expected (for example an
        effect from a rolled-back transaction).
        """
        return _check_exactly_once(self.applied_counts(), expected_keys, allow_extra,
                                   self.stats)


def _check_exactly_once(counts: Mapping[str, int], expected_keys: Iterable[str],
                        allow_extra: bool,
                        stats: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    expected = set(expected_keys)
    lost = sorted(expected - counts.keys())
    doubled = {k: n for k, n in sorted(counts.items()) if n > 1}
    extra = [] if allow_extra else sorted(counts.keys() - expected)
    if lost or doubled or extra:
        def show(items: Iterable[object]) -> str:
            listed = list(items)
            head = ", ".join(map(str, listed[:20]))
            return head + (f", ... ({len(listed)} in all)" if len(listed) > 20 else "")
        parts = []
        if lost:
            parts.append(f"{len(lost)} lost (never applied): {show(lost)}")
        if doubled:
            parts.append(f"{len(doubled)} applied more than once: "
                         f"{show(f'{k} x{n}' for k, n in doubled.items())}")
        if extra:
            parts.append(f"{len(extra)} applied but not expected: {show(extra)}")
        raise AssertionError("exactly-once violated: " + "; ".join(parts))
    return stats()


class Receiver(ReceiverClient):
    """In-process receiver on a background thread: ``with Receiver() as psp: ...``.

    Reads go straight to the ledger, so counts stay available after :meth:`stop` (stop
    first, then count, and no late delivery can change the answer).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 db: str | os.PathLike[str] | None = None,
                 remote_control: bool = False) -> None:
        super().__init__("http://unstarted")
        self.host = host
        self.port = port
        self.db = db
        self.remote_control = remote_control
        self._ledger: Ledger | None = None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def ledger_store(self) -> Ledger:
        """The underlying :class:`Ledger` (opened on first use)."""
        if self._ledger is None:
            self._ledger = Ledger(self.db)
        return self._ledger

    def start(self) -> Self:
        """Listen (port 0 picks a free one) and serve on a daemon thread."""
        if self._server is not None:
            return self
        self._server = _Server((self.host, self.port), self.ledger_store,
                               remote_control=self.remote_control)
        host, port = self._server.server_address[:2]
        self._url = f"http://{_url_host(str(host))}:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                         kwargs={"poll_interval": 0.05},
                                         name=f"psp-{port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, wake sleeping handlers and cut open connections; keep the ledger."""
        server, self._server = self._server, None
        if server is None:
            return
        server.stopping.set()
        server.shutdown()
        server.server_close()
        server.cut_connections()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def close(self) -> None:
        """Stop and close the ledger (an in-memory one is lost)."""
        self.stop()
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        return self.ledger_store.stats()

    def ledger(self, key: str | None = None) -> dict[str, Any]:
        return self.ledger_store.ledger(key)

    def applied_counts(self) -> dict[str, int]:
        return self.ledger_store.applied_counts()

    def rules(self) -> list[dict[str, Any]]:
        return self.ledger_store.rules()

    def set_mode(self, mode: str = "normal", **options: object) -> int | None:
        if mode == FORGET:
            older_than = options.pop("older_than", None)
            if options or isinstance(older_than, bool) or not isinstance(older_than,
                                                                         int | float):
                raise ValueError('forget takes only "older_than" (seconds >= 0)')
            self.ledger_store.set_retention(float(older_than))
            return None
        rule = Rule.from_spec({"mode": mode, **options})
        if rule.is_clear_all:
            self.ledger_store.clear_rules()
            return None
        return self.ledger_store.add_rule(rule)

    def clear_modes(self) -> None:
        self.ledger_store.clear_rules()

    def reset(self) -> None:
        self.ledger_store.reset()

    def assert_exactly_once(self, expected_keys: Iterable[str], *,
                            allow_extra: bool = True) -> dict[str, Any]:
        return _check_exactly_once(self.applied_counts(), expected_keys, allow_extra,
                                   self.stats)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class ReceiverProcess(ReceiverClient):
    """The receiver as its own process (``python -m dispatcher.examples.payments.psp``).

    For crash and restart tests: SIGKILL it, start another on the same ``db`` file, and
    the ledger carries over; two of them on one file dedupe against each other.
    """

    def __init__(self, db: str | os.PathLike[str] | None = None, *, host: str = "127.0.0.1",
                 port: int = 0, python: str = sys.executable,
                 env: Mapping[str, str] | None = None, startup_timeout: float = 15.0) -> None:
        super().__init__("http://unstarted")
        self.db = db
        self.host = host
        self.port = port
        self.python = python
        self.env = env
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        """Process id (for SIGSTOP/SIGKILL in fault tests)."""
        if self.proc is None:
            raise RuntimeError("ReceiverProcess is not started")
        return self.proc.pid

    def start(self) -> Self:
        """Spawn the process and wait for its ``{"url": ...}`` line."""
        if self.proc is not None:
            return self
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ if self.env is None else self.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        cmd = [self.python, "-m", "dispatcher.examples.payments.psp", "--host", self.host,
               "--port", str(self.port)]
        if self.db is not None:
            cmd += ["--db", os.fspath(self.db)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env)
        lines: queue.Queue[bytes] = queue.Queue()
        stdout = self.proc.stdout
        assert stdout is not None
        threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
        try:
            line = lines.get(timeout=self.startup_timeout)
            self._url = str(json.loads(line)["url"])
        except (queue.Empty, ValueError, KeyError) as exc:
            self.kill()
            raise RuntimeError(f"receiver process did not start: {exc!r}") from None
        return self

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait, SIGKILL if needed; returns the exit code."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        return proc.returncode

    def kill(self) -> None:
        """SIGKILL: a crash, not a shutdown (in-progress keys stay in_progress)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """Run a receiver until SIGTERM/SIGINT; print ``{"url": ...}`` once listening."""
    parser = argparse.ArgumentParser(prog="python -m dispatcher.examples.payments.psp",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--db", default=None,
                        help="SQLite file shared by receivers (default: in memory)")
    parser.add_argument("--remote-control", action="store_true",
                        help="answer /_control, /_stats, /_ledger, /_applied and /_reset "
                             "from any peer, not only loopback (private test networks only)")
    args = parser.parse_args(argv)

    try:
        receiver = Receiver(args.host, args.port, db=args.db,
                            remote_control=args.remote_control).start()
    except (OSError, sqlite3.Error) as exc:
        print(f"psp: cannot start: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        print(json.dumps({"url": receiver.url}), flush=True)
        while not stop.wait(0.2):
            pass
    finally:
        receiver.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
