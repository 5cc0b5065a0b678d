#!/usr/bin/env python3
"""Chart of bench_dispatch.py's output: no-op throughput per configuration, ours vs. the
raw-SQL ceiling vs. pgqueuer (one sitting: the JSON lines of one run with `peers`).

    uv run --with matplotlib python bench/plot_dispatch.py results.jsonl docs/dispatch.png
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def main(argv: list[str]) -> int:
    src, dst = Path(argv[0]), Path(argv[1])
    rows = [json.loads(ln) for ln in src.read_text().splitlines() if ln.startswith("{")]
    # Several runs in one file (rounds of one sitting): the median per configuration.
    ours_runs: dict[tuple[int, int], list[float]] = {}
    peer_runs: dict[tuple[str, int, int], list[float]] = {}
    for r in rows:
        if (r.get("section") == "work" and r.get("handler") == "noop"
                and r.get("concurrency", r["batch"]) == r["batch"]):  # slots = batch only
            ours_runs.setdefault((r["workers"], r["batch"]), []).append(r["rate_median"])
        elif r.get("section") == "peers" and r.get("rate_median"):
            peer_runs.setdefault((r["peer"], r["batch"], r.get("clients", 1)), []).append(
                r["rate_median"])
    ours = {k: statistics.median(v) for k, v in ours_runs.items()}
    peers = {k: statistics.median(v) for k, v in peer_runs.items()}
    configs = sorted(ours, key=lambda k: (k[1], k[0]))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{w} proc, B={b}" for w, b in configs]
    series: list[tuple[str, list[float], str]] = [
        ("ours (pg-outbox)", [ours[c] for c in configs], "#2b6cb0"),
        ("raw-SQL ceiling (pgbench, same clients)",
         [peers.get(("ceiling", b, w)) or peers.get(("ceiling", b, 1 if w == 1 else 4), 0.0)
          for w, b in configs], "#a0aec0"),
        ("pgqueuer 1.6 (1 process)",
         [peers.get(("pgqueuer", b, 1), 0.0) if w == 1 else 0.0 for w, b in configs],
         "#dd6b20"),
    ]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.27
    for i, (name, values, color) in enumerate(series):
        xs = [j + (i - 1) * width for j in range(len(configs))]
        bars = ax.bar(xs, values, width, label=name, color=color)
        for bar, v in zip(bars, values, strict=True):
            if v:
                ax.annotate(f"{v / 1000:.1f}k", (bar.get_x() + bar.get_width() / 2, v),
                            ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(configs)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("no-op effects / s")
    summary: dict[str, Any] = next((r for r in rows if r.get("section") == "summary"), {})
    runs = max((len(v) for v in ours_runs.values()), default=0)
    ax.set_title(f"No-op dispatch, median of {runs} interleaved rounds, 2 vCPU shared box"
                 + (f" (git {summary['git']})" if summary.get("git") else ""), fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(dst)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
