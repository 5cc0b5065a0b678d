"""The `outbox` command: migrate, worker, status, list, trace, retry, cancel, purge,
demo, ui.

It lives in `dispatcher` because `outbox worker` runs the dispatcher, and the
`outbox` package must not import `dispatcher`. Errors are one line on stderr.

Exit codes (scripts may rely on them):

- 0: ok (a filter that matches nothing is ok too: there was nothing to do);
- 1: operational failure: the database is unreachable, an invariant failed, the schema
  is behind (`migrate --check`) or missing (`status`: run `outbox migrate`), or none
  of the given effects could be retried/cancelled in their current status;
- 2: usage: bad arguments or configuration;
- 3: not found: no effect with the given id or key (`trace`, `retry`/`cancel` by ids).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from outbox._config import make_engine
from outbox.errors import ConfigurationError, OutboxError

STATUSES = ("pending", "in_flight", "delivered", "failed", "cancelled", "needs_review")


EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_NOT_FOUND = 0, 1, 2, 3


class UsageError(OutboxError):
    """Bad arguments: exit code 2."""


class NotFound(OutboxError):
    """No effect with that id or key: exit code 3."""


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pg-outbox")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def parse_duration(text: str) -> float:
    """`90`, `90s`, `15m`, `24h`, `7d`, `2w` -> seconds (outbox.retention's grammar)."""
    from outbox.retention import parse_duration as parse

    try:
        return parse(text)
    except ConfigurationError as exc:
        raise UsageError(str(exc)) from None


def _engine(name: str) -> Engine:
    return make_engine(application_name=f"outbox-{name}", pool_size=4, max_overflow=4)


def schema_revisions(engine: Engine) -> tuple[str | None, str | None]:
    """(the database's Alembic revision, None when unmigrated; the package's head)."""
    from alembic.script import ScriptDirectory

    from outbox import _migrate

    head = ScriptDirectory.from_config(_migrate.alembic_config()).get_current_head()
    with engine.connect() as conn:
        return _migrate.current(conn), head


def cmd_migrate(args: argparse.Namespace) -> int:
    """Upgrade to head; `--check` only compares (exit 1 when behind), `--current` only
    prints the database's revision."""
    from outbox import _migrate
    from outbox._config import database_url

    if args.check or args.current:
        current, head = schema_revisions(_engine("migrate"))
        if args.current:
            print(current or "none")
            return EXIT_OK
        print(f"current {current or 'none (not migrated)'}, head {head}")
        if current != head:
            print("outbox: the schema is behind: run `outbox migrate`", file=sys.stderr)
            return EXIT_FAILURE
        return EXIT_OK
    url = database_url()
    _migrate.upgrade(url)
    print("migrated to head", file=sys.stderr)
    return 0


def status_snapshot(engine: Engine) -> dict[str, Any]:
    """What `outbox status --json` prints: counts by status first, then health."""
    from outbox.sql import effects as fx
    from outbox.sql import health as hx
    from outbox.sql import keys as kx
    from outbox.sql import watch as wx

    with engine.connect() as conn:
        counts = fx.count_effects(conn)
        health = fx.effect_health(conn)
        blocked = fx.blocked_ordering_keys(conn)
        key_counts = kx.count_keys().run(conn)  # each claim carries its TTL
        horizon = hx.xmin_horizon().run(conn)
        watching = wx.watchers().run(conn)
        stuck = wx.stuck_slots().run(conn)
    out: dict[str, Any] = {s: counts.get(s, 0) for s in STATUSES}
    out.update(health)
    out["idempotency_keys"] = key_counts
    out["blocked_ordering_keys"] = [
        {"ordering_key": r.ordering_key, "head_id": r.id, "status": r.status,
         "attempts": r.attempts, "last_error": _redacted(r.last_error)} for r in blocked]
    out["xmin_horizon"] = {k: {"holders": h.holders, "xid_age": h.xid_age,
                               "seconds": h.seconds} for k, h in horizon.items()}
    out["idle_in_transaction_session_timeout"] = _others_idle_timeout(engine)
    # Workers keeping watch (dispatcher/watch.py): their queues' enqueues skip the NOTIFY.
    out["watchers"] = [{"queue": w.label, "pid": w.pid, "slot": w.slot,
                        "application_name": w.application_name} for w in watching]
    out["watch_slots_stuck"] = [{"pid": x.pid, "slot": x.slot, "queue": f"#{x.queue_hash}",
                                 "application_name": x.application_name} for x in stuck]
    return out


#: `outbox status` warns when a transaction has held the xmin horizon this long (s).
HORIZON_WARN_SECONDS = 300.0


def _others_idle_timeout(engine: Engine) -> str | None:
    """`idle_in_transaction_session_timeout` as another client of this database gets it
    (the server's, database's and role's settings; ours is set per session by
    make_engine, so our engine cannot tell). None if a plain connection fails."""
    import psycopg

    from outbox._config import libpq_dsn
    from outbox.sql import health as hx

    try:
        dsn = libpq_dsn(engine.url.render_as_string(hide_password=False))
        with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as plain:
            value: str | None = hx.idle_in_transaction_timeout().run(plain)
    except psycopg.Error:
        return None
    return value


def _status_warnings(snap: dict[str, Any], database: str | None) -> list[str]:
    """What `outbox status` warns an operator of: the xmin horizon (docs/observability.md,
    "A held xmin horizon") and a watch slot a cancelled enqueue left held (ops/runbook.md,
    "Workers keeping watch")."""
    out = []
    for kind, h in snap["xmin_horizon"].items():
        if h["seconds"] is not None and h["seconds"] >= HORIZON_WARN_SECONDS:
            out.append(f"a {kind.replace('_', ' ')} has held the xmin horizon for "
                       f"{h['seconds']:.0f} s: VACUUM cannot remove the rows delivered since;"
                       " find it in pg_stat_activity (oldest xact_start) and end it")
        elif h["seconds"] is None and h["xid_age"] >= 1_000_000:
            out.append(f"a {kind.replace('_', ' ')} holds the xmin horizon "
                       f"{h['xid_age']} transactions back")
    for x in snap["watch_slots_stuck"]:
        out.append(f"session {x['pid']} ({x['application_name'] or 'no name'}) holds watch "
                   f"slot {x['slot']} of queue {x['queue']} while idle (an enqueue cancelled "
                   "mid-ring left it): that queue's watchers have one slot fewer until the "
                   f"session ends (SELECT pg_terminate_backend({x['pid']}), or let the "
                   "pool recycle it)")
    if snap["idle_in_transaction_session_timeout"] in ("0", "0ms"):
        out.append("idle_in_transaction_session_timeout is 0 for other clients of this "
                   "database: a session left idle in a transaction holds the xmin horizon "
                   "without limit; set one, e.g. ALTER DATABASE "
                   f"{database or '<db>'} SET idle_in_transaction_session_timeout = '5min'")
    return out


def cmd_status(args: argparse.Namespace) -> int:
    """DATABASE_URL's outbox; or, with `--database` (or OUTBOX_DATABASES), each of those
    in turn, as `outbox worker` serves them: one block (or JSON object) per database, and
    exit 1 if one could not be read (the others are still shown)."""
    from dispatcher.databases import databases_from

    specs = databases_from(args.database, os.environ)
    if specs is None:
        snap = _status_of(_engine("status"))
        if args.json:
            print(json.dumps(snap))
        else:
            _print_status(snap)
        return 0
    out: dict[str, Any] = {}
    failed = False
    for spec in specs:
        engine = make_engine(spec.url, application_name="outbox-status", pool_size=2,
                             max_overflow=0)
        try:
            out[spec.name] = _status_of(engine, spec.name)
        except (OutboxError, DBAPIError) as exc:
            failed = True
            reason = str(getattr(exc, "orig", None) or exc).splitlines()[0][:200]
            out[spec.name] = {"error": reason}
            print(f"outbox: {spec.name}: {reason}", file=sys.stderr)
        finally:
            engine.dispose()
    if args.json:
        print(json.dumps({"databases": out}))
    else:
        for spec in specs:
            print(f"== {spec.name} ({spec.shown})")
            if "error" in out[spec.name]:
                print(f"  unreadable: {out[spec.name]['error']}")
            else:
                _print_status(out[spec.name])
    return 1 if failed else 0


def _status_of(engine: Engine, name: str | None = None) -> dict[str, Any]:
    """One database's snapshot; its warnings (schema, horizon) go to stderr."""
    prefix = f"{name}: " if name else ""
    current, head = schema_revisions(engine)
    if current is None:
        raise OutboxError(f"{prefix}this database has no outbox schema: run `outbox migrate`")
    if current != head:
        print(f"outbox: warning: {prefix}the schema is at {current}, the code expects "
              f"{head}: run `outbox migrate`", file=sys.stderr)
    snap = status_snapshot(engine)
    for warning in _status_warnings(snap, engine.url.database):
        print(f"outbox: warning: {prefix}{warning}", file=sys.stderr)
    return snap


def _print_status(snap: dict[str, Any]) -> None:
    print("effects")
    for s in STATUSES:
        print(f"  {s:<13}{snap[s]:>10}")
    print(f"  due now      {snap['due']:>10}   oldest due {snap['oldest_due_age_seconds']:.1f}s"
          f"   expired leases {snap['expired_leases']}")
    keys = snap["idempotency_keys"]
    print(f"idempotency keys  processing {keys['processing']}  completed {keys['completed']}"
          f"  stale {keys['stale_processing']}")
    held = [f"{k.replace('_', ' ')} {h['seconds']:.1f}s, {h['xid_age']} transactions"
            if h["seconds"] is not None else f"{k.replace('_', ' ')} {h['xid_age']} transactions"
            for k, h in snap["xmin_horizon"].items()]
    print(f"xmin horizon      {'held by ' + '; '.join(held) if held else 'not held'}"
          f"   (others' idle_in_transaction_session_timeout: "
          f"{snap['idle_in_transaction_session_timeout']})")
    print(f"watched queues    {_watched(snap['watchers'])}")
    if snap["blocked_ordering_keys"]:
        print("blocked ordering keys (head effect)")
        for b in snap["blocked_ordering_keys"]:
            print(f"  {b['ordering_key']}: #{b['head_id']} {b['status']} "
                  f"after {b['attempts']} attempts: {b['last_error'] or ''}")


def _watched(watchers: list[dict[str, Any]]) -> str:
    """The status line of the workers keeping watch, by queue."""
    if not watchers:
        return "none: every enqueue rings its queue's doorbell"
    pids: dict[str, list[str]] = {}
    for w in watchers:
        pids.setdefault(w["queue"], []).append(str(w["pid"]))
    kept = ", ".join(f"{queue} (pid{'s' if len(p) > 1 else ''} {', '.join(p)})"
                     for queue, p in pids.items())
    return f"{kept}: their enqueues skip the NOTIFY while a busy worker claims every 2 ms"


def _redacted(text: str | None) -> str | None:
    """Stored error text as shown: credentials a URL carried are never printed (rows
    written before the handler stopped storing them included)."""
    from outbox._redact import redact_secrets

    return None if text is None else redact_secrets(text)


def cmd_trace(args: argparse.Namespace) -> int:
    """An effect and its attempts. Payloads and receivers' replies are masked by the
    console's rules (`OUTBOX_UI_MASK`, outbox/masking.py); errors are redacted."""
    from outbox.masking import mask_from_env
    from outbox.sql import effects as fx

    mask = mask_from_env()
    engine = _engine("trace")
    with engine.connect() as conn:
        row = fx.get_effect(conn, args.id)
        if row is None:
            raise NotFound(f"no effect with id or key {args.id!r}")
        attempts = fx.attempts_of(conn, row.id)
    shown = {"payload", "result"}  # masked
    texts = {"last_error", "error"}  # redacted
    effect = {k: (v.isoformat() if hasattr(v, "isoformat") else
                  str(v) if k == "lease_token" and v is not None else
                  mask.apply(v) if k in shown else _redacted(v) if k in texts else v)
              for k, v in row._mapping.items()}
    history = [{k: (v.isoformat() if hasattr(v, "isoformat") else
                    mask.apply(v) if k in shown else _redacted(v) if k in texts else v)
                for k, v in a._mapping.items()} for a in attempts]
    if args.json:
        print(json.dumps({"effect": effect, "attempts": history}, default=str,
                         ensure_ascii=False))
        return 0
    print(f"effect #{row.id} {row.kind} key={row.effect_key}")
    print(f"  status {row.status}, attempts {row.attempts}/{row.max_attempts}, "
          f"created {row.created_at:%Y-%m-%d %H:%M:%S}, available {row.available_at:%H:%M:%S}")
    tp = (row.headers or {}).get("traceparent")
    if tp:
        print(f"  trace {tp.split('-')[1]} (enqueued in traceparent {tp})")
    print(f"  payload: {json.dumps(effect['payload'], ensure_ascii=False, default=str)}")
    if row.last_error:
        print(f"  last error: {effect['last_error']}")
    for a, shown_a in zip(attempts, history, strict=True):
        took = (a.finished_at - a.started_at).total_seconds()
        print(f"  attempt {a.attempt}: {a.outcome:<10} {a.http_status or '':<4} {took:7.3f}s "
              f"by {a.worker} trace={a.trace_id or '-'} {shown_a.get('error') or ''}")
    return 0


def _ids(values: Sequence[str]) -> list[int]:
    try:
        return [int(v) for v in values]
    except ValueError:
        raise UsageError("effect ids are integers") from None


def _effect_filter(args: argparse.Namespace, statuses: Sequence[str] = ()) -> Any:
    """The console's EffectFilter from `--status/--kind/--queue/--older-than/--newer-than`;
    None when no filter was given."""
    from outbox.sql.console import EffectFilter

    older = parse_duration(args.older_than) if args.older_than else None
    newer = parse_duration(args.newer_than) if args.newer_than else None
    chosen = tuple(dict.fromkeys(getattr(args, "status", None) or statuses))
    if not (getattr(args, "status", None) or args.kind or args.queue or older is not None
            or newer is not None):
        return None
    return EffectFilter(statuses=chosen, kind=args.kind, queue=args.queue,
                        older_than=older, newer_than=newer)


def _missing(conn: Any, ids: Sequence[int]) -> list[int]:
    from outbox.sql import effects as fx

    return [i for i in ids if fx.get_effect(conn, str(i)) is None]


def _by_ids(name: str, ids: list[int], dry_run: bool, allowed: Sequence[str],
            act: Any) -> int:
    """retry/cancel by ids: 3 when none exists, 1 when none is in a status it acts on."""
    engine = _engine(name)
    with engine.begin() as conn:
        missing = _missing(conn, ids)
        if len(missing) == len(ids):
            raise NotFound(f"no effect with id {', '.join(map(str, missing))}")
        if dry_run:
            from outbox.sql import effects as fx

            rows = [fx.get_effect(conn, str(i)) for i in ids if i not in missing]
            done = [r.id for r in rows if r is not None and r.status in allowed]
        else:
            done = act(conn, ids)
    verb = {"retry": "requeued", "cancel": "cancelled"}[name]
    print(f"{'would have ' if dry_run else ''}{verb} {len(done)} effects"
          + (f": {done[:20]}" if done else ""))
    if missing:
        print(f"outbox: warning: no effect with id {', '.join(map(str, missing))}",
              file=sys.stderr)
    return EXIT_OK if done else EXIT_FAILURE


def _by_filter(name: str, f: Any, *, dry_run: bool, limit: int, batch: int,
               count: Any, act: Any) -> int:
    """retry/cancel by filter: count (up to `limit`) and fence the set at its highest id,
    then act in batches of fenced statements. A match of nothing is not an error."""
    engine = _engine(name)
    with engine.connect() as conn:
        n, max_id = count(conn, f, cap=limit)
    verb = {"retry": "requeued", "cancel": "cancelled"}[name]
    if dry_run or not n or max_id is None:
        print(f"{'would have ' if dry_run else ''}{verb} {n} effects"
              + (f" (the first {limit} matching; --limit)" if n >= limit else ""))
        return EXIT_OK
    done: list[int] = []
    while len(done) < n:
        with engine.begin() as conn:
            step = act(conn, f, max_id=max_id, limit=min(batch, n - len(done)))
        if not step:
            break  # the rest changed status meanwhile (the fence left them alone)
        done.extend(step)
    print(f"{verb} {len(done)} effects" + (f": {done[:20]}" if done else ""))
    return EXIT_OK


def cmd_retry(args: argparse.Namespace) -> int:
    """By ids (failed, parked or cancelled effects), `--failed` (every dead letter), or
    by filter (dead letters only, like the console's redrive: a parked effect may have
    been applied, so it is retried by id, after a look)."""
    from outbox.sql import console as cx
    from outbox.sql import effects as fx

    f = _effect_filter(args, statuses=("failed",))
    if f is not None and f.statuses != ("failed",):
        raise UsageError("retry by filter takes dead letters only (--status failed); "
                         "retry parked or cancelled effects by id")
    if args.ids and (f is not None or args.failed):
        raise UsageError("give effect ids, or --failed, or filters, not several")
    if args.ids:
        return _by_ids("retry", _ids(args.ids), args.dry_run,
                       ("failed", "needs_review", "cancelled"),
                       lambda conn, ids: fx.requeue(conn, ids))
    if f is None and not args.failed:
        raise UsageError("give effect ids, --failed, or a filter "
                         "(--kind, --queue, --older-than, --newer-than)")
    f = f or cx.EffectFilter(statuses=("failed",))
    return _by_filter("retry", f, dry_run=args.dry_run, limit=args.limit, batch=args.batch,
                      count=cx.count_redrivable, act=cx.redrive_dead_letters)


def cmd_cancel(args: argparse.Namespace) -> int:
    """By ids or by filter; never an in-flight effect (it may already be applied)."""
    from outbox.sql import effects as fx

    f = _effect_filter(args)
    if args.ids and f is not None:
        raise UsageError("give effect ids or filters, not both")
    if args.ids:
        return _by_ids("cancel", _ids(args.ids), args.dry_run, fx.CANCELLABLE,
                       lambda conn, ids: fx.cancel(conn, ids))
    if f is None:
        raise UsageError("give effect ids or a filter (--status, --kind, --queue, "
                         "--older-than, --newer-than)")
    bad = [s for s in f.statuses if s not in fx.CANCELLABLE]
    if bad:
        raise UsageError(f"cannot cancel {', '.join(bad)} effects; "
                         f"cancellable: {', '.join(fx.CANCELLABLE)}")
    return _by_filter("cancel", f, dry_run=args.dry_run, limit=args.limit,
                      batch=args.batch, count=fx.count_cancellable, act=fx.cancel_matching)


def cmd_list(args: argparse.Namespace) -> int:
    """Effects matching the filters, newest first (the console's list statement)."""
    from outbox.sql import console as cx

    f = _effect_filter(args) or cx.EffectFilter()
    with _engine("list").connect() as conn:
        rows = cx.list_effects(conn, f, limit=args.limit)
    if args.json:
        for r in rows:
            # Not last_error: `outbox trace` shows it (redacted), a list does not.
            print(json.dumps({k: (v.isoformat() if hasattr(v, "isoformat") else v)
                              for k, v in r._mapping.items() if k != "last_error"},
                             default=str))
        return EXIT_OK
    for r in rows:
        print(f"#{r.id:<8} {r.status:<12} {r.kind:<20} {r.queue:<10} "
              f"attempts {r.attempts}/{r.max_attempts}  created {r.created_at:%Y-%m-%d %H:%M:%S}"
              f"  {r.effect_key}")
    print(f"{len(rows)} effects" + (f" (the newest {args.limit}; --limit)"
                                    if len(rows) == args.limit else ""), file=sys.stderr)
    return EXIT_OK


def _filter_arguments(parser: argparse.ArgumentParser, statuses: Sequence[str]) -> None:
    parser.add_argument("--status", action="append", choices=statuses,
                        help="repeatable; any of them")
    parser.add_argument("--kind", default=None, help="effect kind")
    parser.add_argument("--queue", default=None)
    parser.add_argument("--older-than", default=None, metavar="AGE",
                        help="created at least this long ago (e.g. 1h, 7d)")
    parser.add_argument("--newer-than", default=None, metavar="AGE",
                        help="created at most this long ago")


def _bulk_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="say what would change")
    parser.add_argument("--limit", type=int, default=10000,
                        help="act on at most this many matching effects (10000)")
    parser.add_argument("--batch", type=int, default=500,
                        help="effects per transaction (500)")


