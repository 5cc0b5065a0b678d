"""Run the `outbox` CLI (dispatcher/cli.py) on the database of Django's settings.

The management commands are the CLI itself, not a second implementation: the same
parser defaults, the same output and exit codes. Only the database differs: the URL
is built from `DATABASES[OUTBOX["DATABASE"]]` (outbox/contrib/django/db.py) and given
to the CLI as `DATABASE_URL` for the duration of the call.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

from outbox.contrib.django.db import database_url


@contextlib.contextmanager
def _database_url(using: str | None) -> Iterator[None]:
    previous = os.environ.get("DATABASE_URL")
    os.environ["DATABASE_URL"] = database_url(using)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("DATABASE_URL", None)
        else:
            os.environ["DATABASE_URL"] = previous


def run_cli(argv: Sequence[str], using: str | None, stdout: Any) -> int:
    """`outbox <argv>` against Django's database; its stdout goes to `stdout`."""
    from dispatcher import cli  # the commands may use the dispatcher; `outbox` never does

    with _database_url(using), contextlib.redirect_stdout(stdout):
        return cli.main(list(argv))
