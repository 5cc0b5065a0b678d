"""`manage.py outbox_status [--json]`: `outbox status` on Django's outbox database."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from django.core.management.base import BaseCommand

from outbox.contrib.django.management.commands._cli import run_cli


class Command(BaseCommand):
    help = "Effects by status, health and blocked ordering keys (the same as `outbox status`)."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true",
                            help="one JSON object: counts by status first, then health")
        parser.add_argument("--database", default=None,
                            help="database alias (default OUTBOX['DATABASE'])")

    def handle(self, *args: Any, **options: Any) -> None:
        code = run_cli(["status", *(["--json"] if options["json"] else [])],
                       options["database"], self.stdout)
        if code:
            sys.exit(code)