def cmd_purge(args: argparse.Namespace) -> int:
    """One run of the retention plan (outbox/retention.py) with these windows: finished
    effects and expired keys always, the inbox, conflicts and versions when asked.
    Horizons: `--horizon` and `OUTBOX_RETAIN_HORIZONS` (the longest per source)."""
    from outbox.retention import RetentionPlan, horizons_from_env

    older = parse_duration(args.older_than)
    horizons: dict[str, float] = {}
    for item in args.horizon or []:
        source, _, value = item.partition("=")
        if not source or not value:
            raise UsageError(f"--horizon takes SOURCE=DURATION, not {item!r}")
        horizons[source] = max(horizons.get(source, 0.0), parse_duration(value))
    windows = {what: parse_duration(value) for what, value in (
        ("inbox", args.inbox_older_than), ("conflicts", args.conflicts_older_than),
        ("versions", args.versions_older_than)) if value}
    plan = RetentionPlan(effects=older, keys=True, inbox=windows.get("inbox"),
                         conflicts=windows.get("conflicts"),
                         versions=windows.get("versions"),
                         batch=args.batch).with_horizons(horizons_from_env())
    plan = plan.with_horizons(horizons)
    plan.check()  # refuse a short window before deleting anything

    def progress(name: str, total: int) -> None:
        if name == "effects":
            print(f"\rpurged {total} effects", end="", file=sys.stderr)

    run = plan.run(_engine("purge"), wait_lock=args.wait_lock, duty=args.duty,
                   progress=progress)
    if run.locked_out:
        raise OutboxError(f"another purge (a worker's retention, or another `outbox "
                          f"purge`) held the lock for {args.wait_lock:g} s; try again")
    print(file=sys.stderr)
    print(json.dumps(run.deleted))
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    """DATABASE_URL's database; or, with `--database` (or OUTBOX_DATABASES), each of
    those from this one process, sharing `--concurrency` (dispatcher/fleet.py)."""
    from dispatcher._core import Dispatcher
    from dispatcher.databases import databases_from
    from dispatcher.handlers import load_registry
    from dispatcher.metrics import configure_metrics, register_queue_gauges
    from dispatcher.worker import run_worker
    from outbox._connections import DEFAULT_WORKER_CALL_TIMEOUT
    from outbox.telemetry_setup import configure

    if args.concurrency < 1:
        raise UsageError("--concurrency must be at least 1")
    specs = databases_from(args.database, os.environ)  # before any side effect
    configure("outbox-worker")
    configure_metrics("outbox-worker")
    # The worker logs at INFO; httpx would add a line per delivery (thousands a second
    # under load, CPU the deliveries need). Attempts are in outbox.attempt_history anyway.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    registry = load_registry(args.handlers)
    if specs is not None:
        from dispatcher.fleet import Settings, retry_max_from, serve

        serve(specs, registry, Settings(
            concurrency=args.concurrency, queue=args.queue, lease=args.lease,
            poll_interval=args.poll, grace=args.grace, full_scan_every=args.full_scan_every,
            application_name=args.name or "outbox-worker",
            retry_max=retry_max_from(os.environ)))
        return 0
    # No pre-ping: every dispatcher statement already retries on a dead connection
    # (dispatcher/_core.py _db_retry), and the ping costs a round trip per statement;
    # a pooled connection idle longer than the call timeout is still pinged. The call
    # timeout is the workers' own, tighter one (docs/network.md).
    engine = make_engine(application_name=args.name or "outbox-worker",
                         pool_size=3, max_overflow=2, pool_pre_ping=False,
                         call_timeout=DEFAULT_WORKER_CALL_TIMEOUT)
    # Metrics carry `db`, the database's name, as a worker serving several does.
    db = engine.url.database or "default"
    register_queue_gauges(engine, db=db)
    dispatcher = Dispatcher(engine, registry, queue=args.queue, concurrency=args.concurrency,
                            lease=args.lease, full_scan_every=args.full_scan_every,
                            metric_labels={"db": db})
    run_worker(dispatcher, poll_interval=args.poll, grace=args.grace,
               application_name=args.name or "outbox-worker")
    return 0


