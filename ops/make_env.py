"""Write `.env` for docker compose with fresh random secrets (no default passwords).

    python3 ops/make_env.py [--output PATH] [--template PATH]

Every empty `NAME=` line of `.env.example` gets a random value of the right shape;
lines with a value and comments are copied as they are. The file is created with mode
0600 and never overwritten: delete it first to rotate (then recreate the postgres
volume, which keeps the password it was initialised with). Standard library only, so
it runs before anything is installed. Prints the names it filled, never the values.
"""

from __future__ import annotations

import argparse
import base64
import os
import secrets
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: How each variable's value is made; anything else gets a URL-safe random string.
GENERATORS: dict[str, Callable[[], str]] = {
    # Spliced into DATABASE_URL: hex needs no percent-encoding.
    "POSTGRES_PASSWORD": lambda: secrets.token_hex(24),
    "GRAFANA_ADMIN_PASSWORD": lambda: secrets.token_urlsafe(24),
    "EXAMPLE_API_TOKENS": lambda: f"{secrets.token_urlsafe(32)}=demo",
    "EXAMPLE_WEBHOOK_SECRETS": lambda: "billing=whsec_"
    + base64.b64encode(secrets.token_bytes(24)).decode(),
}


def render(template: str) -> tuple[str, list[str]]:
    """The template with every empty assignment filled, and the names filled."""
    lines: list[str] = []
    filled: list[str] = []
    for line in template.splitlines():
        name, sep, value = line.partition("=")
        if sep and not line.lstrip().startswith("#") and name.strip() and not value.strip():
            name = name.strip()
            value = GENERATORS.get(name, lambda: secrets.token_urlsafe(24))()
            line = f"{name}={value}"
            filled.append(name)
        lines.append(line)
    return "\n".join(lines) + "\n", filled


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--output", type=Path, default=ROOT / ".env")
    parser.add_argument("--template", type=Path, default=ROOT / ".env.example")
    args = parser.parse_args(argv)
    text, filled = render(args.template.read_text())
    try:
        fd = os.open(args.output, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        print(f"make_env: {args.output} exists; delete it to generate new secrets",
              file=sys.stderr)
        return 1
    with os.fdopen(fd, "w") as out:
        out.write(text)
    print(f"make_env: wrote {args.output} (mode 0600) with fresh {', '.join(filled)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
