"""Offline checks of the operations artefacts: docker-compose.yml, the Dockerfile, the
collector and Prometheus configuration, the alert rules, the Grafana dashboard and the
runbook. No Docker engine, Prometheus or Grafana is needed.

The metric names the dashboard and the alerts may use are derived from the code
(outbox/_telemetry.py, dispatcher/metrics.py) with the collector's Prometheus naming
rules, so a renamed instrument breaks this test rather than a dashboard in production.
The one instrument we export through maintained instrumentation (pool occupancy,
opentelemetry-instrumentation-sqlalchemy) is read from that package by running it.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any, cast

import pytest

from dispatcher.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
OPS = ROOT / "ops"
COMPOSE = ROOT / "docker-compose.yml"
DASHBOARD = OPS / "grafana" / "outbox-dashboard.json"
ALERTS = OPS / "prometheus" / "alerts.yml"
RUNBOOK = OPS / "runbook.md"

#: The process commands of DESIGN.md §8 (external acceptance tests start them so).
DOCUMENTED_COMMANDS = (
    "outbox migrate",
    "outbox example-api",
    "celery -A dispatcher.celery_app worker",
    "celery -A dispatcher.celery_app beat",
    "python -m dispatcher.examples.payments.psp",
)
#: Alerts the runbook promises (each has a section there).
REQUIRED_ALERTS = {
    "OutboxOldestDueAgeHigh", "OutboxDeadLettersGrowing", "OutboxLeaseLostSpike",
    "OutboxStaleProcessingKeys", "OutboxNeedsReview", "OutboxNoDeliveriesWhileDue",
    # Issue 15: what the articles say to watch.
    "OutboxIdempotencyConflictRatioHigh", "OutboxSuspectedDuplicateRequests",
    "OutboxLockWaitsLong", "OutboxPoolSaturated", "OutboxInboxConflictShareHigh",
    "OutboxInboxDuplicateShareHigh",
    # Issue 12: table health (bloat).
    "OutboxXminHorizonHeld", "OutboxDeadTuplesHigh",
}
#: Where every alert's runbook_url points (absolute: Alertmanager and Grafana resolve a
#: relative one against their own host). Offline, the anchor is ops/runbook.md's.
RUNBOOK_URL = "https://github.com/pg-outbox/pg-outbox/blob/main/ops/runbook.md"
#: The dashboard row of issue 15 and what each of its panels must show.
ARTICLES_ROW = "What the articles say to watch"


def load_yaml(path: Path) -> Any:
    """PyYAML if installed, else ruamel.yaml (a dependency of check-jsonschema)."""
    text = path.read_text()
    try:
        import yaml
    except ImportError:
        from ruamel.yaml import YAML

        return YAML(typ="safe", pure=True).load(text)
    return yaml.safe_load(text)


def _tool(name: str) -> str | None:
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


# --------------------------------------------------------------------------- metric names

_UNITS = {"s": "seconds", "ms": "milliseconds", "us": "microseconds", "ns": "nanoseconds",
          "min": "minutes", "h": "hours", "d": "days", "By": "bytes", "%": "percent"}
_COUNTERS = {"create_counter", "create_observable_counter"}
_HISTOGRAMS = {"create_histogram"}
_INSTRUMENTS = _COUNTERS | _HISTOGRAMS | {
    "create_up_down_counter", "create_observable_up_down_counter",
    "create_observable_gauge", "create_gauge"}


def prometheus_name(name: str, unit: str, factory: str) -> str:
    """The collector's prometheus exporter naming (UnderscoreEscapingWithSuffixes)."""
    base = re.sub(r"_+", "_", re.sub(r"[^a-zA-Z0-9]", "_", name)).strip("_")
    if unit and not unit.startswith("{"):
        suffix = "ratio" if unit == "1" else _UNITS.get(unit, re.sub(r"\W", "", unit))
        if unit == "1" and factory not in ("create_observable_gauge", "create_gauge"):
            suffix = ""
        if suffix and not base.endswith("_" + suffix):
            base += "_" + suffix
    if factory in _COUNTERS:
        base += "_total"
    return base


