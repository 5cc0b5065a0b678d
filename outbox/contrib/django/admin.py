"""The Django admin for the outbox: effects, attempts and idempotency keys.

Read only, with two actions on effects: **retry** and **cancel**. They run the CLI's
own statements (outbox/sql/effects.py `requeue` and `cancel`, as `outbox retry` /
`outbox cancel` do), on Django's connection in one transaction, so they are fenced the
same way: retry only moves `failed`, `needs_review` and `cancelled` effects back to
`pending`; cancel never touches an `in_flight` effect (it may already be applied at
the receiver) or a delivered one. What the statement refused is reported, not hidden.
Editing a row by hand is not offered: the state machine's CHECKs and the dispatcher's
lease tokens are not something a form should race with.

Permissions: viewing needs the model's `view` permission; the actions need
`outbox.change_effect`.

With `OUTBOX["CONSOLE_URL"]` set (where `outbox.contrib.django.console.console_app`
serves the web console), the effects list links to it: "Open the outbox console".
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from django.contrib import admin, messages
from django.db import transaction
from django.db.models import QuerySet
from django.db.models.expressions import RawSQL
from django.http import HttpRequest, HttpResponse
from django.utils.html import format_html

from outbox.contrib.django.db import DjangoStatements, alias
from outbox.contrib.django.models import Attempt, Effect, IdempotencyKey
from outbox.sql import effects as fx


class _ReadOnly(admin.ModelAdmin):  # type: ignore[type-arg]
    show_full_result_count = False  # no second count(*) over a big table per page

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class AttemptInline(admin.TabularInline):  # type: ignore[type-arg]
    model = Attempt
    fk_name = "effect"
    extra = 0
    can_delete = False
    fields = ("attempt", "outcome", "http_status", "started_at", "finished_at", "worker",
              "trace_id", "error")
    readonly_fields = fields
    ordering = ("attempt", "id")

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


def _run(ids: Sequence[int], statement: Any) -> list[int]:
    """One CLI statement on Django's connection, in its own transaction."""
    with transaction.atomic(using=alias()):
        done: list[int] = statement(DjangoStatements(), list(ids))
    return done


class _SearchByEffectKey(_ReadOnly):
    """Also finds the rows of an exact effect key, through outbox.effect_keys: effects
    have no index on effect_key since migration 0007, so a plain `=effect_key` search
    field would read the whole table. `effect_column`: the column holding the effect."""

    effect_column = "id"

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[Any],
                           search_term: str) -> tuple[QuerySet[Any], bool]:
        found, dupes = super().get_search_results(request, queryset, search_term)
        term = search_term.strip()
        if not term:
            return found, dupes
        by_key = queryset.filter(
            **{f"{self.effect_column}__in": RawSQL(fx.EFFECT_ID_BY_KEY, (term,))})
        return found | by_key, dupes


