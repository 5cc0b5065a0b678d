"""The idempotency guard and enqueue() against a real PostgreSQL, in both modes.

Scenario numbers (F01-F13, B11-B13) are those of research/anchors-reliability.md.
No mocks: races are real threads released together by a barrier, crashes are claims
that are never completed, time passes by backdating `locked_at` or through the
injectable clock, and serialization failures and deadlocks are real server errors.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import Connection, Engine, event, make_url, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import outbox._inflight
from outbox import (
    Claim,
    Effect,
    IdempotencyGuard,
    Result,
    StoredResponse,
    add_doorbell,
    enqueue,
    enqueue_many,
    fingerprint,
    make_engine,
    remove_doorbell,
)
from outbox._idempotency import Mode, advisory_lock_id
from outbox._inflight import in_flight
from outbox.errors import (
    ClaimLost,
    EffectKeyConflict,
    InvalidInput,
    InvalidRequestBody,
    KeyReused,
    RequestInProgress,
)
from outbox.sql import dispatch
from outbox.sql import keys as keysql
from tests.dispatch_support import CountingDriver
from tests.otel_helpers import span_exporter

SCOPE = "tenant-1:POST /orders"
BODY = {"amount": 42, "currency": "EUR"}
FP = fingerprint("POST", "/orders", BODY)
MODES: list[Mode] = ["atomic", "phased"]
Work = Callable[[Connection, Claim], StoredResponse]


# --- fixtures and helpers --------------------------------------------------------------

@pytest.fixture
def storm_engine(db_url: str) -> Iterator[Engine]:
    """A pool big enough that 50 racing requests never wait for a connection.

    Its connections are opened before the test and closed after it: on a shared
    server, opening them mid-race could meet "too many clients", and holding them for
    the whole module would starve other people's tests.
    """
    eng = make_engine(db_url, application_name="tests-storm", pool_size=50, max_overflow=0,
                      pool_timeout=60)
    held: list[Connection] = []
    deadline = time.monotonic() + 30
    try:
        while len(held) < 50:
            try:
                held.append(eng.connect())
            except OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    finally:
        for conn in held:
            conn.close()  # back to the pool, which keeps it open
    yield eng
    eng.dispose()


@pytest.fixture
def allow_processing() -> None:
    """Requested by a test that deliberately ends with `processing` keys."""


@pytest.fixture(autouse=True)
def _no_stuck_claims(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test: no key is left `processing` (I6), unless the test says so."""
    yield
    if "engine" not in request.fixturenames or "allow_processing" in request.fixturenames:
        return
    eng: Engine = request.getfixturevalue("engine")
    with eng.connect() as conn:
        stuck = conn.execute(text(
            "SELECT count(*) FROM outbox.idempotency_keys WHERE status = 'processing'"
        )).scalar_one()
    assert stuck == 0, f"{stuck} idempotency key(s) left in 'processing'"


@pytest.fixture
def spans() -> InMemorySpanExporter:
    """The process's one in-memory span exporter (tests/otel_helpers sets the SDK
    TracerProvider once per process, or joins one already installed)."""
    return span_exporter()


def response_for(order_id: int, tag: str) -> StoredResponse:
    # Deliberately not canonical JSON, with repeated headers and an order to keep:
    # a replay must give back these exact bytes, not a re-serialisation.
    body = json.dumps({"id": order_id, "status": "created", "by": tag}, indent=1)
    return StoredResponse(
        201,
        (("Content-Type", "application/json"), ("Location", f"/orders/{order_id}"),
         ("Set-Cookie", "a=1"), ("Set-Cookie", "b=2")),
        (body + "\n").encode(),
    )


# How make_work writes its effects: `enqueue_many(conn, ..., claim=claim)`, or deferred to
# the key's completion (`claim.enqueue_many`). Tests that take the `effect_form` fixture
# run on both.
_FORM = {"deferred": False}


@pytest.fixture(params=["enqueue", "deferred"])
def effect_form(request: pytest.FixtureRequest) -> Iterator[str]:
    _FORM["deferred"] = request.param == "deferred"
    yield str(request.param)
    _FORM["deferred"] = False


def make_work(key: str, *, tag: str = "", calls: list[uuid.UUID] | None = None,
              hook: Callable[[Connection, Claim], None] | None = None,
              after_enqueue: Callable[[Connection, Claim], None] | None = None,
              pause: float = 0.0) -> Work:
    """The business handler: one order row, a charge and a receipt effect."""

    def work(conn: Connection, claim: Claim) -> StoredResponse:
        if calls is not None:
            calls.append(claim.token)
        if hook is not None:
            hook(conn, claim)
        order_id = conn.execute(
            text("INSERT INTO test_orders (key, amount) VALUES (:k, 42) RETURNING id"),
            {"k": key}).scalar_one()
        pair = [
            Effect("psp.charge", {"order_key": key, "order_id": order_id, "by": tag}),
            Effect("email.receipt", {"order_key": key, "order_id": order_id, "by": tag}),
        ]
        if _FORM["deferred"]:
            claim.enqueue_many(pair)
        else:
            enqueue_many(conn, pair, claim=claim)
        if after_enqueue is not None:
            after_enqueue(conn, claim)
        if pause:
            time.sleep(pause)
        return response_for(order_id, tag)

    return work


def orders(eng: Engine, key: str | None = None) -> int:
    with eng.connect() as conn:
        if key is None:
            return int(conn.execute(text("SELECT count(*) FROM test_orders")).scalar_one())
        return int(conn.execute(text("SELECT count(*) FROM test_orders WHERE key = :k"),
                                {"k": key}).scalar_one())


def effects(eng: Engine, key: str | None = None) -> int:
    with eng.connect() as conn:
        if key is None:
            return int(conn.execute(text("SELECT count(*) FROM outbox.effects")).scalar_one())
        return int(conn.execute(
            text("SELECT count(*) FROM outbox.effects WHERE payload->>'order_key' = :k"),
            {"k": key}).scalar_one())


def key_rows(eng: Engine) -> list[Any]:
    with eng.connect() as conn:
        return list(conn.execute(text(
            "SELECT * FROM outbox.idempotency_keys ORDER BY scope, key")).tuples())


def key_status(eng: Engine, key: str, scope: str = SCOPE) -> str | None:
    with eng.connect() as conn:
        status: str | None = conn.execute(text(
            "SELECT status FROM outbox.idempotency_keys WHERE scope = :s AND key = :k"),
            {"s": scope, "k": key}).scalar_one_or_none()
    return status


def snapshot(eng: Engine) -> tuple[list[Any], list[Any], list[Any]]:
    with eng.connect() as conn:
        return (
            key_rows(eng),
            list(conn.execute(text("SELECT * FROM test_orders ORDER BY id")).tuples()),
            list(conn.execute(text(
                "SELECT id, effect_key, payload, status FROM outbox.effects ORDER BY id"
            )).tuples()),
        )


def backdate(eng: Engine, key: str, seconds: float, scope: str = SCOPE) -> None:
    """Make a `processing` claim look `seconds` older (the TTL passes instantly)."""
    with eng.begin() as conn:
        moved = conn.execute(text(
            "UPDATE outbox.idempotency_keys SET locked_at = locked_at - make_interval(secs => :s),"
            " lock_expires_at = lock_expires_at - make_interval(secs => :s)"
            " WHERE scope = :scope AND key = :key AND status = 'processing'"),
            {"s": seconds, "scope": scope, "key": key}).rowcount
    assert moved == 1


def later(seconds: float) -> Callable[[], datetime]:
    """An injectable clock running `seconds` ahead of the wall clock."""
    return lambda: datetime.now(UTC) + timedelta(seconds=seconds)


def raw_dsn(db_url: str) -> str:
    return make_url(db_url).set(drivername="postgresql").render_as_string(hide_password=False)


Outcome = Result | RequestInProgress | KeyReused


def guarded(guard: IdempotencyGuard, eng: Engine, key: str, work: Work, mode: Mode,
            barrier: threading.Barrier, delay: float = 0.0) -> tuple[Outcome, float]:
    barrier.wait(timeout=30)
    if delay:
        time.sleep(delay)
    started = time.monotonic()
    try:
        out: Outcome = guard.run(eng, SCOPE, key, FP, work, mode=mode)
    except (RequestInProgress, KeyReused) as exc:
        out = exc
    return out, time.monotonic() - started


def retake(guard: IdempotencyGuard, eng: Engine, key: str, barrier: threading.Barrier
           ) -> Claim | StoredResponse | RequestInProgress:
    barrier.wait(timeout=30)
    try:
        return guard.claim(eng, SCOPE, key, FP)
    except RequestInProgress as exc:
        return exc


def check_storm(outcomes: list[tuple[Outcome, float]]) -> Counter[str]:
    """F01's invariant for one trial: one execution; the rest 409 or an exact replay."""
    executed = [o for o, _ in outcomes if isinstance(o, Result) and not o.replayed]
    replays = [o for o, _ in outcomes if isinstance(o, Result) and o.replayed]
    conflicts = [o for o, _ in outcomes if isinstance(o, RequestInProgress)]
    assert len(executed) == 1, f"{len(executed)} executions"
    assert len(executed) + len(replays) + len(conflicts) == len(outcomes)
    for replay in replays:
        assert replay.response == executed[0].response
        assert replay.response.body == executed[0].response.body  # byte for byte
    for conflict in conflicts:
        assert conflict.status == 409 and conflict.retry_after == 1
    # Nobody hangs: the only waits are bounded by lock_timeout (2 s); the slack is for
    # 50 threads sharing 2 busy cores.
    assert max(elapsed for _, elapsed in outcomes) < 5.0
    return Counter(executed=1, replayed=len(replays), in_progress=len(conflicts))


