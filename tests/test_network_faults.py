"""Silent connections (issue 14): a peer that stops answering costs a bounded wait.

The proxy's `silence_open()` makes every connection open at that moment silent (bytes
read and dropped, no FIN, no RST; the kernel keeps acknowledging, as a wedged middlebox
does), while new connections work: what a failover behind a proxy, or an idle-timeout
NAT, looks like to a client.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, make_url, text
from sqlalchemy.exc import OperationalError

from outbox._config import make_engine
from tests.tcp_proxy import TcpProxy


@pytest.fixture
def pg_proxy(db_url: str) -> Iterator[TcpProxy]:
    url = make_url(db_url)
    if not url.host or url.host.startswith("/"):
        pytest.skip("the database is on a Unix socket")  # pragma: no cover
    proxy = TcpProxy((url.host, url.port or 5432)).start()
    yield proxy
    proxy.stop()


def proxied(db_url: str, proxy: TcpProxy, **kwargs: object) -> Engine:
    url = make_url(db_url).set(host="127.0.0.1", port=proxy.port)
    return make_engine(url.render_as_string(hide_password=False),
                       application_name="net-faults", **kwargs)  # type: ignore[arg-type]


def test_a_call_on_a_silenced_connection_fails_within_the_bound(
        db_url: str, pg_proxy: TcpProxy) -> None:
    engine = proxied(db_url, pg_proxy, call_timeout=1.0)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT 1")).scalar_one() == 1
            assert pg_proxy.silence_open() == 1
            started = time.monotonic()
            with pytest.raises(OperationalError, match="no answer from PostgreSQL"):
                conn.execute(text("SELECT 2"))
            took = time.monotonic() - started
        assert 0.9 <= took < 3.0, took
        # The dead connection left the pool: the next checkout opens a working one.
        with engine.connect() as conn:
            assert conn.execute(text("SELECT 3")).scalar_one() == 3
        assert pg_proxy.connections == 2
    finally:
        engine.dispose()


def test_a_pooled_connection_silenced_while_idle_is_replaced_at_checkout(
        db_url: str, pg_proxy: TcpProxy) -> None:
    """The pool's pre-ping is a bounded call: checkout costs at most the bound."""
    engine = proxied(db_url, pg_proxy, call_timeout=1.0, pool_size=1)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        pg_proxy.silence_open()  # the pooled connection, idle, goes silent
        started = time.monotonic()
        with engine.connect() as conn:
            assert conn.execute(text("SELECT 2")).scalar_one() == 2
        assert time.monotonic() - started < 3.0
        assert pg_proxy.connections == 2
    finally:
        engine.dispose()


def test_a_silenced_commit_fails_within_the_bound(db_url: str, pg_proxy: TcpProxy,
                                                  engine: Engine) -> None:
    """COMMIT waits too: its outcome is unknown, so the caller must see an error."""
    silent = proxied(db_url, pg_proxy, call_timeout=1.0)
    try:
        started = time.monotonic()
        with pytest.raises(OperationalError), silent.begin() as conn:
            conn.execute(text("INSERT INTO public.test_orders (key, amount) VALUES ('s', 1)"))
            pg_proxy.silence_open()
        assert time.monotonic() - started < 3.0
    finally:
        silent.dispose()
    # The server never saw the COMMIT: once the dead backend is gone, nothing is there.
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM public.test_orders")).scalar() == 0
