#!/usr/bin/env python3
"""Held xmin horizon: one worker's throughput while a transaction holds the horizon.

    .venv/bin/python bench/bench_held_xmin.py                      # both variants, ~13 min
    .venv/bin/python bench/bench_held_xmin.py --variants watermark --hold 60 --interval 10

Issue 17. One `outbox worker` process (`run_worker` + `Dispatcher`, the engine
`outbox worker` makes; bench/bench_dispatch.py's Scratch database and helpers),
concurrency = max_batch = 100, a no-op handler, a prefilled backlog large enough not to
run dry. Timeline per variant:

  unheld   `--baseline` intervals of `--interval` seconds (after a short warm-up): the
           unheld rate of this run;
  held     another connection runs `BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT ...`
           on outbox.effects and stays idle in the transaction for `--hold` seconds
           (its snapshot holds the xmin horizon: no dead tuple of the table can be
           removed, and index scans cannot mark the entries they step over as dead);
  recovery the transaction is rolled back, `VACUUM outbox.effects` runs (timed, the
           worker still running), then `--recovery` intervals.

Variants: `watermark` (the default producer: the fresh scan resumes from the last row
claimed, a full scan at least every FULL_SCAN_EVERY seconds and whenever a claim comes
up short), `nowatermark` (`full_scan_every=0`: every claim scans from the head of the
pending index, the claim before issue 17) and `pgqueuer` (the peer, same timeline:
bench/peer_pgqueuer_held_xmin.py, run with the peer benchmark's venv, $PEER_BENCH,
default /tmp/peer-bench: a copy of ../shared/bench, see its README).

One JSON line per interval: effects/s (delivered outcomes the worker recorded in the
interval / its length), claim time (median, p90, max, milliseconds; timed in the worker
process around `Producer.claim`, one autocommitted statement and its round trip:
pg_stat_statements is not loaded on the test server), the full scans among them,
`n_dead_tup` of outbox.effects (pg_stat_user_tables), the pending index's size, the
holder's xmin age, CPU per role (bench_dispatch.CpuMonitor) and the load average. Then
one `"section": "summary"` line per variant: the unheld rate, the last held interval's
rate and their ratio (the target: >= 0.5 after 3 minutes held).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import bench_dispatch as bd  # noqa: E402
from benchlib import pct  # noqa: E402

DB = "bench_held_xmin"
bd.DB = DB  # bench_dispatch's Scratch and CpuMonitor name the scratch database by it
NOOP = bd.NOOP
emit, log = bd.emit, bd.log


# --------------------------------------------------------------------------- the worker


def worker_main(argv: Sequence[str]) -> int:
    """Child: one `outbox worker` loop; claims are timed; samples on command."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--full-scan-every", type=float, required=True)
    ap.add_argument("--batch", type=int, default=100)
    args = ap.parse_args(argv)

    import logging

    from dispatcher._core import Dispatcher
    from dispatcher.handlers import EffectContext, Registry
    from dispatcher.worker import run_worker
    from outbox._config import make_engine
    from outbox._connections import DEFAULT_WORKER_CALL_TIMEOUT

    logging.basicConfig(level=logging.WARNING)
    engine = make_engine(application_name="bench-worker", pool_size=2, max_overflow=2,
                         pool_pre_ping=False, call_timeout=DEFAULT_WORKER_CALL_TIMEOUT)
    bd._warm(engine)

    def noop(effect: EffectContext) -> None:
        return None

    registry = Registry()
    registry.register(NOOP, noop)
    d = Dispatcher(engine, registry, concurrency=args.batch, max_batch=args.batch,
                   lease=30.0, full_scan_every=args.full_scan_every)
    producer = d.producer
    claim = producer.claim
    lock = threading.Lock()
    claims: list[tuple[float, bool, int]] = []  # (ms, full scan, rows)

    def timed_claim(limit: int) -> Any:
        full = (producer.watermark is None or producer.full_scan_every <= 0
                or time.monotonic() >= producer._next_full_scan)
        t0 = time.perf_counter()
        rows = claim(limit)
        ms = (time.perf_counter() - t0) * 1000
        with lock:
            claims.append((ms, full, len(rows)))
        return rows

    producer.claim = timed_claim  # type: ignore[method-assign]
    stop = threading.Event()
    emit({"ready": True, "pid": os.getpid()})
    runner: threading.Thread | None = None
    for msg in bd._read_lines(sys.stdin):
        cmd = msg["cmd"]
        if cmd == "go":
            runner = threading.Thread(
                target=run_worker, args=(d,),
                kwargs={"poll_interval": 1.0, "grace": 5.0, "stop": stop,
                        "install_signals": False, "listen": True}, daemon=True)
            runner.start()
        elif cmd in ("sample", "stop"):
            if cmd == "stop":
                stop.set()
                d.wake.set()
                if runner is not None:
                    runner.join(30)
            with lock:
                got, claims[:] = list(claims), []
            emit({"delivered": d.stats.recorded.get("delivered", 0),
                  "recorded": dict(d.stats.recorded), "claimed": d.stats.claimed,
                  "claims": got})
        if cmd in ("stop", "exit"):
            break
    engine.dispose()
    return 0