# --- F01 concurrent identical requests -------------------------------------------------

@pytest.mark.parametrize("local_twins", [False, True], ids=["database", "local-twins"])
@pytest.mark.parametrize("mode", MODES)
def test_f01_fifty_identical_requests_execute_once(storm_engine: Engine, engine: Engine,
                                                   mode: Mode, effect_form: str,
                                                   local_twins: bool) -> None:
    """`database`: every twin asks PostgreSQL, as twins in other processes do;
    `local-twins`: the default, twins of a request running here answer at once."""
    guard = IdempotencyGuard(local_twins=local_twins)
    threads, trials = 50, 10
    mix: Counter[str] = Counter()
    with ThreadPoolExecutor(threads) as pool:
        for trial in range(trials):
            key = f"f01-{mode}-{trial}"
            # Some trials pause inside the work so that twins meet it in flight; some
            # spread the arrivals over ~50 ms so that late twins get the replay.
            work = make_work(key, tag=f"t{trial}", pause=0.05 if trial % 3 == 1 else 0.0)
            spread = 0.001 if trial % 3 == 2 else 0.0
            barrier = threading.Barrier(threads)
            futures = [pool.submit(guarded, guard, storm_engine, key, work, mode, barrier,
                                   spread * i) for i in range(threads)]
            mix += check_storm([f.result(timeout=60) for f in futures])
            assert orders(engine, key) == 1
            assert effects(engine, key) == 2
            assert key_status(engine, key) == "completed"
    assert mix["executed"] == trials
    assert mix["in_progress"] > 0 and mix["replayed"] > 0
    assert orders(engine) == trials and effects(engine) == 2 * trials


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_f01_storm_at_higher_isolation_still_executes_once(
        storm_engine: Engine, engine: Engine, mode: Mode, isolation: str,
        effect_form: str) -> None:
    """At RR/SERIALIZABLE a twin's snapshot can predate the winner's commit: the unique
    backstop then raises 40001 and the retry replays. Never a 500, never a double."""
    strict = storm_engine.execution_options(isolation_level=isolation)
    guard = IdempotencyGuard(local_twins=False)  # the database's answers, under test
    threads = 30
    with ThreadPoolExecutor(threads) as pool:
        for trial in range(3):
            key = f"f01-{isolation}-{mode}-{trial}"
            work = make_work(key, tag="strict")
            barrier = threading.Barrier(threads)
            futures = [pool.submit(guarded, guard, strict, key, work, mode, barrier)
                       for _ in range(threads)]
            check_storm([f.result(timeout=60) for f in futures])
            assert orders(engine, key) == 1
            assert effects(engine, key) == 2


@pytest.mark.parametrize("isolation", ["READ COMMITTED", "REPEATABLE READ"])
def test_a_key_committed_under_our_feet_rolls_our_work_back_and_replays(
        engine: Engine, isolation: str, effect_form: str) -> None:
    """The key's row is there by the time our completion writes it (at READ COMMITTED:
    written without the lock): nothing of ours commits, and run() retries the
    transaction, whose read replays the twin's answer. Our work ran once and rolled
    back; the twin's stands. Before: ClaimLost, a 500 for a request that has an answer.
    (At REPEATABLE READ PostgreSQL itself raises 40001 for a row committed after our
    snapshot, which run() always retried: that case is a regression check.)"""
    guard = IdempotencyGuard()
    twin = response_for(7, "twin")

    def sneak_in(conn: Connection, claim: Claim) -> None:
        if claim.key != "under-feet" or getattr(sneak_in, "done", False):
            return
        sneak_in.done = True  # type: ignore[attr-defined]
        with engine.begin() as other:
            keysql.insert_completed_key(
                scope=SCOPE, key="under-feet", fingerprint=FP, status=twin.status,
                headers=twin.header_list(), body=twin.body, retention_seconds=600,
                generation=uuid.uuid4()).run(other)

    calls: list[uuid.UUID] = []
    strict = engine.execution_options(isolation_level=isolation)
    result = guard.run(strict, SCOPE, "under-feet", FP,
                       make_work("under-feet", calls=calls, hook=sneak_in))
    assert result.replayed and result.response == twin
    assert len(calls) == 1                       # our work ran once ...
    assert orders(engine, "under-feet") == 0     # ... and rolled back with its effects
    assert effects(engine, "under-feet") == 0
    assert key_status(engine, "under-feet") == "completed"


def test_the_key_read_sees_a_twin_that_committed_after_our_statement_began(
        engine: Engine) -> None:
    """The atomic guard's lock and read are one call (migration 0009), and the read
    runs on a snapshot taken after the lock, not when the statement began: a twin that
    holds the lock when our statement starts and commits its key before we get the lock
    is seen, and replayed. One statement's snapshot would miss it (the reverted
    session-3 attempt: a second execution of the request). Here the calling statement
    sleeps first, so its snapshot predates the twin's commit by half a second."""
    twin = response_for(7, "twin")
    lock_id = advisory_lock_id(SCOPE, "late-twin")
    holding, release = threading.Event(), threading.Event()

    def the_twin() -> None:
        with engine.begin() as other:
            assert other.execute(text("SELECT pg_try_advisory_xact_lock(:i)"),
                                 {"i": lock_id}).scalar()
            keysql.insert_completed_key(
                scope=SCOPE, key="late-twin", fingerprint=FP, status=twin.status,
                headers=twin.header_list(), body=twin.body, retention_seconds=600,
                generation=uuid.uuid4()).run(other)
            holding.set()
            release.wait(10)
        # committed, lock released

    thread = threading.Thread(target=the_twin)
    thread.start()
    assert holding.wait(10)
    with engine.begin() as conn:
        threading.Timer(0.3, release.set).start()
        row = conn.execute(text(
            "SELECT f.* FROM (SELECT pg_sleep(0.8)) AS s,"
            " LATERAL outbox.lock_and_read_key(:i, :scope, :key, NULL) AS f"),
            {"i": lock_id, "scope": SCOPE, "key": "late-twin"}).one()
    thread.join(10)
    assert row.locked is True and row.status == "completed"
    assert bytes(row.response_body) == twin.body
    # And through the guard: the same key is a replay, the work does not run.
    calls: list[uuid.UUID] = []
    result = IdempotencyGuard().run(engine, SCOPE, "late-twin", FP,
                                    make_work("late-twin", calls=calls))
    assert result.replayed and result.response == twin and calls == []


# --- F02 / B12-B14 mismatch and scope --------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_f02_same_key_other_payload_is_422_and_writes_nothing(engine: Engine,
                                                              mode: Mode) -> None:
    guard = IdempotencyGuard()
    first = guard.run(engine, SCOPE, "k", FP, make_work("k"), mode=mode)
    before = snapshot(engine)
    other = fingerprint("POST", "/orders", {"amount": 43, "currency": "EUR"})
    calls: list[uuid.UUID] = []
    for retry_mode in MODES:
        with pytest.raises(KeyReused) as info:
            guard.run(engine, SCOPE, "k", other, make_work("k", calls=calls), mode=retry_mode)
        assert info.value.status == 422
        assert info.value.code == "idempotency_key_reused"
    assert calls == []
    assert snapshot(engine) == before  # nothing written, the original untouched
    again = guard.run(engine, SCOPE, "k", FP, make_work("k"), mode=mode)
    assert again.replayed and again.response == first.response


def test_f02_mismatch_while_in_flight_is_422_not_409(engine: Engine) -> None:
    guard = IdempotencyGuard()
    held = guard.claim(engine, SCOPE, "k", FP)
    assert isinstance(held, Claim)
    other = fingerprint("POST", "/orders", {"amount": 1})
    for mode in MODES:
        with pytest.raises(KeyReused):
            guard.run(engine, SCOPE, "k", other, make_work("k"), mode=mode)
    assert guard.release(engine, held)
    assert key_rows(engine) == []


@pytest.mark.parametrize("mode", MODES)
def test_b12_same_key_in_another_scope_is_independent(engine: Engine, mode: Mode) -> None:
    guard = IdempotencyGuard()
    a = guard.run(engine, "tenant-1:POST /orders", "shared", FP,
                  make_work("shared", tag="tenant-1"), mode=mode)
    b = guard.run(engine, "tenant-2:POST /orders", "shared", FP,
                  make_work("shared", tag="tenant-2"), mode=mode)
    assert not a.replayed and not b.replayed
    assert b"tenant-1" in a.response.body and b"tenant-2" in b.response.body  # no leak
    assert orders(engine, "shared") == 2
    assert effects(engine, "shared") == 4  # derived effect keys differ by scope
    replay = guard.run(engine, "tenant-2:POST /orders", "shared", FP, make_work("x"),
                       mode=mode)
    assert replay.replayed and replay.response == b.response


