"""Retention: what is deleted, after how long, and who runs it.

One `RetentionPlan` is used by `outbox purge` (once, by an operator or cron) and by
the runners, which schedule it by themselves: the standalone worker from its loop's
tick (on a thread of its own, so deliveries and lease extensions never wait for it),
and every Celery worker from its periodic `sweep`. At most one purge runs at a time
across all of them (an advisory lock; a runner that finds it taken skips its turn).
Every delete is one short transaction of at most `batch` rows.

What is purged, and what never is:

- `effects`: delivered or cancelled effects finished more than the window ago (their
  attempts go by cascade). Never pending, in-flight, failed (dead letters) or parked
  (`needs_review`) ones, however old.
- `idempotency_keys`: completed keys past their own `expires_at` (the retention the
  application gave the guard). Never a `processing` claim, however old.
- `inbox`: processed events received more than the window ago; never unprocessed ones.
- `inbox_conflicts`: conflicting copies received more than the window ago.
- `entity_versions`: versions of entities that have not moved for the window.

Inbox, conflict and version rows an open ingestion holds are skipped, not waited for.

A window for the inbox, its conflicts or the versions that is shorter than a declared
sender's redelivery horizon is refused (`RetentionTooShort`) before anything is
deleted: a redelivery arriving after its event was purged would be processed twice.

Configuration (the runners read it at start; `outbox purge` takes arguments and
honours the same horizons):

    OUTBOX_RETENTION=off           no scheduled purge at all (default: on)
    OUTBOX_RETAIN_EFFECTS=30d      finished effects (+ attempts); `off` keeps them
    OUTBOX_RETAIN_KEYS=on          expired completed keys; `off` keeps them
    OUTBOX_RETAIN_INBOX=30d        processed inbox events; `off`
    OUTBOX_RETAIN_CONFLICTS=30d    conflicting inbox copies; `off`
    OUTBOX_RETAIN_VERSIONS=30d     entity versions; `off`
    OUTBOX_RETAIN_HORIZONS=stripe=3d,github=1d   senders' redelivery horizons
    OUTBOX_RETENTION_INTERVAL=10m  between two runs of one process (first: within 1 min)
    OUTBOX_RETENTION_BUDGET=5m     the longest one run lasts, rests included (the rest:
                                   next run; at the default duty ~9 s of deleting, about
                                   400k finished effects on a slow 2-core box)
    OUTBOX_RETENTION_BATCH=500     rows per delete transaction
    OUTBOX_RETENTION_DUTY=0.03     the share of wall time a run spends deleting: after
                                   a batch that took t, it rests t * (1 - duty) / duty,
                                   so the dispatcher's claims keep their p99 while a
                                   million rows go (docs/benchmarks.md, "Retention beside
                                   the claims"); raise it when finished effects arrive
                                   faster than the defaults purge them (~700 a second)

Why on by default: the security review found rows nobody ever deleted (1 MB conflict
copies, versions, attempts) because purging was a command someone had to remember to
schedule. The defaults only delete what is finished and far older than any common
sender's redelivery horizon (Stripe retries for 3 days, Svix for about 28 hours);
dead letters and anything still in progress are never touched. See SECURITY.md.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta

from sqlalchemy import Connection, Engine

from outbox._idempotency import Clock, database_clock
from outbox._inbox import check_retention
from outbox.errors import ConfigurationError
from outbox.sql import effects as fx
from outbox.sql import inbox as ix
from outbox.sql import keys as kx
from outbox.sql import retention as lock

log = logging.getLogger("outbox.retention")

DAY = 86400.0
DEFAULT_WINDOW = 30 * DAY
DEFAULT_INTERVAL = 600.0
DEFAULT_BUDGET = 300.0
DEFAULT_BATCH = 500
DEFAULT_DUTY = 0.03
FIRST_RUN_MAX_DELAY = 60.0

#: The classes, in the order a run purges them, as `outbox purge` reports them.
CLASSES = ("effects", "idempotency_keys", "inbox", "inbox_conflicts", "entity_versions")

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)?\s*$")
_UNITS = {None: 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_OFF = ("off", "none", "never", "false", "no", "0")
_ON = ("on", "true", "yes", "1")


def parse_duration(text: str) -> float:
    """`90`, `90s`, `15m`, `24h`, `7d`, `2w` -> seconds (ConfigurationError otherwise)."""
    match = _DURATION.match(text)
    if not match:
        raise ConfigurationError(f"not a duration: {text!r} (use e.g. 90s, 15m, 24h, 7d)")
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse_horizons(text: str) -> dict[str, float]:
    """`stripe=3d,github=1d` -> {"stripe": 259200.0, "github": 86400.0}."""
    out: dict[str, float] = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        source, _, value = item.partition("=")
        if not source.strip() or not value.strip():
            raise ConfigurationError(f"a horizon is SOURCE=DURATION, not {item!r}")
        out[source.strip()] = max(out.get(source.strip(), 0.0), parse_duration(value))
    return out


def horizons_from_env(environ: Mapping[str, str] | None = None) -> dict[str, float]:
    """The senders' redelivery horizons declared in `OUTBOX_RETAIN_HORIZONS`."""
    env = os.environ if environ is None else environ
    return parse_horizons(env.get("OUTBOX_RETAIN_HORIZONS", ""))


