"""Settings of the Django example: the database is `DATABASE_URL` (or the embedded
server), like the FastAPI example's; everything else is fixed for the contract.
"""

from __future__ import annotations

import os
from typing import Any

from sqlalchemy import make_url

from outbox._config import database_url


def database_from_url(url: str) -> dict[str, Any]:
    """A `DATABASES` entry for a PostgreSQL URL (query parameters become OPTIONS)."""
    parsed = make_url(url)
    options = {k: v if isinstance(v, str) else v[-1] for k, v in parsed.query.items()}
    host = parsed.host or options.pop("host", "")
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parsed.database or "",
        "USER": parsed.username or "",
        "PASSWORD": parsed.password or "",
        "HOST": host,
        "PORT": str(parsed.port or ""),
        "OPTIONS": {"application_name": "payments-api-django", **options},
        # Under ASGI each request runs in a thread of its own: a persistent connection
        # would outlive its thread. The server bounds concurrent requests (asgi.py).
        "CONN_MAX_AGE": 0,
        "ATOMIC_REQUESTS": False,
    }


SECRET_KEY = os.environ.get("EXAMPLE_DJANGO_SECRET_KEY", "example-only-not-a-secret")
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "dispatcher.examples.payments.django_app.urls"
DATABASES = {"default": database_from_url(database_url())}
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "rest_framework",
    "outbox.contrib.django",
    "dispatcher.examples.payments.django_app",
]
MIDDLEWARE = [
    "dispatcher.examples.payments.django_app.auth.BearerTokenMiddleware",
    "django.middleware.common.CommonMiddleware",  # Content-Length on every answer
]
APPEND_SLASH = False
REST_FRAMEWORK = {
    "EXCEPTION_HANDLER": "outbox.contrib.django.drf.problem_exception_handler",
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "dispatcher.examples.payments.django_app.auth.FromMiddleware"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.AllowAny"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "outbox.contrib.django.drf.JSONOnlyNegotiation",
    "UNAUTHENTICATED_USER": None,
}
OUTBOX = {
    # With Celery, ring a drain after each commit instead of waiting for the sweep.
    "DOORBELLS": ["dispatcher.celery_app.ring"] if os.environ.get("BROKER_URL") else [],
}
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
    # A 4xx is an answer, already in uvicorn's access log; errors (5xx) still show.
    "loggers": {"django.request": {"level": "ERROR"}},
}
