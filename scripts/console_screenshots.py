#!/usr/bin/env python3
"""Regenerate the console screenshots in docs/img/ (docs/console.md shows them).

    uv run python scripts/console_screenshots.py

Needs Debian's Chromium (`apt-get install chromium`, /usr/bin/chromium) and the
Playwright package (the `dev` group); downloads no browser. Builds a database of its
own (`outbox_console_shots` on the server of $DATABASE_URL, or the embedded one) with
the benchmark's data shape at 20,000 effects plus an hour of recent attempts, serves
the console from this process on a free loopback port, shoots each page at 1280 px
and drops the database.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import uvicorn  # noqa: E402
from sqlalchemy import create_engine, make_url, text  # noqa: E402
from sqlalchemy.pool import NullPool  # noqa: E402

from bench.bench_console import SEED, SEED_ATTEMPTS  # noqa: E402
from outbox import _migrate  # noqa: E402
from outbox._config import database_url, make_engine  # noqa: E402
from outbox.console import create_console_app  # noqa: E402

DB = "outbox_console_shots"
OUT = ROOT / "docs" / "img"
CHROMIUM = "/usr/bin/chromium"

RECENT = """
INSERT INTO outbox.attempts (effect_id, attempt, worker, started_at, finished_at, outcome,
                             http_status, error, trace_id)
SELECT e.id, 1, 'worker-' || (m % 3), now() - make_interval(mins => m, secs => s),
       now() - make_interval(mins => m, secs => s) + interval '120 ms',
       CASE WHEN m BETWEEN 18 AND 24 AND s % 3 = 0 THEN 'retry' ELSE 'delivered' END,
       CASE WHEN m BETWEEN 18 AND 24 AND s % 3 = 0 THEN 503 ELSE 200 END,
       CASE WHEN m BETWEEN 18 AND 24 AND s % 3 = 0 THEN 'HTTP 503 from PSP' END,
       md5(e.id::text || m || s)
  FROM generate_series(0, 59) AS m, generate_series(0, 59, 4) AS s,
       LATERAL (SELECT id FROM outbox.effects WHERE status = 'delivered'
                 ORDER BY id DESC LIMIT 1 OFFSET (m * 15 + s / 4)) AS e
"""

STORY = """
WITH e AS (SELECT id FROM outbox.effects WHERE status = 'failed' ORDER BY id DESC LIMIT 1)
INSERT INTO outbox.attempts (effect_id, attempt, worker, started_at, finished_at, outcome,
                             http_status, error, trace_id)
SELECT e.id, a, 'worker-' || a, now() - make_interval(mins => 60 - a * 9),
       now() - make_interval(mins => 60 - a * 9) + make_interval(secs => 0.2 * a),
       CASE WHEN a < 4 THEN 'retry' ELSE 'failed' END, CASE WHEN a < 4 THEN 503 ELSE 422 END,
       CASE WHEN a < 4 THEN 'HTTP 503 from PSP' ELSE 'HTTP 422: card declined' END,
       md5('trace' || a)
  FROM e, generate_series(2, 4) AS a
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    from playwright.sync_api import sync_playwright

    server = make_url(database_url())
    admin = create_engine(server, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{DB}"'))
    url = server.set(database=DB).render_as_string(hide_password=False)
    server_thread: threading.Thread | None = None
    uv: uvicorn.Server | None = None
    try:
        _migrate.upgrade(url)
        engine = make_engine(url, application_name="console-shots")
        with engine.begin() as conn:
            conn.execute(text(SEED), {"n": 20_000})
            conn.execute(text(SEED_ATTEMPTS))
            conn.execute(text(RECENT))
            conn.execute(text(STORY))
            conn.execute(text(
                "INSERT INTO outbox.idempotency_keys (scope, key, fingerprint, status,"
                " lock_token, locked_at, lock_expires_at, expires_at) VALUES ('tenant-7',"
                " 'checkout-91f3', 'fp', 'processing', gen_random_uuid(),"
                " now() - interval '7 min', now() - interval '6 min', now() + interval '1 d')"))
            failed = conn.execute(text(
                "SELECT id FROM outbox.effects WHERE status = 'failed' ORDER BY id DESC LIMIT 1")
            ).scalar_one()
        app = create_console_app(engine, trace_url="http://localhost:16686/trace/{trace_id}")
        port = _free_port()
        uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
        server_thread = threading.Thread(target=uv.run, daemon=True)
        server_thread.start()
        while not uv.started:
            time.sleep(0.05)
        base = f"http://127.0.0.1:{port}"
        shots = [
            ("overview", "/"),
            ("effects", "/effects?status=failed&status=needs_review"),
            ("effect", f"/effects/{failed}"),
            ("retry", f"/effects/{failed}/retry"),
            ("redrive", "/redrive?queue=default"),
        ]
        OUT.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM,
                                         args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1280, "height": 900},
                                    color_scheme="light")
            for name, path in shots:
                page.goto(base + path)
                target = OUT / f"console-{name}.png"
                page.screenshot(path=str(target), full_page=name != "effects")
                print(target.relative_to(ROOT))
            browser.close()
        engine.dispose()
    finally:
        if uv is not None:
            uv.should_exit = True
        if server_thread is not None:
            server_thread.join(timeout=10)
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)'))
        admin.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
