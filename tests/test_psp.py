"""The fake PSP must count truthfully, or every exactly-once test built on it proves nothing.

Real HTTP over loopback with httpx; no database needed.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from dispatcher.examples.payments.psp import Ledger, Receiver, ReceiverProcess, main


@pytest.fixture(scope="module")
def _shared() -> Iterator[tuple[Receiver, httpx.Client]]:
    with Receiver() as receiver, \
            httpx.Client(base_url=receiver.url, trust_env=False, timeout=5) as c:
        yield receiver, c


@pytest.fixture
def psp(_shared: tuple[Receiver, httpx.Client]) -> Receiver:
    """One receiver for the module, emptied before each test (``reset`` is under test too)."""
    _shared[0].reset()
    return _shared[0]


@pytest.fixture
def client(psp: Receiver, _shared: tuple[Receiver, httpx.Client]) -> httpx.Client:
    return _shared[1]


def charge(client: httpx.Client, key: str | None, body: object | None = None,
           path: str = "/charges", headers: dict[str, str] | None = None,
           timeout: float | None = None) -> httpx.Response:
    """POST a delivery the way the dispatcher does: JSON body plus Idempotency-Key."""
    sent = {} if key is None else {"Idempotency-Key": key}
    sent.update(headers or {})
    payload = {"amount": 100, "currency": "EUR"} if body is None else body
    if timeout is None:
        return client.post(path, json=payload, headers=sent)
    return client.post(path, json=payload, headers=sent, timeout=timeout)


# -- dedup


def test_first_applies_then_replays_byte_identical(psp: Receiver, client: httpx.Client) -> None:
    first = charge(client, "k1")
    second = charge(client, "k1")
    assert first.status_code == second.status_code == 201
    assert second.content == first.content
    assert first.json()["id"].startswith("ch_") and first.json()["key"] == "k1"
    assert "applied_at" in first.json()
    assert second.headers["Idempotent-Replayed"] == "true"
    stats = psp.stats()
    assert stats["applied"] == 1 and stats["replayed"] == 1 and stats["deliveries"] == 2
    assert stats["max_applied_per_key"] == 1
    assert stats["keys_delivered_more_than_once"] == 1
    assert stats["per_path"] == {"/charges": 1}


def test_fingerprint_ignores_key_order(client: httpx.Client) -> None:
    a = client.post("/charges", content=b'{"amount": 1, "currency": "EUR"}',
                    headers={"Idempotency-Key": "k"})
    b = client.post("/charges", content=b'{"currency":"EUR","amount":1}',
                    headers={"Idempotency-Key": "k"})
    assert (a.status_code, b.status_code) == (201, 201) and a.content == b.content


def test_same_key_different_body_is_422(psp: Receiver, client: httpx.Client) -> None:
    assert charge(client, "k1", {"amount": 1}).status_code == 201
    reply = charge(client, "k1", {"amount": 2})
    assert reply.status_code == 422
    assert reply.json()["error"] == "idempotency_key_reused"
    # Same key on another endpoint is a different request too.
    assert charge(client, "k1", {"amount": 1}, path="/refunds").status_code == 422
    stats = psp.stats()
    assert stats["mismatches"] == 2 and stats["applied"] == 1


@pytest.mark.parametrize("headers", [{}, {"Idempotency-Key": ""}])
def test_missing_or_empty_key_is_400(psp: Receiver, client: httpx.Client,
                                     headers: dict[str, str]) -> None:
    reply = client.post("/charges", json={"amount": 1}, headers=headers)
    assert reply.status_code == 400
    stats = psp.stats()
    assert stats["applied"] == 0 and stats["deliveries"] == 0 and stats["rejected"] == 1


def test_bad_json_is_400_and_not_applied(psp: Receiver, client: httpx.Client) -> None:
    reply = client.post("/charges", content=b"{nope", headers={"Idempotency-Key": "k"})
    assert reply.status_code == 400
    assert psp.stats()["applied"] == 0


def test_any_path_is_accepted_and_counted_per_path(psp: Receiver, client: httpx.Client) -> None:
    assert charge(client, "c1").json()["id"].startswith("ch_")
    assert charge(client, "e1", {"to": "a@b.c"}, path="/emails").json()["object"] == "email"
    assert charge(client, "h1", {"x": 1}, path="/hooks/deep").status_code == 201
    assert psp.stats()["per_path"] == {"/charges": 1, "/emails": 1, "/hooks/deep": 1}


def test_409_while_first_is_in_progress(psp: Receiver, client: httpx.Client) -> None:
    psp.set_mode("slow", key="k1", delay=0.6)
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(charge, client, "k1")
        deadline = time.monotonic() + 2
        while psp.stats()["in_progress"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        psp.clear_modes()
        busy = charge(client, "k1")
        assert busy.status_code == 409
        assert busy.json()["error"] == "idempotency_key_in_use"
        first = slow.result()
    assert first.status_code == 201
    after = charge(client, "k1")
    assert after.status_code == 201 and after.content == first.content
    stats = psp.stats()
    assert stats["applied"] == 1 and stats["conflicts"] == 1 and stats["in_progress"] == 0


def test_concurrent_same_key_applies_once(psp: Receiver) -> None:
    barrier = threading.Barrier(50)
    limits = httpx.Limits(max_connections=50, max_keepalive_connections=50)

    with httpx.Client(base_url=psp.url, trust_env=False, timeout=10, limits=limits) as c:
        def post(_: int) -> httpx.Response:
            barrier.wait()
            return charge(c, "hot")

        with ThreadPoolExecutor(50) as pool:
            replies = list(pool.map(post, range(50)))
    codes = [r.status_code for r in replies]
    assert codes.count(201) == 50  # no slow mode: losers see a finished key and replay
    assert len({r.content for r in replies}) == 1
    stats = psp.stats()
    assert stats["deliveries"] == 50 and stats["applied"] == 1 and stats["replayed"] == 49
    assert stats["max_applied_per_key"] == 1
    psp.assert_exactly_once(["hot"], allow_extra=False)


# -- failure modes


def test_fail_500_times_then_normal(psp: Receiver, client: httpx.Client) -> None:
    psp.set_mode("fail_500", times=2)
    assert [charge(client, "k").status_code for _ in range(3)] == [500, 500, 201]
    stats = psp.stats()
    assert stats["applied"] == 1 and stats["injected"] == 2 and stats["deliveries"] == 3
    assert psp.rules()[0]["remaining"] == 0


def test_per_key_poison_among_many(psp: Receiver, client: httpx.Client) -> None:
    psp.set_mode("fail_500", key="poison")
    keys = [f"k{i}" for i in range(30)]
    assert all(charge(client, k).status_code == 201 for k in keys)
    assert all(charge(client, "poison").status_code == 500 for _ in range(3))
    with pytest.raises(AssertionError, match=r"1 lost .*poison"):
        psp.assert_exactly_once([*keys, "poison"])
    psp.assert_exactly_once(keys, allow_extra=False)


def test_key_prefix_and_path_rules(psp: Receiver, client: httpx.Client) -> None:
    psp.set_mode("status", key_prefix="bad-", status=400)
    psp.set_mode("status", path="/emails", status=503, retry_after=7)
    assert charge(client, "bad-1").status_code == 400
    assert charge(client, "good-1").status_code == 201
    reply = charge(client, "good-2", path="/emails")
    assert reply.status_code == 503 and reply.headers["Retry-After"] == "7"
    # Newer rules win: a per-key normal rule overrides the older prefix rule.
    psp.set_mode("normal", key="bad-2")
    assert charge(client, "bad-2").status_code == 201
    psp.set_mode("normal")  # clears every rule
    assert charge(client, "bad-1").status_code == 201
    assert psp.rules() == []


@pytest.mark.parametrize(("status", "retry_after"), [(409, None), (422, None), (400, None),
                                                     (429, "2"), (503, "1")])
def test_status_mode_does_not_apply(psp: Receiver, client: httpx.Client, status: int,
                                    retry_after: str | None) -> None:
    psp.set_mode("status", status=status, retry_after=retry_after, times=1)
    reply = charge(client, "k")
    assert reply.status_code == status
    assert reply.headers.get("Retry-After") == retry_after
    assert psp.stats()["applied"] == 0
    assert charge(client, "k").status_code == 201


def test_apply_then_timeout(psp: Receiver, client: httpx.Client) -> None:
    psp.set_mode("apply_then_timeout", delay=2, times=1)
    with pytest.raises(httpx.ReadTimeout):
        charge(client, "k", timeout=0.3)
    assert psp.stats()["applied"] == 1  # applied although the client saw nothing
    retry = charge(client, "k")
    assert retry.status_code == 201 and retry.headers["X-Psp-Outcome"] == "replayed"
    psp.assert_exactly_once(["k"])


def test_apply_then_500(psp: Receiver, client: httpx.Client) -> None:
    psp.set_mode("apply_then_500", key="k", times=1)
    assert charge(client, "k").status_code == 500
    retry = charge(client, "k")
    assert retry.status_code == 201 and retry.headers["Idempotent-Replayed"] == "true"
    stats = psp.stats()
    assert stats["applied"] == 1 and stats["replayed"] == 1


def test_reset_applies_then_drops_connection(psp: Receiver, client: httpx.Client) -> None:
    psp.set_mode("reset", times=1)
    with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
        charge(client, "k")
    assert psp.stats()["applied"] == 1
    assert charge(client, "k").headers["X-Psp-Outcome"] == "replayed"
    (delivery,) = [d for d in psp.ledger("k")["deliveries"] if d["mode"] == "reset"]
    assert delivery["status"] is None and delivery["outcome"] == "applied"


def test_seeded_probability_is_reproducible(client: httpx.Client, psp: Receiver) -> None:
    def failing() -> set[str]:
        psp.reset()
        psp.set_mode("fail_500", probability=0.3, seed=7)
        return {k for k in (f"k{i}" for i in range(60))
                if charge(client, k).status_code == 500}

    first = failing()
    assert 5 < len(first) < 35
    assert failing() == first
    psp.reset()
    psp.set_mode("fail_500", probability=0.3, seed=8)
    assert {k for k in (f"k{i}" for i in range(60))
            if charge(client, k).status_code == 500} != first


def test_forget_keys_lets_a_key_apply_twice_and_is_caught(psp: Receiver,
                                                          client: httpx.Client) -> None:
    psp.set_mode("forget", older_than=0)
    charge(client, "k")
    time.sleep(0.01)
    assert charge(client, "k").headers["X-Psp-Outcome"] == "applied"
    assert psp.stats()["max_applied_per_key"] == 2
    with pytest.raises(AssertionError, match=r"1 applied more than once: k x2"):
        psp.assert_exactly_once(["k"])


def test_assert_exactly_once_reports_lost_doubled_and_extra(psp: Receiver,
                                                            client: httpx.Client) -> None:
    for key in ("a", "b", "x"):
        charge(client, key)
    psp.assert_exactly_once(["a", "b"])
    with pytest.raises(AssertionError, match="applied but not expected: x"):
        psp.assert_exactly_once(["a", "b"], allow_extra=False)
    with pytest.raises(AssertionError, match=r"2 lost .*: c, d"):
        psp.assert_exactly_once(["a", "b", "c", "d"])


# -- control plane, tracing, ordering


def test_control_over_http(psp: Receiver, client: httpx.Client) -> None:
    reply = client.post("/_control", json={"mode": "fail_500", "key": "k", "times": 1})
    assert reply.status_code == 200 and reply.json()["rule_id"] >= 1
    assert client.get("/_control").json()["rules"][0]["mode"] == "fail_500"
    assert client.post("/_control", json={"mode": "explode"}).status_code == 400
    assert client.post("/_control", json={"mode": "fail_500", "time": 2}).status_code == 400
    assert client.delete("/_control").json() == {"rules": []}
    client.post("/_control", json={"mode": "fail_500"})
    assert client.post("/_control", json={"mode": "normal"}).json() == {"rules": []}
    assert charge(client, "k").status_code == 201
    assert client.get("/_stats").json()["applied"] == 1
    assert client.get("/_applied").json() == {"k": 1}
    assert client.post("/_reset").status_code == 200
    assert psp.stats()["deliveries"] == 0
    with pytest.raises(ValueError, match="unknown rule fields"):
        psp.set_mode("slow", dealy=1)


def test_ledger_records_trace_attempt_and_order(psp: Receiver, client: httpx.Client) -> None:
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    for seq in (1, 2, 3):
        charge(client, f"o-{seq}", {"ordering_key": "acct-1", "seq": seq},
               headers={"traceparent": tp, "X-Outbox-Attempt": "1"})
    charge(client, "o-2", {"ordering_key": "acct-1", "seq": 2},
           headers={"X-Outbox-Attempt": "2"})
    ledger = client.get("/_ledger").json()
    assert ledger["ordering"] == {"acct-1": [1, 2, 3]}
    assert [(a["key"], a["seq"]) for a in ledger["applications"]] == [
        ("o-1", 1), ("o-2", 2), ("o-3", 3)]
    one = client.get("/_ledger", params={"key": "o-2"}).json()
    assert [(d["attempt"], d["traceparent"], d["outcome"]) for d in one["deliveries"]] == [
        ("1", tp, "applied"), ("2", None, "replayed")]
    assert one["keys"] == [{**one["keys"][0], "key": "o-2", "deliveries": 2, "applied": 1}]


def test_stop_cuts_pooled_connections_and_keeps_counts() -> None:
    receiver = Receiver().start()
    with httpx.Client(base_url=receiver.url, trust_env=False, timeout=2) as c:
        assert charge(c, "k").status_code == 201
        receiver.stop()
        with pytest.raises(httpx.TransportError):
            charge(c, "k2")
    assert receiver.stats()["applied"] == 1  # readable after stop
    receiver.close()


def test_stop_wakes_a_hanging_handler() -> None:
    receiver = Receiver().start()
    receiver.set_mode("apply_then_timeout", delay=30)
    with httpx.Client(base_url=receiver.url, trust_env=False, timeout=5) as c, \
            ThreadPoolExecutor(1) as pool:
        hung = pool.submit(charge, c, "k")
        while receiver.stats()["applied"] == 0:
            time.sleep(0.01)
        started = time.monotonic()
        receiver.stop()
        with pytest.raises(httpx.TransportError):
            hung.result()
        assert time.monotonic() - started < 2
    receiver.close()


# -- processes and a shared SQLite file


def test_sqlite_insert_decides_one_winner_across_connections(tmp_path: Path) -> None:
    """No Python lock in common: only SQLite's transaction can keep this at one."""
    db = tmp_path / "psp.sqlite3"
    ledgers = [Ledger(db), Ledger(db)]
    barrier = threading.Barrier(20)

    def deliver(i: int) -> str:
        ledger = ledgers[i % 2]
        barrier.wait()
        delivery = ledger.open_delivery("k", "/charges", None, str(i))
        return ledger.apply(delivery, key="k", path="/charges", fingerprint="f",
                            request="{}", ordering_key=None, seq=None, mode="normal").outcome

    with ThreadPoolExecutor(20) as pool:
        outcomes = list(pool.map(deliver, range(20)))
    assert sorted(set(outcomes)) == ["applied", "replayed"] and outcomes.count("applied") == 1
    stats = ledgers[0].stats()
    assert stats["applications"] == 1 and stats["deliveries"] == 20
    for ledger in ledgers:
        ledger.close()


