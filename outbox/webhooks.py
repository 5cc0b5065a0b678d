"""Webhook signatures, checked on the raw body before anything is parsed or stored.

An unsigned endpoint lets anyone write to the inbox, and the inbox keeps the first copy
of an id: a forged event with a guessed future id turns the real one into a
`conflict`, a forged huge `version` makes every later real event `stale`. So a
receiver verifies the bytes it got, exactly as received, then parses them.

Three schemes, one class each, all HMAC-SHA256 compared with `hmac.compare_digest`:

* `StandardWebhooks` (standardwebhooks.com, Svix): `webhook-id`, `webhook-timestamp`,
  `webhook-signature: v1,<base64> v1,<base64>`, over `"{id}.{timestamp}.{body}"`,
  secrets `whsec_<base64>`; timestamps outside `tolerance` are refused.
* `StripeSignature`: `Stripe-Signature: t=<unix>,v1=<hex>,v1=<hex>` over
  `"{t}.{body}"`, keyed by the secret string itself; the same tolerance.
* `GitHubSignature`: `X-Hub-Signature-256: sha256=<hex>` over the body. It has no
  timestamp, so a captured delivery verifies forever: its replay is caught only by
  the inbox (same id, same payload: `duplicate`; after the row is purged, it would be
  processed again, so keep inbox retention beyond the sender's redelivery horizon).

Every verifier takes several secrets at once (rotation: add the new one, switch the
sender, remove the old one); a signature by any of them is accepted.

`WebhookSources` maps each accepted source to its verifier: an unregistered source is
`UnknownSource` (404), a missing, bad or stale signature `InvalidSignature` (401), both
before the body is read as JSON. It also makes each registered name a metric label
(`outbox._telemetry.source_label`); other names are counted as "other".

No framework imports: `headers` is any mapping (Starlette's and Django's are
case-insensitive; a plain dict is searched case-insensitively).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from outbox._telemetry import register_source_label
from outbox.errors import ConfigurationError, InvalidSignature, UnknownSource

__all__ = [
    "DEFAULT_TOLERANCE",
    "GitHubSignature",
    "StandardWebhooks",
    "StripeSignature",
    "Verified",
    "Verifier",
    "WebhookSources",
    "parse_secrets",
]

DEFAULT_TOLERANCE = 300.0  # seconds either way; Stripe's and Standard Webhooks' default
MAX_SIGNATURES = 20  # candidates per header: a longer list is refused, not scanned
MAX_NAME = 255
_TIMESTAMP = re.compile(r"[0-9]{1,15}")
_PRINTABLE = re.compile(r"[!-~]{1,255}")

Secret = str | bytes
Clock = Callable[[], float]


class Verifier(Protocol):
    """Checks one delivery's signature over its raw body."""

    def verify(self, headers: Mapping[str, str], body: bytes) -> str | None:
        """Raise `InvalidSignature` unless `body` is signed by a current secret.

        Returns the delivery id the scheme signs (Standard Webhooks' `webhook-id`),
        or None.
        """
        ...


def _header(headers: Mapping[str, str], name: str) -> str:
    value = headers.get(name)
    if value is None:
        lower = name.lower()
        value = next((v for k, v in headers.items() if k.lower() == lower), None)
    if value is None or not value.strip():
        raise InvalidSignature(f"the {name} header is missing: events must be signed")
    return value.strip()


def _secrets(secrets: Secret | Iterable[Secret], decode: Callable[[Secret], bytes]
             ) -> tuple[bytes, ...]:
    items = [secrets] if isinstance(secrets, str | bytes) else list(secrets)
    keys = tuple(decode(s) for s in items)
    if not keys or not all(keys):
        raise ConfigurationError("a webhook verifier needs at least one non-empty secret")
    return keys


def _raw_secret(secret: Secret) -> bytes:
    return secret.encode() if isinstance(secret, str) else secret


def _standard_secret(secret: Secret) -> bytes:
    """`whsec_<base64>` (the prefix is optional) -> the key bytes; bytes are the key."""
    if isinstance(secret, bytes):
        return secret
    text = secret.strip().removeprefix("whsec_")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ConfigurationError(
            "a Standard Webhooks secret is whsec_ followed by base64") from None


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _any_match(expected: Sequence[bytes], candidates: Sequence[bytes]) -> bool:
    """Compare every pair in constant time (no early exit that would time a match)."""
    matched = False
    for want in expected:
        for got in candidates:
            matched |= hmac.compare_digest(want, got)
    return matched


def _from_hex(value: str) -> bytes:
    try:
        return bytes.fromhex(value)
    except ValueError:
        return b""  # never equal to a 32-byte digest


