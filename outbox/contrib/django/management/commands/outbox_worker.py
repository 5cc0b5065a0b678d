"""`manage.py outbox_worker`: `outbox worker` on the database of Django's settings."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.utils.connection import ConnectionDoesNotExist

from outbox.contrib.django import conf
from outbox.contrib.django.db import database_url
from outbox.contrib.django.management.commands._cli import run_cli
from outbox.errors import ConfigurationError


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
        # The default is dispatcher.producer.FULL_SCAN_EVERY's (outbox/ does not import
        # dispatcher/); tests/test_django.py checks that the two agree.
        parser.add_argument("--full-scan-every", type=float, default=2.0,
                            metavar="SECONDS",
                            help="under a full backlog, claim from the head of the queue "
                                 "(not the watermark) at least this often (2); 0: always")
        parser.add_argument("--database", action="append", default=None, metavar="ALIAS",
                            help="database alias (default OUTBOX['DATABASE']); repeat it "
                                 "to serve several outbox databases from this one process "
                                 "(`outbox worker --database`), named by their aliases")

    def handle(self, *args: Any, **options: Any) -> None:
        argv = ["worker", "--concurrency", str(options["concurrency"]),
                "--queue", options["queue"], "--lease", str(options["lease"]),
                "--poll", str(options["poll"]), "--grace", str(options["grace"]),
                "--full-scan-every", str(options["full_scan_every"])]
        handlers = options["handlers"] or conf.get().handlers
        if handlers:
            argv += ["--handlers", handlers]
        if options["name"]:
            argv += ["--name", options["name"]]
        aliases: list[str] = options["database"] or []
        try:
            for alias in aliases:  # an unknown or non-PostgreSQL alias: one line
                url = database_url(alias)
                if len(aliases) > 1:  # a fleet: each alias's database, named by its alias
                    argv += ["--database", f"{alias}={url}"]
        except (ConnectionDoesNotExist, ConfigurationError) as exc:
            raise CommandError(str(exc)) from None
        code = run_cli(argv, aliases[0] if aliases else None, self.stdout)
        if code:
            sys.exit(code)
