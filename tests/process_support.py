"""Real processes for the slow tests: start workers, kill them (and their children)
after, wait for their sessions and for the effects to end.

Shared by tests/test_dispatcher_processes.py, test_celery_queues.py,
test_celery_register.py, test_network_faults.py and test_faults.py; the names
test_dispatcher_processes always had are still importable from it. The H10 checker,
check_exactly_once, stays there: pytest rewrites the asserts of test modules only,
and its failures should show the values compared.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from celery import Celery
from sqlalchemy import Engine, text

from tests.dispatch_support import status_counts, wait_until

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
HANDLERS = "tests.handlers_for_tests:registry"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    stopped: bool = False
    queue: str = ""  # Celery workers: the queue they consume

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def send(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)
            self.stopped = sig == signal.SIGSTOP

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class Procs:
    """Starts worker processes and kills every one of them (and their children) after."""

    tmp: Path
    psp_url: str
    started: list[Proc] = field(default_factory=list)

    def spawn(self, name: str, cmd: Sequence[str], env: Mapping[str, str] | None = None
              ) -> Proc:
        log = self.tmp / f"{name}.log"
        # PYTHONPATH: the `celery` script does not put the cwd on sys.path, and the
        # handlers live in tests/.
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        full_env = {**os.environ, "PSP_URL": self.psp_url, "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": path, **(env or {})}
        with open(log, "wb") as out:
            popen = subprocess.Popen(list(cmd), cwd=ROOT, env=full_env, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        proc = Proc(name, popen, log)
        self.started.append(proc)
        return proc

    def worker(self, name: str, *, concurrency: int = 4, lease: float = 10.0,
               poll: float = 0.5, grace: float = 5.0,
               env: Mapping[str, str] | None = None) -> Proc:
        cmd = [sys.executable, "-m", "dispatcher.cli", "worker",
               "--concurrency", str(concurrency), "--lease", str(lease), "--poll", str(poll),
               "--grace", str(grace), "--handlers", HANDLERS, "--name", name]
        return self.spawn(name, cmd, env)

    def celery(self, name: str, *, broker: str | None, concurrency: int = 2,
               env: Mapping[str, str] | None = None) -> Proc:
        """A prefork worker with beat, on a queue of its own."""
        queue = f"outbox-test-{uuid.uuid4().hex[:8]}"
        return self.celery_app_worker(name, [
            "--pool", "prefork", "-c", str(concurrency), "-B",
            "-s", str(self.tmp / f"{name}-beat-schedule"), "--loglevel", "INFO",
            "-n", f"{name}-{uuid.uuid4().hex[:6]}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat"],
            queue=queue, broker=broker, env=env)

    def celery_app_worker(self, name: str, options: Sequence[str], *, queue: str,
                          broker: str | None, env: Mapping[str, str] | None = None
                          ) -> Proc:
        """`celery -A dispatcher.celery_app worker <options>` consuming `queue`, on
        `broker` (None: the default SQLAlchemy transport); `env` overrides the test
        defaults (a 5 s lease, a sweep every second)."""
        full = {"OUTBOX_HANDLERS": HANDLERS, "OUTBOX_CELERY_QUEUE": queue,
                "OUTBOX_SWEEP_INTERVAL": "1", "OUTBOX_LEASE": "5", "OUTBOX_CONCURRENCY": "4",
                "OUTBOX_DRAIN_BUDGET": "5", **(env or {})}
        if broker is not None:
            full["BROKER_URL"] = broker
        cmd = [str(BIN / "celery"), "-A", "dispatcher.celery_app", "worker", *options]
        proc = self.spawn(name, cmd, full)
        proc.queue = queue
        return proc

    def cleanup(self) -> None:
        """SIGKILL each process group we started (Celery's prefork children included)."""
        for proc in self.started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(10)


def process_group(tmp: Path, psp_url: str, *, tail: int = 40) -> Iterator[Procs]:
    """The body of a `procs` fixture (`yield from` it): the test's processes, killed
    after it, each one's last `tail` log lines printed (pytest shows them on failure)."""
    group = Procs(tmp, psp_url)
    try:
        yield group
    finally:
        group.cleanup()
        for proc in group.started:  # shown by pytest only when the test failed
            print(f"----- {proc.name} (pid {proc.pid}, rc {proc.popen.returncode})")
            print(proc.tail(tail))


def redis_or_skip(url: str, *, flush: bool) -> str:
    """`url` once Redis answers there (its database emptied first with `flush`); a
    machine without Redis skips the test (CI has it)."""
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1)
        if flush:
            client.flushdb()
        else:
            client.ping()
    except redis.exceptions.ConnectionError:
        pytest.skip("Redis is not reachable on 127.0.0.1:6379")
    return url


def wait_connected(engine: Engine, names: Sequence[str], timeout: float = 30.0) -> None:
    """Wait until each named worker holds a session on our database."""
    def ready() -> bool:
        with engine.connect() as conn:
            found = set(conn.execute(text(
                "SELECT DISTINCT application_name FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name = ANY(:n)"),
                {"n": list(names)}).scalars())
        return found == set(names)
    wait_until(ready, timeout, interval=0.2, message=f"workers {list(names)} to connect")


def wait_all_final(engine: Engine, total: int, timeout: float,
                   final: Sequence[str] = ("delivered",)) -> None:
    def done() -> bool:
        counts = status_counts(engine)
        return sum(counts.get(s, 0) for s in final) == total
    wait_until(done, timeout, interval=0.2,
               message=lambda: f"{total} effects final; now {status_counts(engine)}")


def producer(broker: str, queue: str) -> Celery:
    app = Celery(f"outbox-tests-{uuid.uuid4().hex[:6]}", broker=broker)
    app.conf.task_default_queue = queue
    return app