@pytest.mark.parametrize("mode", MODES)
def test_b13_other_method_or_path_is_422_within_one_scope(engine: Engine, mode: Mode) -> None:
    guard = IdempotencyGuard()
    scope = "tenant-1"  # a per-tenant scope: the endpoint lives in the fingerprint
    guard.run(engine, scope, "k", fingerprint("POST", "/orders", BODY), make_work("k"),
              mode=mode)
    for method, path in [("PUT", "/orders"), ("POST", "/refunds"), ("POST", "/orders/")]:
        with pytest.raises(KeyReused):
            guard.run(engine, scope, "k", fingerprint(method, path, BODY), make_work("k"),
                      mode=mode)
    assert orders(engine) == 1
    # With the endpoint in the scope instead, another endpoint is another key.
    guard.run(engine, f"{scope}:POST /refunds", "k", fingerprint("POST", "/refunds", BODY),
              make_work("k"), mode=mode)
    assert orders(engine) == 2


def test_b11_sql_like_keys_are_opaque(engine: Engine) -> None:
    guard = IdempotencyGuard()
    keys = ["'; DROP TABLE outbox.idempotency_keys;--", "%", "_", "\\", "a%", "ab", "a_"]
    for i, key in enumerate(keys):
        guard.run(engine, SCOPE, key, FP, make_work(key), mode=MODES[i % 2])
    rows = key_rows(engine)
    assert sorted(r.key for r in rows) == sorted(keys)
    assert all(r.status == "completed" for r in rows)
    for key in keys:  # each replays its own response, never a LIKE-match's
        assert guard.run(engine, SCOPE, key, FP, make_work(key)).replayed
    assert orders(engine) == len(keys)


# --- F03 replay after completion -------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_f03_replay_is_byte_identical_and_writes_nothing(engine: Engine, mode: Mode,
                                                        effect_form: str) -> None:
    guard = IdempotencyGuard()
    original = StoredResponse(
        402, (("Content-Type", "application/problem+json"), ("X-Weird", " spaced\tvalue "),
              ("x-weird", "second"), ("Retry-After", "0")),
        b'{"type":"card_declined",  "detail":"caf\xc3\xa9"}\r\n\x00\xff')

    def declined(conn: Connection, claim: Claim) -> StoredResponse:
        make_work("k")(conn, claim)
        return original

    first = guard.run(engine, SCOPE, "k", FP, declined, mode=mode)
    assert not first.replayed and first.response is original
    before = snapshot(engine)
    for retry_mode in MODES:
        calls: list[uuid.UUID] = []
        replay = guard.run(engine, SCOPE, "k", FP, make_work("k", calls=calls),
                           mode=retry_mode)
        assert replay.replayed and calls == []
        assert replay.response.status == 402
        assert replay.response.headers == original.headers
        assert replay.response.body == original.body
        assert isinstance(replay.response.body, bytes)
    # begin/claim hand back the same cached answer
    with engine.begin() as conn:
        assert guard.begin(conn, SCOPE, "k", FP) == original
    assert guard.claim(engine, SCOPE, "k", FP) == original
    assert snapshot(engine) == before


# --- F04 / F06 crash after claim, TTL, racing retakers ---------------------------------

@pytest.mark.parametrize("retry_mode", MODES)
@pytest.mark.parametrize("how", ["backdate", "clock"])
def test_f04_crashed_claim_is_409_until_ttl_then_retaken_once(
        engine: Engine, retry_mode: Mode, how: str, effect_form: str) -> None:
    guard = IdempotencyGuard(ttl=60)
    crashed = guard.claim(engine, SCOPE, "k", FP)  # ... and the process dies here
    assert isinstance(crashed, Claim) and not crashed.taken_over
    assert key_status(engine, "k") == "processing"
    for mode in MODES:
        with pytest.raises(RequestInProgress) as info:
            guard.run(engine, SCOPE, "k", FP, make_work("k"), mode=mode)
        assert info.value.status == 409 and info.value.retry_after == 1
    # Just before the TTL: still in progress.
    with pytest.raises(RequestInProgress):
        IdempotencyGuard(ttl=60, clock=later(55)).run(engine, SCOPE, "k", FP,
                                                      make_work("k"), mode=retry_mode)
    if how == "backdate":
        backdate(engine, "k", 61)
        retaker = guard
    else:
        retaker = IdempotencyGuard(ttl=60, clock=later(61))
    result = retaker.run(engine, SCOPE, "k", FP, make_work("k", tag="retry"), mode=retry_mode)
    assert not result.replayed
    assert orders(engine, "k") == 1 and effects(engine, "k") == 2
    assert key_status(engine, "k") == "completed"
    # The crashed holder's late completion is fenced out.
    with pytest.raises(ClaimLost), engine.begin() as conn:
        guard.complete(conn, crashed, response_for(0, "crashed"))
    assert guard.run(engine, SCOPE, "k", FP, make_work("k")).response == result.response


def test_f06_twenty_racing_retakers_one_winner(storm_engine: Engine, engine: Engine) -> None:
    guard = IdempotencyGuard(ttl=60)
    racers, trials = 20, 50
    winners_per_trial: Counter[int] = Counter()
    with ThreadPoolExecutor(racers) as pool:
        for trial in range(trials):
            key = f"f06-{trial}"
            stale = guard.claim(storm_engine, SCOPE, key, FP)
            assert isinstance(stale, Claim)
            backdate(storm_engine, key, 120)
            barrier = threading.Barrier(racers)
            outcomes = [f.result(timeout=60) for f in
                        [pool.submit(retake, guard, storm_engine, key, barrier)
                         for _ in range(racers)]]
            winners = [o for o in outcomes if isinstance(o, Claim)]
            winners_per_trial[len(winners)] += 1
            assert all(isinstance(o, Claim | RequestInProgress) for o in outcomes)
            assert len(winners) == 1 and winners[0].taken_over
            with storm_engine.begin() as conn:
                guard.complete(conn, winners[0], response_for(trial, "winner"))
            with pytest.raises(ClaimLost), storm_engine.begin() as conn:
                guard.complete(conn, stale, response_for(trial, "stale"))
    assert winners_per_trial == Counter({1: trials})


def test_f06_take_over_statement_is_a_compare_and_set(storm_engine: Engine,
                                                      engine: Engine) -> None:
    """Without the advisory lock in front, the conditional UPDATE alone picks one."""
    guard = IdempotencyGuard(ttl=60)
    racers, trials = 20, 50

    def cas(key: str, barrier: threading.Barrier) -> bool:
        with storm_engine.begin() as conn:
            conn.execute(text("SELECT 1"))
            barrier.wait(timeout=30)
            return keysql.take_over_key(scope=SCOPE, key=key, token=uuid.uuid4(),
                                        ttl_seconds=60).run(conn)[0]

    with ThreadPoolExecutor(racers) as pool:
        for trial in range(trials):
            key = f"cas-{trial}"
            stale = guard.claim(storm_engine, SCOPE, key, FP)
            assert isinstance(stale, Claim)
            backdate(storm_engine, key, 120)
            barrier = threading.Barrier(racers)
            won = [f.result(timeout=60) for f in
                   [pool.submit(cas, key, barrier) for _ in range(racers)]]
            assert won.count(True) == 1
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM outbox.idempotency_keys"))


@pytest.mark.parametrize("trial", range(2))
def test_f06_mixed_mode_retakers_execute_once(storm_engine: Engine, engine: Engine,
                                              trial: int) -> None:
    guard = IdempotencyGuard(ttl=60, local_twins=False)  # every racer reaches the database
    racers = 20
    with ThreadPoolExecutor(racers) as pool:
        for round_ in range(10):
            key = f"mixed-{trial}-{round_}"
            assert isinstance(guard.claim(storm_engine, SCOPE, key, FP), Claim)
            backdate(storm_engine, key, 120)
            barrier = threading.Barrier(racers)
            work = make_work(key)
            futures = [pool.submit(guarded, guard, storm_engine, key, work, MODES[i % 2],
                                   barrier) for i in range(racers)]
            check_storm([f.result(timeout=60) for f in futures])
            assert orders(engine, key) == 1 and effects(engine, key) == 2


# --- F05 zombie ------------------------------------------------------------------------

def test_f05_zombie_completion_is_fenced_and_rolls_back(engine: Engine, effect_form: str) -> None:
    guard = IdempotencyGuard(ttl=60)
    a = guard.claim(engine, SCOPE, "k", FP)
    assert isinstance(a, Claim)
    with engine.connect() as zombie:
        zombie.begin()
        response_a = make_work("k", tag="A")(zombie, a)  # order + 2 effects, uncommitted
        backdate(engine, "k", 61)  # A stalls past the TTL ...
        b = guard.claim(engine, SCOPE, "k", FP)  # ... and a retry takes the key over
        assert isinstance(b, Claim) and b.taken_over and b.token != a.token
        with pytest.raises(ClaimLost):
            guard.complete(zombie, a, response_a)  # the fenced write hits 0 rows
        zombie.rollback()
    assert orders(engine) == 0 and effects(engine) == 0
    with engine.begin() as conn:
        response_b = make_work("k", tag="B")(conn, b)
        guard.complete(conn, b, response_b)
    assert orders(engine, "k") == 1 and effects(engine, "k") == 2
    assert guard.run(engine, SCOPE, "k", FP, make_work("k")).response == response_b


