#!/usr/bin/env python3
"""Retention beside the hot path, interleaved: the claim with and without a purge (issue 17).

    uv run python bench/bench_retention_toggle.py                      # duties 0.1,0.03,0.01
    uv run python bench/bench_retention_toggle.py --duties 0.03 --pairs 6

bench_finished_rows.py measures a purge cell after a no-purge cell; on a shared two-core
box the claim's p99 drifts by more between two cells than a paced purge moves it. Here
one worker drains one backlog (bench_held_xmin's child, B=100, a no-op handler) while a
purger child (the retention plan of `outbox purge`, `RetentionPlan.run` with `--duty`)
is switched on and off every `--interval` seconds: `--pairs` pairs of one interval with
the purge and one without, in alternating order (on-off, off-on, ...), so both halves
see the same table, backlog position and box. The purger stops between batches (never
inside one: a stopped purge holds no transaction and no xmin).

Per cell (one per duty): the claim's p50 / p99 over all on-intervals and all
off-intervals (pooled), the p99 difference of each pair, effects/s, and the rows the
purge deleted (its rate while on). Prints JSON lines; the summary has one entry per duty.
"""

from __future__ import annotations

import argparse
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
import bench_finished_rows as bf  # noqa: E402
import bench_held_xmin as bh  # noqa: E402
from benchlib import pct  # noqa: E402

DB = "bench_retention_toggle"
bd.DB = DB
bh.DB = DB
bf.DB = DB
emit, log = bd.emit, bd.log


def purger_main(argv: Sequence[str]) -> int:
    """Child: purge at `duty` while switched on ({"cmd": "on"/"off"/"exit"})."""
    from outbox._config import make_engine
    from outbox.retention import RetentionPlan

    duty, batch = float(argv[0]), int(argv[1])
    engine = make_engine(application_name="bench-purge", pool_size=2, max_overflow=0)
    plan = RetentionPlan(effects=3600.0, keys=False, inbox=None, conflicts=None,
                         versions=None, batch=batch)
    on, done = threading.Event(), threading.Event()
    purged = [0]

    def read() -> None:
        for line in sys.stdin:
            cmd = json.loads(line)["cmd"]
            if cmd == "on":
                on.set()
            elif cmd == "off":
                on.clear()
            elif cmd == "count":
                emit({"purged": purged[0]})
            else:
                done.set()
                on.set()
                return
        done.set()
        on.set()

    threading.Thread(target=read, daemon=True).start()
    emit({"ready": True, "pid": os.getpid()})
    while not done.is_set():
        on.wait()
        if done.is_set():
            break
        run = plan.run(engine, duty=duty, budget=3600.0, wait_lock=5.0,
                       stop=lambda: done.is_set() or not on.is_set())
        purged[0] += run.deleted.get("effects", 0)
        if run.complete and on.is_set():  # nothing left to purge: idle until told
            on.clear()
    emit({"purged": purged[0], "exit": True})
    engine.dispose()
    return 0


