"""A very small HTML builder: everything is escaped unless it is already `Markup`.

The console renders a handful of pages; a template engine would be a dependency for
that. `Markup.format` escapes its arguments (numbers pass as they are, so format
specs work), `Markup.join` escapes the parts: forgetting to escape is not possible
by accident, only by wrapping a value in `Markup` on purpose.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

DASH = "\u2013"  # shown for "no value"


class Markup(str):
    """A string of HTML that is safe to emit as is."""

    __slots__ = ()

    def format(self, *args: Any, **kwargs: Any) -> Markup:
        return Markup(str.format(self, *(_arg(a) for a in args),
                                 **{k: _arg(v) for k, v in kwargs.items()}))

    def join(self, parts: Iterable[Any]) -> Markup:
        return Markup(str.join(self, (escape(p) for p in parts)))

    def __add__(self, other: Any) -> Markup:
        return Markup(str.__add__(self, escape(other)))


def escape(value: Any) -> Markup:
    if isinstance(value, Markup):
        return value
    if value is None:
        return Markup("")
    return Markup(html.escape(str(value), quote=True))


def _arg(value: Any) -> Any:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    return escape(value)


def concat(parts: Iterable[Any]) -> Markup:
    return Markup("").join(parts)


def pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


def duration(seconds: float | None) -> str:
    """90 -> '1m 30s': how long, for people."""
    if seconds is None:
        return DASH
    s = abs(float(seconds))
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 60:
        return f"{s:.1f} s"
    minutes, sec = divmod(int(s), 60)
    if minutes < 60:
        return f"{minutes}m {sec:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h {minutes:02d}m"
    return f"{hours // 24}d {hours % 24}h"


def ago(at: datetime | None, now: datetime) -> Markup:
    """'3m 05s ago' with the exact time in a tooltip (`<time>`)."""
    if at is None:
        return Markup(DASH)
    delta = (now - at).total_seconds()
    word = f"{duration(delta)} ago" if delta >= 0 else f"in {duration(-delta)}"
    return Markup('<time datetime="{}" title="{}">{}</time>').format(
        at.isoformat(), at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + at.strftime(" %z"), word)


def seconds_between(a: datetime, b: datetime) -> float:
    delta: timedelta = b - a
    return delta.total_seconds()


STATUS_CLASS = {
    "pending": "st-pending", "in_flight": "st-inflight", "delivered": "st-delivered",
    "failed": "st-failed", "cancelled": "st-cancelled", "needs_review": "st-review",
    "processing": "st-inflight", "completed": "st-delivered",
    "retry": "st-pending", "lease_lost": "st-review", "ambiguous": "st-review",
    "done": "st-delivered", "refused": "st-failed",
}


def badge(status: str) -> Markup:
    return Markup('<span class="badge {}">{}</span>').format(
        STATUS_CLASS.get(status, "st-other"), status.replace("_", " "))