def test_f05_zombie_run_versus_retaker_run(engine: Engine) -> None:
    """Through run(): the retaker's enqueue waits on the zombie's uncommitted effect rows
    (same derived keys), the zombie is fenced and rolls back, then the retaker commits.
    The TTL passes by `backdate` in the database only, so the zombie's entry among this
    process's requests in flight would still be fresh: every twin asks the database."""
    guard = IdempotencyGuard(ttl=60, local_twins=False)
    in_work, resume = threading.Event(), threading.Event()

    def zombie_work(conn: Connection, claim: Claim) -> StoredResponse:
        response = make_work("k", tag="zombie")(conn, claim)
        in_work.set()
        assert resume.wait(20)
        return response

    def zombie() -> Result | ClaimLost:
        try:
            return guard.run(engine, SCOPE, "k", FP, zombie_work, mode="phased")
        except ClaimLost as exc:
            return exc

    with ThreadPoolExecutor(2) as pool:
        zombie_future = pool.submit(zombie)
        assert in_work.wait(20)
        backdate(engine, "k", 61)
        retaker_future = pool.submit(guard.run, engine, SCOPE, "k", FP,
                                     make_work("k", tag="retaker"), mode="phased")
        try:
            # The retaker blocks on the zombie's effect keys (a wait on outbox.effect_keys'
            # primary key: the zombie's uncommitted rows hold the same keys).
            deadline = time.monotonic() + 15
            waits: list[Any] = []
            while not waits and not retaker_future.done() and time.monotonic() < deadline:
                time.sleep(0.02)
                with engine.connect() as conn:
                    waits = list(conn.execute(text(
                        "SELECT wait_event, left(query, 600) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND wait_event_type = 'Lock'")))
            if retaker_future.done():
                retaker_future.result()  # surface its error, if it has one
                pytest.fail("the retaker finished while the zombie held the effect keys")
            assert len(waits) == 1, waits
            assert "INSERT INTO outbox.effect_keys" in waits[0][1]
        finally:
            resume.set()
        fenced = zombie_future.result(timeout=20)
        result = retaker_future.result(timeout=20)
    assert isinstance(fenced, ClaimLost)
    assert not result.replayed and b"retaker" in result.response.body
    assert orders(engine, "k") == 1 and effects(engine, "k") == 2
    with engine.connect() as conn:
        tags = set(conn.execute(text("SELECT payload->>'by' FROM outbox.effects")).scalars())
    assert tags == {"retaker"}


# --- exceptions in the work ------------------------------------------------------------

def test_exception_in_phased_work_releases_the_claim(engine: Engine) -> None:
    guard = IdempotencyGuard()
    seen: list[str | None] = []

    def prepare(claim: Claim) -> None:
        # The claim has committed before any outside I/O: a twin sees it.
        seen.append(key_status(engine, claim.key))

    def failing(conn: Connection, claim: Claim) -> StoredResponse:
        make_work("k")(conn, claim)
        raise ValueError("the handler failed")

    with pytest.raises(ValueError, match="handler failed"):
        guard.run(engine, SCOPE, "k", FP, failing, mode="phased", prepare=prepare)
    assert seen == ["processing"]
    assert key_rows(engine) == [] and orders(engine) == 0 and effects(engine) == 0
    result = guard.run(engine, SCOPE, "k", FP, make_work("k"), mode="phased")
    assert not result.replayed and orders(engine) == 1


def test_exception_in_prepare_releases_the_claim(engine: Engine) -> None:
    guard = IdempotencyGuard()

    def prepare(claim: Claim) -> None:
        raise ConnectionError("the PSP is down")

    calls: list[uuid.UUID] = []
    with pytest.raises(ConnectionError):
        guard.run(engine, SCOPE, "k", FP, make_work("k", calls=calls), mode="phased",
                  prepare=prepare)
    assert calls == [] and key_rows(engine) == []
    assert not guard.run(engine, SCOPE, "k", FP, make_work("k"), mode="phased").replayed


def test_exception_in_atomic_work_leaves_no_key(engine: Engine, effect_form: str) -> None:
    guard = IdempotencyGuard()

    def failing(conn: Connection, claim: Claim) -> StoredResponse:
        make_work("k")(conn, claim)
        raise ValueError("the handler failed")

    with pytest.raises(ValueError):
        guard.run(engine, SCOPE, "k", FP, failing)
    assert key_rows(engine) == [] and orders(engine) == 0 and effects(engine) == 0
    assert not guard.run(engine, SCOPE, "k", FP, make_work("k")).replayed


# --- F09 serialization failures and deadlocks ------------------------------------------

