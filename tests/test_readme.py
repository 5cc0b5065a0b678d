"""The README's code example runs as written (with its `payments` table created)."""

from __future__ import annotations

import re
from pathlib import Path

from sqlalchemy import Engine, text

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs_and_replays(engine: Engine) -> None:
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert block is not None
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE IF EXISTS public.payments"))
        conn.execute(text("CREATE TABLE public.payments (id bigserial PRIMARY KEY, amount int)"))
    try:
        exec(compile(block.group(1), "README.md", "exec"), {})
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM public.payments")).scalar_one() == 1
            kinds = conn.execute(text("SELECT kind FROM outbox.effects ORDER BY kind")).scalars()
            assert list(kinds) == ["email.receipt", "psp.charge"]
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
