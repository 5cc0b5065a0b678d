"""An idempotency key's life after its request: purge, reuse, stale claims (issue 8.1, 8.9).

Each test here failed before the fix it names: a purged key reused lost its effects, a
`processing` claim was purged, and the stale-claim count assumed a 60 s TTL.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import Connection, Engine, text

from outbox import Claim, IdempotencyGuard, StoredResponse, enqueue, fingerprint
from outbox._idempotency import Mode
from outbox.errors import RequestInProgress
from outbox.sql import keys as kx

ROOT = Path(__file__).resolve().parents[1]
SCOPE = "client-7"
MODES: list[Mode] = ["atomic", "phased"]


def _cli(*args: str, db_url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dispatcher.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={"DATABASE_URL": db_url, "PATH": "/usr/bin:/bin"})


def pay(amount: int) -> object:
    def work(conn: Connection, claim: Claim) -> StoredResponse:
        oid = conn.execute(text("INSERT INTO public.test_orders (key, amount) VALUES (:k, :a)"
                                " RETURNING id"), {"k": claim.key, "a": amount}).scalar_one()
        enqueue(conn, "psp.charge", {"order": oid, "amount": amount}, claim=claim,
                name="charge")
        return StoredResponse(201, (), b'{"id":%d}' % oid)
    return work


def charges(engine: Engine) -> list[tuple[str, int]]:
    with engine.connect() as conn:
        return [(r.effect_key, r.payload["amount"]) for r in conn.execute(text(
            "SELECT effect_key, payload FROM outbox.effects WHERE kind = 'psp.charge'"
            " ORDER BY id"))]


def purge_keys(engine: Engine, db_url: str) -> None:
    """`outbox purge` as an operator runs it, after the keys' retention has passed."""
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox.idempotency_keys"
                          " SET expires_at = now() - interval '1 s'"))
    done = _cli("purge", "--older-than", "7d", db_url=db_url)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("mode", MODES)
def test_a_key_reused_after_purge_enqueues_its_own_effects(engine: Engine, db_url: str,
                                                           mode: Mode) -> None:
    guard = IdempotencyGuard(retention=60)
    body_a, body_b = {"amount": 100}, {"amount": 250}
    first = guard.run(engine, SCOPE, "k", fingerprint("POST", "/pay", body_a), pay(100),
                      mode=mode)
    assert not first.replayed
    purge_keys(engine, db_url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM outbox.idempotency_keys")).scalar() == 0
    # The README: after purge a key runs again. It must then charge again, too.
    second = guard.run(engine, SCOPE, "k", fingerprint("POST", "/pay", body_b), pay(250),
                       mode=mode)
    assert not second.replayed
    got = charges(engine)
    assert [amount for _, amount in got] == [100, 250]
    assert got[0][0] != got[1][0], "the receiver must not see one key for two charges"


def test_a_retried_request_keeps_its_effect_keys_across_a_take_over(engine: Engine) -> None:
    """The generation survives a take-over: the retry enqueues the same effect keys."""
    guard = IdempotencyGuard(ttl=30)
    later = IdempotencyGuard(ttl=30, clock=lambda: datetime.now(UTC) + timedelta(seconds=31))
    crashed = guard.claim(engine, SCOPE, "k", "fp")  # ... and its process dies
    assert isinstance(crashed, Claim) and crashed.generation is not None
    retaken = later.claim(engine, SCOPE, "k", "fp")  # phased retaker
    assert isinstance(retaken, Claim) and retaken.taken_over
    assert retaken.generation == crashed.generation
    assert retaken.effect_key("psp.charge", "charge") == crashed.effect_key(
        "psp.charge", "charge")
    # An atomic retaker of an expired phased claim keeps it too, and stores it.
    crashed2 = guard.claim(engine, SCOPE, "k2", "fp")
    assert isinstance(crashed2, Claim)
    with engine.begin() as conn:
        begun = later.begin(conn, SCOPE, "k2", "fp")
        assert isinstance(begun, Claim) and begun.taken_over
        assert begun.generation == crashed2.generation
        later.complete(conn, begun, StoredResponse(200))
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT generation FROM outbox.idempotency_keys"
                                   " WHERE key = 'k2'")).scalar_one()
    assert stored == crashed2.generation
    later.release(engine, retaken)