def raise_sqlstate(conn: Connection, sqlstate: str) -> None:
    """A real server error with this SQLSTATE, wrapped by SQLAlchemy as usual."""
    conn.execute(text(
        f"DO $$ BEGIN RAISE EXCEPTION 'injected' USING ERRCODE = '{sqlstate}'; END $$"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sqlstate", ["40001", "40P01"])
@pytest.mark.parametrize("phase", ["before_business", "after_enqueue"])
def test_f09_transient_error_is_retried_with_the_same_claim(
        engine: Engine, mode: Mode, sqlstate: str, phase: str, effect_form: str) -> None:
    guard = IdempotencyGuard()
    calls: list[uuid.UUID] = []

    def inject(conn: Connection, claim: Claim) -> None:
        if len(calls) == 1:
            raise_sqlstate(conn, sqlstate)

    work = (make_work("k", calls=calls, hook=inject) if phase == "before_business"
            else make_work("k", calls=calls, after_enqueue=inject))
    result = guard.run(engine, SCOPE, "k", FP, work, mode=mode)
    assert not result.replayed and len(calls) == 2
    if mode == "phased":
        assert calls[0] == calls[1]  # the claim is kept across the retry
    assert orders(engine, "k") == 1 and effects(engine, "k") == 2  # same effect keys
    assert key_status(engine, "k") == "completed"


@pytest.mark.parametrize("mode", MODES)
def test_f09_retries_are_bounded_and_leave_nothing_locked(engine: Engine, mode: Mode) -> None:
    guard = IdempotencyGuard()
    calls: list[uuid.UUID] = []
    work = make_work("k", calls=calls, hook=lambda conn, _: raise_sqlstate(conn, "40001"))
    with pytest.raises(OperationalError) as info:
        guard.run(engine, SCOPE, "k", FP, work, mode=mode)
    assert isinstance(info.value.orig, psycopg.errors.SerializationFailure)
    assert len(calls) == 5
    assert key_rows(engine) == [] and orders(engine) == 0
    assert not guard.run(engine, SCOPE, "k", FP, make_work("k"), mode=mode).replayed


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_f09_real_concurrent_update_conflict_is_retried(engine: Engine, mode: Mode,
                                                        isolation: str) -> None:
    with engine.begin() as conn:
        stock = conn.execute(text(
            "INSERT INTO test_orders (key, amount) VALUES ('stock', 100) RETURNING id"
        )).scalar_one()
    strict = engine.execution_options(isolation_level=isolation)
    calls: list[uuid.UUID] = []

    def take_stock(conn: Connection, claim: Claim) -> None:
        conn.execute(text("SELECT amount FROM test_orders WHERE id = :id"), {"id": stock})
        if len(calls) == 1:  # another transaction changes the row after our snapshot
            with engine.begin() as other:
                other.execute(text("UPDATE test_orders SET amount = amount - 1 WHERE id = :id"),
                              {"id": stock})
        conn.execute(text("UPDATE test_orders SET amount = amount - 1 WHERE id = :id"),
                     {"id": stock})

    result = IdempotencyGuard().run(strict, SCOPE, "k", FP,
                                    make_work("k", calls=calls, hook=take_stock), mode=mode)
    assert not result.replayed and len(calls) == 2
    with engine.connect() as conn:
        left = conn.execute(text("SELECT amount FROM test_orders WHERE id = :id"),
                            {"id": stock}).scalar_one()
    assert left == 98
    assert orders(engine, "k") == 1 and effects(engine, "k") == 2


@pytest.mark.parametrize("mode", MODES)
def test_f09_real_deadlock_is_retried(engine: Engine, mode: Mode) -> None:
    with engine.begin() as conn:
        x, y = (conn.execute(text(
            "INSERT INTO test_orders (key, amount) VALUES ('stock', 100) RETURNING id"
        )).scalar_one() for _ in range(2))
    barrier = threading.Barrier(2)
    calls: dict[str, list[uuid.UUID]] = {"a": [], "b": []}

    def crosswise(first: int, second: int, who: str) -> Callable[[Connection, Claim], None]:
        def hook(conn: Connection, claim: Claim) -> None:
            conn.execute(text("SET LOCAL deadlock_timeout = '50ms'"))
            conn.execute(text("UPDATE test_orders SET amount = amount - 1 WHERE id = :id"),
                         {"id": first})
            if len(calls[who]) == 1:
                barrier.wait(timeout=10)
            conn.execute(text("UPDATE test_orders SET amount = amount - 1 WHERE id = :id"),
                         {"id": second})
        return hook

    guard = IdempotencyGuard()
    with ThreadPoolExecutor(2) as pool:
        fa = pool.submit(guard.run, engine, SCOPE, "a", FP,
                         make_work("a", calls=calls["a"], hook=crosswise(x, y, "a")), mode=mode)
        fb = pool.submit(guard.run, engine, SCOPE, "b", FP,
                         make_work("b", calls=calls["b"], hook=crosswise(y, x, "b")), mode=mode)
        ra, rb = fa.result(timeout=30), fb.result(timeout=30)
    assert not ra.replayed and not rb.replayed
    assert sorted(len(c) for c in calls.values()) == [1, 2]  # one victim, retried once
    with engine.connect() as conn:
        amounts = conn.execute(text("SELECT amount FROM test_orders WHERE id IN (:x, :y)"),
                               {"x": x, "y": y}).scalars().all()
    assert amounts == [98, 98]
    assert orders(engine, "a") == orders(engine, "b") == 1


# --- F10 waits are bounded -------------------------------------------------------------

@pytest.mark.parametrize("lock_timeout_ms", [300, 2_000])
def test_f10_claim_behind_an_uncommitted_inserter_is_409_in_bounded_time(
        engine: Engine, db_url: str, lock_timeout_ms: int) -> None:
    guard = IdempotencyGuard(lock_timeout_ms=lock_timeout_ms)
    with psycopg.connect(raw_dsn(db_url)) as holder:  # a transaction opens implicitly
        holder.execute(
            "INSERT INTO outbox.idempotency_keys (scope, key, fingerprint, status,"
            " lock_token, locked_at, lock_expires_at, expires_at)"
            " VALUES (%s, 'k', %s, 'processing', gen_random_uuid(), now(), now() + '1 min',"
            " now() + '1 day')",
            (SCOPE, FP))
        started = time.monotonic()
        with pytest.raises(RequestInProgress):
            guard.run(engine, SCOPE, "k", FP, make_work("k"), mode="phased")
        elapsed = time.monotonic() - started
        assert lock_timeout_ms / 1000 * 0.9 < elapsed < 3.0
        holder.rollback()
    # Once the holder is gone, the same request runs normally.
    assert not guard.run(engine, SCOPE, "k", FP, make_work("k"), mode="phased").replayed


@pytest.mark.parametrize("mode", MODES)
def test_f10_advisory_lock_held_elsewhere_is_an_immediate_409(engine: Engine, db_url: str,
                                                              mode: Mode) -> None:
    guard = IdempotencyGuard()
    with psycopg.connect(raw_dsn(db_url)) as holder:
        holder.execute("SELECT pg_advisory_xact_lock(%s)", (advisory_lock_id(SCOPE, "k"),))
        started = time.monotonic()
        with pytest.raises(RequestInProgress):
            guard.run(engine, SCOPE, "k", FP, make_work("k"), mode=mode)
        assert time.monotonic() - started < 1.0  # no lock wait at all (lock_timeout is 2 s)
        holder.rollback()
    assert not guard.run(engine, SCOPE, "k", FP, make_work("k"), mode=mode).replayed


# --- F13 rollback and visibility -------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_f13_rolled_back_work_leaves_no_effects_and_readers_never_see_them(
        engine: Engine, mode: Mode) -> None:
    guard = IdempotencyGuard()
    enqueued, polled = threading.Event(), threading.Event()
    claimed: list[Any] = []
    visible: list[int] = []

    def failing(conn: Connection, claim: Claim) -> StoredResponse:
        make_work("k")(conn, claim)
        assert conn.execute(text("SELECT count(*) FROM outbox.effects")).scalar_one() == 2
        enqueued.set()
        assert polled.wait(20)
        raise RuntimeError("failed after enqueue")

    def dispatcher() -> None:
        assert enqueued.wait(20)
        for _ in range(20):
            with engine.begin() as conn:
                claimed.extend(dispatch.claim_due(conn, queue="default", limit=10,
                                                  owner="reader", lease_seconds=30))
                visible.append(conn.execute(text(
                    "SELECT count(*) FROM outbox.effects")).scalar_one())
        polled.set()

    reader = threading.Thread(target=dispatcher)
    reader.start()
    with pytest.raises(RuntimeError):
        guard.run(engine, SCOPE, "k", FP, failing, mode=mode)
    reader.join(20)
    assert claimed == [] and visible == [0] * 20
    assert effects(engine) == 0 and orders(engine) == 0 and key_rows(engine) == []
    # The same reader does see a committed request's effects.
    guard.run(engine, SCOPE, "k", FP, make_work("k"), mode=mode)
    with engine.begin() as conn:
        rows = dispatch.claim_due(conn, queue="default", limit=10, owner="reader",
                                  lease_seconds=30)
    assert sorted(r.kind for r in rows) == ["email.receipt", "psp.charge"]


# --- enqueue ---------------------------------------------------------------------------

def test_enqueue_the_same_logical_effect_twice_is_a_duplicate(engine: Engine) -> None:
    first_try = Claim(SCOPE, "k", FP, "phased", uuid.uuid4())
    retry = Claim(SCOPE, "k", FP, "atomic", uuid.uuid4())  # another token, same request
    with engine.begin() as conn:
        first = enqueue(conn, "psp.charge", {"n": 1}, claim=first_try)
        named = enqueue(conn, "email.receipt", {}, claim=first_try, name="receipt")
    with engine.begin() as conn:
        again = enqueue(conn, "psp.charge", {"n": 1}, claim=retry)
        named_again = enqueue(conn, "email.receipt", {}, claim=retry, name="receipt")
        second = enqueue(conn, "psp.charge", {"n": 2}, claim=retry)  # index 1: new
    assert first.inserted and first.result == "inserted"
    assert not again.inserted and again.result == "duplicate"
    assert (again.id, again.effect_key) == (first.id, first.effect_key)
    assert not named_again.inserted and named_again.id == named.id
    assert second.inserted and second.effect_key != first.effect_key
    with engine.begin() as conn:
        explicit = enqueue(conn, "webhook", {"v": 1}, key="evt-1")
        explicit_again = enqueue(conn, "webhook", {"v": 1}, key="evt-1")  # same txn
    assert explicit.inserted and not explicit_again.inserted
    assert explicit_again.id == explicit.id
    # The same key with another payload is not a duplicate: it is refused, loudly.
    with pytest.raises(EffectKeyConflict) as info, engine.begin() as conn:
        enqueue(conn, "webhook", {"v": 2}, key="evt-1")
    assert info.value.effect_keys == ["evt-1"]
    other_scope = Claim("tenant-2", "k", FP, "atomic", uuid.uuid4())
    assert other_scope.effect_key("psp.charge") != Claim(
        SCOPE, "k", FP, "atomic", uuid.uuid4()).effect_key("psp.charge")
    with engine.connect() as conn:
        stored = conn.execute(text(
            "SELECT payload FROM outbox.effects WHERE effect_key = 'evt-1'")).scalar_one()
    assert stored == {"v": 1}  # a duplicate changes nothing
    assert effects(engine) == 4


def test_enqueue_many_with_a_repeated_key(engine: Engine) -> None:
    claim = Claim(SCOPE, "k", FP, "atomic", uuid.uuid4())
    with engine.begin() as conn:
        results = enqueue_many(conn, [
            Effect("hook", {"n": 1}, key="x"),
            Effect("hook", {"n": 1}, key="x"),
            Effect("hook", {"n": 3}, key="y"),
            Effect("hook", {"n": 1}, key="x"),
            Effect("mail", {"n": 5}, name="welcome"),
            Effect("mail", {"n": 5}, name="welcome"),
        ], claim=claim)
    assert [r.inserted for r in results] == [True, False, True, False, True, False]
    assert results[0].id == results[1].id == results[3].id != results[2].id
    assert results[4].id == results[5].id
    assert effects(engine) == 3
    with engine.connect() as conn:
        assert conn.execute(text(
            "SELECT payload FROM outbox.effects WHERE effect_key = 'x'")).scalar_one() == {"n": 1}
    with engine.begin() as conn:
        later_batch = enqueue_many(conn, [Effect("hook", {"n": 1}, key="x"),
                                          Effect("hook", {}, key="z")])
    assert [r.inserted for r in later_batch] == [False, True]
    assert later_batch[0].id == results[0].id
    with engine.begin() as conn:
        assert enqueue_many(conn, []) == []


@pytest.mark.parametrize("batch", [
    [Effect("hook", {"n": 1}, key="x"), Effect("hook", {"n": 2}, key="x")],   # in one batch
    [Effect("hook", {"n": 1}, key="x"), Effect("mail", {"n": 1}, key="x")],   # other kind
    [Effect("hook", {"n": 9}, key="old")],                                     # vs. a row
    [Effect("hook", {"n": 1}, key="old", queue="other")],                      # other queue
    [Effect("hook", {"n": 1}, key="old", ordering_key="o")],                   # other order
    [Effect("hook", {"n": 1}, key="old", max_attempts=3)],                     # other cap
])
def test_enqueue_refuses_one_key_for_two_different_effects(engine: Engine,
                                                           batch: list[Effect]) -> None:
    """Issue 8.1: a silent ON CONFLICT no-op here dropped the second effect."""
    with engine.begin() as conn:
        enqueue(conn, "hook", {"n": 1}, key="old")
    with pytest.raises(EffectKeyConflict), engine.begin() as conn:
        enqueue(conn, "hook", {"n": 1}, key="other")  # rolled back with the batch
        enqueue_many(conn, batch)
    assert effects(engine) == 1
    with engine.begin() as conn:  # key order and spacing are not a difference
        assert not enqueue_many(conn, [Effect("hook", {"n": 1}, key="old")])[0].inserted


@pytest.mark.parametrize("effect", [
    Effect("", {}), Effect("k" * 201, {}), Effect("hook", {}, max_attempts=0),
    Effect("hook", {}, delay=-1), Effect("hook", {}, retry_for=0), Effect("hook", {}, key=""),
    Effect("hook", {}, key="k" * 256), Effect("hook", {"a": "\x00"}),
    Effect("hook", ["\ud800"]), Effect("hook", {"a": float("nan")}),
    Effect("hook", {"a": [float("inf")]}), Effect("hook", {"t": ("\x00",)}),
])
def test_enqueue_refuses_bad_effects_before_writing(engine: Engine, effect: Effect) -> None:
    with engine.begin() as conn:
        with pytest.raises(InvalidInput):
            enqueue_many(conn, [Effect("hook", {}, key="fine"), effect])
        # nothing was sent, so the transaction is still usable
        assert conn.execute(text("SELECT count(*) FROM outbox.effects")).scalar_one() == 0
    assert issubclass(InvalidRequestBody, InvalidInput)


# --- Session (ORM) forms ---------------------------------------------------------------

class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "test_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str | None]
    amount: Mapped[int]


def test_session_forms_join_the_session_transaction(engine: Engine) -> None:
    guard = IdempotencyGuard()
    rings: list[str] = []
    add_doorbell(rings.append)
    try:
        with Session(engine) as session:
            begun = guard.begin(session, SCOPE, "k", FP)
            assert isinstance(begun, Claim)
            order = Order(key="k", amount=5)
            session.add(order)
            session.flush()
            enqueued = enqueue(session, "psp.charge", {"order_key": "k", "id": order.id},
                               claim=begun)
            response = response_for(order.id, "session")
            guard.complete(session, begun, response)
            assert session.in_transaction() and enqueued.inserted
            # Nothing committed yet: another connection sees nothing ...
            assert orders(engine) == 0 and effects(engine) == 0 and key_rows(engine) == []
            # ... and a twin is told "in progress" (the session holds the advisory lock).
            with pytest.raises(RequestInProgress):
                guard.run(engine, SCOPE, "k", FP, make_work("k"))
            assert rings == []
            session.commit()
        assert rings == ["default"]  # the doorbell rings after commit, once
        assert orders(engine) == 1 and effects(engine) == 1
        assert key_status(engine, "k") == "completed"
        with Session(engine) as session:
            assert guard.begin(session, SCOPE, "k", FP) == response
            session.rollback()
    finally:
        remove_doorbell(rings.append)


def test_session_rollback_leaves_nothing(engine: Engine) -> None:
    guard = IdempotencyGuard()
    rings: list[str] = []
    add_doorbell(rings.append)
    try:
        with Session(engine) as session:
            begun = guard.begin(session, SCOPE, "k", FP)
            assert isinstance(begun, Claim)
            session.add(Order(key="k", amount=5))
            enqueue(session, "psp.charge", {"order_key": "k"}, claim=begun)
            guard.complete(session, begun, response_for(1, "rolled back"))
            session.rollback()
        assert rings == []
    finally:
        remove_doorbell(rings.append)
    assert orders(engine) == 0 and effects(engine) == 0 and key_rows(engine) == []
    assert not guard.run(engine, SCOPE, "k", FP, make_work("k")).replayed


def test_session_phased_zombie_is_fenced(engine: Engine) -> None:
    guard = IdempotencyGuard(ttl=60)
    a = guard.claim(engine, SCOPE, "k", FP)
    assert isinstance(a, Claim)
    backdate(engine, "k", 61)
    b = guard.claim(engine, SCOPE, "k", FP)
    assert isinstance(b, Claim)
    with Session(engine) as session:
        session.add(Order(key="k", amount=1))
        enqueue(session, "psp.charge", {"order_key": "k"}, claim=a)
        with pytest.raises(ClaimLost):
            guard.complete(session, a, response_for(1, "zombie"))
        session.rollback()
    assert orders(engine) == 0 and effects(engine) == 0
    with Session(engine) as session, session.begin():
        session.add(Order(key="k", amount=1))
        enqueue(session, "psp.charge", {"order_key": "k"}, claim=b)
        guard.complete(session, b, response_for(2, "retaker"))
    assert orders(engine) == 1 and effects(engine) == 1
    assert key_status(engine, "k") == "completed"


# --- trace context ---------------------------------------------------------------------

def test_enqueue_captures_the_active_trace(engine: Engine,
                                           spans: InMemorySpanExporter,
                                           effect_form: str) -> None:
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("POST /orders") as request_span:
        guard = IdempotencyGuard()
        guard.run(engine, SCOPE, "k", FP, make_work("k"))
        request = request_span.get_span_context()
    with engine.connect() as conn:
        headers = conn.execute(text("SELECT headers FROM outbox.effects")).scalars().all()
    assert len(headers) == 2
    produced = [s for s in spans.get_finished_spans()
                if s.name.startswith("enqueue") and s.context.trace_id == request.trace_id]
    assert len(produced) == 1
    enqueue_span = produced[0]
    assert enqueue_span.kind == trace.SpanKind.PRODUCER
    assert enqueue_span.parent is not None
    assert enqueue_span.parent.span_id == request.span_id
    for header in headers:
        version, trace_id, parent_id, flags = header["traceparent"].split("-")
        assert version == "00" and int(flags, 16) & 0x01  # sampled (0x02: random id)
        assert trace_id == format(request.trace_id, "032x")
        assert parent_id == format(enqueue_span.context.span_id, "016x")


# --- effects deferred to the key's completion (Claim.enqueue) ---------------------------

def test_an_atomic_request_with_deferred_effects_sends_two_statements(
        engine: Engine, db_url: str) -> None:
    """The lock and read are one statement, the key and its effects another: two of
    ours per request (four before: lock, read, effects, key). An ordering key adds its
    producer lock; `enqueue()` in the work adds its own statement."""
    guard = IdempotencyGuard()
    sent: dict[str, int] = {}
    for form in ("deferred", "deferred+ordering", "enqueue"):
        with psycopg.connect(make_url(db_url).set(drivername="postgresql")
                             .render_as_string(hide_password=False)) as conn:
            driver = CountingDriver(conn)
            key = f"two-{form}"
            claim = driver.drive(guard._begin(SCOPE, key, FP))
            ordering = "o-1" if form.endswith("ordering") else None
            pair = [Effect("psp.charge", {"order_key": key}, ordering_key=ordering),
                    Effect("email.receipt", {"order_key": key})]
            if form == "enqueue":
                enqueue_many(conn, pair, claim=claim)
                driver.statements.append("WITH")  # enqueue's own statement
            else:
                claim.enqueue_many(pair)
            driver.drive(guard._complete(claim, StoredResponse(201)))
            conn.commit()
        sent[form] = len(driver.statements)
        assert effects(engine, key) == 2 and key_status(engine, key) == "completed"
    assert sent == {"deferred": 2, "deferred+ordering": 3, "enqueue": 3}


@pytest.mark.parametrize("mode", MODES)
def test_deferred_effects_return_their_keys_and_match_enqueue(engine: Engine,
                                                              mode: Mode) -> None:
    """The keys `claim.enqueue` returns are the ones `enqueue(..., claim=claim)` would
    derive, and the rows are the same rows (payload, queue, attempts, trace headers)."""
    guard = IdempotencyGuard()
    got: dict[str, list[str]] = {}

    def work(form: str) -> Work:
        def run(conn: Connection, claim: Claim) -> StoredResponse:
            if form == "deferred":
                got[form] = [claim.enqueue("psp.charge", {"n": 1}, queue="q1", max_attempts=3),
                             claim.enqueue("psp.charge", {"n": 2}, name="second")]
            else:
                got[form] = [enqueue(conn, "psp.charge", {"n": 1}, claim=claim, queue="q1",
                                     max_attempts=3).effect_key,
                             enqueue(conn, "psp.charge", {"n": 2}, claim=claim,
                                     name="second").effect_key]
            return StoredResponse(201)
        return run

    for form in ("deferred", "enqueue"):
        guard.run(engine, f"{SCOPE}:{form}", "same-key", FP, work(form), mode=mode)
    assert got["deferred"][0].startswith("psp.charge:")
    with engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT effect_key, payload, queue, max_attempts, status FROM outbox.effects"
            " ORDER BY id")).all()
    assert [r.effect_key for r in rows] == got["deferred"] + got["enqueue"]
    assert [(r.payload, r.queue, r.max_attempts, r.status) for r in rows[:2]] == \
        [(r.payload, r.queue, r.max_attempts, r.status) for r in rows[2:]]


