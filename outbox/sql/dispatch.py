"""The dispatch loop's statements: claim, extend leases, record outcomes, rescue.

Every write after a claim is fenced by the row's `lease_token`: a worker whose lease
was taken over changes nothing, and its attempt is recorded as `lease_lost`.

Statements run through the driver seam (`outbox/_driver.py`): on the psycopg
connection under whatever handle the caller passes (a SQLAlchemy Connection, a psycopg
Connection), without SQLAlchemy's compilation and Row building. Hot statements take
few, wide parameters: `record_outcomes` sends its batch as ONE jsonb parameter
(`jsonb_to_recordset`) rather than eleven arrays, whose dumping in Python cost more
than the statement itself.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from outbox._driver import sql as _sql
from outbox._driver import sync_db
from outbox._schema import AttemptOutcome, EffectStatus

_NOW = "coalesce(CAST(:now AS timestamptz), now())"

# Empty headers (no trace context at enqueue: the common case) come back as NULL,
# sparing psycopg a JSON decode per claimed row.
_CLAIMED_COLUMNS = (
    "e.id, e.effect_key, e.kind, e.payload, nullif(e.headers, '{}'::jsonb) AS headers,"
    " e.attempts, e.max_attempts,"
    " e.lease_token, e.lease_expires_at, e.created_at, e.retry_until,"
    " e.ordering_key, e.queue, e.first_claimed_at")


class Claimed(NamedTuple):
    """One claimed effect: what the executor needs, and the lease that fences it.

    Field order is the claim's RETURNING order (`Claimed._make(row)`). A NamedTuple,
    not a frozen dataclass: made from the row in one C call, where a frozen
    dataclass's `__init__` set its 13 fields one `object.__setattr__` at a time (~8 %
    of the worker's time at 100 rows per claim, with `Outcome`'s).
    """

    id: int
    effect_key: str
    kind: str
    payload: Any
    headers: Any           # None when empty
    attempts: int          # this attempt's number (1 for the first)
    max_attempts: int
    lease_token: uuid.UUID
    lease_expires_at: datetime
    created_at: datetime
    retry_until: datetime | None
    ordering_key: str | None
    queue: str
    # The row's first claim (this one's time if it is the first; migration 0011).
    first_claimed_at: datetime | None = None


# Two MATERIALIZED CTEs: a plain `IN (SELECT ... LIMIT n)` may be re-evaluated and
# claim more than n rows (PostgreSQL bug #15715); a CTE is evaluated exactly once.
# `rescue` takes in-flight rows whose lease expired (their worker died or stalled);
# `fresh` takes due pending rows, only the head of each ordering key.
# The rescue runs only when the caller asks (`:rescue`, a one-time filter: false skips
# the scan entirely). It is off the hot path (issue 17): its index walks every
# in-flight entry since the xmin horizon and finds nothing almost always; the
# dispatcher asks for it when its last claim came up short (the queue is not
# saturated) and at least once a second under a saturated backlog.
# The fresh scan resumes after the caller's watermark (issue 17): the row comparison
# `(available_at, id) > (:after_at, :after_id)` is an Index Cond on effects_pending_idx
# (queue, available_at, id), so the scan starts at the watermark instead of stepping,
# from the head of the index, over the entries of every row claimed since the xmin
# horizon (dead, and unremovable while a transaction holds the horizon back). No
# watermark (both NULL) is the full scan, from the head: `-infinity` and the smallest
# bigint are below every row. Rows can appear behind a watermark (a late commit, a
# released lock, a blocked ordering-key successor): the caller's periodic full scan
# finds them (dispatcher/producer.py, docs/architecture.md).
# Every row of one claim gets the caller's `:token`: a retry of a claim whose reply was
# lost finds its rows by it (`claimed_with`). Fencing stays per (id, token).
# The claim returns two columns after `_CLAIMED_COLUMNS`: the row's available_at and
# whether the fresh scan took it; `claim_batch` makes the next watermark of them.
_CLAIM = _sql(
    f"""
    WITH rescue AS MATERIALIZED (
        SELECT id FROM outbox.effects
         WHERE CAST(:rescue AS boolean)
           AND status = 'in_flight' AND queue = :queue
           AND lease_expires_at < {_NOW}
           AND attempts < max_attempts
           AND (retry_until IS NULL OR retry_until > {_NOW})
         ORDER BY lease_expires_at
         LIMIT :limit
         FOR UPDATE SKIP LOCKED
    ), fresh AS MATERIALIZED (
        SELECT id FROM outbox.effects e
         WHERE status = 'pending' AND queue = :queue
           AND available_at <= {_NOW}
           AND (available_at, id) > (
                coalesce(CAST(:after_at AS timestamptz), '-infinity'),
                coalesce(CAST(:after_id AS bigint), -9223372036854775808))
           AND (ordering_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM outbox.effects h
                 WHERE h.ordering_key = e.ordering_key AND h.id < e.id
                   AND h.status IN ('pending', 'in_flight', 'failed', 'needs_review')))
         ORDER BY available_at, id
         LIMIT :limit
         FOR UPDATE SKIP LOCKED
    ), picked AS MATERIALIZED (
        SELECT id, false AS fresh FROM rescue
        UNION ALL SELECT id, true FROM fresh
        LIMIT :limit
    )
    UPDATE outbox.effects e
       SET status = 'in_flight',
           lease_owner = :owner,
           lease_token = CAST(:token AS uuid),
           lease_expires_at = {_NOW} + make_interval(secs => :lease),
           attempts = e.attempts + 1,
           first_claimed_at = coalesce(
               e.first_claimed_at,
               CASE WHEN e.attempts > 0 THEN e.created_at ELSE {_NOW} END)
      FROM picked
     WHERE e.id = picked.id
    RETURNING {_CLAIMED_COLUMNS}, e.available_at, picked.fresh
    """,
    tuples=True,
)


@dataclass(frozen=True, slots=True, order=True)
class Watermark:
    """Where a worker's next fresh scan resumes: just after this pending row.

    Ordered as the claim orders rows, `(available_at, id)`.
    """

    available_at: datetime
    id: int


@dataclass(frozen=True, slots=True)
class ClaimBatch:
    """One claim's rows, and the watermark after the last row its fresh scan took.

    `watermark` is None when the fresh scan took nothing (every row was a rescue, or
    there were none).
    """

    rows: list[Claimed]
    watermark: Watermark | None


def claim_batch(conn: Any, *, queue: str, limit: int, owner: str, lease_seconds: float,
                now: datetime | None = None, token: uuid.UUID | None = None,
                rescue: bool = True, after: Watermark | None = None) -> ClaimBatch:
    """Claim at most `limit` due effects for `owner`; commit before delivering them.

    `token` becomes every claimed row's lease token (a fresh one if None). A caller
    that may retry the claim passes the same token to each try and to `claimed_with`.
    `rescue=False` skips expired leases (see `_CLAIM`). `after`: the fresh scan takes
    only pending rows past this watermark (None: from the head of the queue). A
    caller passing one must also claim without one now and then: rows can commit, or
    be unlocked, behind it.
    """
    if limit <= 0:
        return ClaimBatch([], None)
    params = {"queue": queue, "limit": limit, "owner": owner, "lease": float(lease_seconds),
              "now": now, "token": token or uuid.uuid4(), "rescue": rescue,
              "after_at": after.available_at if after else None,
              "after_id": after.id if after else None}
    got = sync_db(conn).execute(_CLAIM, params).rows
    make = Claimed._make
    rows = [make(r[:-2]) for r in got]
    # The last row the fresh scan took, in the scan's order (available_at, id).
    fresh = [(r[-2], r[0]) for r in got if r[-1]]
    mark = Watermark(*max(fresh)) if fresh else None
    return ClaimBatch(rows, mark)


def claim_due(conn: Any, *, queue: str, limit: int, owner: str,
              lease_seconds: float, now: datetime | None = None,
              token: uuid.UUID | None = None, rescue: bool = True,
              after: Watermark | None = None) -> list[Claimed]:
    """`claim_batch`'s rows: at most `limit` due effects claimed for `owner`."""
    return claim_batch(conn, queue=queue, limit=limit, owner=owner,
                       lease_seconds=lease_seconds, now=now, token=token, rescue=rescue,
                       after=after).rows