def _window(env: Mapping[str, str], name: str, default: float) -> float | None:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    if raw.strip().lower() in _OFF:
        return None
    return parse_duration(raw)


def _switch(env: Mapping[str, str], name: str) -> bool:
    raw = (env.get(name) or "on").strip().lower()
    if raw in _ON:
        return True
    if raw in _OFF:
        return False
    raise ConfigurationError(f"{name} is on or off, not {raw!r}")


def _seconds(value: float | timedelta | None) -> float | None:
    return value.total_seconds() if isinstance(value, timedelta) else value


@dataclass(frozen=True, slots=True)
class RetentionRun:
    """What one run deleted, per class; `complete` False if it stopped early (budget,
    stop) and `locked_out` True if another purger held the lock (nothing deleted)."""

    deleted: dict[str, int] = field(default_factory=dict)
    complete: bool = True
    locked_out: bool = False
    versions_after: tuple[str, str] | None = None  # where an unfinished walk stopped


@dataclass(frozen=True, slots=True)
class RetentionPlan:
    """Windows in seconds (None: that class is kept); see the module docstring."""

    effects: float | None = DEFAULT_WINDOW
    keys: bool = True
    inbox: float | None = DEFAULT_WINDOW
    conflicts: float | None = DEFAULT_WINDOW
    versions: float | None = DEFAULT_WINDOW
    horizons: Mapping[str, float] = field(default_factory=dict)
    batch: int = DEFAULT_BATCH

    def __post_init__(self) -> None:
        for name in ("effects", "inbox", "conflicts", "versions"):
            value = _seconds(getattr(self, name))
            object.__setattr__(self, name, value)
            if value is not None and value < 0:
                raise ConfigurationError(f"the {name} retention must not be negative")
        object.__setattr__(self, "horizons", {
            s: float(_seconds(h) or 0.0) for s, h in self.horizons.items()})
        if self.batch < 1:
            raise ConfigurationError("the retention batch is at least 1 row")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RetentionPlan | None:
        """The plan `OUTBOX_RETAIN_*` describe (None when `OUTBOX_RETENTION=off`),
        checked against the declared horizons."""
        env = os.environ if environ is None else environ
        if not _switch(env, "OUTBOX_RETENTION"):
            return None
        batch = env.get("OUTBOX_RETENTION_BATCH", "").strip()
        try:
            size = int(batch) if batch else DEFAULT_BATCH
        except ValueError:
            raise ConfigurationError(f"OUTBOX_RETENTION_BATCH is a number, not {batch!r}"
                                     ) from None
        plan = cls(effects=_window(env, "OUTBOX_RETAIN_EFFECTS", DEFAULT_WINDOW),
                   keys=_switch(env, "OUTBOX_RETAIN_KEYS"),
                   inbox=_window(env, "OUTBOX_RETAIN_INBOX", DEFAULT_WINDOW),
                   conflicts=_window(env, "OUTBOX_RETAIN_CONFLICTS", DEFAULT_WINDOW),
                   versions=_window(env, "OUTBOX_RETAIN_VERSIONS", DEFAULT_WINDOW),
                   horizons=horizons_from_env(env), batch=size)
        plan.check()
        return plan

    def check(self) -> None:
        """Refuse a window shorter than a declared redelivery horizon, before any
        delete: `RetentionTooShort` (a ConfigurationError)."""
        for what, window in (("inbox", self.inbox), ("inbox_conflicts", self.conflicts),
                             ("entity_versions", self.versions)):
            if window is not None:
                check_retention(what, window, self.batch, self.horizons)

    def describe(self) -> str:
        def w(value: float | None) -> str:
            return "kept" if value is None else f"{value / DAY:g}d" if value >= DAY \
                else f"{value:g}s"
        parts = [f"effects {w(self.effects)}",
                 f"keys {'at their expiry' if self.keys else 'kept'}",
                 f"inbox {w(self.inbox)}", f"conflicts {w(self.conflicts)}",
                 f"versions {w(self.versions)}"]
        if self.horizons:
            parts.append("horizons " + ",".join(
                f"{s}={h:g}s" for s, h in sorted(self.horizons.items())))
        return ", ".join(parts)

    def with_horizons(self, horizons: Mapping[str, float]) -> RetentionPlan:
        """This plan with more horizons (the longest per source wins)."""
        merged = dict(self.horizons)
        for source, h in horizons.items():
            merged[source] = max(merged.get(source, 0.0), float(h))
        return replace(self, horizons=merged)

    # -- running -----------------------------------------------------------------------

    def run(self, engine: Engine, *, budget: float | None = None,
            stop: Callable[[], bool] | None = None, pause: float = 0.0, duty: float = 1.0,
            wait_lock: float = 0.0, clock: Clock = database_clock,
            versions_after: tuple[str, str] | None = None,
            progress: Callable[[str, int], None] | None = None) -> RetentionRun:
        """Purge each class in batches, holding the purger lock; returns the counts.

        `budget`: seconds for the whole run, shared among the classes (one that
        finishes early leaves its time to the next). `stop()` is asked between
        batches. `wait_lock`: seconds to keep trying for the lock (0: one try).
        `versions_after`: resume the versions walk where an earlier run stopped.
        `duty` (0 < duty <= 1): after a batch that took t seconds, rest
        t * (1 - duty) / duty, so the run uses at most that share of a database core
        and the claims of a busy dispatcher do not queue behind it.
        """
        _check_duty(duty)
        self.check()
        end = None if budget is None else time.monotonic() + budget
        stopped = stop or (lambda: False)
        with engine.connect() as conn:
            if not self._lock(conn, wait_lock, stopped):
                return RetentionRun(complete=False, locked_out=True,
                                    versions_after=versions_after)
            try:
                return self._run_locked(conn, end, stopped, pause, duty, clock,
                                        versions_after, progress)
            finally:
                _unlock(conn)

    @staticmethod
    def _lock(conn: Connection, wait: float, stopped: Callable[[], bool]) -> bool:
        give_up = time.monotonic() + wait
        while True:
            got = lock.try_lock_purger(conn)
            conn.commit()  # a session-level lock outlives the transaction
            if got:
                return True
            if time.monotonic() >= give_up or stopped():
                return False
            time.sleep(0.2)

    def _steps(self, clock: Clock, cursor: list[tuple[str, str] | None]
               ) -> list[tuple[str, Callable[[Connection], tuple[int, bool]]]]:
        batch = self.batch
        steps: list[tuple[str, Callable[[Connection], tuple[int, bool]]]] = []

        def full(n: int) -> tuple[int, bool]:
            return n, n < batch

        effects, inbox, conflicts = self.effects, self.inbox, self.conflicts
        if effects is not None:
            steps.append(("effects", lambda c: full(
                fx.purge_finished_effects(c, effects, batch, now=clock()))))
        if self.keys:
            steps.append(("idempotency_keys", lambda c: full(
                kx.purge_expired_keys(batch, now=clock()).run(c))))
        if inbox is not None:
            steps.append(("inbox", lambda c: full(
                ix.purge_processed_events(c, inbox, batch, now=clock()))))
        if conflicts is not None:
            steps.append(("inbox_conflicts", lambda c: full(
                ix.purge_conflicts(c, conflicts, batch, now=clock()))))
        versions = self.versions
        if versions is not None:
            def walk(c: Connection) -> tuple[int, bool]:
                deleted, after = ix.purge_versions(c, versions, batch,
                                                   cursor[0] or ("", ""), now=clock())
                cursor[0] = after
                return deleted, after is None
            steps.append(("entity_versions", walk))
        return steps

    def _run_locked(self, conn: Connection, end: float | None, stopped: Callable[[], bool],
                    pause: float, duty: float, clock: Clock,
                    versions_after: tuple[str, str] | None,
                    progress: Callable[[str, int], None] | None) -> RetentionRun:
        cursor: list[tuple[str, str] | None] = [versions_after]
        steps = self._steps(clock, cursor)
        deleted = {name: 0 for name, _ in steps}
        # Passes over the classes not yet done, each class getting an even quantum of
        # what is left of the budget at the pass's start: time a class leaves unused
        # (most have little to delete) goes to the next pass, so a busy class (the
        # effects) gets most of the budget rather than its first share alone.
        todo = steps
        while todo:
            unfinished: list[tuple[str, Callable[[Connection], tuple[int, bool]]]] = []
            # The pass's quantum is fixed at its start: a class that leaves part of its
            # quantum unused does not hand it to the next class of the same pass (the
            # last, the versions walk, could take it all), but to the next pass.
            quantum = None if end is None else max(0.0, end - time.monotonic()) / len(todo)
            for name, step in todo:
                share = None if end is None or quantum is None else \
                    min(time.monotonic() + quantum, end)
                while True:
                    if stopped():
                        return RetentionRun(deleted, complete=False,
                                            versions_after=cursor[0])
                    began = time.monotonic()
                    with conn.begin():
                        n, done = step(conn)
                    rest = pause + (time.monotonic() - began) * (1 - duty) / duty
                    deleted[name] += n
                    if progress is not None and n:
                        progress(name, deleted[name])
                    if done:
                        break
                    if share is not None and time.monotonic() >= share:
                        unfinished.append((name, step))  # more in the next pass
                        break
                    if share is not None:  # never past this class's share of the budget
                        rest = min(rest, max(0.0, share - time.monotonic()))
                    _rest(rest, stopped)
            if not unfinished or end is None or time.monotonic() >= end:
                if unfinished:  # the rest next run
                    return RetentionRun(deleted, complete=False, versions_after=cursor[0])
                break
            todo = unfinished
        cursor[0] = None
        return RetentionRun(deleted, complete=True, versions_after=cursor[0])


