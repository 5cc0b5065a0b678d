"""Strict JSON parsing, canonical serialisation and request fingerprints.

A fingerprint must not depend on how a client happened to serialise its body (key
order, whitespace, `1.0` vs `1`), and no body PostgreSQL would refuse later (NUL in a
string, lone surrogates, NaN) may get past validation: such input would otherwise
become a 500 after the key was claimed.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from outbox.errors import InvalidIdempotencyKey, InvalidRequestBody, RequestBodyTooLarge

MAX_KEY_LENGTH = 255
MAX_DEPTH = 64
DEFAULT_MAX_BODY = 1_048_576


# One regex match instead of a Python loop over the characters: every delivery checks
# its effect key (dispatcher/handlers.py), every guarded request its header.
_PRINTABLE = re.compile(r"[\x21-\x7e]+")
_PRINTABLE_OR_SPACE = re.compile(r"[\x20-\x7e]+")


def parse_idempotency_key(values: list[str] | str | None, *, required: bool = True,
                          min_length: int = 1) -> str | None:
    """Validate an Idempotency-Key header (bare token or sf-string) and return the key.

    Printable ASCII only (0x21-0x7E, plus inner spaces in a quoted string), 1-255
    characters, one header only. Case is kept: `ABC` and `abc` are different keys.
    """
    if values is None or values == []:
        if required:
            raise InvalidIdempotencyKey("the Idempotency-Key header is required")
        return None
    if isinstance(values, list):
        if len(values) > 1:
            raise InvalidIdempotencyKey("send exactly one Idempotency-Key header")
        values = values[0]
    raw = values.strip(" \t")
    if len(raw) >= 2 and raw[0] == '"' and raw[-1] == '"':
        # RFC 8941 sf-string: a backslash escapes only `"` or a backslash; any other
        # `"` ends the string, so it is malformed here.
        chars: list[str] = []
        escaped = False
        for c in raw[1:-1]:
            if escaped:
                if c not in '"\\':
                    raise InvalidIdempotencyKey("malformed quoted Idempotency-Key")
                chars.append(c)
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                raise InvalidIdempotencyKey("malformed quoted Idempotency-Key")
            else:
                chars.append(c)
        if escaped:
            raise InvalidIdempotencyKey("malformed quoted Idempotency-Key")
        key = "".join(chars)
        if key and not key.strip(" "):
            raise InvalidIdempotencyKey("the Idempotency-Key is blank")
        allowed_space = True
    else:
        key = raw
        allowed_space = False
    if not key:
        raise InvalidIdempotencyKey("the Idempotency-Key header is empty")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidIdempotencyKey(f"the Idempotency-Key is longer than {MAX_KEY_LENGTH}")
    if (_PRINTABLE_OR_SPACE if allowed_space else _PRINTABLE).fullmatch(key) is None:
        raise InvalidIdempotencyKey(
            "the Idempotency-Key may contain printable ASCII characters only")
    if not allowed_space and "," in key:
        raise InvalidIdempotencyKey("the Idempotency-Key holds a list; send one key")
    if len(key) < min_length:
        raise InvalidIdempotencyKey(f"the Idempotency-Key is shorter than {min_length}")
    return key


def _reject_constant(name: str) -> Any:
    raise InvalidRequestBody(f"{name} is not valid JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise InvalidRequestBody(f"duplicate member {k!r} in a JSON object")
        out[k] = v
    return out


def _check_strings(value: Any, depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        raise InvalidRequestBody(f"JSON nested deeper than {MAX_DEPTH}")
    if isinstance(value, str):
        _check_text(value)
    elif isinstance(value, float):
        # `1e400` parses to inf: PostgreSQL would take it, json.dumps(allow_nan=False)
        # and canonical_json would not (a 500 after the key was claimed).
        if not math.isfinite(value):
            raise InvalidRequestBody("numbers must be finite (no NaN, Infinity or 1e400)")
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str):  # json.dumps turns int/float/bool keys into text
                _check_text(k)
            _check_strings(v, depth + 1)
    elif isinstance(value, list | tuple):  # json.dumps writes a tuple as an array
        for v in value:
            _check_strings(v, depth + 1)


def _check_text(s: str) -> None:
    if "\x00" in s:
        raise InvalidRequestBody("JSON strings may not contain U+0000")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestBody("JSON strings may not contain lone surrogates") from None


def parse_json_body(raw: bytes, *, max_bytes: int = DEFAULT_MAX_BODY,
                    allow_empty: bool = False) -> Any:
    """Parse a request body strictly; every refusal is an `InvalidRequestBody`."""
    if len(raw) > max_bytes:
        raise RequestBodyTooLarge(f"the body is larger than {max_bytes} bytes")
    if not raw.strip():
        if allow_empty:
            return None
        raise InvalidRequestBody("the body is empty")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequestBody("the body is not valid UTF-8") from None
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates,
                           parse_constant=_reject_constant)
    except InvalidRequestBody:
        raise
    except ValueError as exc:  # JSONDecodeError, and int digits over the limit
        raise InvalidRequestBody(f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequestBody("JSON nested too deeply") from None
    _check_strings(value)
    return value


def _normalise(value: Any) -> Any:
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidRequestBody("NaN and Infinity are not valid JSON")
        if value.is_integer() and abs(value) < 2**53:
            return int(value)
        return value
    if isinstance(value, dict):
        return {str(k): _normalise(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_normalise(v) for v in value]
    return value


def canonical_json(value: Any) -> str:
    """Sorted keys, no whitespace, integral floats as integers (RFC 8785 in spirit)."""
    return json.dumps(_normalise(value), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False, allow_nan=False)


def fingerprint(method: str, path: str, body: Any,
                headers: Mapping[str, str] | None = None) -> str:
    """sha256 over the canonical request: method, path, opted-in headers, parsed body."""
    doc = {
        "method": method.upper(),
        "path": path,
        "headers": {k.lower(): v for k, v in (headers or {}).items()},
        "body": body,
    }
    return hashlib.sha256(canonical_json(doc).encode("utf-8")).hexdigest()


def json_fingerprint(value: Any) -> str:
    """sha256 of a JSON document in canonical form."""
    return hashlib.sha256(canonical_json(value).encode("utf-8")).hexdigest()