def run_cell(args: argparse.Namespace, scratch: bd.Scratch, duty: float,
             purge_batch: int) -> dict[str, Any]:
    name = f"toggle_duty_{duty:g}_batch_{purge_batch}"
    log(f"{name}: filling ({args.retained} purgeable, {args.pending} pending)")
    bf.reset(scratch, args.pending, args.retained, 48.0)
    worker = bh.Worker(scratch.url, args.full_scan_every, args.batch)
    purger = bd.Child("_purger", scratch.url, "purge", [str(duty), str(purge_batch)],
                      script=__file__)
    assert worker.recv(60).get("ready")
    assert purger.recv(60).get("ready")
    roles = {worker.pid: "worker", purger.pid: "purge"}
    halves: dict[bool, list[float]] = {True: [], False: []}
    pairs: list[dict[str, Any]] = []
    try:
        worker.send({"cmd": "go"})
        time.sleep(args.warmup)
        worker.send({"cmd": "sample"})
        last = worker.recv(60)["delivered"]
        for i in range(args.pairs):
            order = (True, False) if i % 2 == 0 else (False, True)
            p99: dict[bool, float] = {}
            for state in order:
                purger.send({"cmd": "on" if state else "off"})
                mon = bd.CpuMonitor(DB, roles).start()
                t0 = time.monotonic()
                time.sleep(args.interval)
                worker.send({"cmd": "sample"})
                s = worker.recv(60)
                cpu = mon.stop()
                ms = [c[0] for c in s["claims"]]
                n = s["delivered"] - last
                last = s["delivered"]
                halves[state] += ms
                p99[state] = pct(ms, 99) if ms else float("nan")
                emit({"bench": "retention_toggle", "cell": name, "pair": i, "purge": state,
                      "rate": round(n / (time.monotonic() - t0), 1),
                      "claim_ms_median": bh._r(statistics.median(ms)) if ms else None,
                      "claim_ms_p99": bh._r(p99[state]), "claims": len(ms),
                      "cpu": {k: v for k, v in cpu.items() if k != "other_top"}})
            pairs.append({"pair": i, "p99_on": bh._r(p99[True]),
                          "p99_off": bh._r(p99[False]),
                          "delta_ms": bh._r(p99[True] - p99[False])})
        purger.send({"cmd": "off"})
        purger.send({"cmd": "count"})
        purged = purger.recv(60)["purged"]
        worker.send({"cmd": "stop"})
        worker.recv(60)
    finally:
        purger.send({"cmd": "exit"})
        purger.close()
        worker.close()
    deltas = [p["delta_ms"] for p in pairs]
    on_ms, off_ms = halves[True], halves[False]
    summary = {"bench": "retention_toggle", "section": "cell", "cell": name, "duty": duty,
               "purge_batch": purge_batch, "pairs": len(pairs),
               "claim_ms_p50_on": bh._r(statistics.median(on_ms)),
               "claim_ms_p50_off": bh._r(statistics.median(off_ms)),
               "claim_ms_p99_on": bh._r(pct(on_ms, 99)),
               "claim_ms_p99_off": bh._r(pct(off_ms, 99)),
               "p99_delta_ms_median": bh._r(statistics.median(deltas)),
               "p99_delta_ms_range": [min(deltas), max(deltas)],
               "purged": purged,
               "purged_per_s_on": round(purged / (args.pairs * args.interval), 1)}
    emit(summary)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_worker":
        return bh.worker_main(argv[1:])
    if argv and argv[0] == "_purger":
        return purger_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--duties", default="0.1,0.03,0.01")
    ap.add_argument("--purge-batches", default="500",
                    help="rows per purge batch (OUTBOX_RETENTION_BATCH), one cell each")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--interval", type=float, default=8.0)
    ap.add_argument("--retained", type=int, default=1_000_000)
    ap.add_argument("--pending", type=int, default=1_500_000)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--full-scan-every", type=float, default=2.0)
    ap.add_argument("--keep-db", action="store_true")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from outbox._config import database_url

    scratch = bd.Scratch(database_url())
    scratch.create()
    with scratch.conn() as c:
        server = str(c.execute("SHOW server_version").fetchone()[0])
    cells: list[dict[str, Any]] = []
    try:
        for b in (int(x) for x in args.purge_batches.split(",") if x):
            for d in (float(x) for x in args.duties.split(",") if x):
                cells.append(run_cell(args, scratch, d, b))
    finally:
        if not args.keep_db:
            scratch.drop()
    git = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                         capture_output=True, text=True).stdout.strip()
    emit({"bench": "retention_toggle", "section": "summary", "server": server, "git": git,
          "cores": os.cpu_count(), "load_end": bd.load(),
          "p99_on_off_ms": {c["cell"]: [c["claim_ms_p99_on"], c["claim_ms_p99_off"]]
                            for c in cells},
          "p99_delta_ms_median": {c["cell"]: c["p99_delta_ms_median"] for c in cells}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