def _check_duty(duty: float) -> float:
    if not 0 < duty <= 1:
        raise ConfigurationError(f"the retention duty (OUTBOX_RETENTION_DUTY, --duty) is in "
                                 f"(0, 1], not {duty:g}")
    return duty


def _rest(seconds: float, stopped: Callable[[], bool]) -> None:
    """Sleep between batches, a fifth of a second at a time so a stop is heard."""
    until = time.monotonic() + seconds
    while not stopped():
        left = until - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.2))


def _unlock(conn: Connection) -> None:
    try:
        if conn.in_transaction():
            conn.rollback()
        lock.unlock_purger(conn)
        conn.commit()
    except Exception:  # the session goes, and its lock with it
        log.warning("could not release the purger lock; dropping the connection")
        conn.invalidate()


# -- scheduling ----------------------------------------------------------------------


class ScheduledRetention:
    """A plan run every `interval` seconds by a runner (worker tick, Celery sweep).

    Each call of `run_if_due` / `start_if_due` is cheap when nothing is due. The first
    run comes `min(interval, 60 s)` after start, so a restart loop does not purge on
    every start; a run that finds the lock taken (another process is purging) waits
    for the next interval.
    """

    def __init__(self, plan: RetentionPlan | None, *, interval: float = DEFAULT_INTERVAL,
                 budget: float = DEFAULT_BUDGET, duty: float = DEFAULT_DUTY,
                 clock: Clock = database_clock) -> None:
        if interval <= 0 or budget <= 0:
            raise ConfigurationError("the retention interval and budget must be positive")
        self.duty = _check_duty(duty)
        self.plan = plan
        self.interval = interval
        self.budget = budget
        self.clock = clock
        self._next = time.monotonic() + min(interval, FIRST_RUN_MAX_DELAY)
        self._versions_after: tuple[str, str] | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.last: RetentionRun | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ScheduledRetention:
        """From `OUTBOX_RETENTION*` / `OUTBOX_RETAIN_*`; a bad value (or a window below
        a declared horizon) is a ConfigurationError."""
        env = os.environ if environ is None else environ
        plan = RetentionPlan.from_env(env)
        interval = parse_duration(env.get("OUTBOX_RETENTION_INTERVAL") or "600")
        budget = parse_duration(env.get("OUTBOX_RETENTION_BUDGET") or str(DEFAULT_BUDGET))
        raw = (env.get("OUTBOX_RETENTION_DUTY") or "").strip()
        try:
            duty = float(raw) if raw else DEFAULT_DUTY
        except ValueError:
            raise ConfigurationError(f"OUTBOX_RETENTION_DUTY is a number in (0, 1], not "
                                     f"{raw!r}") from None
        return cls(plan, interval=interval, budget=budget, duty=duty)

    @property
    def enabled(self) -> bool:
        return self.plan is not None

    def _take_turn(self) -> bool:
        with self._lock:
            now = time.monotonic()
            if self.plan is None or now < self._next:
                return False
            if self._thread is not None and self._thread.is_alive():
                return False
            self._next = now + self.interval
            return True

    def run_if_due(self, engine: Engine, stop: Callable[[], bool] | None = None, *,
                   budget: float | None = None) -> RetentionRun | None:
        """Run the plan here if it is due (the Celery sweep); never raises. `budget`
        caps this run's (a sweep task must not hold its worker process for long)."""
        if not self._take_turn():
            return None
        return self._run(engine, stop, budget)

    def start_if_due(self, engine: Engine, stop: threading.Event) -> bool:
        """Run the plan on a daemon thread if it is due (the worker's tick)."""
        if not self._take_turn():
            return False
        thread = threading.Thread(target=self._run, args=(engine, stop.is_set),
                                  name="outbox-retention", daemon=True)
        self._thread = thread
        thread.start()
        return True

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self, engine: Engine, stop: Callable[[], bool] | None,
             budget: float | None = None) -> RetentionRun | None:
        assert self.plan is not None
        try:
            run = self.plan.run(engine, budget=self.budget if budget is None
                                else min(self.budget, budget),
                                stop=stop, clock=self.clock,
                                duty=self.duty, versions_after=self._versions_after)
        except Exception:
            log.exception("retention run failed; next try in %.0f s", self.interval)
            return None
        self._versions_after = run.versions_after
        self.last = run
        if run.locked_out:
            log.debug("retention: another process is purging; skipped")
        elif any(run.deleted.values()):
            log.info("retention: purged %s%s", _counts(run.deleted),
                     "" if run.complete else " (more next run)")
        return run


def _counts(deleted: Mapping[str, int]) -> str:
    return ", ".join(f"{n} {name}" for name, n in deleted.items() if n)


_scheduled: dict[tuple[int, str], ScheduledRetention] = {}
_scheduled_lock = threading.Lock()


def scheduled_retention(database: str = "") -> ScheduledRetention:
    """This process's schedule from the environment (one per pid: safe after a fork),
    and per `database` when one process serves several (each is purged on its own
    schedule, under its own database's purger lock).

    A bad configuration is logged as an ERROR and disables the schedule here (the
    Celery sweep must go on ringing); the standalone worker builds its own with
    `ScheduledRetention.from_env()` and refuses to start instead.
    """
    key = (os.getpid(), database)
    with _scheduled_lock:
        found = _scheduled.get(key)
        if found is None:
            try:
                found = ScheduledRetention.from_env()
            except ConfigurationError as exc:
                log.error("retention disabled: %s", exc)
                found = ScheduledRetention(None)
            else:
                log.info("retention: %s", found.plan.describe() if found.plan else "off")
            _scheduled[key] = found
        return found