def cmd_example_api(args: argparse.Namespace) -> int:
    if args.framework == "django":  # the same routes and answers, in DRF (DESIGN §8)
        from dispatcher.examples.payments.django_app.serve import serve as serve_django

        serve_django(args.host, args.port)
        return 0
    from dispatcher.examples.payments.app import serve

    serve(args.host, args.port)
    return 0


def cmd_ui(args: argparse.Namespace) -> int:
    """The web console (outbox/console/): loopback only unless a token guards it."""
    import uvicorn

    from outbox.console import create_console_app
    from outbox.console._security import is_loopback_host

    token = args.token or os.environ.get("OUTBOX_UI_TOKEN") or None
    if not is_loopback_host(args.host) and not token:
        raise UsageError(f"refusing to serve the console on {args.host} without a token "
                         "(--token or OUTBOX_UI_TOKEN); the default is 127.0.0.1")
    if token is not None and len(token) < 16:
        print("outbox ui: warning: a token shorter than 16 characters is easy to guess",
              file=sys.stderr)
    app = create_console_app(_engine("ui"), token=token)
    shown = f"[{args.host}]" if ":" in args.host else args.host
    print(f"outbox ui: http://{shown}:{args.port}/" + ("  (token required)" if token else ""),
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Run a benchmark script from a source checkout; it prints JSON lines."""
    import subprocess
    from pathlib import Path

    script = Path.cwd() / "bench" / f"bench_{args.which}.py"
    if not script.exists():
        raise UsageError(f"{script} not found: run `outbox bench` from a source checkout")
    return subprocess.call([sys.executable, str(script), *args.rest])


def cmd_demo(args: argparse.Namespace) -> int:
    from dispatcher.examples.payments.demo import main as demo_main
    from outbox._config import EMBEDDED_ENV

    os.environ.setdefault(EMBEDDED_ENV, "1")  # the demo brings its own database

    return int(demo_main(args))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="outbox",
        description="Idempotency keys, transactional outbox and dispatcher for PostgreSQL. "
        "Uses $DATABASE_URL (the demo starts an embedded PostgreSQL in ./.outbox "
        "when it is unset; OUTBOX_EMBEDDED=1 makes every command do so).")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    p.add_argument("--version", action="version",
                   version=f"outbox (pg-outbox) {package_version()}")
    from outbox.retention import DEFAULT_DUTY

    sub = p.add_subparsers(dest="command", required=True)

    mg = sub.add_parser("migrate", help="apply the schema migrations")
    mg.add_argument("--check", action="store_true",
                    help="only compare with the head; exit 1 when the schema is behind")
    mg.add_argument("--current", action="store_true",
                    help="only print the database's revision ('none': not migrated)")
    mg.set_defaults(fn=cmd_migrate)

    w = sub.add_parser("worker", help="run the standalone dispatcher")
    w.add_argument("--concurrency", type=int, default=8,
                   help="deliveries in flight (8); with several databases, the total "
                        "they share")
    w.add_argument("--database", action="append", metavar="[NAME=]URL",
                   help="serve this outbox database (repeatable: one process, several "
                        "databases, each named NAME or by its database name in logs and "
                        "metrics); replaces $OUTBOX_DATABASES; without either, "
                        "$DATABASE_URL")
    w.add_argument("--queue", default="default")
    w.add_argument("--lease", type=float, default=30.0, help="lease seconds (30)")
    w.add_argument("--poll", type=float, default=1.0, help="poll interval seconds (1)")
    w.add_argument("--grace", type=float, default=10.0, help="shutdown grace seconds (10)")
    w.add_argument("--full-scan-every", type=float, default=2.0, metavar="SECONDS",
                   help="under a full backlog, claim from the head of the queue (not the "
                        "watermark) at least this often (2); 0: always")
    w.add_argument("--handlers", default=None,
                   help="module:registry (default $OUTBOX_HANDLERS or the payments example)")
    w.add_argument("--name", default=None, help="application_name for pg_stat_activity")
    w.set_defaults(fn=cmd_worker)

    s = sub.add_parser("status", help="effects by status, health, blocked keys")
    s.add_argument("--json", action="store_true")
    s.add_argument("--database", action="append", metavar="[NAME=]URL",
                   help="report this outbox database (repeatable, as for `worker`; "
                        "replaces $OUTBOX_DATABASES; without either, $DATABASE_URL)")
    s.set_defaults(fn=cmd_status)

    ls = sub.add_parser("list", help="effects by status, kind, queue and age, newest first")
    _filter_arguments(ls, STATUSES)
    ls.add_argument("--limit", type=int, default=50, help="at most this many (50)")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    ls.set_defaults(fn=cmd_list)

    t = sub.add_parser("trace", help="an effect and its attempts, by id or effect key")
    t.add_argument("id")
    t.add_argument("--json", action="store_true")
    t.set_defaults(fn=cmd_trace)

    r = sub.add_parser("retry", help="requeue failed/parked effects, by id or filter")
    r.add_argument("ids", nargs="*")
    r.add_argument("--failed", action="store_true", help="every dead-lettered effect")
    _filter_arguments(r, ("failed",))
    _bulk_arguments(r)
    r.set_defaults(fn=cmd_retry)

    c = sub.add_parser("cancel", help="cancel effects that are not in flight, by id or filter")
    c.add_argument("ids", nargs="*")
    _filter_arguments(c, STATUSES)
    _bulk_arguments(c)
    c.set_defaults(fn=cmd_cancel)

    pu = sub.add_parser("purge", help="delete old delivered effects and expired keys")
    pu.add_argument("--older-than", required=True, help="e.g. 7d")
    pu.add_argument("--batch", type=int, default=1000)
    pu.add_argument("--duty", type=float, default=DEFAULT_DUTY, metavar="SHARE",
                    help="the share of time spent deleting, in (0, 1]: after each batch "
                    f"rest so live claims keep their latency ({DEFAULT_DUTY:g}; 1: no rest)")
    pu.add_argument("--inbox-older-than", default=None,
                    help="also purge processed inbox events older than this (e.g. 14d)")
    pu.add_argument("--conflicts-older-than", default=None,
                    help="also purge conflicting inbox copies received before this (e.g. 30d)")
    pu.add_argument("--versions-older-than", default=None,
                    help="also purge entity versions that have not moved for this long "
                    "(e.g. 14d; see docs/ingestion.md)")
    pu.add_argument("--horizon", action="append", metavar="SOURCE=DURATION",
                    help="a source's redelivery horizon; a shorter inbox, conflicts or "
                    "versions retention is refused (also $OUTBOX_RETAIN_HORIZONS)")
    pu.add_argument("--wait-lock", type=float, default=60.0, metavar="SECONDS",
                    help="wait this long for a running purge (a worker's) to end (60)")
    pu.set_defaults(fn=cmd_purge)

    e = sub.add_parser("example-api", help="run the example payments service")
    e.add_argument("--host", default="127.0.0.1")
    e.add_argument("--port", type=int, default=8000)
    e.add_argument("--framework", choices=("fastapi", "django"),
                   default=os.environ.get("OUTBOX_EXAMPLE_FRAMEWORK") or "fastapi",
                   help="fastapi (default, or $OUTBOX_EXAMPLE_FRAMEWORK) or django (DRF)")
    e.set_defaults(fn=cmd_example_api)

    u = sub.add_parser("ui", help="the web console (loopback unless a token is given)")
    u.add_argument("--host", default="127.0.0.1",
                   help="bind address (127.0.0.1); any other needs a token")
    u.add_argument("--port", type=int, default=8080)
    u.add_argument("--token", default=None,
                   help="required on every request (default $OUTBOX_UI_TOKEN)")
    u.set_defaults(fn=cmd_ui)

    b = sub.add_parser("bench", help="run a benchmark (guard, dispatch, inbox); prints JSON")
    b.add_argument("which", choices=("guard", "dispatch", "inbox"))
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the script")
    b.set_defaults(fn=cmd_bench)

    d = sub.add_parser("demo", help="the whole promise, with crashes, in under a minute")
    d.add_argument("--short", action="store_true", help="a quick run (tests use it)")
    d.add_argument("--workers", type=int, default=None, help="dispatcher workers (3; short 2)")
    d.add_argument("--payments", type=int, default=None, help="distinct payments (150; short 40)")
    d.add_argument("--clients", type=int, default=None, help="clients per payment key (4)")
    d.add_argument("--json", action="store_true", help="end with the report as one JSON line")
    d.set_defaults(fn=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose or args.command == "worker" else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.fn(args))
    except NotFound as exc:
        print(f"outbox: not found: {exc}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except UsageError as exc:
        print(f"outbox: error: {exc}", file=sys.stderr)
        return 2
    except ConfigurationError as exc:
        print(f"outbox: configuration error: {exc}", file=sys.stderr)
        return 2
    except OutboxError as exc:
        print(f"outbox: error: {exc}", file=sys.stderr)
        return 1
    except DBAPIError as exc:
        first = str(exc.orig or exc).strip().splitlines()[0] if str(exc.orig or exc) else ""
        print(f"outbox: database error: {first}", file=sys.stderr)
        return 1
    except SQLAlchemyError as exc:
        print(f"outbox: database error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        if not os.environ.get("DATABASE_URL"):
            from outbox import _embedded

            _embedded.stop()


if __name__ == "__main__":
    sys.exit(main())
