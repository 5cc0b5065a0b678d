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
    ["retry", "abc"],
    ["retry"],
    ["cancel"],
    ["retry", "--status", "failed", "--older-than", "soon"],
    ["cancel", "1", "--kind", "k"],
    ["cancel", "--status", "delivered"],
    ["purge", "--older-than", "7d", "--inbox-older-than", "1d", "--horizon", "stripe=3d"],
    ["purge", "--older-than", "7d", "--duty", "0"],
    ["purge", "--older-than", "7d", "--duty", "2"],
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


# -- issue 12: --version, list, retry/cancel by filter, migrate --check, exit codes ------


def _fail(engine: Engine, ids: list[int]) -> None:
    with engine.begin() as conn:
        conn.execute(text(
            "UPDATE outbox.effects SET status = 'failed', finished_at = now(), attempts = 3,"
            " last_error = 'boom' WHERE id = ANY(:ids)"), {"ids": ids})


def _statuses(engine: Engine) -> dict[int, str]:
    with engine.connect() as conn:
        return dict(conn.execute(text("SELECT id, status FROM outbox.effects")).all())


def test_version(db_url: str) -> None:
    from importlib.metadata import version

    done = _cli("--version", db_url=db_url)
    assert done.returncode == 0, done
    assert done.stdout.strip() == f"outbox (pg-outbox) {version('pg-outbox')}"


@pytest.mark.parametrize("args", [["trace", "no-such-effect"], ["trace", "999999999"],
                                  ["retry", "999999999"], ["cancel", "999999998"]])
