"""Read models over the outbox schema, for the admin: unmanaged, so Django never
creates, alters or drops these tables (Alembic owns them, see migrations_support.py).

Writes never go through these models: retry and cancel run the CLI's fenced
statements (outbox/sql/effects.py) and everything else belongs to the dispatcher.
"""

from __future__ import annotations

from django.db import models

from outbox._schema import AttemptOutcome, EffectStatus, KeyStatus


def _choices(values: type[EffectStatus] | type[AttemptOutcome] | type[KeyStatus]
             ) -> list[tuple[str, str]]:
    return [(v.value, v.value.replace("_", " ")) for v in values]


class Effect(models.Model):
    """outbox.effects: one external effect, its state machine and lease."""

    id = models.BigIntegerField(primary_key=True)
    effect_key = models.TextField()  # unique through outbox.effect_keys (0007)
    kind = models.TextField()
    payload = models.JSONField()
    headers = models.JSONField(default=dict)
    ordering_key = models.TextField(null=True, blank=True)
    queue = models.TextField(default="default")
    status = models.TextField(choices=_choices(EffectStatus), default="pending")
    attempts = models.IntegerField(default=0)
    max_attempts = models.IntegerField(default=25)
    available_at = models.DateTimeField()
    retry_until = models.DateTimeField(null=True, blank=True)
    lease_owner = models.TextField(null=True, blank=True)
    lease_token = models.UUIDField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField()
    delivered_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(null=True, blank=True)
    result = models.JSONField(null=True, blank=True)

    class Meta:
        managed = False
        db_table = '"outbox"."effects"'
        ordering = ("-id",)
        verbose_name = "effect"

    def __str__(self) -> str:
        return f"#{self.id} {self.kind} ({self.status})"

    @property
    def trace_id(self) -> str | None:
        """The trace the effect was enqueued in (its W3C traceparent)."""
        parent = (self.headers or {}).get("traceparent") if isinstance(self.headers, dict) \
            else None
        parts = parent.split("-") if isinstance(parent, str) else []
        return parts[1] if len(parts) == 4 else None


class Attempt(models.Model):
    """outbox.attempt_history: one row per delivery attempt, with the trace it ran in
    (a view: outbox.attempts, and each delivered attempt kept on its effect row)."""

    id = models.BigIntegerField(primary_key=True)
    effect = models.ForeignKey(Effect, on_delete=models.DO_NOTHING, db_column="effect_id",
                               related_name="attempt_rows", db_constraint=False)
    effect_id: int  # the column under `effect` (django-stubs' plugin would infer it)
    attempt = models.IntegerField()
    worker = models.TextField()
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField()
    outcome = models.TextField(choices=_choices(AttemptOutcome))
    http_status = models.IntegerField(null=True, blank=True)
    error = models.TextField(null=True, blank=True)
    trace_id = models.TextField(null=True, blank=True)

    class Meta:
        managed = False
        db_table = '"outbox"."attempt_history"'
        ordering = ("effect_id", "attempt", "id")
        verbose_name = "attempt"

    def __str__(self) -> str:
        return f"attempt {self.attempt} of effect #{self.effect_id}: {self.outcome}"


class IdempotencyKey(models.Model):
    """outbox.idempotency_keys, read only.

    The table's primary key is (scope, key); Django's admin needs one column, so the
    record's `generation` stands in (a new UUID per record, kept by a take-over; only
    rows written before migration 0002 lack it, and those cannot be opened).
    """

    generation = models.UUIDField(primary_key=True)
    scope = models.TextField()
    key = models.TextField()
    fingerprint = models.TextField()
    status = models.TextField(choices=_choices(KeyStatus))
    lock_token = models.UUIDField(null=True, blank=True)
    locked_at = models.DateTimeField(null=True, blank=True)
    lock_expires_at = models.DateTimeField(null=True, blank=True)
    response_status = models.IntegerField(null=True, blank=True)
    response_headers = models.JSONField(null=True, blank=True)
    response_body = models.BinaryField(null=True, blank=True)
    created_at = models.DateTimeField()
    completed_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = '"outbox"."idempotency_keys"'
        ordering = ("-created_at",)
        verbose_name = "idempotency key"

    def __str__(self) -> str:
        return f"{self.scope} / {self.key} ({self.status})"
