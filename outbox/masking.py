"""One masking rule for payloads wherever people read them: the web console,
`outbox trace` and your logs.

The rules (the console's, which imports them from here; no web dependency): a dotted
path of object keys, compared case-insensitively:

- `card.number`     payload["card"]["number"]
- `*.password`      "password" one level down, under any key
- `**.password`     "password" at any depth, the top level included
- `password`        the top-level key only (write `**.password` for anywhere)

Arrays are transparent: `items.*.pan` and `items.pan` both reach the `pan` of every
element of `items`. The whole value under a matching key becomes "•••".

The rules come from `OUTBOX_UI_MASK` (comma-separated; empty: mask nothing; unset:
`DEFAULT_RULES`), so one setting covers the console, `outbox trace` (text and
`--json`: payloads and receivers' replies) and a log handler with `MaskingFilter`:

    import logging
    from outbox.masking import MaskingFilter

    handler = logging.StreamHandler()
    handler.addFilter(MaskingFilter())          # OUTBOX_UI_MASK, or the defaults
    logging.basicConfig(handlers=[handler])
    logging.getLogger("app").info("charging %s", payload)   # card.number -> "•••"

Masking is for display: the database keeps the real payload. It reaches values
passed as structured data (dicts and lists); a payload already formatted into a
string, or an exception's free text, is not parsed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

ENV = "OUTBOX_UI_MASK"

__all__ = ["DEFAULT_RULES", "ENV", "MASKED", "Mask", "MaskingFilter", "mask_from_env"]

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
        raw = os.environ.get(ENV) if value is None else value
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


def mask_from_env() -> Mask:
    """The rules of `OUTBOX_UI_MASK` (the defaults when unset)."""
    return Mask.from_env()


class MaskingFilter(logging.Filter):
    """Masks dicts and lists in a record's arguments (and a dict logged as the message,
    and the `payload` attribute `extra={"payload": ...}` sets) before it is formatted.

    Attach it to a handler (filters on a logger do not see its children's records).
    """

    def __init__(self, mask: Mask | None = None) -> None:
        super().__init__()
        self.mask = mask if mask is not None else mask_from_env()

    def _apply(self, value: Any) -> Any:
        return self.mask.apply(value) if isinstance(value, dict | list) else value

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.mask.rules:
            return True
        args = record.args
        if isinstance(args, Mapping):  # log.info("%(card)s", payload)
            record.args = self.mask.apply(dict(args))
        elif isinstance(args, tuple):
            record.args = tuple(self._apply(a) for a in args)
        if isinstance(record.msg, dict | list):
            record.msg = self.mask.apply(record.msg)
        payload = getattr(record, "payload", None)
        if isinstance(payload, dict | list):
            record.payload = self.mask.apply(payload)
        return True