def test_not_found_is_exit_3_not_usage(db_url: str, args: list[str]) -> None:
    done = _cli(*args, db_url=db_url)
    assert done.returncode == 3, done
    assert done.stderr.startswith("outbox: not found:"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_list_filters(engine: Engine, db_url: str) -> None:
    with engine.begin() as conn:
        a = [enqueue(conn, "mail", {"i": i}).id for i in range(3)]
        b = [enqueue(conn, "charge", {"i": i}, queue="payments").id for i in range(2)]
        conn.execute(text("UPDATE outbox.effects SET created_at = now() - interval '2 days'"
                          " WHERE id = :id"), {"id": a[0]})
    _fail(engine, [a[1], b[0]])

    def listed(*args: str) -> list[int]:
        done = _cli("list", "--json", *args, db_url=db_url)
        assert done.returncode == 0, done
        return [json.loads(line)["id"] for line in done.stdout.splitlines()]

    assert listed() == sorted(a + b, reverse=True)
    assert listed("--status", "failed") == sorted([a[1], b[0]], reverse=True)
    assert listed("--status", "failed", "--status", "pending", "--kind", "mail") == \
        sorted(a, reverse=True)
    assert listed("--queue", "payments") == sorted(b, reverse=True)
    assert listed("--older-than", "1d") == [a[0]]
    assert listed("--newer-than", "1h", "--kind", "mail") == [a[2], a[1]]
    assert listed("--limit", "2") == sorted(a + b, reverse=True)[:2]
    text_out = _cli("list", "--kind", "charge", db_url=db_url)
    assert text_out.returncode == 0 and "charge" in text_out.stdout
    assert _cli("list", "--status", "nope", db_url=db_url).returncode == 2


def test_retry_by_filter_with_dry_run(engine: Engine, db_url: str) -> None:
    with engine.begin() as conn:
        mail = [enqueue(conn, "mail", {"i": i}).id for i in range(3)]
        charge = [enqueue(conn, "charge", {"i": i}).id for i in range(2)]
    _fail(engine, mail + charge)
    with engine.begin() as conn:  # a parked one of the same kind: never retried in bulk
        conn.execute(text("UPDATE outbox.effects SET status = 'needs_review'"
                          " WHERE id = :id"), {"id": mail[2]})

    dry = _cli("retry", "--kind", "mail", "--dry-run", db_url=db_url)
    assert dry.returncode == 0, dry
    assert "would have requeued 2 effects" in dry.stdout
    assert set(_statuses(engine).values()) == {"failed", "needs_review"}

    done = _cli("retry", "--kind", "mail", "--batch", "1", db_url=db_url)
    assert done.returncode == 0, done
    assert "requeued 2 effects" in done.stdout
    st = _statuses(engine)
    assert [st[i] for i in mail] == ["pending", "pending", "needs_review"]
    assert {st[i] for i in charge} == {"failed"}

    nothing = _cli("retry", "--kind", "no-such-kind", db_url=db_url)
    assert nothing.returncode == 0 and "requeued 0 effects" in nothing.stdout
    # By id: a parked effect is retried after a look; one that is pending is not.
    assert _cli("retry", "--dry-run", str(mail[2]), db_url=db_url).returncode == 0
    assert _statuses(engine)[mail[2]] == "needs_review"
    assert _cli("retry", str(mail[0]), db_url=db_url).returncode == 1
    assert _cli("retry", str(mail[2]), db_url=db_url).returncode == 0


def test_cancel_by_filter_never_touches_in_flight(engine: Engine, db_url: str) -> None:
    with engine.begin() as conn:
        ids = [enqueue(conn, "mail", {"i": i}, queue="q2").id for i in range(4)]
        other = enqueue(conn, "mail", {"i": 9}).id
        conn.execute(text(
            "UPDATE outbox.effects SET status = 'in_flight', attempts = 1,"
            " lease_token = gen_random_uuid(), lease_owner = 'w',"
            " lease_expires_at = now() + interval '1 minute' WHERE id = :id"),
            {"id": ids[0]})
    _fail(engine, [ids[1]])

    dry = _cli("cancel", "--queue", "q2", "--dry-run", db_url=db_url)
    assert dry.returncode == 0 and "would have cancelled 3 effects" in dry.stdout, dry
    only_failed = _cli("cancel", "--queue", "q2", "--status", "failed", "--dry-run",
                       db_url=db_url)
    assert "would have cancelled 1 effects" in only_failed.stdout
    done = _cli("cancel", "--queue", "q2", "--batch", "2", db_url=db_url)
    assert done.returncode == 0 and "cancelled 3 effects" in done.stdout, done
    st = _statuses(engine)
    assert st[ids[0]] == "in_flight"
    assert [st[i] for i in ids[1:]] == ["cancelled"] * 3
    assert st[other] == "pending"
    # By id: an in-flight effect cannot be cancelled (exit 1, not "not found").
    assert _cli("cancel", str(ids[0]), db_url=db_url).returncode == 1


def test_migrate_check_and_current(db_url: str) -> None:
    from alembic.script import ScriptDirectory

    from outbox import _migrate

    head = ScriptDirectory.from_config(_migrate.alembic_config()).get_current_head()
    check = _cli("migrate", "--check", db_url=db_url)
    assert check.returncode == 0, check
    assert f"current {head}, head {head}" in check.stdout
    current = _cli("migrate", "--current", db_url=db_url)
    assert current.returncode == 0 and current.stdout.strip() == head


def test_unmigrated_database_says_run_migrate(engine: Engine, db_url: str) -> None:
    from sqlalchemy import make_url

    name = "outbox_cli_unmigrated"
    admin = engine.execution_options(isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS {name}"))
        conn.execute(text(f"CREATE DATABASE {name}"))
    url = make_url(db_url).set(database=name).render_as_string(hide_password=False)
    try:
        status = _cli("status", db_url=url)
        assert status.returncode == 1, status
        assert "run `outbox migrate`" in status.stderr
        assert len(status.stderr.strip().splitlines()) == 1, status.stderr
        check = _cli("migrate", "--check", db_url=url)
        assert check.returncode == 1, check
        assert "current none (not migrated)" in check.stdout
        assert "run `outbox migrate`" in check.stderr
        assert _cli("migrate", "--current", db_url=url).stdout.strip() == "none"
        assert _cli("migrate", db_url=url).returncode == 0
        assert _cli("migrate", "--check", db_url=url).returncode == 0
        assert _cli("status", db_url=url).returncode == 0
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


def test_status_tells_who_holds_the_xmin_horizon_and_a_missing_timeout(
        engine: Engine, db_url: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 17's guard rails: `outbox status` shows the oldest xmin holder, warns when one
    has held the horizon too long, and when other clients of the database get no
    `idle_in_transaction_session_timeout` (a forgotten session would hold it forever)."""
    import time

    from sqlalchemy import make_url

    from dispatcher import cli

    monkeypatch.setattr(cli, "HORIZON_WARN_SECONDS", 0.5)
    name = make_url(db_url).database
    admin = engine.execution_options(isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" SET'
                              " idle_in_transaction_session_timeout = 0"))
        with engine.connect() as report:  # a report's transaction, left open
            report = report.execution_options(isolation_level="REPEATABLE READ")
            report.begin()
            report.execute(text("SET LOCAL idle_in_transaction_session_timeout = 0"))
            report.execute(text("SELECT count(*) FROM outbox.effects")).scalar()
            time.sleep(1.0)
            assert main(["status", "--json"]) == 0
            out = capsys.readouterr()
            report.rollback()
        snap = json.loads(out.out)
        assert snap["xmin_horizon"]["session"]["seconds"] >= 1.0
        assert snap["idle_in_transaction_session_timeout"] == "0"
        assert "has held the xmin horizon" in out.err
        assert "idle_in_transaction_session_timeout is 0" in out.err
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" SET'
                              " idle_in_transaction_session_timeout = '5min'"))
        assert main(["status"]) == 0
        out = capsys.readouterr()
        assert "xmin horizon" in out.out and "5min" in out.out
        assert "has held" not in out.err and "is 0" not in out.err
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" RESET'
                              " idle_in_transaction_session_timeout"))