# A retried claim's first step: the rows an earlier try of the same claim took, if its
# UPDATE committed but the reply was lost. Only in-flight rows of the queue are scanned
# (effects_in_flight_idx: bounded by the workers' slots), and only on the retry path.
_CLAIMED_WITH = _sql(
    f"""
    SELECT {_CLAIMED_COLUMNS}
      FROM outbox.effects e
     WHERE e.status = 'in_flight' AND e.queue = :queue AND e.lease_token = :token
     ORDER BY e.id
    """,
    tuples=True,
)


def claimed_with(conn: Any, *, queue: str, token: uuid.UUID) -> list[Claimed]:
    """The rows a claim with `token` holds (the claim's own RETURNING columns)."""
    rows = sync_db(conn).execute(_CLAIMED_WITH, {"queue": queue, "token": token}).rows
    return [Claimed._make(r) for r in rows]


# Whether a backend (an earlier try's connection, lost to us) still runs a statement:
# its claim may not have committed yet, and `claimed_with` could not see its rows.
_BACKENDS_BUSY = _sql(
    """
    SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                    WHERE pid = ANY(CAST(:pids AS int[])) AND pid <> pg_backend_pid()
                      AND state <> 'idle')
    """
)


def backends_busy(conn: Any, pids: Sequence[int]) -> bool:
    """True while any of `pids` (other than ours) is running or inside a transaction."""
    if not pids:
        return False
    return bool(sync_db(conn).execute(_BACKENDS_BUSY, {"pids": list(pids)}).scalar())


