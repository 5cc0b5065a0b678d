"""Security, issue 16: bounded outbound calls, no credentials at rest, sane effect keys,
no baggage in effect rows, retention that runs by itself, masking in `outbox trace`.

Real parts only: a loopback receiver on a bare socket (it trickles bytes, sends 300 MiB,
records the Idempotency-Key and Authorization of each request), real PostgreSQL, real
`outbox worker` and Celery worker processes, the in-memory span exporter.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis
from opentelemetry import baggage, context, trace
from sqlalchemy import Engine, text
from tenacity import wait_fixed

from dispatcher import Dispatcher, EffectContext, HttpHandler, Registry, RetryPolicy
from dispatcher.cli import main
from dispatcher.http_async import AsyncHttpHandler
from outbox import Effect, enqueue, enqueue_many, ingest
from outbox.errors import AmbiguousOutcome, InvalidInput, PermanentFailure, TransientFailure
from outbox.masking import MASKED, MaskingFilter
from outbox.retention import RetentionPlan, ScheduledRetention
from outbox.sql import retention as retention_lock
from tests.dispatch_support import attempts_of, drain_then_shut_down, effect_row, wait_until
from tests.otel_helpers import span_exporter

ROOT = Path(__file__).resolve().parents[1]
SECRET = "S3cr3t"
MiB = 1024 * 1024


# --------------------------------------------------------------------------- receiver


@dataclass
class Seen:
    key: str | None
    authorization: str | None
    sent: int = 0            # bytes of the reply written before the client went away
    closed_after: float = 0.0


@dataclass
class RawReceiver:
    """HTTP/1.1 on a bare socket, one request per connection. Each request takes the
    next behaviour from `plan` (then `default`):

    - `ok`: 201 with a small JSON body; `status:N`: that status
    - `trickle`: the status line and then a header, one byte every `gap` seconds, never
      finishing (for `limit` seconds at most)
    - `trickle_body`: a 200 with complete headers, then the body one byte per `gap`
    - `huge`: a 200 announcing 300 MiB and sending it (one reused 1 MiB buffer)
    """

    plan: list[str] = field(default_factory=list)
    default: str = "ok"
    gap: float = 0.2
    limit: float = 20.0
    seen: list[Seen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        accept = threading.Thread(target=self._accept, daemon=True)
        accept.start()
        self.threads.append(accept)

    def url(self, path: str = "/charges", userinfo: str = "") -> str:
        return f"http://{userinfo}127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(5)
        self.sock.close()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self.threads.append(t)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in
                       (line.partition(":") for line in lines[1:])}
            length = int(headers.get("content-length", "0"))
            while len(body) < length:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                body += chunk
            seen = Seen(headers.get("idempotency-key"), headers.get("authorization"))
            with self.lock:
                self.seen.append(seen)
                behaviour = self.plan.pop(0) if self.plan else self.default
            started = time.monotonic()
            # The client going away is the point of most tests.
            with contextlib.suppress(OSError):
                self._answer(conn, behaviour, seen)
            seen.closed_after = time.monotonic() - started

    def _answer(self, conn: socket.socket, behaviour: str, seen: Seen) -> None:
        end = time.monotonic() + self.limit
        if behaviour == "ok" or behaviour.startswith("status:"):
            status = int(behaviour.split(":")[1]) if ":" in behaviour else 201
            body = b'{"id":"ch_1"}'
            conn.sendall(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                         % (status, len(body), body))
        elif behaviour == "trickle":
            for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10_000:
                if self.stop.is_set() or time.monotonic() > end:
                    return
                conn.sendall(bytes([byte]))
                seen.sent += 1
                time.sleep(self.gap)
        elif behaviour == "trickle_body":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10000\r\n\r\n{")
            for _ in range(9_999):
                if self.stop.is_set() or time.monotonic() > end:
                    return
                conn.sendall(b"a")
                seen.sent += 1
                time.sleep(self.gap)
        elif behaviour == "huge":
            chunk = b"x" * MiB
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                         b"Content-Length: %d\r\n\r\n" % (300 * MiB))
            for _ in range(300):
                if self.stop.is_set():
                    return
                conn.sendall(chunk)
                seen.sent += len(chunk)
        else:
            raise AssertionError(behaviour)


@pytest.fixture
def receiver() -> Iterator[RawReceiver]:
    r = RawReceiver()
    try:
        yield r
    finally:
        r.close()


def effect_ctx(key: str, *, deadline_in: float = 30.0, attempt: int = 1) -> EffectContext:
    return EffectContext(id=1, key=key, kind="psp.charge", payload={"amount": 5},
                         attempt=attempt, max_attempts=5,
                         deadline=time.monotonic() + deadline_in,
                         created_at=datetime.now(UTC))


# Both HTTP handlers keep one contract: every test below that takes `http_cls` runs on
# each (httpx, in the worker's threads; aiohttp, on the dispatcher's event loop).
HTTP_HANDLERS = {"httpx": HttpHandler, "aiohttp": AsyncHttpHandler}


@pytest.fixture(params=sorted(HTTP_HANDLERS))
def http_cls(request: pytest.FixtureRequest) -> Any:
    return HTTP_HANDLERS[request.param]


def call(handler: Any, effect: EffectContext) -> Any:
    """Run a handler as the dispatcher would: an async one on an event loop."""
    result = handler(effect)
    if asyncio.iscoroutine(result):
        async def run() -> Any:
            try:
                return await result
            finally:
                await handler.aclose()
        return asyncio.run(run())
    return result


def registry_of(kind: str, handler: Any, *, retry_safe: bool = True) -> Registry:
    reg = Registry()
    reg.register(kind, handler, retry_safe=retry_safe)
    return reg


def worker_registry() -> Registry:
    """For `outbox worker --handlers tests.test_security_outbound:worker_registry`."""
    reg = Registry()
    cls = HTTP_HANDLERS[os.environ.get("SECURITY_TEST_HANDLER", "httpx")]
    reg.register("psp.charge", cls(os.environ["SECURITY_TEST_RECEIVER"], timeout=10))
    return reg


# --------------------------------------------------------------------------- deadline


@pytest.mark.parametrize("retry_safe", [True, False], ids=["retry-safe", "not-retry-safe"])
def test_a_trickling_receiver_ends_within_the_deadline_ambiguous_then_same_key(
        engine: Engine, receiver: RawReceiver, retry_safe: bool, http_cls: Any) -> None:
    """One byte every 0.2 s never trips a per-read timeout of 1 s: the attempt ran as long
    as the receiver liked (20 s here, any time at all in the issue). Now the whole attempt
    ends at its 1 s deadline: ambiguous, retried with the same key (or parked for review
    when the kind is not retry-safe)."""
    receiver.plan = ["trickle"]
    handler = http_cls(receiver.url(), timeout=1.0)
    with engine.begin() as conn:
        eid = enqueue(conn, "psp.charge", {"amount": 5}, key="trickle-1").id
    d = Dispatcher(engine, registry_of("psp.charge", handler, retry_safe=retry_safe),
                   lease=10, policy=RetryPolicy(wait=wait_fixed(0)))
    try:
        t0 = time.monotonic()
        d.drain(budget=10)  # the retry is due at once (wait 0): it runs in this drain
        took = time.monotonic() - t0
        first = attempts_of(engine, eid)[0]
        assert first.outcome == "ambiguous", first
        ran = (first.finished_at - first.started_at).total_seconds()  # until recorded
        assert 0.9 <= ran < 1.0 + 0.75, ran
        assert took < 1.0 + 1.5, took
        if retry_safe:
            assert [a.outcome for a in attempts_of(engine, eid)] == ["ambiguous", "delivered"]
            assert [s.key for s in receiver.seen] == ["trickle-1", "trickle-1"]
        else:
            assert effect_row(engine, "trickle-1").status == "needs_review"
            assert [s.key for s in receiver.seen] == ["trickle-1"]
    finally:
        d.shutdown(0)


def test_a_reply_trickling_its_body_is_cut_at_the_deadline_and_the_status_decides(
        receiver: RawReceiver, http_cls: Any) -> None:
    """Once the status and headers are in, the receiver has answered: a body trickled
    past the deadline is cut there, and the 200 counts (body kept so far, truncated)."""
    receiver.plan = ["trickle_body"]
    handler = http_cls(receiver.url(), timeout=1.0)
    t0 = time.monotonic()
    summary = call(handler, effect_ctx("slow-body"))
    took = time.monotonic() - t0
    assert took < 1.0 + 0.5, took
    assert summary["status"] == 200 and summary["truncated"] is True
    assert summary["body"].startswith("{a")


def test_a_reply_trickling_past_the_effects_deadline_is_delivered_truncated(
        engine: Engine, receiver: RawReceiver, http_cls: Any) -> None:
    """The effect's deadline (0.8 x lease) binds, not the handler's 30 s: the 200 still
    decides (delivered, body truncated), for the async handler too, which the
    dispatcher cancels at that deadline (its own timeouts end the attempt just before)."""
    receiver.plan = ["trickle_body"]
    handler = http_cls(receiver.url(), timeout=30.0)
    with engine.begin() as conn:
        eid = enqueue(conn, "psp.charge", {"amount": 5}, key="slow-body-lease").id
    d = Dispatcher(engine, registry_of("psp.charge", handler), lease=1.5,
                   policy=RetryPolicy(wait=wait_fixed(0)))
    drain_then_shut_down(d, 10)
    [attempt] = attempts_of(engine, eid)
    assert attempt.outcome == "delivered", attempt
    row = effect_row(engine, "slow-body-lease")
    assert row.status == "delivered"
    assert row.result["status"] == 200 and row.result["truncated"] is True, row.result


def test_an_async_request_never_sent_is_a_plain_retry(receiver: RawReceiver) -> None:
    """AsyncHttpHandler with one connection: while a trickling reply holds it, a second
    delivery waits for the pool until its deadline. Nothing of it was sent, so it is a
    plain retry (TransientFailure), not ambiguous (which parks kinds that are not
    retry-safe); the first, whose request went out, is ambiguous."""
    receiver.plan = ["trickle"]
    handler = AsyncHttpHandler(receiver.url(), timeout=1.0, limit=1)

    async def both() -> list[Any]:
        try:
            first = asyncio.ensure_future(handler(effect_ctx("held-1")))
            await asyncio.sleep(0.2)  # the first holds the only connection
            second = asyncio.ensure_future(handler(effect_ctx("queued-2", deadline_in=0.5)))
            return list(await asyncio.gather(first, second, return_exceptions=True))
        finally:
            await handler.aclose()

    first, second = asyncio.run(both())
    assert isinstance(first, AmbiguousOutcome), first
    assert isinstance(second, TransientFailure), second
    assert [s.key for s in receiver.seen] == ["held-1"]


def test_the_effects_deadline_bounds_the_attempt_below_the_handlers_timeout(
        receiver: RawReceiver, http_cls: Any) -> None:
    """The handler's timeout is 30 s, but the attempt's deadline (from its lease) comes
    first: the earlier of the two ends it."""
    receiver.plan = ["trickle"]
    handler = http_cls(receiver.url(), timeout=30.0)
    t0 = time.monotonic()
    with pytest.raises(AmbiguousOutcome, match="deadline"):
        call(handler, effect_ctx("lease-bound", deadline_in=0.8))
    assert time.monotonic() - t0 < 0.8 + 0.5


# --------------------------------------------------------------------------- huge reply


def _rss(proc: psutil.Process) -> int:
    return int(proc.memory_info().rss)


def test_a_huge_reply_does_not_grow_the_worker_and_the_stored_result_is_bounded(
        engine: Engine, db_url: str, receiver: RawReceiver, tmp_path: Path,
        http_cls: Any) -> None:
    """A 300 MiB reply grew the worker by ~300 MiB (read whole, then decoded). Now the
    real `outbox worker` reads a 64 KiB prefix, closes the connection and stores 512
    characters of it: its RSS, sampled through the whole delivery, stays within a few
    MiB of what it was after a small delivery."""
    receiver.plan = ["ok", "huge"]
    env = {**os.environ, "DATABASE_URL": db_url, "PYTHONPATH": str(ROOT),
           "SECURITY_TEST_RECEIVER": receiver.url(), "OUTBOX_RETENTION": "off",
           "SECURITY_TEST_HANDLER": next(k for k, v in HTTP_HANDLERS.items() if v is http_cls),
           "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "dispatcher.cli", "worker", "--handlers",
             "tests.test_security_outbound:worker_registry", "--concurrency", "1",
             "--lease", "30", "--poll", "0.1", "--name", "security-huge"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc = psutil.Process(worker.pid)
        with engine.begin() as conn:
            enqueue(conn, "psp.charge", {"amount": 1}, key="warm-up")
        wait_until(lambda: effect_row_or_none(engine, "warm-up") == "delivered", 60,
                   interval=0.05, message=lambda: log.read_text(errors="replace")[-2000:])
        time.sleep(0.3)
        baseline = _rss(proc)
        with engine.begin() as conn:
            enqueue(conn, "psp.charge", {"amount": 2}, key="huge-reply")
        peak = baseline
        deadline = time.monotonic() + 60
        while effect_row_or_none(engine, "huge-reply") != "delivered":
            peak = max(peak, _rss(proc))
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-2000:]
            time.sleep(0.005)
        for _ in range(20):  # and a little after the outcome was recorded
            peak = max(peak, _rss(proc))
            time.sleep(0.01)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(10)
    grown = (peak - baseline) / MiB
    row = effect_row(engine, "huge-reply")
    print(f"huge reply: worker RSS {baseline / MiB:.1f} MiB -> peak {peak / MiB:.1f} MiB "
          f"(+{grown:.2f}); receiver wrote {receiver.seen[-1].sent / MiB:.1f} MiB before "
          "the client closed")
    assert grown < 4, f"the worker grew by {grown:.1f} MiB"
    assert row.result["status"] == 200 and row.result["truncated"] is True
    assert len(row.result["body"]) <= 512
    assert len(json.dumps(row.result)) < 1024
    assert receiver.seen[-1].sent < 300 * MiB  # the rest was never read


def effect_row_or_none(engine: Engine, key: str) -> str | None:
    with engine.connect() as conn:
        status: str | None = conn.execute(text(
            "SELECT status FROM outbox.effects WHERE effect_key = :k"), {"k": key}
        ).scalar()
        return status


# --------------------------------------------------------------------------- credentials


def _all_span_text(key: str) -> str:
    """Every attribute and event of the spans of the effect with `key`, as text."""
    out: list[str] = []
    for span in span_exporter().get_finished_spans():
        if (span.attributes or {}).get("outbox.effect_key") != key:
            continue
        out.append(span.name)
        out.extend(f"{k}={v!r}" for k, v in (span.attributes or {}).items())
        for event in span.events:
            out.append(event.name)
            out.extend(f"{k}={v!r}" for k, v in (event.attributes or {}).items())
    assert out, f"no span for {key}"
    return "\n".join(out)


def test_credentials_in_the_receiver_url_reach_no_error_attempt_span_or_cli_output(
        engine: Engine, receiver: RawReceiver, capsys: pytest.CaptureFixture[str],
        http_cls: Any) -> None:
    """`http://user:S3cr3t@host` leaked into last_error, attempts, span events and
    `outbox trace`. The handler now sends the credentials as `Authorization: Basic` and
    names the URL without them; a custom handler's error quoting such a URL is
    redacted before it is stored or traced."""
    span_exporter()
    receiver.default = "status:500"
    handler = http_cls(receiver.url(userinfo=f"user:{SECRET}@"), timeout=5)

    def custom(effect: EffectContext) -> Any:
        raise RuntimeError(f"POST https://svc:{SECRET}@hooks.example/x?token={SECRET} "
                           "failed")

    reg = registry_of("psp.charge", handler)
    reg.register("custom.hook", custom)
    with engine.begin() as conn:
        http_id = enqueue(conn, "psp.charge", {"amount": 5}, key="creds-http",
                          max_attempts=1).id
        custom_id = enqueue(conn, "custom.hook", {}, key="creds-custom", max_attempts=1).id
    d = Dispatcher(engine, reg, lease=10)
    drain_then_shut_down(d, 10)
    # The credentials still work: they travel in the Authorization header.
    expected = "Basic " + base64.b64encode(f"user:{SECRET}".encode()).decode()
    assert [s.authorization for s in receiver.seen] == [expected]
    for key, eid in (("creds-http", http_id), ("creds-custom", custom_id)):
        row = effect_row(engine, key)
        assert row.status == "failed" and row.last_error, row
        assert SECRET not in row.last_error, row.last_error
        [attempt] = attempts_of(engine, eid)
        assert attempt.error and SECRET not in attempt.error, attempt.error
        assert SECRET not in _all_span_text(key)
    assert "HTTP 500 from http://127.0.0.1:" in effect_row(engine, "creds-http").last_error
    assert "https://***@hooks.example/x?token=***" in effect_row(
        engine, "creds-custom").last_error
    # Rows stored by an older version still hold the secret: the CLI never prints it.
    with engine.begin() as conn:
        conn.execute(text(
            "UPDATE outbox.effects SET last_error = :e WHERE id = :i"),
            {"e": f"HTTP 500 from http://user:{SECRET}@old.example/hook", "i": http_id})
        conn.execute(text(
            "UPDATE outbox.attempts SET error = :e WHERE effect_id = :i"),
            {"e": f"HTTP 500 from http://user:{SECRET}@old.example/hook", "i": http_id})
    capsys.readouterr()
    for args in (["trace", str(http_id)], ["trace", str(http_id), "--json"],
                 ["trace", str(custom_id)], ["status"], ["status", "--json"]):
        assert main(args) == 0
        out = capsys.readouterr()
        assert SECRET not in out.out + out.err, (args, out.out)
    assert main(["trace", str(http_id)]) == 0
    assert "http://***@old.example/hook" in capsys.readouterr().out
    assert SECRET not in repr(handler) and SECRET not in handler.url


# --------------------------------------------------------------------------- effect keys


@pytest.mark.parametrize("key", [
    "a\r\nX-Injected: 1", "line\nfeed", "nul\x00", "clé", "ключ", "", "k" * 256,
    "has space", "a,b", '"quoted"', "\t",
], ids=["crlf", "lf", "nul", "latin1", "cyrillic", "empty", "256", "space", "comma",
        "quoted", "tab"])
def test_bad_effect_keys_are_refused_at_enqueue(engine: Engine, key: str) -> None:
    """CR/LF was accepted and then refused by the HTTP library at every delivery, as an
    ambiguous failure retried 25 times; non-ASCII raised there. Now the caller hears it
    at enqueue, and nothing is stored."""
    with engine.begin() as conn, pytest.raises(InvalidInput, match="effect key"):
        enqueue(conn, "psp.charge", {"amount": 1}, key=key)
    with engine.begin() as conn, pytest.raises(InvalidInput, match="effect key"):
        enqueue_many(conn, [Effect("psp.charge", {}, key="fine-1"),
                            Effect("psp.charge", {}, key=key)])
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM outbox.effects")).scalar() == 0


@pytest.mark.parametrize("kind", ["has space", "kïnd", "", "k" * 201, "a,b", "x\r\ny"])
def test_bad_kinds_are_refused_at_enqueue(engine: Engine, kind: str) -> None:
    """The kind starts every derived key (`kind:digest`): the same characters."""
    with engine.begin() as conn, pytest.raises(InvalidInput, match="kind"):
        enqueue(conn, kind, {"amount": 1})


def test_good_keys_and_kinds_pass(engine: Engine) -> None:
    with engine.begin() as conn:
        a = enqueue(conn, "psp.charge", {}, key="k" * 255)
        b = enqueue(conn, "order.placed/v2", {}, key="ord_123:charge-#1~!$%&'()*+./;<=>?@[]")
        c = enqueue(conn, "k" * 200, {})
    assert (a.inserted, b.inserted, c.inserted) == (True, True, True)


def test_a_stored_bad_key_fails_permanently_at_once(receiver: RawReceiver,
                                                   http_cls: Any) -> None:
    """A row written before enqueue checked keys: one permanent failure, not 25
    ambiguous retries; nothing is sent."""
    handler = http_cls(receiver.url(), timeout=2)
    with pytest.raises(PermanentFailure, match="effect key"):
        call(handler, effect_ctx("bad\r\nkey"))
    assert receiver.seen == []


# --------------------------------------------------------------------------- baggage


def test_client_baggage_is_not_stored_in_effect_rows(engine: Engine) -> None:
    """`baggage` (say `user.email=...` from a client) rode in every effect row; only the
    W3C trace context is stored now, and the trace still continues."""
    span_exporter()
    token = context.attach(baggage.set_baggage("user.email", "alice@example.com"))
    try:
        with trace.get_tracer("test").start_as_current_span("request") as span, \
                engine.begin() as conn:
            enqueue(conn, "psp.charge", {"amount": 1}, key="with-baggage")
            trace_id = format(span.get_span_context().trace_id, "032x")
    finally:
        context.detach(token)
    headers = effect_row(engine, "with-baggage").headers
    assert set(headers) == {"traceparent"}, headers
    assert trace_id in headers["traceparent"]
    assert "alice" not in json.dumps(headers)


# --------------------------------------------------------------------------- retention

WINDOW_ENV = {"OUTBOX_RETAIN_EFFECTS": "7d", "OUTBOX_RETAIN_INBOX": "7d",
              "OUTBOX_RETAIN_CONFLICTS": "7d", "OUTBOX_RETAIN_VERSIONS": "7d",
              "OUTBOX_RETAIN_HORIZONS": "s=3d", "OUTBOX_RETENTION_INTERVAL": "0.5",
              "OUTBOX_RETENTION_BATCH": "2"}


def ago(**delta: float) -> Callable[[], datetime]:
    moment = datetime.now(UTC) - timedelta(**delta)
    return lambda: moment


def seed_aged_rows(engine: Engine) -> None:
    """Rows on both sides of every window, and rows no window may ever take. Effects sit
    on a queue no worker here serves, so only retention can change them."""
    effects = ["old-delivered", "old-delivered-2", "old-delivered-3", "new-delivered",
               "old-cancelled", "old-failed", "old-review", "old-pending", "old-in-flight"]
    with engine.begin() as conn:
        ids = {k: enqueue(conn, "noop", {"k": k}, key=k, queue="retention-only").id
               for k in effects}
        # Old, and never due here (Celery's sweep rings every queue with due work).
        conn.execute(text("UPDATE outbox.effects SET created_at = now() - interval '10 days',"
                          " available_at = now() + interval '1 day'"))

        def finish(key: str, status: str, days: float) -> None:
            conn.execute(text(
                "UPDATE outbox.effects SET status = :s, finished_at = now() - make_interval("
                "days => :d), delivered_at = CASE WHEN :s = 'delivered' THEN now() -"
                " make_interval(days => :d) END, attempts = 1 WHERE id = :i"),
                {"s": status, "d": days, "i": ids[key]})
            conn.execute(text(
                "INSERT INTO outbox.attempts (effect_id, attempt, worker, started_at,"
                " finished_at, outcome) VALUES (:i, 1, 'w', now() - make_interval(days => :d),"
                " now() - make_interval(days => :d), :o)"),
                {"i": ids[key], "d": days,
                 "o": {"delivered": "delivered", "needs_review": "ambiguous"}.get(status,
                                                                                  "failed")})

        for key in ("old-delivered", "old-delivered-2", "old-delivered-3"):
            finish(key, "delivered", 10)
        finish("new-delivered", "delivered", 1)
        finish("old-cancelled", "cancelled", 10)
        finish("old-failed", "failed", 10)
        finish("old-review", "needs_review", 10)
        conn.execute(text(
            "UPDATE outbox.effects SET status = 'in_flight', lease_owner = 'elsewhere',"
            " lease_token = gen_random_uuid(), lease_expires_at = now() + interval '1 hour',"
            " attempts = 1 WHERE id = :i"), {"i": ids["old-in-flight"]})
        # Keys: one expired, one live, one stale `processing` claim.
        conn.execute(text(
            "INSERT INTO outbox.idempotency_keys (scope, key, fingerprint, status,"
            " response_status, response_headers, response_body, created_at, completed_at,"
            " expires_at) VALUES"
            " ('t', 'expired', 'f', 'completed', 200, '[]', '', now() - interval '2 days',"
            "  now() - interval '2 days', now() - interval '1 day'),"
            " ('t', 'live', 'f', 'completed', 200, '[]', '', now(), now(),"
            "  now() + interval '1 day')"))
        conn.execute(text(
            "INSERT INTO outbox.idempotency_keys (scope, key, fingerprint, status,"
            " lock_token, locked_at, lock_expires_at, created_at, expires_at) VALUES"
            " ('t', 'processing', 'f', 'processing', gen_random_uuid(),"
            "  now() - interval '10 days', now() - interval '10 days',"
            "  now() - interval '10 days', now() - interval '9 days')"))
    with engine.begin() as conn:  # inbox, conflicts, versions
        ingest(conn, "s", "old", {"v": 0}, clock=ago(days=10))
        ingest(conn, "s", "old", {"v": 1}, clock=ago(days=10))  # a conflicting copy
        ingest(conn, "s", "old-unprocessed", {"v": 0}, processed=False, clock=ago(days=10))
        ingest(conn, "s", "fresh", {"v": 0})
        ingest(conn, "s", "v-old", {"v": 0}, version=1, entity="e-old", clock=ago(days=10))
        ingest(conn, "s", "v-new", {"v": 0}, version=1, entity="e-new")


def state(engine: Engine) -> dict[str, Any]:
    with engine.connect() as conn:
        def col(sql: str) -> list[Any]:
            return sorted(conn.execute(text(sql)).scalars())
        return {
            "effects": col("SELECT effect_key FROM outbox.effects"),
            "attempts": col("SELECT e.effect_key FROM outbox.attempt_history a"
                            " JOIN outbox.effects e ON e.id = a.effect_id"),
            "orphan_attempts": conn.execute(text(
                "SELECT count(*) FROM outbox.attempt_history a WHERE NOT EXISTS (SELECT 1 FROM"
                " outbox.effects e WHERE e.id = a.effect_id)")).scalar(),
            "keys": col("SELECT key FROM outbox.idempotency_keys"),
            "inbox": col("SELECT event_id FROM outbox.inbox"),
            "conflicts": conn.execute(text(
                "SELECT count(*) FROM outbox.inbox_conflicts")).scalar(),
            "versions": col("SELECT entity FROM outbox.entity_versions"),
        }


SEEDED = {
    "effects": ["new-delivered", "old-cancelled", "old-delivered", "old-delivered-2",
                "old-delivered-3", "old-failed", "old-in-flight", "old-pending",
                "old-review"],
    "attempts": ["new-delivered", "old-cancelled", "old-delivered", "old-delivered-2",
                 "old-delivered-3", "old-failed", "old-review"],
    "orphan_attempts": 0,
    "keys": ["expired", "live", "processing"],
    "inbox": ["fresh", "old", "old-unprocessed", "v-new", "v-old"],
    "conflicts": 1,
    "versions": ["e-new", "e-old"],
}
PURGED = {
    "effects": ["new-delivered", "old-failed", "old-in-flight", "old-pending",
                "old-review"],
    "attempts": ["new-delivered", "old-failed", "old-review"],
    "orphan_attempts": 0,
    "keys": ["live", "processing"],
    "inbox": ["fresh", "old-unprocessed", "v-new"],
    "conflicts": 0,
    "versions": ["e-new"],
}


def spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **env}
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=full, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def test_retention_runs_by_itself_in_the_worker(engine: Engine, db_url: str,
                                                tmp_path: Path) -> None:
    """Nothing was ever purged unless an operator ran `outbox purge`. A plain
    `outbox worker` now purges every class on its own, in batches (of 2 here), within
    the windows, and never a dead letter, a parked or unfinished effect, a processing
    claim, an unprocessed event or a row younger than its window."""
    seed_aged_rows(engine)
    assert state(engine) == SEEDED
    log = tmp_path / "worker.log"
    worker = spawn([sys.executable, "-m", "dispatcher.cli", "worker", "--poll", "0.2",
                    "--handlers", "tests.test_security_outbound:worker_registry",
                    "--name", "security-retention"],
                   {"DATABASE_URL": db_url, "SECURITY_TEST_RECEIVER": "http://127.0.0.1:9",
                    **WINDOW_ENV}, log)
    try:
        wait_until(lambda: state(engine) == PURGED, 30, interval=0.2,
                   message=lambda: f"{state(engine)}\n{log.read_text(errors='replace')}")
        time.sleep(1.5)  # more runs take nothing else
        assert state(engine) == PURGED
        assert worker.poll() is None
    finally:
        kill(worker)
    text_ = log.read_text(errors="replace")
    assert "retention: effects 7d" in text_ and "retention: purged" in text_, text_


def test_a_window_below_a_horizon_stops_the_worker_before_anything_is_deleted(
        engine: Engine, db_url: str, tmp_path: Path) -> None:
    seed_aged_rows(engine)
    log = tmp_path / "worker.log"
    worker = spawn([sys.executable, "-m", "dispatcher.cli", "worker",
                    "--handlers", "tests.test_security_outbound:worker_registry"],
                   {"DATABASE_URL": db_url, "SECURITY_TEST_RECEIVER": "http://127.0.0.1:9",
                    **WINDOW_ENV, "OUTBOX_RETAIN_INBOX": "1d"}, log)
    try:
        assert worker.wait(60) == 2
    finally:
        kill(worker)
    out = log.read_text(errors="replace")
    assert "configuration error" in out and "redelivery horizon" in out, out
    assert state(engine) == SEEDED


REDIS_URL = "redis://127.0.0.1:6379/12"


def test_retention_runs_by_itself_in_celery(engine: Engine, db_url: str,
                                            tmp_path: Path) -> None:
    """`celery -A dispatcher.celery_app worker` alone (no beat): its periodic sweep runs
    the same plan."""
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).flushdb()
    except redis.exceptions.ConnectionError:
        pytest.skip("Redis is not reachable on 127.0.0.1:6379")
    seed_aged_rows(engine)
    log = tmp_path / "celery.log"
    celery = spawn([str(Path(sys.executable).parent / "celery"), "-A", "dispatcher.celery_app",
                    "worker", "-c", "2", "--loglevel", "INFO",
                    "-n", f"retention-{uuid.uuid4().hex[:6]}@%h"],
                   {"DATABASE_URL": db_url, "BROKER_URL": REDIS_URL,
                    "OUTBOX_CELERY_QUEUE": f"outbox-ret-{uuid.uuid4().hex[:8]}",
                    "OUTBOX_SWEEP_INTERVAL": "0.5",
                    "OUTBOX_HANDLERS": "tests.test_security_outbound:worker_registry",
                    "SECURITY_TEST_RECEIVER": "http://127.0.0.1:9", **WINDOW_ENV}, log)
    try:
        wait_until(lambda: state(engine) == PURGED, 60, interval=0.2,
                   message=lambda: f"{state(engine)}\n{log.read_text(errors='replace')[-4000:]}")
        time.sleep(1.5)
        assert state(engine) == PURGED
    finally:
        kill(celery)


def test_one_purger_at_a_time(engine: Engine, db_url: str) -> None:
    """While another session holds the purger lock, a run deletes nothing and says so
    (a scheduler skips its turn; `outbox purge` waits, then gives up with exit 1)."""
    seed_aged_rows(engine)
    plan = RetentionPlan(effects=7 * 86400.0, inbox=7 * 86400.0, conflicts=7 * 86400.0,
                         versions=7 * 86400.0, horizons={"s": 3 * 86400.0}, batch=2)
    holder = engine.connect()
    try:
        assert retention_lock.try_lock_purger(holder)
        holder.commit()
        run = plan.run(engine)
        assert run.locked_out and not run.deleted
        done = subprocess.run(
            [sys.executable, "-m", "dispatcher.cli", "purge", "--older-than", "7d",
             "--wait-lock", "0.5"], cwd=ROOT, capture_output=True, text=True, timeout=60,
            env={**os.environ, "DATABASE_URL": db_url})
        assert done.returncode == 1 and "held the lock" in done.stderr, done
        assert state(engine) == SEEDED
        assert retention_lock.unlock_purger(holder)
        holder.commit()
    finally:
        holder.invalidate()  # its session (and any lock) ends with it
        holder.close()
    run = plan.run(engine)
    assert not run.locked_out and run.complete
    assert run.deleted == {"effects": 4, "idempotency_keys": 1, "inbox": 2,
                           "inbox_conflicts": 1, "entity_versions": 1}
    assert state(engine) == PURGED


def test_a_run_over_its_budget_resumes_next_time(engine: Engine) -> None:
    """A budget shared by the classes: a run that stops early leaves the rest (and the
    versions walk's position) to the next."""
    seed_aged_rows(engine)
    plan = RetentionPlan(effects=7 * 86400.0, inbox=7 * 86400.0, conflicts=7 * 86400.0,
                         versions=7 * 86400.0, horizons={"s": 3 * 86400.0}, batch=1)
    first = plan.run(engine, budget=0.0001)
    assert not first.complete and first.deleted["effects"] >= 1
    scheduled = ScheduledRetention(plan, interval=0.01, budget=30)
    time.sleep(0.02)
    capped = scheduled.run_if_due(engine, budget=0.0001)  # a Celery sweep caps its run
    assert capped is not None and not capped.complete
    time.sleep(0.02)
    assert scheduled.run_if_due(engine) is not None
    assert state(engine) == PURGED


def test_a_run_rests_between_batches_by_its_duty(engine: Engine) -> None:
    """`duty`: after a batch that took t, the run rests t * (1 - duty) / duty, so a purge
    of a million rows leaves the database's cores to the live claims (the claim p99 is
    measured in docs/benchmarks.md, "Finished rows")."""
    seed_aged_rows(engine)
    plan = RetentionPlan(effects=7 * 86400.0, keys=False, inbox=None, conflicts=None,
                         versions=None, batch=1)
    gaps: list[float] = []
    last = [time.monotonic()]

    def progress(name: str, total: int) -> None:
        now = time.monotonic()
        gaps.append(now - last[0])
        last[0] = now

    run = plan.run(engine, duty=0.005, progress=progress)
    assert run.complete and run.deleted == {"effects": 4}
    # Between two batches: the rest after the first (199 times its length) and the
    # second batch. A run ignoring its duty takes a few milliseconds per batch.
    assert len(gaps) == 4 and min(gaps[1:]) > 0.05, gaps
    from outbox.errors import ConfigurationError

    with pytest.raises(ConfigurationError):
        plan.run(engine, duty=0)


@pytest.mark.parametrize(("env", "expected"), [
    ({}, "effects 30d, keys at their expiry, inbox 30d, conflicts 30d, versions 30d"),
    ({"OUTBOX_RETAIN_EFFECTS": "off", "OUTBOX_RETAIN_KEYS": "off",
      "OUTBOX_RETAIN_INBOX": "14d"},
     "effects kept, keys kept, inbox 14d, conflicts 30d, versions 30d"),
    ({"OUTBOX_RETENTION": "off"}, None),
])
def test_the_plan_from_the_environment(env: dict[str, str], expected: str | None) -> None:
    plan = RetentionPlan.from_env(env)
    assert (plan.describe() if plan else None) == expected


@pytest.mark.parametrize("env", [
    {"OUTBOX_RETAIN_EFFECTS": "soon"}, {"OUTBOX_RETAIN_KEYS": "maybe"},
    {"OUTBOX_RETAIN_HORIZONS": "stripe"}, {"OUTBOX_RETENTION_BATCH": "0"},
    {"OUTBOX_RETAIN_CONFLICTS": "1d", "OUTBOX_RETAIN_HORIZONS": "stripe=3d"},
    {"OUTBOX_RETENTION_DUTY": "0"}, {"OUTBOX_RETENTION_DUTY": "1.5"},
    {"OUTBOX_RETENTION_DUTY": "half"},
])
def test_a_bad_retention_setting_is_a_configuration_error(env: dict[str, str]) -> None:
    from outbox.errors import ConfigurationError

    with pytest.raises(ConfigurationError):
        ScheduledRetention.from_env(env)


# --------------------------------------------------------------------------- masking


def test_trace_masks_payload_fields_by_the_consoles_rules(
        engine: Engine, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`outbox trace --json` printed the payload (card numbers, passwords) as stored.
    It now masks it with the console's rules (`OUTBOX_UI_MASK`, or the defaults), in
    text and JSON, and the receiver's stored reply too."""
    payload = {"amount": 5, "card": {"number": "4242424242424242", "cvc": "123"},
               "user": {"password": "hunter2", "name": "ann"}}
    with engine.begin() as conn:
        eid = enqueue(conn, "psp.charge", payload, key="masked").id
        conn.execute(text(  # the receiver's stored reply
            "UPDATE outbox.effects SET result = '{\"status\": 402, \"token\":"
            " \"tok_live_secret\"}' WHERE id = :i"), {"i": eid})
    monkeypatch.delenv("OUTBOX_UI_MASK", raising=False)
    capsys.readouterr()
    for args in (["trace", str(eid), "--json"], ["trace", "masked"]):
        assert main(args) == 0
        out = capsys.readouterr().out
        for secret in ("4242424242424242", "hunter2", "tok_live_secret"):
            assert secret not in out, (args, out)
        assert MASKED in out and "ann" in out, out
    assert main(["trace", str(eid), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["effect"]["payload"]["card"] == {"number": MASKED, "cvc": MASKED}
    assert shown["effect"]["payload"]["amount"] == 5
    # One rule for the console, trace and logs: the operator's own replaces the defaults.
    monkeypatch.setenv("OUTBOX_UI_MASK", "amount,**.name")
    assert main(["trace", str(eid), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["effect"]["payload"]
    assert shown["amount"] == MASKED and shown["user"]["name"] == MASKED
    assert shown["card"]["number"] == "4242424242424242"


def test_logs_mask_payload_fields_by_the_same_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OUTBOX_UI_MASK", raising=False)
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    handler = Collect()
    handler.addFilter(MaskingFilter())
    log = logging.getLogger(f"test.masking.{uuid.uuid4().hex}")
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)
    payload: dict[str, Any] = {"amount": 5, "card": {"number": "4242424242424242"},
                               "api_key": "sk_1"}
    log.info("charging %s", payload)
    log.info("charging %(amount)s with %(card)s", payload)
    log.info(payload)
    assert len(lines) == 3
    for line in lines:
        assert "4242424242424242" not in line and "sk_1" not in line, line
        assert "5" in line
    assert payload["card"]["number"] == "4242424242424242"  # the caller's copy is intact


def test_a_busy_class_gets_the_budget_the_others_leave(engine: Engine) -> None:
    """Each class starts with an even share of the budget; what the others leave unused
    (they have nothing to delete here) goes to the effects in the next pass. Before, the
    effects had their first share only (a fifth of the budget with the default plan),
    and the scheduled runs purged a fifth of what their duty and budget promised."""
    with engine.begin() as conn:
        conn.execute(text(
            "WITH ins AS (INSERT INTO outbox.effects (effect_key, kind, payload, status,"
            " delivered_at, finished_at) SELECT 'busy-' || g, 'noop', '{}', 'delivered',"
            " now() - interval '40 days', now() - interval '40 days'"
            " FROM generate_series(1, 40000) g RETURNING id, effect_key)"
            " INSERT INTO outbox.effect_keys (effect_key, effect_id)"
            " SELECT effect_key, id FROM ins"))
    plan = RetentionPlan(batch=50)  # every class on, as by default
    batches: list[float] = []
    run = plan.run(engine, budget=1.5, duty=0.1,
                   progress=lambda name, total: batches.append(time.monotonic()))
    assert not run.complete
    # Rests of 9x each batch: at its first share (0.3 s) the effects stop after a few
    # batches; with the whole budget they keep deleting until ~1.5 s.
    assert batches[-1] - batches[0] > 0.9, (len(batches), batches[-1] - batches[0])
    assert run.deleted["effects"] < 40000
