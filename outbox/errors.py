"""Every exception the project raises, as one small tree.

    OutboxError
    ├── ConfigurationError           bad settings; the process cannot start
    ├── InvalidInput                 a client's input is wrong: map it to a 4xx
    │   ├── InvalidIdempotencyKey    400: missing, empty, too long, control chars
    │   ├── InvalidRequestBody       400: not JSON, NaN, duplicate members, ...
    │   │   └── RequestBodyTooLarge  413
    │   ├── InvalidEvent             400: a bad incoming event (ingestion)
    │   ├── UnsupportedMediaType     415: not JSON, other charset, compressed
    │   ├── InvalidTenant            400: unusable tenant header (HTTP scope)
    │   ├── Unauthenticated          401: no client identity to scope the key by
    │   ├── InvalidSignature         401: a webhook's signature is missing, bad or stale
    │   └── UnknownSource            404: a webhook from a source nobody registered
    ├── IdempotencyConflict          the key cannot be used for this request now
    │   ├── RequestInProgress        409 + Retry-After: a twin holds the key
    │   ├── KeyReused                422: same key, different request
    │   └── ClaimLost                our phased claim was taken over: roll back
    ├── EffectKeyConflict            an effect key already names another effect
    ├── LeaseLost                    a dispatcher's lease was taken over: fenced
    ├── RetentionTooShort            inbox retention below the source's horizon
    └── DeliveryError                raised by effect handlers to steer retries
        ├── RetryAfter               retry no sooner than `delay` seconds
        ├── PermanentFailure         never retry: dead-letter now
        ├── TransientFailure         retry with the policy's backoff
        └── AmbiguousOutcome         the request may have been applied

Client errors carry an HTTP `status` so an adapter maps them without a table.
"""

from __future__ import annotations


class OutboxError(Exception):
    """Base class of every error raised by `outbox` and `dispatcher`."""


class ConfigurationError(OutboxError):
    """The configuration is unusable (bad URL, missing embedded server, ...)."""


class InvalidInput(OutboxError):
    """A client sent something we refuse; never leaves state behind."""

    status: int = 400
    code: str = "invalid_input"


class InvalidIdempotencyKey(InvalidInput):
    code = "invalid_idempotency_key"


class InvalidRequestBody(InvalidInput):
    code = "invalid_body"


class RequestBodyTooLarge(InvalidRequestBody):
    status = 413
    code = "body_too_large"


class InvalidEvent(InvalidInput):
    code = "invalid_event"


class UnsupportedMediaType(InvalidInput):
    """415: the body is not JSON, not UTF-8, or compressed (we never inflate bodies)."""

    status = 415
    code = "unsupported_media_type"


class InvalidTenant(InvalidInput):
    """400: the tenant header is unusable as a scope (control chars, too long, twice)."""

    code = "invalid_tenant"


class Unauthenticated(InvalidInput):
    """401: the endpoint scopes keys by client, and this request names no client."""

    status = 401
    code = "unauthenticated"


class InvalidSignature(InvalidInput):
    """401: the raw body is not signed by a current secret of its source, or too late.

    Raised before the body is parsed or stored (outbox.webhooks). The message names
    the rule that failed, never an expected signature.
    """

    status = 401
    code = "invalid_signature"


class UnknownSource(InvalidInput):
    """404: events are accepted from registered sources only; nothing is stored."""

    status = 404
    code = "unknown_source"


class IdempotencyConflict(OutboxError):
    """The key exists in a state that forbids running this request now."""

    status: int = 409
    code: str = "idempotency_conflict"


class RequestInProgress(IdempotencyConflict):
    """A request with the same key is being processed; try again later."""

    code = "request_in_progress"

    def __init__(self, message: str = "a request with this key is in progress",
                 retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class KeyReused(IdempotencyConflict):
    """The key was first used with a different request (method, path or body)."""

    status = 422
    code = "idempotency_key_reused"


class ClaimLost(IdempotencyConflict):
    """Our phased claim expired and another request took the key over.

    Raised inside the business transaction by `complete()`: letting it propagate rolls
    back every business and outbox row of the zombie request.
    """

    code = "claim_lost"


class EffectKeyConflict(OutboxError):
    """`enqueue` met an existing effect with the same key but another kind or payload.

    A silent no-op would drop the new effect (a second charge never written), and the
    receiver would see one Idempotency-Key with two payloads. Raised inside the
    caller's transaction: letting it propagate rolls the business rows back too.
    """

    def __init__(self, effect_keys: list[str]) -> None:
        shown = ", ".join(effect_keys[:3]) + (" ..." if len(effect_keys) > 3 else "")
        super().__init__(f"effect key(s) already used for another kind or payload: {shown}")
        self.effect_keys = effect_keys


class LeaseLost(OutboxError):
    """A dispatcher wrote after its lease was taken over; the write was refused."""


class RetentionTooShort(ConfigurationError):
    """Purging inbox rows sooner than the source redelivers would re-apply events."""


class DeliveryError(OutboxError):
    """Raised by an effect handler to choose what happens to the effect next.

    `http_status` and `detail` (a short summary of the receiver's answer) are stored
    on the attempt and the effect, so an operator sees why without the logs.
    """

    def __init__(self, message: str = "delivery failed", *, http_status: int | None = None,
                 detail: object = None) -> None:
        super().__init__(message)
        self.http_status = http_status
        self.detail = detail


class RetryAfter(DeliveryError):
    """Retry the effect no sooner than `delay` seconds from now."""

    def __init__(self, delay: float, message: str = "retry requested", *,
                 http_status: int | None = None, detail: object = None) -> None:
        super().__init__(message, http_status=http_status, detail=detail)
        self.delay = max(0.0, float(delay))


class PermanentFailure(DeliveryError):
    """The effect can never succeed: dead-letter it without further attempts."""


class KeyRetentionPassed(PermanentFailure):
    """Not sent: a retry would reach the receiver after it may have forgotten the
    effect's key (`Registry.register(..., key_retention=)`), and then apply it again."""


class FirstAttemptTooLate(KeyRetentionPassed):
    """Not sent, and the attempt not counted: the effect's first attempt would have
    reached the receiver past its key retention, because this host was suspended (or
    the process stalled) longer than the lease between the claim and the send. Nobody
    sent it (the record's lease token shows nobody claimed it meanwhile), so the next
    claim is its first contact. Only the dispatcher's own refusal counts as this; a
    handler raising it is a KeyRetentionPassed like any other (parked)."""


#: The error names an effect parked past its key retention is recorded under (its
#: `last_error` starts with one and a colon): `outbox retry` by id clears its first
#: claim, and the console warns before it does.
KEY_RETENTION_REFUSALS = (KeyRetentionPassed.__name__, FirstAttemptTooLate.__name__)


class TransientFailure(DeliveryError):
    """Worth retrying with backoff (5xx, 409, refused connection, ...)."""


class AmbiguousOutcome(DeliveryError):
    """The request went out but its result is unknown (timeout, reset).

    Retried with the same effect key, unless the handler says the receiver cannot
    deduplicate; then the effect is parked for reconciliation.
    """