# The fenced writes (`_EXTEND`, `_RECORD`) match a row by (id, lease_token) only, with
# no `status = 'in_flight'`: the lease_iff_in_flight constraint makes a row with a
# lease token in flight anyway, and that predicate let the planner read the rows
# through effects_in_flight_idx (whose predicate it implies), estimated at a handful
# of rows. While a transaction holds the xmin horizon that index keeps an entry for
# every row claimed since (dead, not removable), and each record walked all of them:
# its time grew with the time held (issue 17). Matched by id, the primary key it is.
# `least(:lease, v.secs)`: a lease is never extended past its attempt's deadline (plus
# a margin): the caller passes, per lease, the seconds left until then.
_EXTEND = _sql(
    f"""
    UPDATE outbox.effects e
       SET lease_expires_at = {_NOW} + make_interval(secs => least(:lease, v.secs))
      FROM unnest(CAST(:ids AS bigint[]), CAST(:tokens AS uuid[]),
                  CAST(:secs AS float8[])) AS v(id, token, secs)
     WHERE e.id = v.id AND e.lease_token = v.token
    RETURNING e.id
    """,
    tuples=True,
)


def extend_leases(conn: Any, leases: Sequence[tuple[int, uuid.UUID]],
                  lease_seconds: float, now: datetime | None = None, *,
                  caps: Sequence[float] | None = None) -> set[int]:
    """Extend many leases in one statement; returns the ids still ours.

    `caps[i]`, if given, caps lease i's new length (seconds from now).
    """
    if not leases:
        return set()
    secs = [float(c) for c in caps] if caps is not None else [float(lease_seconds)] * len(
        leases)
    params = {"ids": [i for i, _ in leases], "tokens": [t for _, t in leases],
              "secs": secs, "lease": float(lease_seconds), "now": now}
    return {r[0] for r in sync_db(conn).execute(_EXTEND, params).rows}


class Outcome(NamedTuple):
    """What one attempt ended in, and the state the effect moves to (a NamedTuple for
    the reason `Claimed` is one)."""

    effect_id: int
    lease_token: uuid.UUID
    attempt: int
    outcome: AttemptOutcome | str          # recorded for the attempt
    next_status: EffectStatus | str        # delivered | pending | failed | needs_review
    started_at: datetime
    delay: float = 0.0       # seconds until the next attempt, when next_status=pending
    error: str | None = None
    result: str | None = None  # JSON text stored on the effect
    http_status: int | None = None
    trace_id: str | None = None
    # Metric labels only (never written): the effect's kind and queue.
    kind: str = ""
    queue: str = ""
    # Never written: the effect has an ordering key (its successor may be unblocked).
    ordered: bool = False
    # The attempt was not made (a first attempt whose host slept past the key
    # retention after the claim): not counted, and the effect's next claim is its
    # first contact again (first_claimed_at cleared).
    unsent: bool = False