def test_purge_never_deletes_a_processing_claim(engine: Engine, db_url: str) -> None:
    """F11: the reaper deletes only completed keys, however old a claim is."""
    guard = IdempotencyGuard(retention=1)
    long_ago = datetime.now(UTC) - timedelta(days=30)
    slow = IdempotencyGuard(retention=1, clock=lambda: long_ago)
    assert isinstance(slow.claim(engine, SCOPE, "still-running", "fp"), Claim)
    guard.run(engine, SCOPE, "done", "fp", lambda c, cl: StoredResponse(200))
    purge_keys(engine, db_url)
    with engine.connect() as conn:
        left = conn.execute(text("SELECT key, status FROM outbox.idempotency_keys")).all()
    assert [(r.key, r.status) for r in left] == [("still-running", "processing")]


def test_status_counts_stale_claims_by_their_own_ttl(engine: Engine, db_url: str) -> None:
    past = datetime.now(UTC) - timedelta(seconds=120)
    for key, ttl in (("short", 60.0), ("long", 3600.0), ("tiny", 5.0)):
        guard = IdempotencyGuard(ttl=ttl, clock=lambda: past)
        assert isinstance(guard.claim(engine, SCOPE, key, "fp"), Claim)
    assert isinstance(IdempotencyGuard(ttl=5.0).claim(engine, SCOPE, "new", "fp"), Claim)
    with engine.connect() as conn:
        counts = kx.count_keys().run(conn)
    assert counts == {"processing": 4, "completed": 0, "stale_processing": 2}
    done = _cli("status", "--json", db_url=db_url)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["idempotency_keys"]["stale_processing"] == 2
    # And the 10-minute claim is not taken over after the default 60 s either.
    hurried = IdempotencyGuard(ttl=60, clock=lambda: past + timedelta(seconds=200))
    with pytest.raises(RequestInProgress):
        hurried.claim(engine, SCOPE, "long", "fp")
    assert isinstance(hurried.claim(engine, SCOPE, "short", "fp"), Claim)


# --- effect keys in their own table (migrations 0007, 0008) ----------------------------


def test_an_effect_key_is_unique_through_effect_keys_and_freed_by_purge(
        engine: Engine) -> None:
    """outbox.effect_keys is the arbiter: a key enqueued twice is one effect (the second
    call gets the first's id back), the effect row has no key index the dispatcher's
    updates would write to, and retention deletes the key with its effect, after which
    the key is a new effect."""
    from outbox.retention import RetentionPlan
    from outbox.sql import effects as fx

    with engine.begin() as conn:
        first = enqueue(conn, "noop", {"n": 1}, key="once", queue="nobody")
    with engine.begin() as conn:
        again = enqueue(conn, "noop", {"n": 1}, key="once", queue="nobody")
    assert again.id == first.id
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM outbox.effects")).scalar_one() == 1
        assert conn.execute(text(
            "SELECT effect_id FROM outbox.effect_keys WHERE effect_key = 'once'")
        ).scalar_one() == first.id
        assert conn.execute(text(
            "SELECT count(*) FROM pg_indexes WHERE schemaname = 'outbox'"
            " AND tablename = 'effects' AND indexdef LIKE '%effect_key%'")).scalar_one() == 0
        assert fx.get_effect(conn, "once").id == first.id  # found through its key
    with engine.begin() as conn:
        conn.execute(text(
            "UPDATE outbox.effects SET status = 'delivered', delivered_at = now() - interval"
            " '10 days', finished_at = now() - interval '10 days' WHERE id = :i"),
            {"i": first.id})
    run = RetentionPlan(effects=86400.0, keys=False, inbox=None, conflicts=None,
                        versions=None).run(engine)
    assert run.deleted == {"effects": 1}
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM outbox.effect_keys")).scalar_one() == 0
    with engine.begin() as conn:
        reborn = enqueue(conn, "noop", {"n": 2}, key="once", queue="nobody")
    assert reborn.id != first.id


def test_ids_follow_the_callers_order_whatever_the_keys_sort_order(engine: Engine) -> None:
    """Effects of one ordering key run in id order: one enqueue_many gives ids in the
    order of its effects, not of their keys (the keys are inserted into effect_keys
    first, and take their ids there). A key repeated in one call is one effect."""
    from outbox import Effect, enqueue_many

    with engine.begin() as conn:
        got = enqueue_many(conn, [
            Effect("noop", {"n": 1}, key="zz-first", ordering_key="K", queue="nobody"),
            Effect("noop", {"n": 2}, key="mm-second", ordering_key="K", queue="nobody"),
            Effect("noop", {"n": 3}, key="aa-third", ordering_key="K", queue="nobody"),
            Effect("noop", {"n": 3}, key="aa-third", ordering_key="K", queue="nobody"),
        ])
    ids = [e.id for e in got]
    assert ids[0] < ids[1] < ids[2] and ids[3] == ids[2]
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT effect_key FROM outbox.effects ORDER BY id")
                            ).scalars().all()
    assert rows == ["zz-first", "mm-second", "aa-third"]


