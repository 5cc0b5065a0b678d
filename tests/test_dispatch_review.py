"""Issue 8, items 3-5: async handlers, the attempt cap, a claim retried after a lost reply.

Real PostgreSQL; the lost reply is a real one: a TCP proxy (tests/tcp_proxy.py) between
the Dispatcher and the server forwards the claim and resets the client before the
server's answer gets through, so the claim commits and the worker never hears of it.
Exactly-once is shown by counting handler runs and attempt rows.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine
from tenacity import wait_fixed

from dispatcher import Dispatcher, Registry, RetryPolicy
from dispatcher.handlers import EffectContext
from outbox.errors import TransientFailure
from tests.dispatch_support import (
    add_effects,
    attempts_of,
    db_now,
    effect_row,
)

# --------------------------------------------------------------------------- item 4


@pytest.mark.parametrize("exc", [SystemExit, KeyboardInterrupt])
def test_base_exception_from_a_handler_counts_toward_the_cap(
        engine: Engine, exc: type[BaseException]) -> None:
    """SystemExit/KeyboardInterrupt skipped the policy: back to pending, forever."""
    cap = 2
    calls = [0]

    def dies(effect: EffectContext) -> None:
        calls[0] += 1
        raise exc("handler gave up")

    reg = Registry()
    reg.register("dies", dies)
    [eid] = add_effects(engine, ["dies"], kind="dies", max_attempts=cap)
    clock = [db_now(engine)]
    d = Dispatcher(engine, reg, policy=RetryPolicy(wait=wait_fixed(5)),
                   clock=lambda: clock[0])
    try:
        for _ in range(cap + 2):  # more chances than the cap allows
            d.drain(budget=5)
            clock[0] += timedelta(seconds=6)
    finally:
        d.shutdown(0)
    assert calls == [cap]
    row = effect_row(engine, "dies")
    assert (row.status, row.attempts) == ("failed", cap)
    assert [a.outcome for a in attempts_of(engine, eid)] == ["retry", "failed"]
    assert exc.__name__ in row.last_error


class _BrokenPolicy(RetryPolicy):
    def decide(self, **kwargs: Any) -> Any:
        raise RuntimeError("a bug in the policy")


def test_a_crashed_delivery_is_dead_lettered_at_the_cap(engine: Engine) -> None:
    """When deciding itself fails, the fallback retried without looking at the cap."""
    calls = [0]

    def fails(effect: EffectContext) -> None:
        calls[0] += 1
        raise TransientFailure("receiver down")

    reg = Registry()
    reg.register("fails", fails)
    [eid] = add_effects(engine, ["crash-cap"], kind="fails", max_attempts=1)
    clock = [db_now(engine)]
    d = Dispatcher(engine, reg, policy=_BrokenPolicy(), clock=lambda: clock[0])
    try:
        d.drain(budget=5)
        clock[0] += timedelta(seconds=120)  # past any backoff of the fallback
        d.drain(budget=5)
    finally:
        d.shutdown(0)
    assert calls == [1]
    row = effect_row(engine, "crash-cap")
    assert (row.status, row.attempts) == ("failed", 1)
    [a] = attempts_of(engine, eid)
    assert a.outcome == "failed" and "a bug in the policy" in a.error


def _blocking(release: threading.Event, calls: list[str], *,
              retry_safe: bool = True) -> Registry:
    def block(effect: EffectContext) -> dict[str, bool]:
        calls.append(effect.key)
        release.wait(10)
        return {"late": True}

    reg = Registry()
    reg.register("block", block, retry_safe=retry_safe)
    return reg


def test_shutdown_release_on_the_last_attempt_dead_letters(engine: Engine) -> None:
    """A release sent the effect back to pending whatever its attempts: one more
    attempt than the cap per shutdown mid-delivery."""
    release, calls = threading.Event(), list[str]()
    reg = _blocking(release, calls)
    [eid] = add_effects(engine, ["release-cap"], kind="block", max_attempts=1)
    d = Dispatcher(engine, reg)
    try:
        assert d.fill() == 1
        d.shutdown(grace=0.1)
    finally:
        release.set()
    row = effect_row(engine, "release-cap")
    assert (row.status, row.attempts, row.lease_token) == ("failed", 1, None)
    [a] = attempts_of(engine, eid)
    assert a.outcome == "failed" and a.error.startswith("released")
    # A fresh worker finds nothing to run: the handler ran once, as the cap says.
    again = Dispatcher(engine, reg)
    try:
        again.drain(budget=2)
    finally:
        again.shutdown(0)
    assert calls == ["release-cap"]
    assert effect_row(engine, "release-cap").attempts == 1


def test_shutdown_release_past_retry_until_dead_letters(engine: Engine) -> None:
    release, calls = threading.Event(), list[str]()
    reg = _blocking(release, calls)
    [eid] = add_effects(engine, ["release-late"], kind="block", retry_for=60)
    clock = [db_now(engine)]
    d = Dispatcher(engine, reg, clock=lambda: clock[0])
    try:
        assert d.fill() == 1
        clock[0] += timedelta(seconds=61)  # retry_until passed while it was delivering
        d.shutdown(grace=0.1)
    finally:
        release.set()
    assert effect_row(engine, "release-late").status == "failed"
    assert [a.outcome for a in attempts_of(engine, eid)] == ["failed"]


def test_shutdown_release_of_an_unsafe_handler_on_its_last_attempt_is_parked(
        engine: Engine) -> None:
    """At the cap too, an ambiguous outcome of a retry-unsafe handler needs a human."""
    release, calls = threading.Event(), list[str]()
    reg = _blocking(release, calls, retry_safe=False)
    [eid] = add_effects(engine, ["release-unsafe"], kind="block", max_attempts=1)
    d = Dispatcher(engine, reg)
    try:
        assert d.fill() == 1
        d.shutdown(grace=0.1)
    finally:
        release.set()
    assert effect_row(engine, "release-unsafe").status == "needs_review"
    assert [a.outcome for a in attempts_of(engine, eid)] == ["ambiguous"]