def _from_base64(value: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return b""


def _timestamp(value: str) -> int:
    if not _TIMESTAMP.fullmatch(value):
        raise InvalidSignature("the signature timestamp is not a number of unix seconds")
    return int(value)


def _check_age(timestamp: int, tolerance: float, clock: Clock) -> None:
    """Within `tolerance` of now, both ways: an old one is a replay, a future one lives on."""
    skew = clock() - timestamp
    if skew > tolerance:
        raise InvalidSignature(
            f"the signature is {skew:.0f}s old, beyond the {tolerance:g}s tolerance "
            "(a replay, or a clock off): send a freshly signed copy")
    if -skew > tolerance:
        raise InvalidSignature(
            f"the signature timestamp is {-skew:.0f}s in the future, beyond the "
            f"{tolerance:g}s tolerance")


def _bounded(candidates: list[bytes], header: str) -> list[bytes]:
    if not candidates:
        raise InvalidSignature(f"the {header} header holds no signature of a known version")
    if len(candidates) > MAX_SIGNATURES:
        raise InvalidSignature(f"the {header} header holds more than {MAX_SIGNATURES} "
                               "signatures")
    return candidates


class StandardWebhooks:
    """Standard Webhooks: HMAC-SHA256 over `"{webhook-id}.{webhook-timestamp}.{body}"`.

    `secrets`: one or more `whsec_<base64>` strings (or raw key bytes). `verify`
    returns the `webhook-id`, which is signed too.
    """

    ID, TIMESTAMP, SIGNATURE = "webhook-id", "webhook-timestamp", "webhook-signature"

    def __init__(self, secrets: Secret | Iterable[Secret], *,
                 tolerance: float = DEFAULT_TOLERANCE, clock: Clock = time.time) -> None:
        self._keys = _secrets(secrets, _standard_secret)
        self.tolerance = float(tolerance)
        self._clock = clock

    def verify(self, headers: Mapping[str, str], body: bytes) -> str | None:
        msg_id = _header(headers, self.ID)
        if not _PRINTABLE.fullmatch(msg_id):
            raise InvalidSignature(f"{self.ID} must be 1-{MAX_NAME} printable ASCII characters")
        stamp = _header(headers, self.TIMESTAMP)
        timestamp = _timestamp(stamp)
        candidates = [_from_base64(sig) for version, _, sig in
                      (item.partition(",") for item in _header(headers, self.SIGNATURE).split())
                      if version == "v1"]
        signed = b"%s.%s." % (msg_id.encode(), stamp.encode())
        expected = [_mac(key, signed, body) for key in self._keys]
        if not _any_match(expected, _bounded(candidates, self.SIGNATURE)):
            raise InvalidSignature(f"no {self.SIGNATURE} matches this body and a current "
                                   "secret")
        _check_age(timestamp, self.tolerance, self._clock)
        return msg_id

    def sign(self, body: bytes, msg_id: str, timestamp: int | None = None) -> dict[str, str]:
        """The three headers for `body`, signed with every secret (a sender's side)."""
        stamp = str(int(self._clock()) if timestamp is None else timestamp)
        signed = b"%s.%s." % (msg_id.encode(), stamp.encode())
        sigs = " ".join("v1," + base64.b64encode(_mac(k, signed, body)).decode()
                        for k in self._keys)
        return {self.ID: msg_id, self.TIMESTAMP: stamp, self.SIGNATURE: sigs}


class StripeSignature:
    """Stripe's scheme: `Stripe-Signature: t=<unix>,v1=<hex>[,v1=<hex>...]`.

    HMAC-SHA256 over `"{t}.{body}"` keyed by the endpoint secret string as given
    (`whsec_...` is not decoded). Stripe sends one v1 per active secret while you roll
    it; `v0` (its test scheme) is ignored.
    """

    HEADER = "Stripe-Signature"

    def __init__(self, secrets: Secret | Iterable[Secret], *,
                 tolerance: float = DEFAULT_TOLERANCE, clock: Clock = time.time) -> None:
        self._keys = _secrets(secrets, _raw_secret)
        self.tolerance = float(tolerance)
        self._clock = clock

    def verify(self, headers: Mapping[str, str], body: bytes) -> str | None:
        stamps: list[str] = []
        candidates: list[bytes] = []
        for item in _header(headers, self.HEADER).split(","):
            key, _, value = item.strip().partition("=")
            if key == "t":
                stamps.append(value)
            elif key == "v1":
                candidates.append(_from_hex(value))
        if len(stamps) != 1:
            raise InvalidSignature(f"the {self.HEADER} header needs exactly one t=<timestamp>")
        timestamp = _timestamp(stamps[0])
        expected = [_mac(key, stamps[0].encode(), b".", body) for key in self._keys]
        if not _any_match(expected, _bounded(candidates, self.HEADER)):
            raise InvalidSignature(f"no {self.HEADER} v1 matches this body and a current "
                                   "secret")
        _check_age(timestamp, self.tolerance, self._clock)
        return None

    def sign(self, body: bytes, timestamp: int | None = None) -> dict[str, str]:
        stamp = str(int(self._clock()) if timestamp is None else timestamp)
        v1 = ",".join("v1=" + _mac(k, stamp.encode(), b".", body).hex() for k in self._keys)
        return {self.HEADER: f"t={stamp},{v1}"}


class GitHubSignature:
    """GitHub's scheme: `X-Hub-Signature-256: sha256=<hex>` over the body alone.

    No timestamp is signed, so there is no tolerance: a captured delivery verifies
    forever. Its replay is a `duplicate` while the inbox row is kept; keep inbox
    retention beyond the redelivery horizon (GitHub: manual redeliveries for 3 days).
    """

    HEADER = "X-Hub-Signature-256"

    def __init__(self, secrets: Secret | Iterable[Secret]) -> None:
        self._keys = _secrets(secrets, _raw_secret)

    def verify(self, headers: Mapping[str, str], body: bytes) -> str | None:
        value = _header(headers, self.HEADER)
        algorithm, _, digest = value.partition("=")
        if algorithm != "sha256":
            raise InvalidSignature(f"the {self.HEADER} header is sha256=<hex>")
        expected = [_mac(key, body) for key in self._keys]
        if not _any_match(expected, [_from_hex(digest)]):
            raise InvalidSignature(f"the {self.HEADER} signature does not match this body "
                                   "and a current secret")
        return None

    def sign(self, body: bytes) -> dict[str, str]:
        return {self.HEADER: "sha256=" + _mac(self._keys[0], body).hex()}


@dataclass(frozen=True, slots=True)
class Verified:
    """A delivery that passed: its source, the signed delivery id if any, and whether
    it was signed at all (False only in the explicit `WebhookSources.unsigned()` mode)."""

    source: str
    delivery_id: str | None
    signed: bool


def _check_name(source: str) -> str:
    if not isinstance(source, str) or not _PRINTABLE.fullmatch(source):
        raise ConfigurationError(
            f"a webhook source name is 1-{MAX_NAME} printable ASCII characters, "
            f"not {source!r}")
    return source


def parse_secrets(spec: str) -> dict[str, list[str]]:
    """`billing=whsec_a,crm=whsec_b,billing=whsec_c` -> {source: [secrets...]}.

    A source named twice has several secrets (rotation). Base64 padding (`=`) stays
    in the secret: only the first `=` of an item separates the name.
    """
    found: dict[str, list[str]] = {}
    for n, item in enumerate(spec.split(","), 1):
        name, sep, secret = item.strip().partition("=")
        if not sep or not name.strip() or not secret.strip():  # never echo a secret
            raise ConfigurationError(f"webhook secrets are source=secret items separated "
                                     f"by commas; item {n} is not")
        found.setdefault(_check_name(name.strip()), []).append(secret.strip())
    return found


class WebhookSources:
    """The sources a receiver accepts, each with its verifier.

    `verify(source, headers, body)` is the one call an endpoint makes, on the raw body,
    before parsing: `UnknownSource` (404) for an unregistered source,
    `InvalidSignature` (401) for a missing, bad or stale signature. An endpoint can
    call `check_source` first, to answer 404 before reading a body.
    """

    def __init__(self, verifiers: Mapping[str, Verifier] | None = None) -> None:
        self._verifiers: dict[str, Verifier] = {}
        self._unsigned = False
        for name, verifier in (verifiers or {}).items():
            self.register(name, verifier)

    @classmethod
    def unsigned(cls) -> WebhookSources:
        """Accept every source without a signature: demos and tests only.

        Anyone who can reach the endpoint then decides what the inbox holds. Metric
        labels stay bounded: no name is registered, all count as "other".
        """
        sources = cls()
        sources._unsigned = True
        return sources

    @classmethod
    def standard_webhooks(cls, spec: str | Mapping[str, Secret | Sequence[Secret]], *,
                          tolerance: float = DEFAULT_TOLERANCE,
                          clock: Clock = time.time) -> WebhookSources:
        """Standard Webhooks sources from `billing=whsec_...,crm=whsec_...` or a mapping."""
        table = parse_secrets(spec) if isinstance(spec, str) else dict(spec)
        if not table:
            raise ConfigurationError("no webhook sources given")
        return cls({name: StandardWebhooks(secrets, tolerance=tolerance, clock=clock)
                    for name, secrets in table.items()})

    def register(self, source: str, verifier: Verifier) -> None:
        """Accept `source`, signed as `verifier` checks (replaces its previous verifier)."""
        register_source_label(_check_name(source))
        self._verifiers[source] = verifier

    def remove(self, source: str) -> None:
        self._verifiers.pop(source, None)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._verifiers)

    @property
    def signed(self) -> bool:
        """False only for `unsigned()`: then nothing is verified."""
        return not self._unsigned

    def check_source(self, source: str) -> None:
        """`UnknownSource` (404) unless `source` is registered (or the mode is unsigned)."""
        if not self._unsigned and source not in self._verifiers:
            shown = source if len(source) <= 64 else source[:64] + "..."
            raise UnknownSource(f"no webhook source {shown!r} is registered")

    def verify(self, source: str, headers: Mapping[str, str], body: bytes) -> Verified:
        """Check `body`, exactly as received, against `source`'s signature scheme."""
        self.check_source(source)
        verifier = self._verifiers.get(source)
        if verifier is None:  # unsigned mode
            return Verified(source, None, signed=False)
        return Verified(source, verifier.verify(headers, body), signed=True)