def test_an_effect_deleted_by_hand_takes_its_key_with_it(engine: Engine) -> None:
    """An effect removed any way (an operator's DELETE, an older version's retention)
    frees its key, which can then be enqueued again; a key row never outlives its effect
    (review finding: an orphaned key made every later enqueue of it fail). Since
    migration 0008 a statement-level trigger does it, set-based, where a foreign key's
    cascade did it row by row: one DELETE of several effects frees each key and deletes
    each attempt, and leaves the others' alone."""
    from outbox import Effect, enqueue_many

    with engine.begin() as conn:
        got = enqueue_many(conn, [Effect("noop", {"n": n}, key=f"by-hand-{n}",
                                         queue="nobody") for n in range(3)])
        for e in got:
            conn.execute(text(
                "INSERT INTO outbox.attempts (effect_id, attempt, worker, started_at,"
                " outcome, error) VALUES (:i, 1, 'w', now(), 'retry', 'boom')"), {"i": e.id})
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM outbox.effects WHERE id = ANY(:ids)"),
                     {"ids": [got[0].id, got[1].id]})
    with engine.connect() as conn:
        assert conn.execute(text("SELECT effect_key FROM outbox.effect_keys")
                            ).scalars().all() == ["by-hand-2"]
        assert conn.execute(text("SELECT effect_id FROM outbox.attempts")
                            ).scalars().all() == [got[2].id]
    with engine.begin() as conn:
        again = enqueue(conn, "noop", {"n": 0}, key="by-hand-0", queue="nobody")
    assert again.id not in {e.id for e in got}


def test_truncating_the_effects_truncates_their_keys_and_attempts(engine: Engine) -> None:
    """Without a foreign key, TRUNCATE outbox.effects alone would have left every key
    behind, and no key could ever be enqueued again (migration 0008's TRUNCATE trigger)."""
    with engine.begin() as conn:
        first = enqueue(conn, "noop", {"n": 1}, key="truncated", queue="nobody")
        conn.execute(text(
            "INSERT INTO outbox.attempts (effect_id, attempt, worker, started_at, outcome)"
            " VALUES (:i, 1, 'w', now(), 'retry')"), {"i": first.id})
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE outbox.effects"))
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM outbox.effect_keys")).scalar_one() == 0
        assert conn.execute(text("SELECT count(*) FROM outbox.attempts")).scalar_one() == 0
    with engine.begin() as conn:
        again = enqueue(conn, "noop", {"n": 1}, key="truncated", queue="nobody")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT effect_id FROM outbox.effect_keys")
                            ).scalar_one() == again.id


def test_the_cascade_functions_serve_outbox_effects_only(engine: Engine) -> None:
    """The trigger functions run as the schema's owner (SECURITY DEFINER). Reviewed: left
    executable by PUBLIC, any role could hang `effects_truncated()` on a table of its own,
    TRUNCATE it and empty every effect key (each could then be enqueued twice). EXECUTE is
    revoked from PUBLIC, and a function hung on another table refuses to run."""
    import uuid

    from sqlalchemy.exc import DBAPIError

    role = f"outbox_probe_{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.execute(text(f'CREATE ROLE "{role}"'))
        conn.execute(text(f'GRANT USAGE ON SCHEMA outbox TO "{role}"'))
        first = enqueue(conn, "noop", {"n": 1}, key="kept-key", queue="nobody")
    try:
        for function in ("effects_truncated", "effects_deleted"):
            timing = "TRUNCATE" if function == "effects_truncated" else "DELETE"
            with pytest.raises(DBAPIError, match="permission denied"), \
                    engine.begin() as conn:
                conn.execute(text(f'SET LOCAL ROLE "{role}"'))
                conn.execute(text("CREATE TEMP TABLE probe (id bigint)"))
                conn.execute(text(
                    f"CREATE TRIGGER probe_t AFTER {timing} ON probe"
                    + (" REFERENCING OLD TABLE AS gone" if timing == "DELETE" else "")
                    + f" FOR EACH STATEMENT EXECUTE FUNCTION outbox.{function}()"))
        with engine.begin() as conn:  # the owner may; the function still refuses
            conn.execute(text("CREATE TABLE public.probe_owner (id bigint)"))
            conn.execute(text(
                "CREATE TRIGGER t AFTER TRUNCATE ON public.probe_owner FOR EACH STATEMENT"
                " EXECUTE FUNCTION outbox.effects_truncated()"))
        with pytest.raises(DBAPIError, match=r"serves outbox\.effects only"), \
                engine.begin() as conn:
            conn.execute(text("TRUNCATE public.probe_owner"))
        with engine.connect() as conn:
            assert conn.execute(text("SELECT effect_id FROM outbox.effect_keys")
                                ).scalars().all() == [first.id]
    finally:
        with engine.begin() as conn:
            conn.execute(text("DROP TABLE IF EXISTS public.probe_owner"))
            conn.execute(text(f'DROP OWNED BY "{role}"'))
            conn.execute(text(f'DROP ROLE "{role}"'))


