"""FastAPI on the application's own Session / AsyncSession (issue 9).

`IdempotentRequest.run_in(session, work)` and `arun_in(async_session, work)`: the key,
the business rows and the effects commit in the app's transaction (dependency
injection as FastAPI users write it), not on an engine of ours.
"""

# No `from __future__ import annotations`: FastAPI resolves the endpoints' annotations,
# which refer to locals of make_app.

import threading
import warnings
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

import pytest
from fastapi import Depends, FastAPI
from sqlalchemy import Engine, make_url, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker
from starlette.responses import JSONResponse, Response

from outbox import Claim, IdempotencyGuard, aenqueue, enqueue
from outbox.http import (
    REPLAYED_HEADER,
    Idempotency,
    IdempotentRequest,
    anonymous_scope,
    install_problem_handlers,
)

with warnings.catch_warnings():  # starlette would rather have `httpx2`; httpx works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

Req = IdempotentRequest[dict[str, Any]]


def make_app(engine: Engine, db_url: str, *, local_twins: bool = True
             ) -> tuple[FastAPI, threading.Event]:
    app = FastAPI()
    install_problem_handlers(app)
    app.state.engine = engine
    guard = Idempotency(dict, scope=anonymous_scope,
                        guard=IdempotencyGuard(local_twins=local_twins))
    factory = sessionmaker(engine)
    aengine = create_async_engine(make_url(db_url).set(drivername="postgresql+psycopg"))
    afactory = async_sessionmaker(aengine)
    fail = threading.Event()

    def get_session() -> Iterator[Session]:
        with factory() as session:
            yield session

    async def get_async_session() -> AsyncIterator[AsyncSession]:
        async with afactory() as session:
            yield session

    @app.post("/sync")
    def create(req: Annotated[Req, Depends(guard)],
               session: Annotated[Session, Depends(get_session)]) -> Response:
        def work(s: Session, claim: Claim) -> Response:
            oid = s.execute(text("INSERT INTO public.test_orders (key, amount) VALUES (:k, :a)"
                                 " RETURNING id"), {"k": claim.key, "a": req.body["a"]}
                            ).scalar_one()
            enqueue(s, "order.placed", {"id": oid}, claim=claim, name="placed")
            if fail.is_set():
                raise RuntimeError("work failed after writing")
            return JSONResponse({"id": oid}, 201)
        return req.run_in(session, work)  # type: ignore[arg-type]

    @app.post("/async")
    async def acreate(req: Annotated[Req, Depends(guard)],
                      session: Annotated[AsyncSession, Depends(get_async_session)]
                      ) -> Response:
        async def work(s: AsyncSession, claim: Claim) -> Response:
            oid = (await s.execute(text(
                "INSERT INTO public.test_orders (key, amount) VALUES (:k, :a) RETURNING id"),
                {"k": claim.key, "a": req.body["a"]})).scalar_one()
            await aenqueue(s, "order.placed", {"id": oid}, claim=claim, name="placed")
            return JSONResponse({"id": oid}, 201)
        return await req.arun_in(session, work)

    return app, fail


def counts(engine: Engine) -> tuple[int, int, int]:
    with engine.connect() as conn:
        return tuple(conn.execute(text(  # type: ignore[return-value]
            "SELECT (SELECT count(*) FROM public.test_orders),"
            " (SELECT count(*) FROM outbox.effects),"
            " (SELECT count(*) FROM outbox.idempotency_keys)")).one())


@pytest.mark.parametrize("path", ["/sync", "/async"])
def test_the_apps_own_session_carries_key_rows_and_effects(engine: Engine, db_url: str,
                                                           path: str) -> None:
    app, _ = make_app(engine, db_url)
    with TestClient(app) as client:
        first = client.post(path, json={"a": 1}, headers={"Idempotency-Key": "k1"})
        again = client.post(path, json={"a": 1}, headers={"Idempotency-Key": "k1"})
        other = client.post(path, json={"a": 2}, headers={"Idempotency-Key": "k1"})
    assert first.status_code == 201 and REPLAYED_HEADER.lower() not in first.headers
    assert again.status_code == 201 and again.headers[REPLAYED_HEADER] == "true"
    assert again.content == first.content
    assert other.status_code == 422
    assert counts(engine) == (1, 1, 1)


@pytest.mark.parametrize("local_twins", [True, False], ids=["local-twins", "database"])
@pytest.mark.parametrize("path", ["/sync", "/async"])
def test_twenty_concurrent_twins_execute_once(engine: Engine, db_url: str, path: str,
                                              local_twins: bool) -> None:
    app, _ = make_app(engine, db_url, local_twins=local_twins)
    with TestClient(app) as client, ThreadPoolExecutor(20) as pool:
        barrier = threading.Barrier(20)

        def hit(_: int) -> tuple[int, str | None]:
            barrier.wait(10)
            r = client.post(path, json={"a": 5}, headers={"Idempotency-Key": "storm"})
            return r.status_code, r.headers.get("retry-after")
        answers = list(pool.map(hit, range(20)))
    statuses = [status for status, _ in answers]
    assert set(statuses) <= {201, 409} and 201 in statuses
    assert all(after == "1" for status, after in answers if status == 409)
    assert counts(engine) == (1, 1, 1)


def test_work_that_fails_leaves_nothing_in_the_apps_session(engine: Engine,
                                                            db_url: str) -> None:
    app, fail = make_app(engine, db_url)
    fail.set()
    with TestClient(app, raise_server_exceptions=False) as client:
        resp = client.post("/sync", json={"a": 1}, headers={"Idempotency-Key": "k"})
    assert resp.status_code == 500
    assert counts(engine) == (0, 0, 0)