# The batch is one jsonb parameter (an array of objects, keys as in `v` below):
# psycopg dumps one string instead of eleven Python lists element by element.
_RECORD = _sql(
    f"""
    WITH v AS MATERIALIZED (
        SELECT * FROM jsonb_to_recordset(CAST(:batch AS jsonb))
          AS v(id bigint, token uuid, attempt int, outcome text, next_status text,
               delay float8, error text, result text, http_status int,
               started_at timestamptz, trace_id text, unsent boolean)
    ), upd AS (
        UPDATE outbox.effects e
           SET status = v.next_status,
               attempts = CASE WHEN v.unsent THEN e.attempts - 1 ELSE e.attempts END,
               first_claimed_at = CASE WHEN v.unsent THEN NULL ELSE e.first_claimed_at END,
               available_at = CASE WHEN v.next_status = 'pending'
                                   THEN {_NOW} + make_interval(secs => coalesce(v.delay, 0))
                                   ELSE e.available_at END,
               lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL,
               delivered_at = CASE WHEN v.next_status = 'delivered' THEN {_NOW} END,
               finished_at = CASE WHEN v.next_status IN ('delivered', 'failed', 'needs_review')
                                  THEN {_NOW} END,
               last_error = coalesce(v.error, e.last_error),
               result = coalesce(CAST(v.result AS jsonb), e.result),
               delivered_by = CASE WHEN v.next_status = 'delivered' THEN :worker END,
               delivered_started_at = CASE WHEN v.next_status = 'delivered'
                                           THEN v.started_at END,
               delivered_http_status = CASE WHEN v.next_status = 'delivered'
                                            THEN v.http_status END,
               delivered_trace_id = CASE WHEN v.next_status = 'delivered'
                                         THEN v.trace_id END
          FROM v
         WHERE e.id = v.id AND e.lease_token = v.token  -- in flight: see `_EXTEND`
        RETURNING e.id, v.token, e.status
    ), ins AS (
    -- Join back on (id, token), not id alone: a stale outcome that shares a batch with
    -- the live outcome for the same effect must still be recorded as lease_lost.
    -- A delivery the UPDATE applied is not inserted: the effect row now holds it
    -- (delivered_by, ...: migration 0006; outbox.attempt_history shows it).
    INSERT INTO outbox.attempts
           (effect_id, attempt, worker, started_at, finished_at, outcome, http_status,
            error, trace_id)
    SELECT v.id, v.attempt, :worker, v.started_at, {_NOW},
           CASE WHEN upd.id IS NULL THEN 'lease_lost' ELSE v.outcome END,
           v.http_status, v.error, v.trace_id
      FROM v LEFT JOIN upd ON upd.id = v.id AND upd.token = v.token
     WHERE (upd.id IS NULL OR upd.status <> 'delivered')
       -- The effect must still exist. Not under a lock (reviewed): FOR KEY SHARE made a
       -- record wait behind any open DELETE of a fenced row (a psql session), for as
       -- long as it stayed open. So a fenced outcome recorded while its effect is being
       -- deleted may leave its lease_lost row behind: an audit row of a deleted effect,
       -- nothing delivered or lost (migration 0008's trigger deletes the attempts
       -- written before the DELETE).
       AND EXISTS (SELECT 1 FROM outbox.effects x WHERE x.id = v.id)
       -- A retried record whose first COMMIT landed (the reply was lost) must not add
       -- a second, spurious lease_lost row for an attempt already recorded. Only a
       -- fenced row (upd.id IS NULL) can be such a repeat: had the first try committed,
       -- the lease token would be gone and this UPDATE could not have matched. Testing
       -- upd first keeps the lookup off the hot path: as a NOT EXISTS anti-join on every
       -- row, a cached generic plan seq-scanned outbox.attempts once per outcome
       -- (planned while the table was small), so each record got slower as it grew.
       AND (upd.id IS NOT NULL
            OR (NOT EXISTS (SELECT 1 FROM outbox.attempts a
                             WHERE a.effect_id = v.id AND a.attempt = v.attempt
                               AND a.worker = :worker AND a.started_at = v.started_at)
                -- ... nor for a delivery it recorded on the effect row
                AND NOT EXISTS (SELECT 1 FROM outbox.effects d
                                 WHERE d.id = v.id AND d.delivered_by = :worker
                                   AND d.delivered_started_at = v.started_at)))
    RETURNING effect_id, outcome
    )
    SELECT effect_id, outcome FROM ins
    UNION ALL
    SELECT upd.id, 'delivered' FROM upd WHERE upd.status = 'delivered'
    """,
    tuples=True,
)