class Worker(bd.Child):
    """bench_dispatch's child, started from this script."""

    def __init__(self, db_url: str, full_scan_every: float, batch: int) -> None:
        super().__init__("_worker", db_url, "worker",
                         ["--full-scan-every", str(full_scan_every), "--batch", str(batch)],
                         script=__file__)


# --------------------------------------------------------------------------- the run


def _claim_stats(claims: list[list[Any]]) -> dict[str, Any]:
    ms = [c[0] for c in claims]
    full = [c[0] for c in claims if c[1]]
    return {"claims": len(ms),
            "claim_ms_median": _r(statistics.median(ms)) if ms else None,
            "claim_ms_p90": _r(pct(ms, 90)) if ms else None,
            "claim_ms_max": _r(max(ms)) if ms else None,
            "full_scans": len(full),
            "full_scan_ms_median": _r(statistics.median(full)) if full else None,
            "rows_per_claim": _r(statistics.mean(c[2] for c in claims)) if claims else None}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _table(c: Any, holder_pid: int | None) -> dict[str, Any]:
    dead, live = c.execute(
        "SELECT n_dead_tup, n_live_tup FROM pg_stat_user_tables"
        " WHERE schemaname = 'outbox' AND relname = 'effects'").fetchone()
    idx = c.execute("SELECT pg_relation_size('outbox.effects_pending_idx')").fetchone()[0]
    age = None
    if holder_pid is not None:
        age = c.execute("SELECT age(backend_xmin) FROM pg_stat_activity WHERE pid = %s",
                        (holder_pid,)).fetchone()[0]
    return {"n_dead_tup": int(dead), "n_live_tup": int(live),
            "pending_idx_mb": round(int(idx) / 2**20, 1), "holder_xmin_age": age}


