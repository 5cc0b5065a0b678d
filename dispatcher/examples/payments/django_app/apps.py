from __future__ import annotations

from django.apps import AppConfig


class PaymentsConfig(AppConfig):
    name = "dispatcher.examples.payments.django_app"
    label = "payments"
    verbose_name = "Payments (example)"
    default_auto_field = "django.db.models.BigAutoField"
