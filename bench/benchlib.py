"""Helpers shared by the benchmark scripts (run as `python bench/bench_*.py`)."""

from __future__ import annotations

from collections.abc import Sequence


def pct(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile with linear interpolation; None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    f = int(k)
    c = min(f + 1, len(s) - 1)
    return s[f] + (s[c] - s[f]) * (k - f)