@admin.register(Effect)
class EffectAdmin(_SearchByEffectKey):
    list_display = ("id", "kind", "status", "queue", "attempts_shown", "available_at",
                    "ordering_key", "effect_key", "last_error_short")
    list_filter = ("status", "kind", "queue")
    search_fields = ("=id", "=ordering_key")  # and the exact key (the mixin)
    inlines = (AttemptInline,)
    actions = ("retry", "cancel")
    readonly_fields = ("id", "effect_key", "kind", "status", "queue", "ordering_key",
                       "attempts", "max_attempts", "available_at", "retry_until",
                       "created_at", "delivered_at", "finished_at", "lease_owner",
                       "lease_expires_at", "trace", "payload_json", "headers_json",
                       "result_json", "last_error")
    fields = readonly_fields

    def changelist_view(self, request: HttpRequest,
                        extra_context: dict[str, Any] | None = None) -> HttpResponse:
        from outbox.contrib.django import conf

        context = {"outbox_console_url": conf.raw().get("CONSOLE_URL") or None,
                   **(extra_context or {})}
        return super().changelist_view(request, extra_context=context)

    @admin.display(description="attempts")
    def attempts_shown(self, obj: Effect) -> str:
        return f"{obj.attempts}/{obj.max_attempts}"

    @admin.display(description="last error")
    def last_error_short(self, obj: Effect) -> str:
        text = obj.last_error or ""
        return text if len(text) <= 80 else text[:79] + "…"

    @admin.display(description="trace id")
    def trace(self, obj: Effect) -> str:
        return obj.trace_id or "-"

    @staticmethod
    def _json(value: Any) -> str:
        return format_html("<pre>{}</pre>", json.dumps(value, indent=2, sort_keys=True))

    @admin.display(description="payload")
    def payload_json(self, obj: Effect) -> str:
        return self._json(obj.payload)

    @admin.display(description="headers")
    def headers_json(self, obj: Effect) -> str:
        return self._json(obj.headers)

    @admin.display(description="result")
    def result_json(self, obj: Effect) -> str:
        return self._json(obj.result)

    def has_retry_permission(self, request: HttpRequest) -> bool:
        has_perm = getattr(request.user, "has_perm", None)
        return bool(has_perm is not None and has_perm("outbox.change_effect"))

    has_cancel_permission = has_retry_permission

    def _apply(self, request: HttpRequest, queryset: QuerySet[Effect], statement: Any,
               verb: str, rule: str) -> None:
        """Run `statement` (one of the CLI's, outbox/sql/effects.py) on the selected
        effects, then report what it did and what it refused (`rule` says why)."""
        asked = list(queryset.values_list("id", flat=True))
        done = _run(asked, statement)
        if done:
            self.message_user(request, f"{verb} {len(done)} effect(s): "
                              f"{', '.join(f'#{i}' for i in sorted(done)[:50])}",
                              messages.SUCCESS)
        refused = sorted(set(asked) - set(done))
        if refused:
            self.message_user(request, f"refused {len(refused)} effect(s) ({rule}): "
                              f"{', '.join(f'#{i}' for i in refused[:50])}", messages.WARNING)

    @admin.action(description="Retry: requeue with a fresh set of attempts",
                  permissions=["retry"])
    def retry(self, request: HttpRequest, queryset: QuerySet[Effect]) -> None:
        self._apply(request, queryset, lambda conn, ids: fx.requeue(conn, ids), "requeued",
                    "only failed, needs-review or cancelled effects are retried")

    @admin.action(description="Cancel: never deliver (not in flight, not delivered)",
                  permissions=["cancel"])
    def cancel(self, request: HttpRequest, queryset: QuerySet[Effect]) -> None:
        self._apply(request, queryset, lambda conn, ids: fx.cancel(conn, ids), "cancelled",
                    "in-flight effects may already be applied; delivered ones are done")


@admin.register(Attempt)
class AttemptAdmin(_SearchByEffectKey):
    list_display = ("id", "effect_link", "attempt", "outcome", "http_status", "finished_at",
                    "worker", "trace_id")
    list_filter = ("outcome", "effect__kind", "effect__queue")
    search_fields = ("=trace_id", "=effect__id")  # and the effect's key (the mixin)
    list_select_related = ("effect",)
    effect_column = "effect_id"

    def get_object(self, request: HttpRequest, object_id: str,
                   from_field: str | None = None) -> Attempt | None:
        """An attempt of outbox.attempt_history by its id, through an index in both
        halves of the view: a delivery kept on its effect row has id -effect_id (found by
        the effect's primary key), any other attempt is an outbox.attempts row (its
        effect found by that row). A lookup by the id alone reads every effect."""
        try:
            ident = int(object_id)
        except ValueError:
            return None
        found = self.get_queryset(request)
        if ident < 0:
            found = found.filter(effect_id=-ident)
        else:  # an outbox.attempts row: its effect too, or the view's other half scans
            found = found.filter(effect_id__in=RawSQL(fx.EFFECT_ID_OF_ATTEMPT, (ident,)))
        row: Attempt | None = found.filter(pk=ident).first()
        return row

    @admin.display(description="effect")
    def effect_link(self, obj: Attempt) -> str:
        return format_html('<a href="../effect/{}/change/">#{} {}</a>', obj.effect_id,
                           obj.effect_id, obj.effect.kind)


@admin.register(IdempotencyKey)
class IdempotencyKeyAdmin(_ReadOnly):
    list_display = ("scope", "key", "status", "response_status", "created_at",
                    "completed_at", "expires_at")
    list_filter = ("status",)
    search_fields = ("=key", "scope")
    readonly_fields = ("scope", "key", "status", "fingerprint", "generation", "lock_token",
                       "locked_at", "lock_expires_at", "response_status", "headers_shown",
                       "body_shown", "created_at", "completed_at", "expires_at")
    fields = readonly_fields

    @admin.display(description="response headers")
    def headers_shown(self, obj: IdempotencyKey) -> str:
        return format_html("<pre>{}</pre>", json.dumps(obj.response_headers, indent=2))

    @admin.display(description="response body")
    def body_shown(self, obj: IdempotencyKey) -> str:
        body = bytes(obj.response_body or b"")
        text = body[:4096].decode("utf-8", "replace")
        more = f"\n… {len(body) - 4096} more bytes" if len(body) > 4096 else ""
        return format_html("<pre>{}{}</pre>", text, more)
