"""The Django app: `INSTALLED_APPS = [..., "outbox.contrib.django"]` (label `outbox`)."""

from __future__ import annotations

from django.apps import AppConfig


class OutboxConfig(AppConfig):
    name = "outbox.contrib.django"
    label = "outbox"
    verbose_name = "Outbox"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from outbox import add_doorbell
        from outbox.contrib.django import checks, conf

        checks.register()
        if not conf.problems():  # else the checks report it; never fail at import
            for bell in conf.get().doorbells:
                add_doorbell(bell)