def run_variant(args: argparse.Namespace, scratch: bd.Scratch, variant: str) -> dict[str, Any]:
    fse = 0.0 if variant == "nowatermark" else args.full_scan_every
    log(f"{variant}: prefilling {args.prefill} effects")
    t = time.monotonic()
    scratch.reset(args.prefill, NOOP)
    log(f"{variant}: prefilled in {time.monotonic() - t:.0f}s; starting the worker")
    worker = Worker(scratch.url, fse, args.batch)
    msg = worker.recv(60)
    assert msg.get("ready"), msg
    roles = {worker.pid: "worker"}
    holder: Any = None
    holder_pid: int | None = None
    rows: list[dict[str, Any]] = []
    last = 0
    try:
        worker.send({"cmd": "go"})
        time.sleep(args.warmup)
        worker.send({"cmd": "sample"})
        last = worker.recv(60)["delivered"]
        t0 = time.monotonic()

        def interval(phase: str, seconds: float, held_at: float | None = None,
                     **extra: Any) -> dict[str, Any]:
            nonlocal last, t0
            mon = bd.CpuMonitor(DB, roles).start()
            time.sleep(max(0.0, t0 + seconds - time.monotonic()))
            worker.send({"cmd": "sample"})
            s = worker.recv(60)
            t1 = time.monotonic()
            cpu = mon.stop()
            with scratch.conn() as c:
                table = _table(c, holder_pid)
            row = {"bench": "held_xmin", "variant": variant, "phase": phase,
                   "t_s": round(t1 - start, 1),
                   "rate": round((s["delivered"] - last) / (t1 - t0), 1),
                   **({"held_s": round(t1 - held_at, 1)} if held_at is not None else {}),
                   **_claim_stats(s["claims"]), **table, **extra,
                   "pending_left": args.prefill - s["claimed"],
                   "load": bd.load()}
            if t1 - t0 >= 2.0:  # CPU shares over a shorter window are noise
                row["cpu"] = {k: v for k, v in cpu.items() if k != "other_top"}
                row["other_top"] = cpu.get("other_top")
            last, t0 = s["delivered"], t1
            emit(row)
            rows.append(row)
            return row

        start = t0
        for _ in range(args.baseline):
            interval("unheld", args.interval)
        holder = scratch._connect(scratch.dsn)
        holder.autocommit = False
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM outbox.effects WHERE id < 100").fetchone()
        holder_pid = holder.info.backend_pid
        held_at = time.monotonic()
        log(f"{variant}: horizon held by backend {holder_pid}")
        n_held = max(1, round(args.hold / args.interval))
        for _ in range(n_held):
            interval("held", args.interval, held_at)
        holder.rollback()
        holder.close()
        holder, holder_pid = None, None
        log(f"{variant}: released; VACUUM outbox.effects")
        with scratch.conn() as c:
            tv = time.monotonic()
            c.execute("VACUUM outbox.effects")
            vacuum_s = round(time.monotonic() - tv, 1)
        log(f"{variant}: VACUUM took {vacuum_s}s")
        interval("vacuum", max(0.1, time.monotonic() - t0), vacuum_s=vacuum_s)
        for _ in range(args.recovery):
            interval("recovered", args.interval)
        worker.send({"cmd": "stop"})
        final = worker.recv(60)
    finally:
        if holder is not None:
            with contextlib.suppress(Exception):
                holder.rollback()
                holder.close()
        worker.close()
    unheld = statistics.median(r["rate"] for r in rows if r["phase"] == "unheld")
    held = [r for r in rows if r["phase"] == "held"]
    recovered = [r["rate"] for r in rows if r["phase"] == "recovered"]
    summary = {
        "bench": "held_xmin", "section": "summary", "variant": variant,
        "full_scan_every": fse, "batch": args.batch,
        "unheld_rate": unheld,
        "held_rates": [r["rate"] for r in held],
        "held_claim_ms_median": [r["claim_ms_median"] for r in held],
        "held_s": round(args.interval * len(held), 1),
        "last_held_rate": held[-1]["rate"],
        "last_held_vs_unheld": round(held[-1]["rate"] / unheld, 2) if unheld else None,
        "recovered_rate": statistics.median(recovered) if recovered else None,
        "n_dead_tup_at_release": held[-1]["n_dead_tup"],
        "lease_lost": final["recorded"].get("lease_lost", 0),
        "ran_dry": any(r["pending_left"] <= 0 for r in rows),
    }
    emit(summary)
    return summary


