from __future__ import annotations

from django.urls import path

from dispatcher.examples.payments.django_app import views

urlpatterns = [
    path("payments", views.PaymentsView.as_view()),
    path("payments/<str:payment_id>", views.PaymentView.as_view()),
    path("webhooks/<str:source>", views.WebhookView.as_view()),
    path("webhooks/<str:source>/batch", views.WebhookBatchView.as_view()),
    path("healthz", views.HealthView.as_view()),
]
handler404 = views.not_found
handler500 = views.server_error
