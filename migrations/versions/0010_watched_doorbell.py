"""The doorbell rings only when no worker keeps watch over the queue (issue 11, scale).

A NOTIFY serializes commits: from PreCommit_Notify until after the commit record is
flushed, the notifying transaction holds the one notify-queue lock of the cluster, so
notifying transactions cannot share a WAL flush. pgbench on the 2-core box (our
bench/bench_doorbell.py): 8 300 enqueue transactions/s at 4 clients without a NOTIFY,
4 500 with one; 9 100 against 4 400 at 8.

`outbox.ring(channel, queue)` replaces the enqueue's `pg_notify`. A worker busy on a
queue keeps watch (dispatcher/watch.py): it holds one of 4 session advisory locks
(0x6F757464 + slot, hashtext(queue): `outbox.sql.watch.SLOTS`) and claims every few
milliseconds instead of waiting to be rung. `ring`:

1. takes a shared transaction lock (0x6F757463, hashtext(queue)) that tells a watcher
   this transaction may have skipped the bell (held until the transaction ends; a
   try-lock, which nothing refuses: nothing takes it exclusively);
2. then looks at the slots, each with a shared try-lock given back at once (it waits
   for nothing, and holds nothing past this call): a slot it cannot take is held by a
   watcher, and the NOTIFY is skipped; otherwise it NOTIFYs, as before.

A watcher that stops watching first gives its slot back, then lists the transactions
holding the shared lock (pg_locks), claims once more at once and again as listed ones
end: every transaction that skipped the bell took that lock before it looked at the
slot, so it is on the list or committed before the list was read (the claim made at
once sees those). Locks are not MVCC: this holds at any isolation level. A
watcher whose session ends (a crash) gives its slot back with it; rows whose bell it
silenced are then found by the other workers' polling, as after a lost NOTIFY.

Deploy order: migrate before deploying code that calls `outbox.ring` (every enqueue
fails without the function). A role that enqueues needs EXECUTE on it (PUBLIC has it
by default). Enqueueing in a transaction then PREPAREd (two-phase) still fails when
the bell rings (PostgreSQL refuses to PREPARE after a NOTIFY), as before; a watcher
waits for prepared transactions holding the lock whenever it lists.

A hashtext collision between two queues makes one's watcher silence the other's bell:
that queue's rows wait for its workers' polling (as after a lost NOTIFY), never lost.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# Assignments and IF conditions take PL/pgSQL's simple-expression path; a PERFORM is a
# whole query each time (the first form, six PERFORMs, cost ~25 us a call). The shared
# try-lock of ENQUEUING always succeeds (nothing takes it exclusively); were it ever
# refused, the bell rings: a transaction not on a watcher's list must not skip it.
_RING = """
CREATE FUNCTION outbox.ring(p_channel text, p_queue text) RETURNS void
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_queue int4 := hashtext(p_queue);
    v_slot int4;
    v_ok boolean;
BEGIN
    IF pg_try_advisory_xact_lock_shared(1869968483, v_queue) THEN
        FOR v_slot IN 1869968484 .. 1869968487 LOOP
            IF NOT pg_try_advisory_lock_shared(v_slot, v_queue) THEN
                RETURN;  -- a watcher holds this slot: it will look
            END IF;
            v_ok := pg_advisory_unlock_shared(v_slot, v_queue);
        END LOOP;
    END IF;
    PERFORM pg_notify(p_channel, p_queue);
END $$
"""


def upgrade() -> None:
    op.execute(_RING)


def downgrade() -> None:
    op.execute("DROP FUNCTION outbox.ring(text, text)")