def test_a_fenced_out_zombie_writes_none_of_its_deferred_effects(engine: Engine) -> None:
    """The effects ride in the fenced completion and are gated on it: a zombie whose
    claim was taken over writes none of them, even if it ignores ClaimLost and commits
    its transaction (with `enqueue()` in the work its rows would have been written)."""
    guard = IdempotencyGuard(ttl=60)
    a = guard.claim(engine, SCOPE, "k", FP)
    assert isinstance(a, Claim)
    backdate(engine, "k", 61)
    b = guard.claim(engine, SCOPE, "k", FP)
    assert isinstance(b, Claim) and b.taken_over
    with engine.begin() as zombie:
        a.enqueue("psp.charge", {"order_key": "k", "by": "zombie"})
        with pytest.raises(ClaimLost):
            guard.complete(zombie, a, StoredResponse(201, (), b"zombie"))
        # ... and commits anyway
    assert effects(engine, "k") == 0
    with engine.begin() as conn:
        b.enqueue("psp.charge", {"order_key": "k", "by": "retaker"})
        guard.complete(conn, b, StoredResponse(201, (), b"retaker"))
    with engine.connect() as conn:
        tags = conn.execute(text("SELECT payload->>'by' FROM outbox.effects")).scalars().all()
    assert tags == ["retaker"]


