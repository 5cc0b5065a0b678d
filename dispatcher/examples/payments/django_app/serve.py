"""`outbox example-api --framework django`: the DRF example under uvicorn (ASGI)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from types import FrameType

SETTINGS = "dispatcher.examples.payments.django_app.settings"


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def serve(host: str = "127.0.0.1", port: int = 8000) -> None:
    """Check, create the payments table, then serve until SIGTERM/SIGINT (exit 0)."""
    import django
    import uvicorn

    from dispatcher.metrics import configure_metrics
    from outbox.telemetry_setup import configure, instrument_library

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", SETTINGS)
    if configure("outbox-example-api"):
        instrument_library("django")  # a SERVER span per request, by the conventions
    configure_metrics("outbox-example-api")
    django.setup()
    from django.core import checks

    errors = [m for m in checks.run_checks() if m.is_serious()]
    if errors:
        for message in errors:
            print(f"outbox example-api: {message}", file=sys.stderr)
        raise SystemExit(2)

    from dispatcher.examples.payments.schema import ensure_schema
    from outbox._config import make_engine
    from outbox.contrib.django.db import database_url

    engine = make_engine(database_url(), application_name="payments-api-django")
    try:
        ensure_schema(engine)
    finally:
        engine.dispose()
    from dispatcher.examples.payments.django_app.asgi import application

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_cleanly)
    uvicorn.run(application, host=host, port=port, timeout_graceful_shutdown=10,
                log_level="info", lifespan="off")


def main(argv: list[str] | None = None) -> None:
    """`python -m dispatcher.examples.payments.django_app.serve [--host H] [--port P]`."""
    parser = argparse.ArgumentParser(description="Run the example payments API (Django).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    serve(args.host, args.port)


if __name__ == "__main__":
    main()
