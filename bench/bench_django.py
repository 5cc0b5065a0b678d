#!/usr/bin/env python3
"""The same DRF endpoint with and without @idempotent, in one run (issue 10).

    uv run python bench/bench_django.py [--requests 1000] [--rounds 3]

Both endpoints parse the JSON body with a DRF serializer, INSERT one business row and
enqueue one effect inside `transaction.atomic()` on Django's connection, and answer
201. `guarded` adds `@idempotent(serializer=...)`: key and scope parsing, strict JSON,
the fingerprint, the advisory try-lock, the key lookup and the completed key's INSERT,
all in the same transaction. Requests go through Django's test client (the full
middleware and DRF stack, no network), one client, a new key per request, rounds
interleaved so drift hits both alike; then a replay of each guarded key. A persistent
database connection (CONN_MAX_AGE) keeps connection setup out of the numbers.
Prints ONE JSON line: requests/s and p50/p99 latency per endpoint, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchlib import pct  # noqa: E402

from outbox._config import database_url  # noqa: E402
from outbox._migrate import upgrade  # noqa: E402

BUSINESS = "CREATE TABLE IF NOT EXISTS public.bench_orders (id bigserial PRIMARY KEY, n int)"


def setup(url: str) -> Any:
    import django
    from django.conf import settings

    from dispatcher.examples.payments.django_app.settings import database_from_url

    db = {**database_from_url(url), "CONN_MAX_AGE": 600}
    settings.configure(
        SECRET_KEY="bench", DEBUG=False, USE_TZ=True, ALLOWED_HOSTS=["testserver"],
        DATABASES={"default": db}, ROOT_URLCONF="bench_django_urls",
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth",
                        "rest_framework", "outbox.contrib.django"],
        REST_FRAMEWORK={"DEFAULT_AUTHENTICATION_CLASSES": [],
                        "DEFAULT_PERMISSION_CLASSES": [],
                        "UNAUTHENTICATED_USER": None})
    django.setup()

    import types

    from django.db import connection, transaction
    from django.urls import path
    from rest_framework import serializers
    from rest_framework.response import Response
    from rest_framework.views import APIView

    from outbox import enqueue
    from outbox.contrib.django import anonymous_scope, idempotent

    class OrderIn(serializers.Serializer[Any]):
        n = serializers.IntegerField(min_value=1)

    def write(n: int, claim: Any = None) -> Response:
        with connection.cursor() as cur:
            cur.execute("INSERT INTO public.bench_orders (n) VALUES (%s) RETURNING id", [n])
            order_id = cur.fetchone()[0]
        enqueue(connection, "bench.effect", {"order_id": order_id}, claim=claim)
        return Response({"id": order_id}, status=201)

    class Plain(APIView):
        def post(self, request: Any) -> Response:
            body = OrderIn(data=request.data)
            body.is_valid(raise_exception=True)
            with transaction.atomic():
                return write(body.validated_data["n"])

    class Guarded(APIView):
        @idempotent(serializer=OrderIn, scope=anonymous_scope)
        def post(self, request: Any) -> Response:
            return write(request.idempotency.body["n"], request.idempotency.claim)

    module = types.ModuleType("bench_django_urls")
    module.urlpatterns = [path("plain", Plain.as_view()),  # type: ignore[attr-defined]
                          path("guarded", Guarded.as_view())]
    sys.modules["bench_django_urls"] = module
    with connection.cursor() as cur:
        cur.execute(BUSINESS)
    from django.test import Client

    return Client()


def run(client: Any, endpoint: str, keys: list[str]) -> list[float]:
    times = []
    for key in keys:
        start = time.perf_counter()
        resp = client.post(f"/{endpoint}", data=b'{"n": 7}', content_type="application/json",
                           HTTP_IDEMPOTENCY_KEY=key)
        times.append(time.perf_counter() - start)
        if resp.status_code != 201:
            raise SystemExit(f"{endpoint}: {resp.status_code} {resp.content[:200]!r}")
    return times


def summary(times: list[float]) -> dict[str, float]:
    return {"rps": round(len(times) / sum(times), 1),
            "p50_ms": round((pct(times, 50) or 0) * 1000, 3),
            "p99_ms": round((pct(times, 99) or 0) * 1000, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="per endpoint per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    url = database_url()
    upgrade(url)
    client = setup(url)
    run(client, "plain", [uuid.uuid4().hex for _ in range(50)])  # warm up both
    run(client, "guarded", [uuid.uuid4().hex for _ in range(50)])
    plain: list[float] = []
    guarded: list[float] = []
    replays: list[float] = []
    for _ in range(args.rounds):
        keys = [uuid.uuid4().hex for _ in range(args.requests)]
        plain += run(client, "plain", keys)
        guarded += run(client, "guarded", keys)
        for key in keys[: args.requests // 10]:
            begun = time.perf_counter()
            resp = client.post("/guarded", data=b'{"n": 7}', content_type="application/json",
                               HTTP_IDEMPOTENCY_KEY=key)
            assert resp.status_code == 201 and resp["Idempotent-Replayed"] == "true"
            replays.append(time.perf_counter() - begun)
    result = {"bench": "django", "requests": args.requests * args.rounds,
              "plain": summary(plain), "guarded": summary(guarded),
              "replay": summary(replays),
              "guarded_over_plain_p50": round((pct(guarded, 50) or 0) / (pct(plain, 50) or 1),
                                              3)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
