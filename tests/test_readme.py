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
