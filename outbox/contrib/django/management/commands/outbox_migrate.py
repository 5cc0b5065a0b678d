"""`manage.py outbox_migrate`: bring the outbox schema to Alembic's head by itself.

`manage.py migrate` already does this through the app's Django migrations; this is
the repair for a schema that drifted behind what Django recorded (outbox.E010: a
faked migration, a restored dump) and the same as `outbox migrate`.
"""

from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand

from outbox import _migrate
from outbox.contrib.django.db import database_url


class Command(BaseCommand):
    help = "Apply the outbox schema's Alembic migrations (the same as `outbox migrate`)."
    requires_system_checks: list[str] = []  # it repairs what a check reports

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--revision", default="head", help="Alembic revision (head)")
        parser.add_argument("--database", default=None,
                            help="database alias (default OUTBOX['DATABASE'])")

    def handle(self, *args: Any, **options: Any) -> None:
        _migrate.upgrade(database_url(options["database"]), options["revision"])
        self.stdout.write(f"outbox schema migrated to {options['revision']}")