def test_two_processes_share_one_sqlite_ledger(tmp_path: Path) -> None:
    db = tmp_path / "psp.sqlite3"
    with ReceiverProcess(db) as one, ReceiverProcess(db) as two, \
            httpx.Client(trust_env=False, timeout=10) as c:
        assert one.url != two.url
        first = c.post(one.url + "/charges", json={"amount": 1},
                       headers={"Idempotency-Key": "k"})
        second = c.post(two.url + "/charges", json={"amount": 1},
                        headers={"Idempotency-Key": "k"})
        assert first.status_code == second.status_code == 201
        assert second.content == first.content

        barrier = threading.Barrier(20)

        def post(i: int) -> int:
            barrier.wait()
            url = (one if i % 2 else two).url
            return c.post(url + "/charges", json={"amount": 2},
                          headers={"Idempotency-Key": "hot"}).status_code

        with ThreadPoolExecutor(20) as pool:
            assert set(pool.map(post, range(20))) <= {201, 409}

        two.set_mode("fail_500", key="k", times=1)  # rules live in the shared file too
        assert c.post(one.url + "/charges", json={"amount": 1},
                      headers={"Idempotency-Key": "k"}).status_code == 500
        stats = one.stats()
        assert stats["applied"] == 2 and stats["max_applied_per_key"] == 1
        assert stats["deliveries"] == 23
        one.assert_exactly_once(["k", "hot"], allow_extra=False)
        assert one.stop() == 0  # SIGTERM: clean exit

    # A restarted receiver remembers what was applied.
    with ReceiverProcess(db) as again, httpx.Client(trust_env=False, timeout=10) as c:
        replay = c.post(again.url + "/charges", json={"amount": 1},
                        headers={"Idempotency-Key": "k"})
        assert replay.status_code == 201 and replay.content == first.content
        assert again.stats()["applied"] == 2


def test_process_exits_cleanly_on_sigint(tmp_path: Path) -> None:
    proc = ReceiverProcess(tmp_path / "psp.sqlite3").start()
    assert proc.stats()["deliveries"] == 0
    assert proc.proc is not None
    proc.proc.send_signal(signal.SIGINT)
    assert proc.proc.wait(5) == 0
    proc.stop()


def test_cli_rejects_a_busy_port(capsys: pytest.CaptureFixture[str]) -> None:
    with Receiver() as receiver:
        port = int(receiver.url.rsplit(":", 1)[1])
        assert main(["--port", str(port)]) == 1
    assert "cannot start" in capsys.readouterr().err


def test_truncated_body_from_a_killed_sender_is_refused_not_applied() -> None:
    """A worker SIGKILLed after the headers must not get `{}` applied under its key."""
    import socket

    with Receiver() as rx:
        host, port = rx.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: cut-1\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 60\r\n\r\n")
            sock.shutdown(socket.SHUT_WR)
            sock.recv(4096)
        assert rx.stats()["applied"] == 0