def test_f11_purging_keys_under_load_blocks_no_request(engine: Engine) -> None:
    """F11 under load: 20,000 completed keys past their expiry and a claim left
    `processing` 30 days ago; 4 threads run guarded requests with new keys, and one in
    four reuses a key the purge is deleting (before its delete: a replay; after: a new
    request). The purge, in batches of 500, deletes every expired completed key but
    those executed anew meanwhile, never the claim; no request fails or waits on it
    (p99 during the purge within 5x the p99 before it, or 0.5 s); every key is one
    business row at most, a reused one included."""
    import random
    import statistics
    import threading

    from outbox.retention import RetentionPlan
    from tests.load_support import latencies_around, steps

    n_old = 20_000
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO outbox.idempotency_keys (scope, key, fingerprint, status,"
            " response_status, response_headers, response_body, created_at, completed_at,"
            " expires_at, generation)"
            " SELECT :scope, 'old-' || i, 'fp', 'completed', 201, '[]', '', now() - interval"
            " '10 days', now() - interval '10 days', now() - interval '3 days',"
            " gen_random_uuid() FROM generate_series(0, :n - 1) AS i"),
            {"scope": SCOPE, "n": n_old})
    long_ago = datetime.now(UTC) - timedelta(days=30)
    assert isinstance(IdempotencyGuard(clock=lambda: long_ago).claim(
        engine, SCOPE, "still-running", "fp"), Claim)

    guard = IdempotencyGuard()
    lock = threading.Lock()
    reused: dict[str, bool] = {}  # key -> executed anew (False: replayed)
    reuse = iter(random.sample(range(n_old), n_old))

    def request(k: int, i: int) -> None:
        if i % 4:
            key, fp = f"new-{k}-{i}", "fp-new"
        else:
            with lock:
                key, fp = f"old-{next(reuse)}", "fp"
        result = guard.run(engine, SCOPE, key, fp, pay(i))
        if key.startswith("old-"):
            with lock:
                reused[key] = not result.replayed

    plan = RetentionPlan(effects=None, inbox=None, conflicts=None, versions=None, batch=500)
    load = latencies_around(steps(request), lambda: plan.run(engine))
    run, during, purge_seconds = load.result, load.during, load.seconds
    with engine.connect() as conn:
        left_old = conn.execute(text(
            "SELECT count(*) FROM outbox.idempotency_keys WHERE scope = :s"
            " AND key LIKE 'old-%' AND expires_at < now()"), {"s": SCOPE}).scalar_one()
        claim_left = conn.execute(text(
            "SELECT status FROM outbox.idempotency_keys WHERE key = 'still-running'"
        )).scalar_one()
        rows_per_key = dict(conn.execute(text(
            "SELECT key, count(*) FROM public.test_orders GROUP BY key")).all())
    assert left_old == 0
    assert claim_left == "processing"
    assert set(rows_per_key.values()) <= {1}
    anew = [k for k, executed in reused.items() if executed]
    assert all(rows_per_key.get(k) == 1 for k in anew)
    assert all(k not in rows_per_key for k, executed in reused.items() if not executed)
    deleted = run.deleted["idempotency_keys"]
    assert deleted >= n_old - len(reused)
    assert len(during) > 20
    p99, p99_before = load.p99(during), load.p99(load.baseline)
    print(f"\nF11 purge {deleted} keys in {purge_seconds:.2f}s (batches of 500) under "
          f"load; requests before: p99 {p99_before * 1000:.1f} ms; during ({len(during)}):"
          f" p50 {statistics.median(during) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms; "
          f"old keys reused: {len(reused)} ({len(anew)} executed anew, the rest replayed)")
    assert p99 < max(0.5, 5 * p99_before)
