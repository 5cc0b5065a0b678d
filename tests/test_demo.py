"""`outbox demo --short` end to end: real processes, a real storm, a real SIGKILL.

The demo checks its own invariants and exits 1 when one fails; these tests read its
JSON report as well, so a broken check cannot pass silently, and look for processes
it might have left behind (the embedded PostgreSQL above all).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _outbox() -> list[str]:
    script = Path(sys.executable).with_name("outbox")
    return [str(script)] if script.exists() else [sys.executable, "-m", "dispatcher.cli"]


def _processes_mentioning(needle: str) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True,
                        check=True).stdout
    return [line for line in ps.splitlines()[1:] if needle in line]


@pytest.fixture
def home() -> Iterator[Path]:
    """A private OUTBOX_HOME in the repo's ignored `.outbox/` (not pytest's tmp_path:
    as root the embedded server runs as a system user that must reach the folder)."""
    path = ROOT / ".outbox" / f"test-demo-{os.getpid()}-{time.monotonic_ns()}"
    path.mkdir(parents=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run_demo(env: dict[str, str], timeout: float = 240.0) -> tuple[int, str, dict[str, Any],
                                                                    float]:
    env = {k: v for k, v in env.items() if k not in ("BROKER_URL", "CELERY_BROKER_URL")}
    t0 = time.monotonic()
    proc = subprocess.Popen([*_outbox(), "demo", "--short", "--json"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the demo stops its children and its PostgreSQL
        stdout, stderr = proc.communicate(timeout=60)
        pytest.fail(f"the demo took more than {timeout:.0f}s:\n{stdout}\n{stderr}")
    took = time.monotonic() - t0
    lines = stdout.strip().splitlines()
    assert lines, f"no output; stderr:\n{stderr}"
    report = json.loads(lines[-1])
    return proc.returncode, stdout + stderr, report, took


def logs(home: Path) -> str:
    """The children's logs, for the assertion message when the demo fails."""
    parts = []
    for log in sorted((home / "demo").glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-40:]
        parts.append(f"--- {log.name}\n" + "\n".join(tail))
    return "\n".join(parts)


def check_report(status: int, output: str, report: dict[str, Any], home: Path) -> None:
    assert status == 0, output + "\n" + logs(home)
    assert report["ok"] is True, output
    assert all(report["invariants"].values()), report["invariants"]
    # zero lost: every effect of every payment was applied at the PSP
    assert report["effects"]["lost"] == 0
    assert report["effects"]["stuck"] == 0
    assert report["effects"]["dead_lettered"] == 0
    assert report["effects"]["delivered"] == report["effects"]["expected"] \
        == 2 * report["payments"]
    # one charge applied per payment, never two for one key
    assert report["payments_created"] == report["payments"] == 40
    assert report["charges_applied"] == report["payments_created"]
    assert report["max_applied_per_key"] == 1
    # no 5xx, and the storm really stormed: twins, replays, mismatches, bad requests, a kill
    responses = report["responses"]
    assert responses["5xx"] == 0
    assert responses["unreachable"] == 0
    assert responses["replayed"] > 0
    assert responses["422"] == 4
    assert responses["4xx_bad_request"] == 5
    assert report["workers_killed"] == 1
    assert report["duplicates_prevented"]["api"] > 0
    # and the terminal output is the readable report, not a traceback
    assert "Traceback" not in output
    assert "PASS: every payment charged exactly once" in output


def test_demo_short_on_the_embedded_database(home: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env["OUTBOX_HOME"] = str(home)
    status, output, report, took = run_demo(env)
    print(output, f"\n(took {took:.1f}s)")
    check_report(status, output, report, home)
    assert report["database"] == "embedded"
    assert report["dispatcher"] == "standalone"
    # the demo owned the embedded server: it must be gone, and every child with it
    pgdata = home / "pgdata"
    assert pgdata.is_dir()
    deadline = time.monotonic() + 10
    while _processes_mentioning(str(pgdata)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_mentioning(str(pgdata)) == []
    assert not (pgdata / "postmaster.pid").exists()
    assert _processes_mentioning(str(home / "demo")) == []  # the PSP's --db path


def test_demo_short_on_database_url(db_url: str, home: Path) -> None:
    env = dict(os.environ)
    env["DATABASE_URL"] = db_url
    env["OUTBOX_HOME"] = str(home)
    status, output, report, took = run_demo(env)
    print(output, f"\n(took {took:.1f}s)")
    check_report(status, output, report, home)
    assert report["database"] == "DATABASE_URL"
    assert not (home / "pgdata").exists()  # nothing embedded was started
    assert _processes_mentioning(str(home / "demo")) == []
