"""Our Celery tasks on a user's own Celery app (issue 12, the Celery bullet).

`dispatcher.celery_tasks.register(app)` puts `outbox.drain`/`outbox.sweep`, the beat
entry, the per-worker sweep and the doorbell on the user's app, with the user's config;
importing `dispatcher.celery_app` no longer makes our app Celery's current one, so a
user's `@shared_task` stays on the user's app and queue. The process test runs
`celery -A <user module> worker` (not ours) on Redis, the session's PostgreSQL and the
fake PSP, which counts applications per key: exactly once is counted, not inferred.
The lease test checks that a handler past its deadline is not kept leased.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, text

from dispatcher._core import Dispatcher
from dispatcher.examples.payments.psp import ReceiverProcess
from dispatcher.handlers import Registry
from tests.dispatch_support import add_effects, keys, wait_until
from tests.process_support import BIN, HANDLERS, Procs
from tests.test_celery_queues import (
    REDIS_URL,
    procs,  # noqa: F401  (fixture)
    psp,  # noqa: F401  (fixture)
    redis_url,  # noqa: F401  (fixture)
    wait_delivered,
    wait_ready,
)
from tests.test_dispatcher_processes import check_exactly_once

ROOT = Path(__file__).resolve().parent.parent

USER_MODULE = '''
"""A user's project: its own Celery app, config, default queue and shared task."""
import os

from celery import Celery, current_app, shared_task

app = Celery("userproject", broker=os.environ["USER_BROKER"])
app.conf.update(task_default_queue=os.environ["USER_DEFAULT_QUEUE"], task_acks_late=True,
                worker_prefetch_multiplier=1, task_ignore_result=True)

from dispatcher.celery_tasks import register  # noqa: E402

outbox = register(app, queue_name=os.environ["USER_OUTBOX_QUEUE"], sweep_interval=3600)

import dispatcher.celery_app  # noqa: E402,F401  (must not take over our shared tasks)


@shared_task(name="userproject.record", bind=True)
def record(self, path):
    with open(path, "a") as out:
        out.write("%s %s %s\\n" % (current_app.main, self.app.main,
                                   self.request.delivery_info.get("routing_key")))
    return "ok"
'''

CLIENT = '''
import sys

import {module} as user
from outbox import Effect, enqueue_many
from outbox._config import make_engine

from celery import current_app

assert current_app.main == "userproject", current_app.main
user.record.delay(sys.argv[1])
engine = make_engine(application_name="user-client")
with engine.begin() as conn:  # the doorbell rings the user's app after commit
    enqueue_many(conn, [Effect("psp.charge", {{"n": i, "key": k}}, key=k)
                        for i, k in enumerate(sys.argv[2:])])