def test_deferred_effect_whose_key_holds_another_effect_fails_the_completion(
        engine: Engine) -> None:
    """An explicit key already used for another effect: EffectKeyConflict from the
    completion, and nothing of the request commits (not its key, not its rows). The same
    effect under that key is a duplicate, and the request completes."""
    with engine.begin() as conn:
        enqueue(conn, "psp.charge", {"order_key": "k", "n": 1}, key="charge-1")
    guard = IdempotencyGuard()

    def work(payload: dict[str, Any]) -> Work:
        def run(conn: Connection, claim: Claim) -> StoredResponse:
            conn.execute(text("INSERT INTO test_orders (key, amount) VALUES ('k', 1)"))
            assert claim.enqueue("psp.charge", payload, key="charge-1") == "charge-1"
            claim.enqueue("email.receipt", {"order_key": "k"})
            return StoredResponse(201)
        return run

    with pytest.raises(EffectKeyConflict):
        guard.run(engine, SCOPE, "k", FP, work({"order_key": "k", "n": 2}))
    assert orders(engine, "k") == 0 and effects(engine, "k") == 1 and key_rows(engine) == []
    result = guard.run(engine, SCOPE, "k", FP, work({"order_key": "k", "n": 1}))
    assert not result.replayed
    assert orders(engine, "k") == 1 and effects(engine, "k") == 2


def test_deferred_effects_refuse_bad_input_at_the_call(engine: Engine) -> None:
    """Checked when deferred, as `enqueue` checks them: the caller's error, at its line.
    One key for two different effects in one request is refused at the second call."""
    guard = IdempotencyGuard()
    begun: list[Claim] = []

    def work(conn: Connection, claim: Claim) -> StoredResponse:
        begun.append(claim)
        with pytest.raises(InvalidInput):
            claim.enqueue("bad kind", {})
        with pytest.raises(InvalidInput):
            claim.enqueue("psp.charge", {}, key="two\r\nlines")
        claim.enqueue("psp.charge", {"n": 1}, key="k-1")
        claim.enqueue("psp.charge", {"n": 1}, key="k-1")  # the same effect: folded
        with pytest.raises(EffectKeyConflict):
            claim.enqueue("psp.charge", {"n": 2}, key="k-1")
        return StoredResponse(201)

    guard.run(engine, SCOPE, "k", FP, work)
    assert effects(engine) == 1


def test_deferred_effects_ring_the_doorbell_after_commit(engine: Engine) -> None:
    rings: list[str] = []
    add_doorbell(rings.append)
    try:
        guard = IdempotencyGuard()

        def work(conn: Connection, claim: Claim) -> StoredResponse:
            claim.enqueue("psp.charge", {}, queue="payments")
            claim.enqueue("email.receipt", {}, queue="mail")
            assert rings == []
            return StoredResponse(201)

        guard.run(engine, SCOPE, "k", FP, work)
        assert sorted(rings) == ["mail", "payments"]
        rings.clear()
        guard.run(engine, SCOPE, "k", FP, work)  # a replay writes and rings nothing
        assert rings == []
    finally:
        remove_doorbell(rings.append)


def test_deferred_effects_on_an_async_session(db_url: str, engine: Engine) -> None:
    """abegin / acomplete on SQLAlchemy's AsyncSession: the same rows, one commit."""
    import asyncio

    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    async def main() -> list[str]:
        aengine = create_async_engine(db_url)
        try:
            async with async_sessionmaker(aengine).begin() as session:
                guard = IdempotencyGuard()
                begun = await guard.abegin(session, SCOPE, "async-k", FP)
                assert isinstance(begun, Claim)
                keys = begun.enqueue_many([Effect("psp.charge", {"order_key": "async-k"}),
                                           Effect("email.receipt", {"order_key": "async-k"})])
                await guard.acomplete(session, begun, StoredResponse(201))
            return keys
        finally:
            await aengine.dispose()

    keys = asyncio.run(main())
    assert len(keys) == 2 and effects(engine, "async-k") == 2
    assert key_status(engine, "async-k") == "completed"


def test_effects_deferred_by_a_phased_prepare_survive_a_retried_transaction(
        engine: Engine) -> None:
    """`prepare(claim)` has no connection: `claim.enqueue` is how it adds an effect.
    A serialization failure in the work retries the transaction; the prepared effect is
    written once, with the work's, and nothing is deferred after the completion."""
    guard = IdempotencyGuard()
    tries: list[int] = []

    def prepare(claim: Claim) -> None:
        claim.enqueue("psp.authorize", {"order_key": "k", "step": "prepare"})

    def work(conn: Connection, claim: Claim) -> StoredResponse:
        tries.append(1)
        claim.enqueue("psp.charge", {"order_key": "k", "step": "work"})
        if len(tries) == 1:
            raise_sqlstate(conn, "40001")
        return StoredResponse(201)

    guard.run(engine, SCOPE, "k", FP, work, mode="phased", prepare=prepare)
    assert len(tries) == 2
    with engine.connect() as conn:
        steps = conn.execute(text("SELECT payload->>'step' FROM outbox.effects"
                                  " ORDER BY id")).scalars().all()
    assert steps == ["prepare", "work"]
    done = guard.claim(engine, SCOPE, "other", FP)
    assert isinstance(done, Claim)
    with engine.begin() as conn:
        guard.complete(conn, done, StoredResponse(201))
    with pytest.raises(RuntimeError, match="completed"):
        done.enqueue("psp.charge", {"late": True})


def test_deferred_effects_with_duplicate_detection_in_one_statement(engine: Engine) -> None:
    """The detecting key write (same_request=) carries the effects too: the other key of
    the same payment is reported, and the effects are written."""
    guard = IdempotencyGuard(same_request=lambda body: body["customer"])
    body = {"customer": "c-1", "amount": 5}

    def work(conn: Connection, claim: Claim) -> StoredResponse:
        claim.enqueue("psp.charge", {"order_key": claim.key})
        return StoredResponse(201)

    first = guard.run(engine, SCOPE, "k1", FP, work, business_key=guard.business_key(body))
    second = guard.run(engine, SCOPE, "k2", FP, work, business_key=guard.business_key(body))
    assert (first.suspected_duplicates, second.suspected_duplicates) == (0, 1)
    assert effects(engine, "k1") == 1 and effects(engine, "k2") == 1


def test_deferred_effects_are_due_by_the_database_clock(engine: Engine) -> None:
    """The guard's injectable clock times the key, not the effects: as with `enqueue`,
    a deferred effect is due at the database's now() (plus its delay)."""
    with engine.connect() as conn:
        db_now = conn.execute(text("SELECT now()")).scalar_one()
    guard = IdempotencyGuard(clock=lambda: db_now + timedelta(hours=1))

    def work(conn: Connection, claim: Claim) -> StoredResponse:
        claim.enqueue("psp.charge", {"order_key": "k"})
        claim.enqueue("email.receipt", {"order_key": "k"}, delay=30)
        return StoredResponse(201)

    guard.run(engine, SCOPE, "k", FP, work)
    with engine.connect() as conn:
        due = conn.execute(text(
            "SELECT extract(epoch FROM available_at - now()) FROM outbox.effects"
            " ORDER BY id")).scalars().all()
        created = conn.execute(text(
            "SELECT created_at FROM outbox.idempotency_keys")).scalar_one()
    assert due[0] <= 1 and 25 <= due[1] <= 31
    assert created >= db_now + timedelta(minutes=59)  # the key: the guard's clock


# --- twins of a request running in this process (outbox/_inflight.py) -------------------

class CheckoutsByThread:
    """Counts each thread's connection checkouts from an engine's pool: a request that
    asks the database checks one out (our statements bypass SQLAlchemy's execute
    events: they go to psycopg's cursor)."""

    def __init__(self, eng: Engine) -> None:
        self.eng = eng
        self.counts: Counter[int] = Counter()

    def __enter__(self) -> CheckoutsByThread:
        event.listen(self.eng, "checkout", self._count)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(self.eng, "checkout", self._count)

    def _count(self, *_: Any) -> None:
        self.counts[threading.get_ident()] += 1


