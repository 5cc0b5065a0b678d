#!/usr/bin/env python3
"""Issue 11's targets in one sitting: runs the benchmarks, prints ONE JSON line.

    uv run python bench/bench_targets.py                     # about 12-15 min
    uv run python bench/bench_targets.py --old-tree /tmp/old # + HTTP against that tree

It runs, one after another on the same server:
1. `bench_dispatch.py --sections work,enqueue,latency,peers` (no-op and aiohttp HTTP
   handlers; pgqueuer and the raw-SQL ceiling from $PEER_BENCH, a copy of
   ../shared/bench with its venv: see its README);
2. with `--old-tree`, that checkout's `bench_dispatch.py --sections work --handlers
   http` (the tree the HTTP target is measured against: a `git worktree` of the commit
   issue 11 was filed on, `b70fc68`), as the "today's best" of the HTTP target;
3. `bench_guard.py --parts throughput,processes,storm` (the guarded request against
   the bare one, in 8 threads and in 8 processes; the same-key storm in its three
   forms).

Each target is printed with what was measured, the goal, and whether it was met;
stderr gets the same as a table. The raw lines of every run go to --raw (JSON lines).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(f"[bench-targets {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], cwd: Path, raw: Any, tag: str) -> list[dict[str, Any]]:
    """Run one benchmark; its JSON lines (tagged) are kept and returned."""
    log(" ".join(cmd[1:]) + (f"   (in {cwd})" if cwd != ROOT else ""))
    proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, text=True, check=False)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    for line in lines:
        raw.write(json.dumps({"part": tag, **line}) + "\n")
    raw.flush()
    if proc.returncode != 0:
        log(f"{tag} exited with {proc.returncode}")
    return lines


def target(name: str, measured: float | None, goal: float, *, at_most: bool = False
           ) -> dict[str, Any]:
    met = None if measured is None else (measured <= goal if at_most else measured >= goal)
    return {"target": name, "measured": measured, "goal": goal,
            "kind": "at most" if at_most else "at least", "met": met}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    ap.add_argument("--old-tree", help="checkout to measure HTTP (httpx) against")
    ap.add_argument("--duration", default="3", help="seconds per dispatch cell (default 3)")
    ap.add_argument("--runs", default="2", help="runs per dispatch cell (default 2)")
    ap.add_argument("--raw", default="bench-targets.jsonl", help="raw JSON lines (appended)")
    args = ap.parse_args(argv)
    py = sys.executable
    started = time.monotonic()
    with open(args.raw, "a") as raw:
        dispatch = run([py, "bench/bench_dispatch.py", "--sections", "work,enqueue,latency,peers",
                        "--handlers", "noop,http_async", "--workers", "1,2,4",
                        "--batches", "10,100", "--duration", args.duration, "--runs", args.runs,
                        "--clients", "1,4"], ROOT, raw, "dispatch")
        old_http: list[dict[str, Any]] = []
        if args.old_tree:
            old_http = run([py, "bench/bench_dispatch.py", "--sections", "work", "--handlers",
                            "http", "--workers", "1,2,4", "--batches", "10,100",
                            "--duration", args.duration, "--runs", "1"],
                           Path(args.old_tree), raw, "old-http")
        guard = run([py, "bench/bench_guard.py", "--parts", "throughput,processes,storm",
                     "--seconds", "6", "--storm-rounds", "3"], ROOT, raw, "guard")
    summary = next((x for x in dispatch if x.get("section") == "summary"), {})
    ratios = summary.get("ratios", {})
    peer = summary.get("peer_rates", {})
    latency = summary.get("latency_listen_notify_ms") or {}
    old_best = max((x["rate_median"] for x in old_http if x.get("section") == "work"),
                   default=None)
    http_best = (summary.get("http_async_best") or {}).get("rate_median")
    g = guard[0] if guard else {}
    storm = g.get("storm", {})
    targets = [
        target("dispatch, 1 process, B=10 vs pgqueuer", ratios.get("W1xB10_vs_pgqueuer"), 1.0),
        target("dispatch, 1 process, B=100 vs pgqueuer", ratios.get("W1xB100_vs_pgqueuer"),
               1.0),
        target("dispatch, 1 process, B=100 vs raw-SQL ceiling (1 client)",
               ratios.get("W1xB100_vs_ceiling_1c"), 0.35),
        target("dispatch, best vs 4-client ceiling", ratios.get("best_vs_ceiling_4c"), 0.35),
        target("HTTP delivery, best vs the old tree's best",
               round(http_best / old_best, 2) if http_best and old_best else None, 3.0),
        target("guarded request (atomic, 2 effects deferred) vs bare, 8 threads",
               (g.get("ratios") or {}).get("f_over_a_rps"), 0.5),
        target("guarded request vs bare, 8 processes of one thread",
               (g.get("processes") or {}).get("f_over_a_rps"), 0.5),
        target("same-key storm of 100, p99 ms (atomic, one process, default)",
               (storm.get("atomic_local") or {}).get("p99_ms"), 50.0, at_most=True),
        target("same-key storm of 100, p99 ms (atomic, 4 processes)",
               (storm.get("atomic_processes") or {}).get("p99_ms"), 50.0, at_most=True),
        target("same-key storm of 100, p99 ms (atomic, every twin asks the database)",
               (storm.get("atomic_database") or {}).get("p99_ms"), 50.0, at_most=True),
        target("enqueue, 1 client vs raw SQL", ratios.get("enqueue_1c_vs_ceiling"), 0.7),
        target("enqueue, 4 clients vs raw SQL", ratios.get("enqueue_4c_vs_ceiling"), 0.5),
        target("NOTIFY latency p50 ms (enqueue -> handler start, 200/s)",
               latency.get("start_p50"), 3.0, at_most=True),
        target("NOTIFY latency p99 ms", latency.get("start_p99"), 10.0, at_most=True),
    ]
    for t in targets:
        mark = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        print(f"  {t['target']:<72} {t['measured']!s:>8}  ({t['kind']} {t['goal']}): {mark}",
              file=sys.stderr)
    # Not targets: ours against a hand-rolled outbox in the same Python clients (the
    # rest of the gap to pgbench is the clients' own stack), and the hand-rolled guard
    # (bench_guard.py's g_raw) against the bare transaction and against ours: what
    # the guarded target asks of a guard with none of our guarantees.
    by_hand: dict[str, Any] = {
        f"enqueue_{n}c_vs_python_raw": ratios.get(f"enqueue_{n}c_vs_python_raw")
        for n in (1, 4)}
    for form, part in (("8_threads", g.get("ratios") or {}),
                       ("8_processes", g.get("processes") or {})):
        by_hand[f"hand_rolled_guard_vs_bare_{form}"] = part.get("g_over_a_rps")
        by_hand[f"guarded_vs_hand_rolled_guard_{form}"] = part.get("f_over_g_rps")
    for name, value in by_hand.items():
        print(f"  (for reference) {name:<56} {value!s:>8}", file=sys.stderr)
    print(json.dumps({"bench": "targets", "targets": targets, "by_hand": by_hand,
                      "peer_rates": peer,
                      "http_best": http_best, "old_http_best": old_best,
                      "git": summary.get("git"), "elapsed_s":
                      round(time.monotonic() - started, 1),
                      "peer_bench": os.environ.get("PEER_BENCH", "/tmp/peer-bench")}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