def instrumentation_instruments() -> dict[str, tuple[str, str]]:
    """{otel name: (factory, unit)} of what opentelemetry-instrumentation-sqlalchemy
    exports for a pool, read by running it on a throwaway SQLite engine with a private
    meter provider (instrument() is once per process: it is undone afterwards)."""
    from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.trace import NoOpTracerProvider
    from sqlalchemy import create_engine, text

    from dispatcher.metrics import POOL_USAGE_INSTRUMENT

    reader = InMemoryMetricReader()
    instrumentor = SQLAlchemyInstrumentor()
    instrumentor.uninstrument()
    engine = create_engine("sqlite://")
    instrumentor.instrument(engine=engine, meter_provider=MeterProvider(metric_readers=[reader]),
                            tracer_provider=NoOpTracerProvider())
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        data = reader.get_metrics_data()
        assert data is not None
        found = {m.name: (m.unit or "", type(m.data).__name__, m.data.is_monotonic)
                 for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    finally:
        instrumentor.uninstrument()
        engine.dispose()
    assert POOL_USAGE_INSTRUMENT in found, found
    unit, kind, monotonic = found[POOL_USAGE_INSTRUMENT]
    assert (kind, monotonic) == ("Sum", False)  # an UpDownCounter
    return {POOL_USAGE_INSTRUMENT: ("create_up_down_counter", unit)}


@cache
def emitted_instruments() -> dict[str, tuple[str, str]]:
    """{otel name: (factory, unit)} for every instrument our code creates or wires up."""
    found: dict[str, tuple[str, str]] = dict(instrumentation_instruments())
    for source in (ROOT / "outbox" / "_telemetry.py", ROOT / "dispatcher" / "metrics.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in _INSTRUMENTS):
                continue
            first = node.args[0] if node.args else None
            assert isinstance(first, ast.Constant) and isinstance(first.value, str), (
                f"{source.name}:{node.lineno}: instrument names must be literals")
            unit = next((k.value.value for k in node.keywords if k.arg == "unit"
                         and isinstance(k.value, ast.Constant)), "")
            found[first.value] = (node.func.attr, str(unit))
    return found


@cache
def emitted_metric_names() -> dict[str, str]:
    """{prometheus series name: otel name}, histograms with _bucket/_sum/_count."""
    names: dict[str, str] = {}
    for otel, (factory, unit) in emitted_instruments().items():
        base = prometheus_name(otel, unit, factory)
        if factory in _HISTOGRAMS:
            for suffix in ("_bucket", "_sum", "_count"):
                names[base + suffix] = otel
        else:
            names[base] = otel
    return names


def test_metric_names_derived_from_the_code() -> None:
    names = emitted_metric_names()
    # Spot checks of the translation against the collector's documented behaviour.
    assert names["outbox_deliveries_total"] == "outbox.deliveries"
    assert names["outbox_delivery_lag_seconds_bucket"] == "outbox.delivery.lag"
    assert names["outbox_delivery_duration_seconds_count"] == "outbox.delivery.duration"
    assert names["outbox_idempotency_requests_total"] == "outbox.idempotency.requests"
    assert names["outbox_queue_oldest_due_age_seconds"] == "outbox.queue.oldest_due_age"
    assert names["outbox_queue_effects"] == "outbox.queue.effects"  # {effect}: dropped
    # Issue 15.
    assert names["outbox_idempotency_suspected_duplicates_total"] == (
        "outbox.idempotency.suspected_duplicates")
    assert names["outbox_db_lock_waits"] == "outbox.db.lock_waits"
    assert names["outbox_db_lock_wait_age_seconds"] == "outbox.db.lock_wait_age"
    assert names["outbox_inbox_write_duration_seconds_bucket"] == "outbox.inbox.write.duration"
    assert names["db_client_connections_usage_connections"] == "db.client.connections.usage"
    assert names["db_client_connections_max"] == "db.client.connections.max"
    gauges = {o for o, (f, _) in emitted_instruments().items()
              if f == "create_observable_gauge"}
    assert gauges == {"outbox.queue.effects", "outbox.queue.due",
                      "outbox.queue.oldest_due_age", "outbox.queue.expired_leases",
                      "outbox.idempotency.stale_processing", "outbox.db.lock_waits",
                      "outbox.db.lock_wait_age", "db.client.connections.max",
                      # Issue 12: table health.
                      "outbox.db.table.dead_tuples", "outbox.db.table.live_tuples",
                      "outbox.db.table.last_autovacuum_age",
                      "outbox.db.table.last_vacuum_age", "outbox.db.xmin_horizon.age",
                      "outbox.db.xmin_horizon.duration",
                      # The watch (dispatcher/watch.py).
                      "outbox.queue.watchers"}
    assert names["outbox_db_table_dead_tuples"] == "outbox.db.table.dead_tuples"
    assert names["outbox_db_xmin_horizon_duration_seconds"] == "outbox.db.xmin_horizon.duration"


_METRIC = re.compile(r"\b((?:outbox|db_client|messaging)_[a-zA-Z0-9_]+)")


def metrics_in(expr: str) -> set[str]:
    return set(_METRIC.findall(expr))


def promql_checkable(expr: str) -> str:
    """Grafana's variables replaced, so a PromQL parser accepts the expression."""
    return (expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")
            .replace("$kind", ".*"))


# --------------------------------------------------------------------------- compose


@cache
def compose() -> dict[str, Any]:
    doc = load_yaml(COMPOSE)
    assert isinstance(doc, dict)
    return doc


def services() -> dict[str, dict[str, Any]]:
    return dict(compose()["services"])


def app_services() -> dict[str, dict[str, Any]]:
    return {n: s for n, s in services().items() if "build" in s}


def command_of(service: dict[str, Any]) -> list[str]:
    cmd = service["command"]
    return list(cmd) if isinstance(cmd, list) else shlex.split(cmd)


def test_compose_matches_the_compose_spec_schema() -> None:
    tool = _tool("check-jsonschema")
    assert tool, "check-jsonschema is missing: pip install -e . --group dev"
    proc = subprocess.run([tool, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_schema_check_rejects_a_broken_file(tmp_path: Path) -> None:
    """The validator really validates: a typo and a bad condition are refused."""
    tool = _tool("check-jsonschema")
    assert tool, "check-jsonschema is missing: pip install -e . --group dev"
    broken = COMPOSE.read_text().replace("healthcheck:", "helthcheck:", 1).replace(
        "condition: service_healthy", "condition: service_happy", 1)
    path = tmp_path / "docker-compose.yml"
    path.write_text(broken)
    proc = subprocess.run([tool, "--builtin-schema", "vendor.compose-spec", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "helthcheck" in proc.stdout + proc.stderr


def test_compose_has_every_service_of_the_system() -> None:
    assert {"postgres", "redis", "migrate", "api", "worker", "beat", "psp",
            "otel-collector", "jaeger"} <= set(services())
    assert services()["postgres"]["image"].split(":")[1].startswith("15")
    assert set(app_services()) == {"migrate", "api", "worker", "beat", "psp"}


def test_depends_on_targets_exist_and_conditions_hold() -> None:
    svcs = services()
    for name, svc in svcs.items():
        deps = svc.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        for target, spec in deps.items():
            assert target in svcs, f"{name} depends on undefined service {target!r}"
            assert target != name
            condition = spec.get("condition", "service_started")
            if condition == "service_healthy":
                assert "healthcheck" in svcs[target], (
                    f"{name} waits for {target} to be healthy, but it has no healthcheck")
            if condition == "service_completed_successfully":
                assert svcs[target].get("restart") == "no", (
                    f"{target} is a one-shot for {name}; it must not restart")
            # A default service must not depend on one that only runs in a profile.
            if not svc.get("profiles"):
                assert not svcs[target].get("profiles"), (
                    f"{name} depends on {target}, which only runs with a profile")
    # No cycles.
    seen: dict[str, int] = {}

    def visit(n: str) -> None:
        assert seen.get(n) != 1, f"depends_on cycle through {n}"
        if seen.get(n) == 2:
            return
        seen[n] = 1
        for d in svcs[n].get("depends_on") or {}:
            visit(d)
        seen[n] = 2

    for n in svcs:
        visit(n)


def test_long_running_services_have_healthchecks() -> None:
    for name in ("postgres", "redis", "api", "worker", "psp"):
        check = services()[name].get("healthcheck")
        assert check and check.get("test"), f"{name} has no healthcheck"
    deps = services()["worker"]["depends_on"]
    assert deps["migrate"]["condition"] == "service_completed_successfully"
    assert deps["redis"]["condition"] == "service_healthy"
    assert services()["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_app_services_run_documented_commands() -> None:
    for name, svc in app_services().items():
        line = " ".join(command_of(svc))
        assert any(line == c or line.startswith(c + " ") for c in DOCUMENTED_COMMANDS), (
            f"{name}: {line!r} is not one of our documented commands")
    expected = {
        "migrate": "outbox migrate",
        "api": "outbox example-api --host 0.0.0.0 --port 8000",
        "worker": "celery -A dispatcher.celery_app worker --pool prefork -c 2",
        "beat": "celery -A dispatcher.celery_app beat",
        "psp": "python -m dispatcher.examples.payments.psp --host 0.0.0.0 --port 8081",
    }
    assert {n: " ".join(command_of(s)) for n, s in app_services().items()} == expected


def test_outbox_commands_parse_with_our_cli() -> None:
    parser = build_parser()
    for name, svc in app_services().items():
        cmd = command_of(svc)
        if cmd[0] == "outbox":
            args = parser.parse_args(cmd[1:])
            assert args.fn.__name__ == "cmd_" + cmd[1].replace("-", "_"), name


def test_psp_and_celery_commands_resolve() -> None:
    out = subprocess.run([sys.executable, "-m", "dispatcher.examples.payments.psp", "--help"],
                         cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "--host" in out.stdout and "--port" in out.stdout
    cmd = command_of(services()["worker"])
    module = cmd[cmd.index("-A") + 1]
    assert module == "dispatcher.celery_app"
    assert (ROOT / "dispatcher" / "celery_app.py").exists()
    source = (ROOT / "dispatcher" / "celery_app.py").read_text()
    assert re.search(r"^app = Celery\(", source, re.M), "celery -A needs a module-level app"


def test_app_services_build_from_the_root_dockerfile() -> None:
    for name, svc in app_services().items():
        build = svc["build"]
        context = build if isinstance(build, str) else build.get("context", ".")
        dockerfile = "Dockerfile" if isinstance(build, str) else build.get(
            "dockerfile", "Dockerfile")
        assert (ROOT / context).resolve() == ROOT, name
        assert dockerfile == "Dockerfile", name
    text = (ROOT / "Dockerfile").read_text()
    copied = {w for c in re.findall(r"^COPY (?!--from)(.+)$", text, re.M)
              for w in c.split()[:-1]}
    # Every package pyproject ships must be in the image, and what uv needs to lock it.
    for top in ("outbox", "dispatcher", "migrations", "pyproject.toml",
                "uv.lock", "README.md"):
        assert top in copied, f"{top} not copied"
    ignored = (ROOT / ".dockerignore").read_text().split()
    for needed in ("outbox", "dispatcher", "migrations", "pyproject.toml",
                   "README.md", "uv.lock"):
        assert needed not in ignored, f".dockerignore drops {needed}"
    assert ".venv" in ignored and ".git" in ignored
    assert ".env" in ignored, "the build context must never carry .env's secrets"


def test_app_environment_points_at_the_services(tmp_path: Path) -> None:
    svcs = interpolated(generated_env(tmp_path))["services"]
    pg = svcs["postgres"]["environment"]
    for name in ("migrate", "api", "worker", "beat"):
        env = svcs[name]["environment"]
        assert env["DATABASE_URL"] == (
            f"postgresql://{pg['POSTGRES_USER']}:{pg['POSTGRES_PASSWORD']}"
            f"@postgres:5432/{pg['POSTGRES_DB']}"), name
        assert env["BROKER_URL"].startswith("redis://redis:6379/"), name
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318", name
        assert env["OTEL_TRACES_EXPORTER"] == env["OTEL_METRICS_EXPORTER"] == "otlp", name
        assert env["OTEL_SERVICE_NAME"].startswith("outbox-"), name
    psp_cmd = command_of(svcs["psp"])
    psp_port = psp_cmd[psp_cmd.index("--port") + 1]
    for name in ("api", "worker"):
        assert svcs[name]["environment"]["PSP_URL"] == f"http://psp:{psp_port}"
    names = {svcs[n]["environment"]["OTEL_SERVICE_NAME"]
             for n in ("migrate", "api", "worker", "beat")}
    assert len(names) == 4


def test_mounted_files_exist() -> None:
    for name, svc in services().items():
        for volume in svc.get("volumes") or []:
            source = volume.split(":")[0] if isinstance(volume, str) else volume["source"]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"


# --------------------------------------------------------------------------- secrets
# Issue 16: no default passwords (each one required, or generated by ops/make_env.py),
# Grafana without admin/admin, the PSP's control endpoints unpublished, the image from
# uv.lock on pinned bases.

ENV_EXAMPLE = ROOT / ".env.example"
MAKE_ENV = OPS / "make_env.py"
_INTERPOLATION = re.compile(
    r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[?-])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")
#: The variables compose must refuse to start without.
SECRETS = {"POSTGRES_PASSWORD", "GRAFANA_ADMIN_PASSWORD", "EXAMPLE_API_TOKENS",
           "EXAMPLE_WEBHOOK_SECRETS"}


class MissingVariable(Exception):
    pass


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's interpolation: `$$`, `$VAR`, `${VAR}`, `${VAR:-d}`, `${VAR-d}`,
    `${VAR:?msg}` (unset or empty stops compose), `${VAR?msg}`."""
    def one(m: re.Match[str]) -> str:
        if m.group(1):
            return "$"
        name, op, arg = m.group(2) or m.group(5), m.group(3), m.group(4) or ""
        got = env.get(name)
        if op in (":?", "?"):
            if got is None or (op == ":?" and got == ""):
                raise MissingVariable(name)
            return got
        if op in (":-", "-"):
            return arg if got is None or (op == ":-" and got == "") else got
        return got or ""
    return _INTERPOLATION.sub(one, value)


def interpolated(env: dict[str, str]) -> dict[str, Any]:
    def walk(node: Any) -> Any:
        if isinstance(node, str):
            return interpolate(node, env)
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node
    return cast(dict[str, Any], walk(compose()))


def read_env(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep and not line.lstrip().startswith("#"):
            env[name.strip()] = value.strip()
    return env


def generated_env(tmp_path: Path) -> dict[str, str]:
    out = tmp_path / "generated.env"
    if not out.exists():
        done = subprocess.run([sys.executable, str(MAKE_ENV), "--output", str(out)],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
    return read_env(out)


def environments() -> Iterator[tuple[str, str, str]]:
    for name, svc in services().items():
        env = svc.get("environment") or {}
        if isinstance(env, list):
            env = dict(item.partition("=")[::2] for item in env)
        for key, value in env.items():
            yield name, key, str(value)


def test_compose_has_no_default_passwords() -> None:
    """Before: postgres ran with outbox/outbox and DATABASE_URL carried it in clear."""
    required = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*):\?",
                              json.dumps(compose())))  # values, not the comments
    assert required == SECRETS
    for name in SECRETS:  # each one alone missing stops compose
        env = {n: "x" for n in SECRETS - {name}}
        with pytest.raises(MissingVariable, match=name):
            interpolated(env)
        with pytest.raises(MissingVariable, match=name):
            interpolated({**env, name: ""})  # empty is missing too (`:?`)
    secretish = re.compile(r"PASSWORD|SECRET|TOKEN", re.I)
    for service, key, value in environments():
        if secretish.search(key):
            assert re.fullmatch(r"\$\{[A-Z_]+:\?[^}]+\}", value), (
                f"{service}.{key} must be a required variable, not {value!r}")
        for password in re.findall(r"://[^:/@\s]+:([^@\s]+)@", value):
            assert re.fullmatch(r"\$\{[A-Z_]+:\?[^}]+\}", password), (
                f"{service}.{key} carries a literal password")


def test_grafana_has_no_default_admin_password() -> None:
    env = services()["grafana"]["environment"]
    assert env["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")
    assert str(env.get("GF_AUTH_ANONYMOUS_ORG_ROLE", "Viewer")) == "Viewer"
    assert str(env.get("GF_USERS_ALLOW_SIGN_UP", "false")).lower() == "false"


def test_env_example_documents_every_required_variable() -> None:
    example = read_env(ENV_EXAMPLE)
    assert set(example) == SECRETS
    assert all(v == "" for v in example.values()), ".env.example must not ship a value"
    assert ".env" in (ROOT / ".gitignore").read_text().split()


def test_make_env_generates_every_secret_and_never_overwrites(tmp_path: Path) -> None:
    from dispatcher.examples.payments.auth import parse_tokens
    from outbox.webhooks import WebhookSources

    env = generated_env(tmp_path)
    out = tmp_path / "generated.env"
    assert out.stat().st_mode & 0o777 == 0o600
    assert set(env) == SECRETS and all(len(v) >= 24 for v in env.values())
    other = tmp_path / "other.env"
    subprocess.run([sys.executable, str(MAKE_ENV), "--output", str(other)], check=True,
                   capture_output=True, timeout=30)
    assert read_env(other)["POSTGRES_PASSWORD"] != env["POSTGRES_PASSWORD"]  # random
    again = subprocess.run([sys.executable, str(MAKE_ENV), "--output", str(out)],
                           capture_output=True, text=True, timeout=30)
    assert again.returncode == 1 and read_env(out) == env  # never overwritten
    assert env["POSTGRES_PASSWORD"] not in again.stdout + again.stderr
    # The values have the shapes the services parse.
    svcs = interpolated(env)["services"]
    assert svcs["postgres"]["environment"]["POSTGRES_PASSWORD"] == env["POSTGRES_PASSWORD"]
    assert make_url_password(svcs["api"]["environment"]["DATABASE_URL"]) == (
        env["POSTGRES_PASSWORD"])
    tokens = parse_tokens(svcs["api"]["environment"]["EXAMPLE_API_TOKENS"])
    assert tokens and set(tokens.values()) == {"demo"}
    WebhookSources.standard_webhooks(svcs["api"]["environment"]["EXAMPLE_WEBHOOK_SECRETS"])
    assert svcs["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] not in ("", "admin")


def make_url_password(url: str) -> str | None:
    from sqlalchemy.engine import make_url

    return make_url(url).password  # type: ignore[return-value]


def test_psp_control_port_is_not_published() -> None:
    """Before: 127.0.0.1:8081 exposed /_control (fail every charge) and /_reset."""
    psp = services()["psp"]
    assert not psp.get("ports"), "the fake PSP's port must not be published"
    assert "--remote-control" not in command_of(psp)
    for name, svc in services().items():
        for port in svc.get("ports") or []:
            spec = port if isinstance(port, str) else f"{port.get('host_ip', '')}:"
            assert spec.startswith("127.0.0.1:"), f"{name} publishes {port!r} beyond loopback"


def dockerfile_stages() -> list[tuple[str, list[str]]]:
    """[(FROM image, [instructions])] of the Dockerfile, comments dropped."""
    stages: list[tuple[str, list[str]]] = []
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append((line.split()[1], []))
        else:
            stages[-1][1].append(line)
    return stages


def test_image_is_built_from_uv_lock_on_pinned_bases() -> None:
    """Before: one stage on `python:3.11-slim` resolved pyproject's ranges with pip at
    build time, so the image ran versions the tests never saw."""
    stages = dockerfile_stages()
    assert len(stages) >= 2, "multi-stage: build with uv, run without it"
    for image, _ in stages:
        tag = image.rpartition(":")[2]
        assert ":" in image and re.match(r"\d+\.\d+\.\d+", tag), (
            f"{image} is not pinned to an exact version")
    build_steps = " ".join(step for _, steps in stages for step in steps)
    assert "uv sync --locked --no-dev" in build_steps
    assert "pip install" not in build_steps
    assert re.search(r"COPY .*\buv\.lock\b", build_steps)
    runtime_image, runtime = stages[-1]
    assert runtime_image.startswith("python:3.11."), runtime_image
    users = [s.split()[1] for s in runtime if s.upper().startswith("USER ")]
    assert users and users[-1] not in ("root", "0"), "the image must not run as root"
    assert any(s.startswith("COPY --from=") and "/app/.venv" in s for s in runtime)
    # `--locked` fails the build when uv.lock no longer matches pyproject.toml.
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH (the static checks above still ran)")
    done = subprocess.run([uv, "lock", "--check", "--offline"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


# --------------------------------------------------------------------------- collector


def test_collector_pipelines_and_endpoints() -> None:
    cfg = load_yaml(OPS / "otel-collector.yaml")
    for kind in ("receivers", "processors", "exporters"):
        for pipeline in cfg["service"]["pipelines"].values():
            for component in pipeline.get(kind, []):
                assert component in cfg[kind], f"{component} is not defined in {kind}"
    for ext in cfg["service"].get("extensions", []):
        assert ext in cfg["extensions"]
    pipelines = cfg["service"]["pipelines"]
    assert "prometheus" in pipelines["metrics"]["exporters"]
    assert any(e.startswith("otlp") for e in pipelines["traces"]["exporters"])
    protocols = cfg["receivers"]["otlp"]["protocols"]
    assert protocols["http"]["endpoint"].endswith(":4318")
    assert protocols["grpc"]["endpoint"].endswith(":4317")
    # Traces go to the compose service jaeger; Prometheus scrapes the exporter's port.
    jaeger = cfg["exporters"]["otlp/jaeger"]["endpoint"]
    assert jaeger.split(":")[0] in services()
    port = cfg["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1]
    prom = load_yaml(OPS / "prometheus" / "prometheus.yml")
    targets = [t for job in prom["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]]
    assert f"otel-collector:{port}" in targets
    assert "/etc/prometheus/alerts.yml" in prom["rule_files"]


# --------------------------------------------------------------------------- alerts


_DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")


@cache
def alert_rules() -> list[dict[str, Any]]:
    doc = load_yaml(ALERTS)
    assert isinstance(doc, dict) and set(doc) == {"groups"}
    rules: list[dict[str, Any]] = []
    for group in doc["groups"]:
        assert isinstance(group["name"], str) and group["name"]
        assert group["rules"], f"group {group['name']} has no rules"
        rules.extend(group["rules"])
    return rules


def runbook_anchors() -> set[str]:
    """GitHub-style anchors of the runbook's headings."""
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", RUNBOOK.read_text(), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def test_alert_rules_structure() -> None:
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)), "duplicate alert names"
    assert set(names) >= REQUIRED_ALERTS
    anchors = runbook_anchors()
    allowed_keys = {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
    for rule in rules:
        name = rule["alert"]
        assert set(rule) <= allowed_keys, f"{name}: unknown keys {set(rule) - allowed_keys}"
        assert re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", name)
        assert isinstance(rule["expr"], str) and rule["expr"].strip()
        assert rule["expr"].count("(") == rule["expr"].count(")"), name
        assert _DURATION.match(str(rule.get("for", "0s"))), f"{name}: bad for"
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        notes = rule["annotations"]
        assert notes["summary"] and notes["description"], name
        url = notes["runbook_url"]
        assert url.startswith(RUNBOOK_URL + "#"), name
        assert url.split("#", 1)[1] in anchors, f"{name}: runbook has no section {url}"


def test_runbook_urls_resolve_from_alertmanager_and_grafana() -> None:
    """Absolute, one base (the project's runbook URL in pyproject.toml), and each anchor
    a heading of ops/runbook.md, so the same link works online and, by its anchor, in
    the checkout offline."""
    import tomllib
    from urllib.parse import urlsplit

    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    assert urls["Runbook"] == RUNBOOK_URL
    anchors = runbook_anchors()
    for rule in alert_rules():
        url = rule["annotations"]["runbook_url"]
        parts = urlsplit(url)
        assert parts.scheme == "https" and parts.netloc, f"{rule['alert']}: not absolute"
        assert "{{" not in url, f"{rule['alert']}: templated runbook_url"
        assert parts.fragment in anchors, f"{rule['alert']}: no section #{parts.fragment}"
        assert parts.fragment == rule["alert"].lower().replace("critical", "high")
    # The dashboard's links to the runbook use the same base and existing anchors.
    for p in panels():
        for url in re.findall(r"https://\S+?#[\w-]+", p.get("description", "")):
            assert url.startswith(RUNBOOK_URL + "#"), p["title"]
            assert url.split("#", 1)[1] in anchors, (p["title"], url)


def test_alerts_use_only_metrics_our_code_emits() -> None:
    known = emitted_metric_names()
    for rule in alert_rules():
        used = metrics_in(rule["expr"])
        assert used, f"{rule['alert']} uses none of our metrics"
        assert used <= set(known), f"{rule['alert']}: unknown {used - set(known)}"
    # Database-wide gauges are reported by every worker process alike: max(), never
    # sum(). (A pool's size is per process; it is divided, never summed, anyway.)
    gauge_names = {n for n, o in known.items()
                   if emitted_instruments()[o][0] == "create_observable_gauge"}
    for rule in alert_rules():
        for name in metrics_in(rule["expr"]) & gauge_names:
            assert not re.search(r"sum\s*(by\s*\([^)]*\)\s*)?\(\s*" + name, rule["expr"]), (
                f"{rule['alert']} sums the gauge {name}")


def test_alert_rules_pass_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (the structural checks above still ran)")
    proc = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def all_exprs() -> Iterator[tuple[str, str]]:
    for rule in alert_rules():
        yield rule["alert"], rule["expr"]
    yield from dashboard_exprs()


def test_every_expression_parses_as_promql() -> None:
    parser = pytest.importorskip("promql_parser", reason="pip install promql-parser to "
                                 "parse the PromQL of alerts and panels")
    for where, expr in all_exprs():
        try:
            parser.parse(promql_checkable(expr))
        except Exception as exc:  # the parser raises plain ValueError-like errors
            pytest.fail(f"{where}: {expr!r} does not parse: {exc}")


# --------------------------------------------------------------------------- dashboard


@cache
def dashboard() -> dict[str, Any]:
    doc = json.loads(DASHBOARD.read_text())
    assert isinstance(doc, dict)
    return doc


def panels() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for panel in dashboard()["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def dashboard_exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in panels() for t in p.get("targets", [])]


def test_dashboard_is_a_grafana_dashboard() -> None:
    d = dashboard()
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for p in panels():
        grid = p["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["type"] in ("timeseries", "stat", "gauge", "bargauge", "table"), p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], f"{p['title']} has no queries"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            for var in re.findall(r"\$(\w+)", t["expr"]):
                assert var.startswith("__") or var in variables, f"{p['title']}: ${var}"


def test_dashboard_uses_only_metrics_our_code_emits() -> None:
    known = emitted_metric_names()
    used: set[str] = set()
    for title, expr in dashboard_exprs():
        names = metrics_in(expr)
        assert names, f"panel {title!r} queries none of our metrics"
        assert names <= set(known), f"panel {title!r}: unknown {names - set(known)}"
        used |= names
    for var in dashboard()["templating"]["list"]:
        query = var.get("definition") or ""
        assert metrics_in(query) <= set(known), var["name"]
    # And the other way round: every instrument we emit is on the dashboard.
    shown = {known[n] for n in used}
    assert shown == set(emitted_instruments()), (
        f"not on the dashboard: {set(emitted_instruments()) - shown}")


def test_dashboard_shows_what_operators_asked_for() -> None:
    exprs = " ".join(e for _, e in dashboard_exprs())
    for needle in ("sum by (outcome) (rate(outbox_deliveries_total",
                   "histogram_quantile(0.5, sum by (le) (rate(outbox_delivery_lag_seconds_bucket",
                   "histogram_quantile(0.99, sum by (le) (rate(outbox_delivery_lag_seconds_bucket",
                   'outbox_queue_effects{status="pending"}',
                   'outbox_queue_effects{status="in_flight"}',
                   'outbox_queue_effects{status="failed"}',
                   "outbox_queue_oldest_due_age_seconds",
                   'outbox_idempotency_requests_total{outcome="in_progress"}',  # 409
                   'outbox_idempotency_requests_total{outcome="mismatch"}',     # 422
                   'outbox_idempotency_requests_total{outcome="replayed"}',
                   'outbox_deliveries_total{outcome="lease_lost"}'):
        assert needle in exprs, needle


def test_dashboard_has_the_row_the_articles_ask_for() -> None:
    """Issue 15: one row holds every signal the two articles tell operators to watch."""
    rows = [p for p in dashboard()["panels"] if p["type"] == "row"]
    row = next(r for r in rows if r["title"] == ARTICLES_ROW)
    below = sorted(r["gridPos"]["y"] for r in rows if r["gridPos"]["y"] > row["gridPos"]["y"])
    end = below[0] if below else 10**6
    inside = [p for p in dashboard()["panels"] if p["type"] != "row"
              and row["gridPos"]["y"] < p["gridPos"]["y"] < end]
    exprs = " ".join(t["expr"] for p in inside for t in p["targets"])
    for needle in (
        # 409 : 2xx on idempotent endpoints
        'outbox_idempotency_requests_total{outcome=~"in_progress|claim_lost"}',
        'status_class="2xx"',
        # keys in processing past their TTL
        "max(outbox_idempotency_stale_processing)",
        # the same business request under different keys
        "outbox_idempotency_suspected_duplicates_total",
        # write latency p50 / p95 / p99 per source
        *(f"histogram_quantile({q}, sum by (le, source) "
          "(rate(outbox_inbox_write_duration_seconds_bucket" for q in ("0.5", "0.95", "0.99")),
        # lock waits on our tables, pool occupancy
        "max by (table) (outbox_db_lock_waits)", "outbox_db_lock_wait_age_seconds",
        'db_client_connections_usage_connections{state="used"}',
        "db_client_connections_max",
        # share of conflicts and duplicates per source
        'sum by (source) (rate(outbox_inbox_events_total{outcome="conflict"}',
        'sum by (source) (rate(outbox_inbox_events_total{outcome="duplicate"}',
    ):
        assert needle in exprs, needle
    # Every panel of the row says what it shows.
    assert all(p["description"] for p in inside)


def test_the_labels_the_queries_use_are_the_ones_the_code_sets() -> None:
    """`status_class`, `mode`, `table`, `pool_name`, `state`: set by our code or the
    instrumentation, or a query would silently match nothing."""
    sources = "\n".join((ROOT / p).read_text() for p in (
        "outbox/_idempotency.py", "dispatcher/metrics.py", "outbox/_inbox.py"))
    for label in ('"status_class"', '"mode"', '{"table"', '"pool.name"', '"source"',
                  '{"holder"'):
        assert label in sources, label
    exprs = " ".join(e for _, e in all_exprs())
    for label in ("status_class", "mode", "table", "pool_name", "state", "source", "holder"):
        assert re.search(rf"\b{label}\b", exprs), label


def test_bucket_boundaries_fit_the_latencies_they_measure() -> None:
    """p50/p95/p99 need boundaries around the values: inbox writes take milliseconds.

    Every histogram of ours gives its boundaries to the API as advisory ones, so any
    MeterProvider (an application's own, with no View of ours) uses them; the SDK's
    defaults are shaped for milliseconds. test_tracing checks the buckets a bare
    provider actually exported.
    """
    from outbox._telemetry import DURATION_BUCKETS, WRITE_BUCKETS

    for source in (ROOT / "outbox" / "_telemetry.py", ROOT / "dispatcher" / "metrics.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in _HISTOGRAMS):
                keywords = {k.arg for k in node.keywords}
                assert "explicit_bucket_boundaries_advisory" in keywords, (
                    f"{source.name}:{node.lineno}: a histogram on the SDK's default buckets")
    assert WRITE_BUCKETS[0] <= 0.001 and WRITE_BUCKETS[-1] >= 10
    assert list(WRITE_BUCKETS) == sorted(WRITE_BUCKETS)
    # At least three boundaries per decade between 1 ms and 1 s.
    for low in (0.001, 0.01, 0.1):
        assert sum(low <= b < low * 10 for b in WRITE_BUCKETS) >= 3, low
    assert DURATION_BUCKETS[0] <= 0.005


# --------------------------------------------------------------------------- runbook


def test_runbook_covers_every_alert_with_look_and_repair() -> None:
    text = RUNBOOK.read_text()
    sections = dict(re.findall(r"^## (\w+)\n(.*?)(?=^## |\Z)", text, re.M | re.S))
    covered = {a for a in (r["alert"] for r in alert_rules())
               if a in sections or a.replace("Critical", "High") in sections}
    assert covered == {r["alert"] for r in alert_rules()}
    for name, body in sections.items():
        for part in ("**Meaning.**", "**How to look.**", "**How to repair.**",
                     "**Safe / not safe.**"):
            assert part in body, f"runbook section {name} lacks {part}"
    # Every `outbox <command>` the runbook tells an operator to run exists.
    choices = {name for action in build_parser()._actions
               if isinstance(action, argparse._SubParsersAction) for name in action.choices}
    for command in set(re.findall(r"`outbox ([a-z][a-z-]*)", text)):
        assert command in choices, f"runbook mentions unknown command: outbox {command}"
    for command in ("status", "trace", "retry", "cancel"):
        assert f"`outbox {command}" in text


def test_dashboard_and_alerts_watch_table_health() -> None:
    """Issue 12: bloat is visible before it hurts: dead tuples, vacuum ages and the xmin
    horizon are on the dashboard, and alerts fire on a held horizon and on dead tuples."""
    exprs = " ".join(e for _, e in dashboard_exprs())
    for needle in ("max by (table) (outbox_db_table_dead_tuples)",
                   "outbox_db_table_live_tuples", "outbox_db_table_last_vacuum_age_seconds",
                   "outbox_db_table_last_autovacuum_age_seconds",
                   "max by (holder) (outbox_db_xmin_horizon_duration_seconds)",
                   "max by (holder) (outbox_db_xmin_horizon_age)"):
        assert needle in exprs, needle
    rules = {r["alert"]: r["expr"] for r in alert_rules()}
    assert "outbox_db_xmin_horizon_duration_seconds" in rules["OutboxXminHorizonHeld"]
    assert "outbox_db_xmin_horizon_age" in rules["OutboxXminHorizonHeld"]
    assert "outbox_db_table_dead_tuples" in rules["OutboxDeadTuplesHigh"]
