"""The `outbox` command: meaningful exit codes, one-line errors, repairs that work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from dispatcher.cli import main, parse_duration
from outbox import enqueue

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, db_url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dispatcher.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={"DATABASE_URL": db_url, "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize(("text_", "seconds"), [("90", 90), ("90s", 90), ("15m", 900),
                                               ("24h", 86400), ("7d", 604800), ("2w", 1209600)])
def test_durations(text_: str, seconds: float) -> None:
    assert parse_duration(text_) == seconds


@pytest.mark.parametrize("args", [
    ["purge", "--older-than", "soon"],
    ["trace", "no-such-effect"],
    ["retry", "abc"],
    ["retry"],
    ["purge", "--older-than", "7d", "--inbox-older-than", "1d", "--horizon", "stripe=3d"],
])
def test_bad_input_is_one_line_and_exit_2(db_url: str, args: list[str]) -> None:
    done = _cli(*args, db_url=db_url)
    assert done.returncode == 2, done
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("outbox:"), done.stderr
    assert "Traceback" not in done.stderr


def test_unreachable_database_is_one_line_and_exit_1() -> None:
    done = _cli("status", db_url="postgresql://nobody@127.0.0.1:1/none")
    assert done.returncode == 1
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "database error" in done.stderr


def test_not_a_postgres_url_is_a_configuration_error() -> None:
    done = _cli("status", db_url="mysql://x@y/z")
    assert done.returncode == 2 and "only PostgreSQL" in done.stderr


def test_status_trace_retry_cancel_purge(engine: Engine, db_url: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    with engine.begin() as conn:
        ids = [enqueue(conn, "k", {"i": i}).id for i in range(3)]
        conn.execute(text(
            "UPDATE outbox.effects SET status = 'failed', finished_at = now(), attempts = 3,"
            " last_error = 'boom' WHERE id = :id"), {"id": ids[0]})
        conn.execute(text(
            "INSERT INTO outbox.attempts (effect_id, attempt, worker, started_at, outcome,"
            " http_status, error) VALUES (:id, 3, 'w1', now(), 'failed', 500, 'boom')"),
            {"id": ids[0]})
        conn.execute(text(
            "UPDATE outbox.effects SET status = 'delivered', delivered_at = now() - interval"
            " '30 days', finished_at = now() - interval '30 days' WHERE id = :id"),
            {"id": ids[1]})

    assert main(["status", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["pending"], status["failed"], status["delivered"]) == (1, 1, 1)

    assert main(["trace", str(ids[0])]) == 0
    out = capsys.readouterr().out
    assert "attempt 3: failed" in out and "boom" in out

    assert main(["retry", "--failed"]) == 0
    assert "requeued 1" in capsys.readouterr().out
    assert main(["cancel", str(ids[2])]) == 0
    capsys.readouterr()
    assert main(["purge", "--older-than", "7d"]) == 0
    purged = json.loads(capsys.readouterr().out)
    assert purged["effects"] == 1
    with engine.connect() as conn:
        rows = dict(conn.execute(text("SELECT id, status FROM outbox.effects")).all())
    assert rows == {ids[0]: "pending", ids[2]: "cancelled"}
