"""Payload masking: JSON-path-ish rules whose matching values are shown as "•••".

A rule is a dotted path of object keys, compared case-insensitively:

- `card.number`     payload["card"]["number"]
- `*.password`      "password" one level down, under any key
- `**.password`     "password" at any depth, the top level included
- `password`        the top-level key only (write `**.password` for anywhere)

Arrays are transparent: `items.*.pan` and `items.pan` both reach the `pan` of every
element of `items`. The whole value under a matching key is replaced, whatever it is.
Masking is for display only: it hides values from people who look over an operator's
shoulder or at a screenshot; the database keeps the real payload.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

MASKED = "•••"

DEFAULT_RULES: tuple[str, ...] = (
    "**.password", "**.secret", "**.token", "**.api_key", "**.authorization",
    "**.cvc", "**.cvv", "**.card.number",
)


class Mask:
    """Compiled rules; `apply(value)` returns a masked copy."""

    def __init__(self, rules: Iterable[str] = DEFAULT_RULES) -> None:
        compiled: list[tuple[str, ...]] = []
        for rule in rules:
            parts = tuple(p.strip().lower() for p in rule.strip().split("."))
            if not rule.strip() or any(not p for p in parts):
                raise ValueError(f"not a mask rule: {rule!r} (dotted keys, * or **)")
            compiled.append(parts)
        self.rules: tuple[tuple[str, ...], ...] = tuple(compiled)

    @classmethod
    def from_env(cls, value: str | None = None) -> Mask:
        """`OUTBOX_UI_MASK` (comma-separated rules; empty: mask nothing), or the defaults."""
        raw = os.environ.get("OUTBOX_UI_MASK") if value is None else value
        if raw is None:
            return cls()
        return cls(r for r in raw.split(",") if r.strip())

    def __repr__(self) -> str:
        return f"Mask({['.'.join(r) for r in self.rules]!r})"

    def apply(self, value: Any) -> Any:
        if not self.rules:
            return value
        return _walk(value, [(r, 0) for r in self.rules])


def _advance(states: Sequence[tuple[tuple[str, ...], int]], key: str
             ) -> tuple[bool, list[tuple[tuple[str, ...], int]]]:
    """Step every partial match over `key`: (is the value under it masked, next states)."""
    key = key.lower()
    nxt: list[tuple[tuple[str, ...], int]] = []
    hit = False
    for rule, i in states:
        hit |= _step(rule, i, key, nxt)
    return hit, list(dict.fromkeys(nxt))


def _step(rule: tuple[str, ...], i: int, key: str,
          nxt: list[tuple[tuple[str, ...], int]]) -> bool:
    part = rule[i]
    if part == "**":
        nxt.append((rule, i))
        return i + 1 == len(rule) or _step(rule, i + 1, key, nxt)
    if part in ("*", key):
        if i + 1 == len(rule):
            return True
        nxt.append((rule, i + 1))
    return False


def _walk(value: Any, states: list[tuple[tuple[str, ...], int]]) -> Any:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            hit, nxt = _advance(states, str(k))
            out[k] = MASKED if hit else (_walk(v, nxt) if nxt else v)
        return out
    if isinstance(value, list):
        # Arrays are transparent; a `*` may also stand for the index.
        skip = [(r, i + 1) for r, i in states if r[i] == "*" and i + 1 < len(r)]
        return [_walk(v, states + skip) for v in value]
    return value