def gate() -> tuple[threading.Event, threading.Event, Callable[[Connection, Claim], None]]:
    """A work hook that holds the request in flight: it sets the first event once
    inside the work, then waits (10 s at most) for the second."""
    inside, go_on = threading.Event(), threading.Event()

    def hook(conn: Connection, claim: Claim) -> None:
        inside.set()
        assert go_on.wait(timeout=10)
    return inside, go_on, hook


def twin(guard: IdempotencyGuard, eng: Engine, key: str, fp: str = FP,
         mode: Mode = "atomic") -> tuple[Outcome | KeyReused, int]:
    """One request on `key` from its own thread: (its outcome, that thread's id)."""
    try:
        out: Outcome | KeyReused = guard.run(eng, SCOPE, key, fp, make_work(key), mode=mode)
    except (RequestInProgress, KeyReused) as exc:
        out = exc
    return out, threading.get_ident()


@pytest.mark.parametrize("mode", MODES)
def test_twins_of_a_request_running_here_answer_409_without_a_round_trip(
        engine: Engine, mode: Mode) -> None:
    guard = IdempotencyGuard()
    inside, go_on, held = gate()

    with ThreadPoolExecutor(11) as pool, CheckoutsByThread(engine) as sent:
        first = pool.submit(guard.run, engine, SCOPE, "k", FP,
                            make_work("k", hook=held), mode=mode)
        assert inside.wait(timeout=10)
        started = time.monotonic()
        twins = [f.result(timeout=10) for f in
                 [pool.submit(twin, guard, engine, "k", FP, mode) for _ in range(10)]]
        elapsed = time.monotonic() - started
        other_scope = guard.run(engine, "other-scope", "k", FP, make_work("k-other"))
        go_on.set()
        assert not first.result(timeout=10).replayed
    assert all(isinstance(out, RequestInProgress) and out.status == 409
               and out.retry_after == 1 for out, _ in twins)
    assert sum(sent.counts[ident] for _, ident in twins) == 0  # not one connection
    assert elapsed < 2.0
    assert not other_scope.replayed  # another scope's key is another request
    assert len(in_flight) == 0
    replay = guard.run(engine, SCOPE, "k", FP, make_work("k"), mode=mode)
    assert replay.replayed and orders(engine, "k") == 1 and effects(engine, "k") == 2


def test_a_twin_with_another_body_is_answered_by_the_database(engine: Engine) -> None:
    """409 while the first runs (from PostgreSQL: its lock), 422 once it is stored."""
    guard = IdempotencyGuard()
    inside, go_on, held = gate()

    with ThreadPoolExecutor(2) as pool, CheckoutsByThread(engine) as sent:
        first = pool.submit(guard.run, engine, SCOPE, "k", FP, make_work("k", hook=held))
        assert inside.wait(timeout=10)
        out, ident = pool.submit(twin, guard, engine, "k", "another-fingerprint").result(10)
        assert isinstance(out, RequestInProgress) and sent.counts[ident] > 0
        go_on.set()
        first.result(timeout=10)
    out, _ = twin(guard, engine, "k", "another-fingerprint")
    assert isinstance(out, KeyReused) and out.status == 422
    assert orders(engine, "k") == 1


def test_a_request_past_its_ttl_no_longer_answers_for_its_twins(engine: Engine) -> None:
    """Phased, ttl 0.3 s: the first request's work outlives it; its twin asks the
    database, takes the key over (F06) and runs; the first is fenced out (its effects'
    keys are the twin's, with another order id: EffectKeyConflict before its ClaimLost)."""
    guard = IdempotencyGuard(ttl=0.3)
    inside, go_on, held = gate()

    with ThreadPoolExecutor(2) as pool, CheckoutsByThread(engine) as sent:
        first = pool.submit(guard.run, engine, SCOPE, "k", FP, make_work("k", hook=held),
                            mode="phased")
        assert inside.wait(timeout=10)
        time.sleep(0.5)
        out, ident = pool.submit(twin, guard, engine, "k", FP, "phased").result(10)
        go_on.set()
        with pytest.raises((ClaimLost, EffectKeyConflict)):
            first.result(timeout=10)
    assert isinstance(out, Result) and not out.replayed and sent.counts[ident] > 0
    assert orders(engine, "k") == 1 and effects(engine, "k") == 2


def test_a_failed_request_lets_its_retry_run_at_once(engine: Engine) -> None:
    guard = IdempotencyGuard()

    def boom(conn: Connection, claim: Claim) -> None:
        raise RuntimeError("the work failed")

    with pytest.raises(RuntimeError):
        guard.run(engine, SCOPE, "k", FP, make_work("k", hook=boom))
    assert len(in_flight) == 0
    assert not guard.run(engine, SCOPE, "k", FP, make_work("k")).replayed


def test_twins_of_an_async_request_answer_409_at_once(db_url: str, engine: Engine) -> None:
    import asyncio

    from sqlalchemy.ext.asyncio import create_async_engine

    async def main() -> list[Any]:
        aengine = create_async_engine(db_url)
        guard = IdempotencyGuard()
        inside, go_on = asyncio.Event(), asyncio.Event()

        async def work(conn: Any, claim: Claim) -> StoredResponse:
            claim.enqueue("psp.charge", {"order_key": "ak"})
            inside.set()
            await go_on.wait()
            return StoredResponse(201, (), b"{}")

        async def attempt() -> Any:
            try:
                return await guard.arun(aengine, SCOPE, "ak", FP, work)
            except RequestInProgress as exc:
                return exc

        checkouts: list[object] = []
        event.listen(aengine.sync_engine, "checkout", lambda *_: checkouts.append(1))
        try:
            first = asyncio.create_task(attempt())
            await inside.wait()
            twins = await asyncio.gather(*[attempt() for _ in range(5)])
            assert len(checkouts) == 1  # the first request's: none for its twins
            go_on.set()
            return [await first, *twins]
        finally:
            await aengine.dispose()

    first, *twins = asyncio.run(main())
    assert isinstance(first, Result) and not first.replayed
    assert all(isinstance(t, RequestInProgress) for t in twins)
    assert effects(engine, "ak") == 1 and len(in_flight) == 0


def test_an_atomic_request_answers_for_its_twins_for_the_horizon_only(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past HORIZON (0.2 s here) a twin asks the database, which still holds the lock
    of the running atomic request: 409 from PostgreSQL."""
    monkeypatch.setattr(outbox._inflight, "HORIZON", 0.2)
    guard = IdempotencyGuard()
    inside, go_on, held = gate()

    with ThreadPoolExecutor(2) as pool, CheckoutsByThread(engine) as sent:
        first = pool.submit(guard.run, engine, SCOPE, "k", FP, make_work("k", hook=held))
        assert inside.wait(timeout=10)
        early, early_ident = pool.submit(twin, guard, engine, "k").result(10)
        early_checkouts = sent.counts[early_ident]  # (the pool may reuse its thread)
        time.sleep(0.3)
        late, late_ident = pool.submit(twin, guard, engine, "k").result(10)
        go_on.set()
        assert not first.result(timeout=10).replayed
    assert isinstance(early, RequestInProgress) and early_checkouts == 0
    assert isinstance(late, RequestInProgress) and sent.counts[late_ident] > early_checkouts


def test_an_expired_entry_leaving_does_not_drop_its_successors(engine: Engine) -> None:
    """A (phased, ttl 0.3 s) outlives its entry; B takes the key over and is held
    there; A's end must leave B's entry alone, so C is still answered here."""
    guard = IdempotencyGuard(ttl=0.3)
    a_inside, a_go, a_held = gate()
    b_inside, b_go, b_held = gate()

    with ThreadPoolExecutor(3) as pool, CheckoutsByThread(engine) as sent:
        a = pool.submit(guard.run, engine, SCOPE, "k", FP,
                        make_work("k", hook=a_held), mode="phased")
        assert a_inside.wait(timeout=10)
        time.sleep(0.5)
        b = pool.submit(guard.run, engine, SCOPE, "k", FP,
                        make_work("k", hook=b_held), mode="phased")
        assert b_inside.wait(timeout=10)
        a_go.set()
        with pytest.raises((ClaimLost, EffectKeyConflict)):
            a.result(timeout=10)
        before = sent.counts.copy()  # the pool may run C on A's thread
        c, c_ident = pool.submit(twin, guard, engine, "k", FP, "phased").result(10)
        c_checkouts = sent.counts[c_ident] - before[c_ident]
        b_go.set()
        assert not b.result(timeout=10).replayed
    assert isinstance(c, RequestInProgress) and c_checkouts == 0
    assert orders(engine, "k") == 1 and len(in_flight) == 0


def test_a_forked_child_starts_with_no_requests_in_flight(engine: Engine) -> None:
    import os

    guard = IdempotencyGuard()
    with guard.in_flight(engine, SCOPE, "k", FP):
        assert len(in_flight) == 1
        pid = os.fork()
        if pid == 0:  # the child: nothing held, and the registry's lock is free
            try:
                with guard.in_flight(engine, SCOPE, "k", FP):
                    os._exit(0 if len(in_flight) == 1 else 1)
            except BaseException:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(in_flight) == 0