def _outcome_json(o: Outcome) -> dict[str, Any]:
    # Keys left out are NULL to jsonb_to_recordset: a plain delivery sends six of twelve.
    out: dict[str, Any] = {
        "id": o.effect_id, "token": str(o.lease_token), "attempt": o.attempt,
        "outcome": str(o.outcome), "next_status": str(o.next_status),
        "started_at": o.started_at.isoformat()}
    if o.delay:
        out["delay"] = o.delay
    if o.error is not None:
        out["error"] = o.error
    if o.result is not None:
        out["result"] = o.result
    if o.http_status is not None:
        out["http_status"] = o.http_status
    if o.trace_id is not None:
        out["trace_id"] = o.trace_id
    if o.unsent:
        out["unsent"] = True
    return out


def _batch_json(outcomes: Sequence[Outcome]) -> str:
    return json.dumps([_outcome_json(o) for o in outcomes], ensure_ascii=False,
                      allow_nan=False)


def record_outcomes(conn: Any, outcomes: Sequence[Outcome], worker: str,
                    now: datetime | None = None) -> dict[int, str]:
    """Apply a batch of attempt outcomes in one statement, fenced by lease token.

    Returns {effect_id: recorded attempt outcome}; `lease_lost` marks a fenced write.
    An outcome already recorded by an earlier try of the same batch is skipped (absent).
    """
    if not outcomes:
        return {}
    params = {"batch": _batch_json(outcomes), "worker": worker, "now": now}
    return {r[0]: r[1] for r in sync_db(conn).execute(_RECORD, params).rows}


_FAIL_EXHAUSTED = _sql(
    f"""
    WITH dead AS MATERIALIZED (
        SELECT id, attempts, lease_owner FROM outbox.effects
         WHERE status = 'in_flight' AND lease_expires_at < {_NOW}
           AND (attempts >= max_attempts OR retry_until <= {_NOW})
         LIMIT :batch
         FOR UPDATE SKIP LOCKED
    ), upd AS (
        UPDATE outbox.effects e
           SET status = 'failed', finished_at = {_NOW},
               lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL,
               last_error = 'lease expired on the last allowed attempt'
          FROM dead WHERE e.id = dead.id
        RETURNING e.id
    )
    INSERT INTO outbox.attempts (effect_id, attempt, worker, started_at, outcome, error)
    SELECT dead.id, dead.attempts, dead.lease_owner, {_NOW}, 'failed',
           'lease expired on the last allowed attempt'
      FROM dead JOIN upd ON upd.id = dead.id
    RETURNING effect_id
    """
)


def fail_exhausted_leases(conn: Any, batch: int = 1000,
                          now: datetime | None = None) -> list[int]:
    """Dead-letter expired leases that may not be retried (the poison-loop stop)."""
    rows = sync_db(conn).execute(_FAIL_EXHAUSTED, {"batch": batch, "now": now}).rows
    return [r[0] for r in rows]


_NEXT_DUE = _sql(
    f"""
    SELECT extract(epoch FROM least(
             (SELECT min(available_at) FROM outbox.effects
               WHERE status = 'pending' AND queue = :queue),
             (SELECT min(lease_expires_at) FROM outbox.effects
               WHERE status = 'in_flight' AND queue = :queue)) - {_NOW}) AS wait
    """
)


def seconds_until_due(conn: Any, queue: str, now: datetime | None = None
                      ) -> float | None:
    """Seconds until something becomes claimable (<= 0: now); None if nothing waits."""
    wait = sync_db(conn).execute(_NEXT_DUE, {"queue": queue, "now": now}).one()[0]
    return None if wait is None else float(wait)


