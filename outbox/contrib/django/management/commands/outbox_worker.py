"""`manage.py outbox_worker`: `outbox worker` on the database of Django's settings."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from django.core.management.base import BaseCommand

from outbox.contrib.django import conf
from outbox.contrib.django.management.commands._cli import run_cli


class Command(BaseCommand):
    help = ("Run the standalone dispatcher (LISTEN/NOTIFY + polling) on Django's outbox "
            "database; the same process as `outbox worker`.")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--concurrency", type=int, default=8,
                            help="deliveries in flight (8)")
        parser.add_argument("--queue", default="default")
        parser.add_argument("--lease", type=float, default=30.0, help="lease seconds (30)")
        parser.add_argument("--poll", type=float, default=1.0, help="poll interval (1 s)")
        parser.add_argument("--grace", type=float, default=10.0, help="shutdown grace (10 s)")
        parser.add_argument("--handlers", default=None,
                            help="module:registry (default OUTBOX['HANDLERS'], then "
                                 "$OUTBOX_HANDLERS, then the payments example)")
        parser.add_argument("--name", default=None,
                            help="application_name for pg_stat_activity")
        parser.add_argument("--database", default=None,
                            help="database alias (default OUTBOX['DATABASE'])")

    def handle(self, *args: Any, **options: Any) -> None:
        argv = ["worker", "--concurrency", str(options["concurrency"]),
                "--queue", options["queue"], "--lease", str(options["lease"]),
                "--poll", str(options["poll"]), "--grace", str(options["grace"])]
        handlers = options["handlers"] or conf.get().handlers
        if handlers:
            argv += ["--handlers", handlers]
        if options["name"]:
            argv += ["--name", options["name"]]
        code = run_cli(argv, options["database"], self.stdout)
        if code:
            sys.exit(code)