def run_pgqueuer(args: argparse.Namespace) -> dict[str, Any] | None:
    """The peer, same timeline: bench/peer_pgqueuer_held_xmin.py in the peer venv."""
    home = Path(os.environ.get("PEER_BENCH", "/tmp/peer-bench"))
    py = home / ".venv" / "bin" / "python"
    if not py.exists():
        log(f"pgqueuer skipped: no {py} (copy ../shared/bench there and make its venv)")
        return None
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    cmd = [str(py), str(Path(__file__).resolve().parent / "peer_pgqueuer_held_xmin.py"),
           "--n", str(args.prefill), "--batch", str(args.batch),
           "--interval", str(args.interval), "--baseline", str(args.baseline),
           "--hold", str(args.hold), "--recovery", str(args.recovery),
           "--warmup", str(args.warmup),
           "--log-aggregation-interval", str(args.pgqueuer_log_aggregation)]
    log("pgqueuer: " + " ".join(cmd[1:]))
    proc = subprocess.Popen(cmd, cwd=home, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    summary: dict[str, Any] | None = None
    for line in proc.stdout:
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        emit(row)
        if row.get("section") == "summary":
            summary = row
    proc.wait()
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_worker":
        return worker_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--variants", default="watermark,nowatermark,pgqueuer",
                    help="any of watermark, nowatermark (full_scan_every=0) and pgqueuer "
                         "(needs $PEER_BENCH, default /tmp/peer-bench), run in this order")
    ap.add_argument("--full-scan-every", type=float, default=None,
                    help="the watermark variant's full_scan_every (default: the "
                         "Dispatcher's, FULL_SCAN_EVERY)")
    ap.add_argument("--batch", type=int, default=100, help="concurrency = max_batch (100)")
    ap.add_argument("--interval", type=float, default=15.0, help="seconds per line (15)")
    ap.add_argument("--baseline", type=int, default=2, help="unheld intervals (2)")
    ap.add_argument("--hold", type=float, default=180.0, help="seconds held (180)")
    ap.add_argument("--recovery", type=int, default=2, help="intervals after VACUUM (2)")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--prefill", type=int, default=2_600_000,
                    help="effects prefilled per variant (enough for ~10k/s throughout)")
    ap.add_argument("--pgqueuer-log-aggregation", type=float, default=30.0,
                    help="pgqueuer's log_aggregation_interval, seconds (its default 30; 0: "
                         "off; it folds pgqueuer_log on the worker's one connection)")
    ap.add_argument("--keep-db", action="store_true")
    args = ap.parse_args(argv)
    # SIGTERM (or SIGINT from a background shell, which ignores it) still cleans up:
    # the holder rolled back, the worker stopped, the scratch database dropped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.full_scan_every is None:
        from dispatcher.producer import FULL_SCAN_EVERY

        args.full_scan_every = FULL_SCAN_EVERY
    from outbox._config import database_url

    scratch = bd.Scratch(database_url())
    where = scratch.server.set(database=DB).render_as_string(hide_password=True)
    log(f"scratch database {where}; load {bd.load()}")
    scratch.create()
    with scratch.conn() as c:
        server = str(c.execute("SHOW server_version").fetchone()[0])
        autovacuum = str(c.execute("SHOW autovacuum").fetchone()[0])
    started = time.monotonic()
    summaries: list[dict[str, Any]] = []
    try:
        for v in args.variants.split(","):
            if v == "pgqueuer":
                got = run_pgqueuer(args)
                if got is not None:
                    summaries.append(got)
            else:
                summaries.append(run_variant(args, scratch, v))
    finally:
        if not args.keep_db:
            scratch.drop()
    try:
        git = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        git = None
    emit({"bench": "held_xmin", "section": "run", "server": server, "autovacuum": autovacuum,
          "cores": os.cpu_count(), "git": git, "elapsed_s": round(time.monotonic() - started),
          "interval_s": args.interval, "hold_s": args.hold, "prefill": args.prefill,
          "ratios": {s["variant"]: s["last_held_vs_unheld"] for s in summaries},
          "load_end": bd.load()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
