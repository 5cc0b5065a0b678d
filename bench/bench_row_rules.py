#!/usr/bin/env python3
"""The row rules' cost on the server, measured with pgbench: prints JSON lines.

    uv run python bench/bench_row_rules.py [--rounds 4] [--seconds 5] [--before 0012]

Migration 0013 put each table's CHECKs into one CHECK that calls a PL/pgSQL function
(docs/architecture.md, "Row rules"). This measures what that changed on the server,
without our Python client in the way. Two scratch databases on $DATABASE_URL's
server: one migrated to `--before`, one to head. On each, alternately (which one goes
first swaps round by round), pgbench (one client, prepared statements,
`synchronous_commit=off` so that the disk's flush does not hide the server's CPU) runs
two scripts:
- `effect_insert`: `BEGIN; INSERT INTO outbox.effects (one row); COMMIT`;
- `enqueue`: `BEGIN; INSERT INTO bench_orders; <our enqueue statement>; COMMIT`. The
  statement is `outbox.sql.effects`' own (keys, effect row, doorbell), one effect with
  a random key, as pgbench_outbox.py's enqueue script is for a raw outbox.

One line per run (latency in ms, pgbench's average), then a summary line: the median
per script and database, and new ÷ old. Needs pgbench (Debian postgresql-contrib).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchlib import pgbench, scratch_database  # noqa: E402

_ROW = ("jsonb_build_array(jsonb_build_object('k', md5(random()::text), 'kind', 'bench.noop',"
        " 'p', jsonb_build_object('order_id', currval('bench_orders_id_seq'),"
        " 'customer', :cust::int), 'h', '{}'::jsonb, 'ok', null, 'q', 'bench-row-rules',"
        " 'm', 25, 'd', 0, 'ru', null))")


def scripts() -> dict[str, str]:
    from outbox.sql.effects import _INSERT_EFFECTS

    statement = " ".join(str(_INSERT_EFFECTS).split())
    statement = (statement.replace("%(rows)s", _ROW).replace("%(channel)s", "'outbox_bell'")
                 .replace("%(effect_now)s", "NULL"))
    assert "%(" not in statement, statement
    return {
        "effect_insert": "BEGIN;\nINSERT INTO outbox.effects (effect_key, kind, payload, queue)"
                         " VALUES (md5(random()::text), 'bench.noop', '{\"a\":1}',"
                         " 'bench-row-rules');\nCOMMIT;\n",
        "enqueue": "\\set cust random(1, 100000)\nBEGIN;\n"
                   "INSERT INTO bench_orders (customer, amount) VALUES (:cust, 10.00);\n"
                   f"{statement};\nCOMMIT;\n",
    }


def latency_ms(url: Any, script: str, seconds: int) -> float:
    """pgbench's average latency for `script`, one client, synchronous_commit off."""
    out = pgbench(url, script, seconds=seconds, options="-c synchronous_commit=off")
    found = re.search(r"latency average = ([\d.]+) ms", out)
    if not found:
        raise SystemExit(f"no latency in pgbench's output: {out}")
    return float(found.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--before", default="0012", help="the older revision (default 0012)")
    args = parser.parse_args(argv)

    from alembic import command
    from sqlalchemy import create_engine, make_url, text
    from sqlalchemy.pool import NullPool

    from outbox._config import database_url
    from outbox._migrate import alembic_config

    base = make_url(database_url())
    tag = uuid.uuid4().hex[:8]
    results: dict[tuple[str, str], list[float]] = {}
    with contextlib.ExitStack() as stack:
        urls = {side: stack.enter_context(scratch_database(base, f"bench_rules_{side}_{tag}"))
                for side in ("old", "new")}
        for side, url in urls.items():
            rendered = url.render_as_string(hide_password=False)
            command.upgrade(alembic_config(rendered), args.before if side == "old" else "head")
            scratch = create_engine(url, poolclass=NullPool)
            with scratch.begin() as conn:
                conn.execute(text("CREATE TABLE bench_orders (id bigserial PRIMARY KEY,"
                                  " customer int NOT NULL, amount numeric(12,2) NOT NULL)"))
            scratch.dispose()
        for rnd in range(1, args.rounds + 1):
            sides = list(urls.items())
            if rnd % 2 == 0:  # old first in odd rounds, new first in even ones
                sides.reverse()
            for name, script in scripts().items():
                for side, url in sides:
                    latency = latency_ms(url, script, args.seconds)
                    results.setdefault((name, side), []).append(latency)
                    print(json.dumps({"bench": "row_rules", "round": rnd, "script": name,
                                      "schema": args.before if side == "old" else "head",
                                      "latency_ms": latency}), flush=True)
    summary: dict[str, Any] = {"bench": "row_rules", "summary": True, "before": args.before,
                               "rounds": args.rounds, "seconds": args.seconds}
    for name in scripts():
        old = statistics.median(results[(name, "old")])
        new = statistics.median(results[(name, "new")])
        summary[name] = {"old_ms": old, "new_ms": new, "new_over_old": round(new / old, 3)}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
