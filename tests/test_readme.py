"""The README's code example runs as written (with its `payments` table created)."""

from __future__ import annotations

import re
from pathlib import Path

from sqlalchemy import Engine, text

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_examples_run_and_write_what_they_say(engine: Engine) -> None:
    """Every Python block of the README, as written: sync SQLAlchemy, psycopg, async."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 3
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE IF EXISTS public.payments"))
        conn.execute(text("CREATE TABLE public.payments (id bigserial PRIMARY KEY, amount int)"))
    try:
        for i, block in enumerate(blocks):
            exec(compile(block, f"README.md block {i + 1}", "exec"), {})
        with engine.connect() as conn:
            amounts = conn.execute(text("SELECT amount FROM public.payments ORDER BY id"))
            assert list(amounts.scalars()) == [500, 700, 900]
            kinds = conn.execute(text("SELECT kind FROM outbox.effects ORDER BY id")).scalars()
            assert list(kinds) == ["psp.charge", "email.receipt", "psp.charge", "psp.charge"]
            keys = conn.execute(text("SELECT key FROM outbox.idempotency_keys ORDER BY key"))
            assert list(keys.scalars()) == ["key-2", "key-3", "key-from-client"]
    finally:
        with engine.begin() as conn:
            conn.execute(text("DROP TABLE IF EXISTS public.payments"))


def test_ci_runs_the_readme_commands_as_written() -> None:
    """CI must fail whenever a newcomer's `uv run pytest` would (issue 8)."""
    block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S)
    assert block is not None
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    assert commands == ["uv run outbox demo", "uv run pytest"]
    ci = (README.parent / ".ci" / "run").read_text()
    for command in commands:
        assert re.search(rf"^{re.escape(command)}$", ci, re.M), f"CI must run {command!r}"
    # ... with nothing set up first but uv, and no DATABASE_URL (the embedded default).
    assert "unset DATABASE_URL" in ci and "uv sync" not in ci and "--extra" not in ci
