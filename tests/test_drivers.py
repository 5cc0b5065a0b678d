"""One contract, every handle (issue 9): the outbox inside the caller's own transaction.

Parametrized over psycopg 3 `Connection` / `AsyncConnection` and SQLAlchemy
`Connection`, `Session`, `scoped_session`, `AsyncConnection`, `AsyncSession`,
`async_scoped_session`. For each: commit -> the effect exists and a worker delivers
it; rollback -> no effect; a rolled-back savepoint -> no effect; F01 (50 concurrent
same-key requests -> one execution) through the guard on that handle; the NOTIFY
wakes a LISTEN connection only after commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, make_url, text
from sqlalchemy.ext.asyncio import (
    AsyncSession,
    async_scoped_session,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import scoped_session, sessionmaker

from dispatcher import Dispatcher, Registry
from outbox import Claim, IdempotencyGuard, StoredResponse, add_doorbell, enqueue, remove_doorbell
from outbox._config import NOTIFY_CHANNEL
from outbox._enqueue import aenqueue
from outbox.errors import RequestInProgress

SYNC = ["psycopg", "sa_connection", "sa_session", "sa_scoped_session"]
ASYNC = ["psycopg_async", "sa_async_connection", "sa_async_session", "sa_async_scoped"]


def dsn(db_url: str) -> str:
    return make_url(db_url).set(drivername="postgresql").render_as_string(hide_password=False)


@contextmanager
def sync_handle(kind: str, engine: Engine, db_url: str) -> Iterator[tuple[Any, Any]]:
    """(handle, transaction control): `.commit()`, `.rollback()`, `.savepoint()`."""
    if kind == "psycopg":
        with psycopg.connect(dsn(db_url)) as conn:
            yield conn, conn
        return
    if kind == "sa_connection":
        with engine.connect() as conn:
            yield conn, conn
        return
    factory = sessionmaker(engine)
    if kind == "sa_session":
        with factory() as session:
            yield session, session
        return
    scoped = scoped_session(factory)
    try:
        yield scoped, scoped
    finally:
        scoped.remove()


@asynccontextmanager
async def async_handle(kind: str, db_url: str) -> AsyncIterator[tuple[Any, Any]]:
    if kind == "psycopg_async":
        async with await psycopg.AsyncConnection.connect(dsn(db_url)) as conn:
            yield conn, conn
        return
    engine = create_async_engine(make_url(db_url).set(drivername="postgresql+psycopg"))
    try:
        if kind == "sa_async_connection":
            async with engine.connect() as conn:
                yield conn, conn
            return
        factory = async_sessionmaker(engine)
        if kind == "sa_async_session":
            async with factory() as session:
                yield session, session
            return
        scoped = async_scoped_session(factory, scopefunc=asyncio.current_task)
        try:
            yield scoped, scoped
        finally:
            await scoped.remove()
    finally:
        await engine.dispose()


def savepoint(tx: Any) -> Any:
    """A savepoint context on any sync handle."""
    if isinstance(tx, psycopg.Connection):
        return tx.transaction()
    return tx.begin_nested()


def asavepoint(tx: Any) -> Any:
    if isinstance(tx, psycopg.AsyncConnection):
        return tx.transaction()
    return tx.begin_nested()


def effect_keys(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT effect_key FROM outbox.effects ORDER BY id"))
                    .scalars())


def deliver_all(engine: Engine) -> list[str]:
    seen: list[str] = []
    registry = Registry()
    registry.register("contract", lambda e: seen.append(e.key) or {"ok": True})
    d = Dispatcher(engine, registry, concurrency=4)
    try:
        d.drain(5)
    finally:
        d.shutdown(0)
    return seen


@pytest.mark.parametrize("kind", SYNC)
def test_sync_handle_commit_rollback_savepoint(kind: str, engine: Engine, db_url: str) -> None:
    with sync_handle(kind, engine, db_url) as (handle, tx):
        enqueue(handle, "contract", {"n": 1}, key=f"{kind}-committed")
        tx.commit()
        enqueue(handle, "contract", {"n": 2}, key=f"{kind}-rolled-back")
        tx.rollback()
        enqueue(handle, "contract", {"n": 3}, key=f"{kind}-outer")
        with contextlib.suppress(RuntimeError), savepoint(tx):
            enqueue(handle, "contract", {"n": 4}, key=f"{kind}-in-savepoint")
            raise RuntimeError("roll the savepoint back")
        tx.commit()
    assert effect_keys(engine) == [f"{kind}-committed", f"{kind}-outer"]
    assert sorted(deliver_all(engine)) == [f"{kind}-committed", f"{kind}-outer"]


@pytest.mark.parametrize("kind", ASYNC)
def test_async_handle_commit_rollback_savepoint(kind: str, engine: Engine,
                                                db_url: str) -> None:
    async def scenario() -> None:
        async with async_handle(kind, db_url) as (handle, tx):
            await aenqueue(handle, "contract", {"n": 1}, key=f"{kind}-committed")
            await tx.commit()
            await aenqueue(handle, "contract", {"n": 2}, key=f"{kind}-rolled-back")
            await tx.rollback()
            await aenqueue(handle, "contract", {"n": 3}, key=f"{kind}-outer")
            with contextlib.suppress(RuntimeError):
                async with asavepoint(tx):
                    await aenqueue(handle, "contract", {"n": 4}, key=f"{kind}-in-savepoint")
                    raise RuntimeError("roll the savepoint back")
            await tx.commit()

    asyncio.run(scenario())
    assert effect_keys(engine) == [f"{kind}-committed", f"{kind}-outer"]
    assert sorted(deliver_all(engine)) == [f"{kind}-committed", f"{kind}-outer"]


def _work_counter() -> tuple[list[int], threading.Lock]:
    return [], threading.Lock()


def our_listeners(handle: Any) -> int:
    """The commit listeners a SQLAlchemy handle holds (none of psycopg's: it has none)."""
    for attr in ("sync_session", "sync_connection"):
        handle = getattr(handle, attr, handle)
    if isinstance(handle, scoped_session | async_scoped_session):
        return our_listeners(handle())
    dispatch = handle.dispatch
    return len(dispatch.after_commit if hasattr(dispatch, "after_commit")
               else dispatch.commit)


@pytest.mark.parametrize("kind", [k for k in SYNC if k != "psycopg"])
def test_a_long_lived_handle_keeps_one_doorbell_listener(kind: str, engine: Engine,
                                                         db_url: str) -> None:
    """With an in-process doorbell (Celery's, Django's), a Session or Connection that
    commits many transactions holds one listener of ours, not one per transaction
    (a `once` listener stays registered after it ran: the handle grew without bound,
    and every commit called them all). Each commit still rings once per queue, a
    rolled-back transaction rings at the next commit (a hint, never a loss), and a
    transaction without effects rings nothing."""
    rang: list[str] = []
    add_doorbell(rang.append)
    try:
        with sync_handle(kind, engine, db_url) as (handle, tx):
            for n in range(50):
                enqueue(handle, "contract", {"n": n}, key=f"{kind}-{n}", queue="bells")
                enqueue(handle, "contract", {"n": n}, key=f"{kind}-{n}-b", queue="bells")
                tx.commit()
            assert our_listeners(handle) == 1
            assert rang == ["bells"] * 50
            # A released savepoint is not the COMMIT (a Session fires after_commit for
            # it): the ring waits for the COMMIT, when a worker can see the rows.
            enqueue(handle, "contract", {"n": -2}, key=f"{kind}-saved", queue="saved")
            with savepoint(tx):
                handle.execute(text("SELECT 1"))
            assert rang == ["bells"] * 50
            tx.commit()
            assert rang[50:] == ["saved"]
            del rang[50:]
            # The COMMIT with a savepoint still open (committed with it): rung, once.
            enqueue(handle, "contract", {"n": -3}, key=f"{kind}-open", queue="open")
            handle.begin_nested()
            tx.commit()
            assert rang[50:] == ["open"]
            del rang[50:]
            enqueue(handle, "contract", {"n": -1}, key=f"{kind}-gone", queue="other")
            tx.rollback()
            handle.execute(text("SELECT 1"))
            tx.commit()
            assert rang[50:] == ["other"]
            handle.execute(text("SELECT 1"))
            tx.commit()
            assert rang[51:] == [] and our_listeners(handle) == 1
    finally:
        remove_doorbell(rang.append)
    assert len(effect_keys(engine)) == 102


@pytest.mark.parametrize("kind", [k for k in ASYNC if k != "psycopg_async"])
def test_a_long_lived_async_handle_keeps_one_doorbell_listener(kind: str, db_url: str
                                                               ) -> None:
    """The same on the async SQLAlchemy handles (their listeners sit on the sync
    Session or Connection inside)."""
    rang: list[str] = []

    async def go() -> None:
        async with async_handle(kind, db_url) as (handle, tx):
            for n in range(20):
                await aenqueue(handle, "contract", {"n": n}, key=f"{kind}-{n}",
                               queue="bells")
                await tx.commit()
            assert our_listeners(handle) == 1

    add_doorbell(rang.append)
    try:
        asyncio.run(go())
    finally:
        remove_doorbell(rang.append)
    assert rang == ["bells"] * 20


@pytest.mark.parametrize("kind", SYNC)
def test_f01_through_the_guard_on_each_sync_handle(kind: str, engine: Engine,
                                                   db_url: str) -> None:
    """50 concurrent same-key requests, each in its own handle: one execution."""
    guard = IdempotencyGuard()
    runs, lock = _work_counter()
    barrier = threading.Barrier(50)

    def request(i: int) -> str:
        with sync_handle(kind, engine, db_url) as (handle, tx):
            barrier.wait(30)
            try:
                begun = guard.begin(handle, "contract", "same-key", "fp")
                if isinstance(begun, StoredResponse):
                    tx.commit()
                    return "replayed"
                with lock:
                    runs.append(i)
                enqueue(handle, "contract", {"once": True}, claim=begun, name="charge")
                guard.complete(handle, begun, StoredResponse(201, (), b"done"))
                tx.commit()
                return "executed"
            except RequestInProgress:
                tx.rollback()
                return "409"

    with ThreadPoolExecutor(50) as pool:
        outcomes = list(pool.map(request, range(50)))
    assert len(runs) == 1 and outcomes.count("executed") == 1
    assert set(outcomes) <= {"executed", "replayed", "409"}
    assert len(effect_keys(engine)) == 1


@pytest.mark.parametrize("kind", ASYNC)
def test_f01_through_the_guard_on_each_async_handle(kind: str, engine: Engine,
                                                    db_url: str) -> None:
    guard = IdempotencyGuard()
    runs: list[int] = []

    async def request(i: int, start: asyncio.Event) -> str:
        async with async_handle(kind, db_url) as (handle, tx):
            await start.wait()
            try:
                begun = await guard.abegin(handle, "contract", "same-key", "fp")
                if isinstance(begun, StoredResponse):
                    await tx.commit()
                    return "replayed"
                runs.append(i)
                await aenqueue(handle, "contract", {"once": True}, claim=begun, name="c")
                await asyncio.sleep(0.01)  # let the twins collide while we hold the key
                await guard.acomplete(handle, begun, StoredResponse(201, (), b"done"))
                await tx.commit()
                return "executed"
            except RequestInProgress:
                await tx.rollback()
                return "409"

    async def storm() -> list[str]:
        start = asyncio.Event()
        tasks = [asyncio.create_task(request(i, start)) for i in range(50)]
        await asyncio.sleep(0.5)  # every task connected and waiting
        start.set()
        return list(await asyncio.gather(*tasks))

    outcomes = asyncio.run(storm())
    assert len(runs) == 1 and outcomes.count("executed") == 1
    assert set(outcomes) <= {"executed", "replayed", "409"}
    assert len(effect_keys(engine)) == 1


@pytest.mark.parametrize("kind", SYNC)
def test_notify_reaches_a_listener_only_after_commit(kind: str, engine: Engine,
                                                     db_url: str) -> None:
    with psycopg.connect(dsn(db_url), autocommit=True) as listener:
        listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        with sync_handle(kind, engine, db_url) as (handle, tx):
            enqueue(handle, "contract", {}, queue=f"q-{kind}")
            assert list(listener.notifies(timeout=0.3)) == []  # not before COMMIT
            tx.commit()
        got = [n.payload for n in listener.notifies(timeout=2, stop_after=1)]
    assert got == [f"q-{kind}"]


def test_run_and_arun_take_a_psycopg_connection(engine: Engine, db_url: str) -> None:
    """`run` on a plain psycopg connection: the key and the effect in one transaction."""
    guard = IdempotencyGuard()

    def work(conn: psycopg.Connection[Any], claim: Claim) -> StoredResponse:
        conn.execute("INSERT INTO public.test_orders (key, amount) VALUES (%s, 1)",
                     (claim.key,))
        enqueue(conn, "contract", {"k": claim.key}, claim=claim, name="c")
        return StoredResponse(201, (), b"ok")

    async def awork(conn: psycopg.AsyncConnection[Any], claim: Claim) -> StoredResponse:
        await conn.execute("INSERT INTO public.test_orders (key, amount) VALUES (%s, 1)",
                           (claim.key,))
        await aenqueue(conn, "contract", {"k": claim.key}, claim=claim, name="c")
        return StoredResponse(201, (), b"ok")

    with psycopg.connect(dsn(db_url)) as conn:
        for mode in ("atomic", "phased"):
            first = guard.run(conn, "s", f"sync-{mode}", "fp", work, mode=mode)  # type: ignore[arg-type]
            again = guard.run(conn, "s", f"sync-{mode}", "fp", work, mode=mode)  # type: ignore[arg-type]
            assert not first.replayed and again.replayed

    async def run_async() -> None:
        async with await psycopg.AsyncConnection.connect(dsn(db_url)) as aconn:
            for mode in ("atomic", "phased"):
                first = await guard.arun(aconn, "s", f"async-{mode}", "fp", awork, mode=mode)  # type: ignore[arg-type]
                again = await guard.arun(aconn, "s", f"async-{mode}", "fp", awork, mode=mode)  # type: ignore[arg-type]
                assert not first.replayed and again.replayed

    asyncio.run(run_async())
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM public.test_orders")).scalar() == 4
    assert len(effect_keys(engine)) == 4


def test_a_wrong_handle_is_a_clear_type_error(engine: Engine) -> None:
    with pytest.raises(TypeError, match="psycopg 3 connection, a SQLAlchemy"):
        enqueue(object(), "contract", {})
    with engine.connect() as conn, pytest.raises(TypeError, match="async"):
        asyncio.run(_enqueue_sync_handle_from_async(conn))
    with pytest.raises(TypeError, match="is async"):
        enqueue(AsyncSession(), "contract", {})


async def _enqueue_sync_handle_from_async(conn: Any) -> None:
    await aenqueue(conn, "contract", {})





def test_run_refuses_a_psycopg_connection_inside_a_transaction(db_url: str,
                                                               engine: Engine) -> None:
    """A review finding: psycopg would turn run()'s transaction into a savepoint of the
    caller's open one; the client was told 201 with nothing committed."""
    guard = IdempotencyGuard()

    def work(conn: Any, claim: Claim) -> StoredResponse:
        enqueue(conn, "contract", {}, claim=claim, name="c")
        return StoredResponse(201)

    with psycopg.connect(dsn(db_url)) as conn:
        conn.execute("SELECT 1")  # a transaction is open now
        for mode in ("atomic", "phased"):
            with pytest.raises(TypeError, match="no open transaction"):
                guard.run(conn, "s", f"k-{mode}", "fp", work, mode=mode)  # type: ignore[arg-type]
        conn.rollback()
        assert not guard.run(conn, "s", "k-idle", "fp", work).replayed  # idle: fine
    assert len(effect_keys(engine)) == 1


def test_begin_refuses_an_autocommit_handle(engine: Engine, db_url: str) -> None:
    """In autocommit the key's lock ends after one statement and the key would commit
    before the work: begin()/complete() need a transaction."""
    guard = IdempotencyGuard()
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        with pytest.raises(TypeError, match="autocommit"):
            guard.begin(conn, "s", "k", "fp")
    with psycopg.connect(dsn(db_url), autocommit=True) as raw, \
            pytest.raises(TypeError, match="autocommit"):
        guard.begin(raw, "s", "k", "fp")