engine.dispose()
print("sent")
'''


def test_importing_our_app_does_not_rebind_a_users_shared_task() -> None:
    """In one process: the user's app stays current, its shared task stays on it."""
    script = textwrap.dedent('''
        from celery import Celery, current_app, shared_task

        user = Celery("userproject", broker="memory://")
        user.conf.task_default_queue = "user-default"

        @shared_task(name="userproject.t")
        def t():
            return 1

        import dispatcher.celery_app as ours
        from dispatcher.celery_tasks import register

        assert current_app._get_current_object() is user, current_app.main
        assert t.app is user and t.app.conf.task_default_queue == "user-default"
        assert "outbox.drain" not in user.tasks  # ours are not shared tasks
        assert "outbox.drain" in ours.app.tasks
        tasks = register(user, queue_name="user-outbox", doorbell=False)
        assert user.tasks["outbox.drain"] is tasks.drain and tasks.drain.app is user
        assert tasks.drain.queue == "user-outbox"
        assert tasks.drain.soft_time_limit < tasks.drain.time_limit
        assert user.conf.beat_schedule["outbox-sweep"]["options"]["queue"] == "user-outbox"
        assert current_app._get_current_object() is user
        print("ok")
    ''')
    env = {**os.environ, "BROKER_URL": "memory://", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.slow
def test_users_own_app_delivers_our_effects_once_and_keeps_its_task(
        engine: Engine, procs: Procs, psp: ReceiverProcess,  # noqa: F811
        redis_url: str, tmp_path: Path, db_url: str) -> None:  # noqa: F811
    """`celery -A usermodule worker` (not ours): a non-default queue for our tasks."""
    tag = uuid.uuid4().hex[:8]
    module = f"user_celery_{tag}"
    (tmp_path / f"{module}.py").write_text(USER_MODULE)
    user_default, user_outbox = f"user-default-{tag}", f"user-outbox-{tag}"
    env = {"USER_BROKER": REDIS_URL, "BROKER_URL": REDIS_URL,
           "USER_DEFAULT_QUEUE": user_default, "USER_OUTBOX_QUEUE": user_outbox,
           "OUTBOX_HANDLERS": HANDLERS, "OUTBOX_LEASE": "5", "OUTBOX_CONCURRENCY": "4",
           "OUTBOX_DRAIN_BUDGET": "5", "DATABASE_URL": db_url,
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    env.pop("OUTBOX_CELERY_QUEUE", None)
    # Effects committed before the worker starts: its start-up sweep rings the user's
    # queue (the user's sweep interval is an hour). Committed after `ready`, they raced
    # that one sweep, and lost it now and then (seen twice in full runs).
    before = keys(f"ur-before-{tag}", 5)
    add_effects(engine, before, kind="psp.charge")
    worker = procs.spawn("user-worker", [
        str(BIN / "celery"), "-A", module, "worker", "-Q", f"{user_default},{user_outbox}",
        "--pool", "prefork", "-c", "2", "--loglevel", "INFO",
        "-n", f"user-{tag}@%h", "--without-gossip", "--without-mingle",
        "--without-heartbeat"], env)
    wait_ready(worker)
    wait_delivered(engine, before, timeout=45)

    # The user's shared task and the user's doorbell, from another process of theirs
    # (the periodic sweep is an hour away: the doorbell is what rings).
    marker = tmp_path / "user-task.txt"
    after = keys(f"ur-after-{tag}", 8)
    client = procs.spawn("user-client", [sys.executable, "-c",
                                         CLIENT.format(module=module), str(marker), *after],
                         {**env, "OUTBOX_SWEEP_INTERVAL": "3600"})
    assert client.popen.wait(60) == 0, client.tail()
    wait_delivered(engine, after, timeout=45)
    wait_until(lambda: marker.exists() and marker.read_text().strip(), 30,
               message="the user's task ran")
    assert marker.read_text().split() == ["userproject", "userproject", user_default]
    check_exactly_once(engine, psp, [*before, *after])
    log = worker.tail(100_000)
    assert "outbox.drain" in log and "userproject.record" in log
    assert "raised unexpected" not in log, log[-3000:]


def test_a_handler_past_its_deadline_is_not_kept_leased(engine: Engine) -> None:
    """The dispatcher caps every lease extension at the attempt's deadline (+1 s).

    A handler that ignores its deadline (0.8 x lease) keeps running; its lease must
    still expire by deadline + margin, however often extensions are attempted.
    """
    release = threading.Event()
    registry = Registry()

    def stuck(effect: Any) -> None:
        release.wait(30)

    registry.register("stuck", stuck)
    [effect_id] = add_effects(engine, ["stuck-1"], kind="stuck", queue="stuck")
    lease = 3.0
    d = Dispatcher(engine, registry, queue="stuck", concurrency=2, lease=lease)

    def lease_left() -> float | None:
        with engine.connect() as conn:
            left = conn.execute(text(
                "SELECT extract(epoch FROM lease_expires_at - now()) FROM outbox.effects"
                " WHERE id = :id AND status = 'in_flight'"), {"id": effect_id}).scalar()
        return None if left is None else float(left)

    try:
        assert d.fill() == 1
        claimed = time.monotonic()
        seen: list[tuple[float, float]] = []
        while time.monotonic() - claimed < lease * 0.8 + 2.5:
            d.extend_leases(force=True)
            left = lease_left()
            if left is not None:
                seen.append((time.monotonic() - claimed, left))
            time.sleep(0.2)
        assert seen
        # Never leased beyond the deadline (0.8 x lease after the claim) + 1 s (+ slack).
        for at, left in seen:
            assert at + left <= lease * 0.8 + 1.0 + 0.5, (at, left)
        # And extensions did happen before the deadline (the cap is not "never extend").
        assert max(at + left for at, left in seen) > lease * 0.8 - 0.5
    finally:
        release.set()
        d.shutdown(2.0)



def test_drain_time_limit_releases_in_flight_work(engine: Engine) -> None:
    """A handler that ignores its deadline does not hold a drain (and its Celery
    child) forever: at budget + lease the drain releases what is in flight through
    the Dispatcher's shutdown (fenced by lease token), then chains one drain."""
    from celery import Celery

    from dispatcher.celery_tasks import register

    release = threading.Event()
    registry = Registry()
    registry.register("stuck", lambda effect: release.wait(30))
    [effect_id] = add_effects(engine, ["soft-1"], kind="stuck", queue="soft")
    d = Dispatcher(engine, registry, queue="soft", concurrency=2, lease=2.0)
    app = Celery("drain-limit-test", broker="memory://", set_as_current=False)
    tasks = register(app, queue_name="soft-outbox", doorbell=False, periodic_sweep=False,
                     drain_budget=0.5)
    tasks.dispatcher_for = lambda queue, **_: d
    sent: list[dict[str, Any]] = []
    tasks.drain.apply_async = lambda *a, **kw: sent.append(kw)
    started = time.monotonic()
    try:
        result = tasks.run_drain("soft", False)
    finally:
        release.set()
    assert time.monotonic() - started < 0.5 + 2.0 + 2.5
    assert result["timed_out"] is True and result["claimed"] == 1
    with engine.connect() as conn:
        row = conn.execute(text("SELECT status, lease_token FROM outbox.effects"
                                " WHERE id = :id"), {"id": effect_id}).one()
    assert row.status != "in_flight" and row.lease_token is None, row
    assert [s["args"] for s in sent] == [["soft"]]
    assert sent[0]["queue"] == "soft-outbox"


def test_the_sweep_starts_retention_on_a_thread_and_returns(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep task starts a due retention run on a thread of its own (as `outbox
    worker` does) and returns at once: a paced run rests most of its time, and the task
    must not hold its worker process meanwhile."""
    from celery import Celery

    from dispatcher import celery_tasks
    from dispatcher.celery_tasks import register
    from outbox.retention import RetentionPlan, ScheduledRetention

    schedule = ScheduledRetention(
        RetentionPlan(effects=86400.0, keys=False, inbox=None, conflicts=None,
                      versions=None), interval=600.0, budget=30.0, duty=0.5)
    schedule._next = 0.0  # due now (the first run otherwise comes a minute after start)
    monkeypatch.setattr(celery_tasks, "scheduled_retention", lambda name="": schedule)
    [old] = add_effects(engine, ["sweep-retention"], queue="sweep-retention")
    with engine.begin() as conn:
        conn.execute(text(
            "UPDATE outbox.effects SET status = 'delivered', delivered_at = now() - interval"
            " '10 days', finished_at = now() - interval '10 days' WHERE id = :i"), {"i": old})
    d = Dispatcher(engine, Registry(), queue="sweep-retention", concurrency=2)
    app = Celery("sweep-retention-test", broker="memory://", set_as_current=False)
    tasks = register(app, doorbell=False, periodic_sweep=False, beat=False)
    tasks.dispatcher_for = lambda queue, **_: d
    result = tasks.run_sweep("sweep-retention")
    assert result["retention_started"] == [""]
    schedule.join(30)
    assert schedule.last is not None and schedule.last.deleted["effects"] == 1
    assert tasks.run_sweep("sweep-retention")["retention_started"] == []  # not due again


def test_an_exiting_child_writes_what_its_dispatchers_hold(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefork child that exits (max-tasks-per-child, a warm shutdown) shuts its
    cached Dispatchers down: outcomes they still hold (kept while the database did not
    answer, or finished after a drain's last write) are written, not left to the lease."""
    from dispatcher import celery_tasks
    from tests.dispatch_support import effect_row

    add_effects(engine, ["child-exit"], kind="noop")
    registry = Registry()
    registry.register("noop", lambda effect: None)
    d = Dispatcher(engine, registry, queue="default", concurrency=2)
    monkeypatch.setattr(celery_tasks, "_dispatchers", {(os.getpid(), "", "default"): d})
    assert d.fill() == 1
    wait_until(lambda: len(d._done) == 1, 5)  # delivered; not written (no loop runs)
    assert effect_row(engine, "child-exit").status == "in_flight"
    celery_tasks._on_worker_process_shutdown()
    assert effect_row(engine, "child-exit").status == "delivered"