# Claimable now, exactly as `claim_due` decides (keep the three in step): a due pending
# row at the head of its ordering key, or an expired lease that may still be retried.
# "Due" by any looser test (a blocked successor, an exhausted lease) would make every
# drain and sweep ring again at once, forever, for work no claim will take.
_CLAIMABLE_PENDING = f"""
    e.status = 'pending' AND e.available_at <= {_NOW}
    AND (e.ordering_key IS NULL OR NOT EXISTS (
         SELECT 1 FROM outbox.effects h
          WHERE h.ordering_key = e.ordering_key AND h.id < e.id
            AND h.status IN ('pending', 'in_flight', 'failed', 'needs_review')))"""
_CLAIMABLE_RESCUE = f"""
    e.status = 'in_flight' AND e.lease_expires_at < {_NOW}
    AND e.attempts < e.max_attempts
    AND (e.retry_until IS NULL OR e.retry_until > {_NOW})"""

# The queues a sweep must ring. The distinct queues of pending rows come from a skip
# scan of effects_pending_idx (one index probe per queue, however deep the backlog);
# in-flight rows are few (bounded by the workers' slots).
_QUEUES_WITH_DUE_WORK = _sql(
    f"""
    WITH RECURSIVE pending_queues(queue) AS (
        (SELECT queue FROM outbox.effects WHERE status = 'pending' ORDER BY queue LIMIT 1)
        UNION ALL
        SELECT (SELECT e.queue FROM outbox.effects e
                 WHERE e.status = 'pending' AND e.queue > p.queue
                 ORDER BY e.queue LIMIT 1)
          FROM pending_queues p WHERE p.queue IS NOT NULL
    ), candidates AS (
        SELECT queue FROM pending_queues WHERE queue IS NOT NULL
        UNION
        SELECT queue FROM outbox.effects WHERE status = 'in_flight'
    )
    SELECT c.queue FROM candidates c
     WHERE EXISTS (SELECT 1 FROM outbox.effects e
                    WHERE e.queue = c.queue AND {_CLAIMABLE_PENDING})
        OR EXISTS (SELECT 1 FROM outbox.effects e
                    WHERE e.queue = c.queue AND {_CLAIMABLE_RESCUE})
     ORDER BY c.queue
    """
)


def queues_with_due_work(conn: Any, now: datetime | None = None) -> list[str]:
    """Every queue holding an effect a claim would take now (the sweep rings each)."""
    return [r[0] for r in sync_db(conn).execute(_QUEUES_WITH_DUE_WORK, {"now": now}).rows]


# When a drain that found nothing to claim must look again: 0 if a claim would take
# something now (a row committed or freed after its last claim), else the first
# future moment a row becomes claimable: a retry's available_at, or the expiry of a
# lease that may still be rescued (its worker may be dead). Rows blocked behind their
# ordering key's head and exhausted leases (the sweep dead-letters those) never make
# it "now", so a drain never re-arms in a loop for them.
_SECONDS_UNTIL_CLAIMABLE = _sql(
    f"""
    SELECT CASE
      WHEN EXISTS (SELECT 1 FROM outbox.effects e
                    WHERE e.queue = :queue AND {_CLAIMABLE_PENDING})
        OR EXISTS (SELECT 1 FROM outbox.effects e
                    WHERE e.queue = :queue AND {_CLAIMABLE_RESCUE})
      THEN CAST(0 AS float8)
      ELSE CAST(extract(epoch FROM least(
             (SELECT min(available_at) FROM outbox.effects
               WHERE status = 'pending' AND queue = :queue AND available_at > {_NOW}),
             (SELECT min(lease_expires_at) FROM outbox.effects
               WHERE status = 'in_flight' AND queue = :queue
                 AND lease_expires_at >= {_NOW} AND attempts < max_attempts
                 AND (retry_until IS NULL OR retry_until > lease_expires_at))
           ) - {_NOW}) AS float8)
    END AS wait
    """
)


def seconds_until_claimable(conn: Any, queue: str, now: datetime | None = None
                            ) -> float | None:
    """0 if a claim on `queue` would take something now, else seconds until one would.

    None: nothing on `queue` waits for a moment to pass (a blocked successor becomes
    claimable when its head is delivered, by the drain that delivers it).
    """
    wait = sync_db(conn).execute(_SECONDS_UNTIL_CLAIMABLE,
                              {"queue": queue, "now": now}).one()[0]
    return None if wait is None else float(wait)
