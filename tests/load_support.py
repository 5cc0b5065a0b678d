"""Client threads that measure each request's latency while a test does something else.

F11 (keys purged under request load) and F37 (inbox retention under ingestion load)
ask the same question: does a purge block the writers around it? `latencies_around`
runs the clients, lets them warm up, runs the action, and gives back the latencies
before and during it.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

#: A client thread's loop body, `step(i)`, inside what the thread holds (a connection).
Client = Callable[[int], AbstractContextManager[Callable[[int], None]]]


@dataclass
class AroundLoad(Generic[T]):
    baseline: list[float]  # latencies after warm-up, before the action (s)
    during: list[float]    # latencies of the requests that ended during the action (s)
    result: T              # what the action returned
    seconds: float         # how long the action took

    @staticmethod
    def p99(values: list[float]) -> float:
        return statistics.quantiles(values, n=100)[98]


def latencies_around(client: Client, action: Callable[[], T], *, clients: int = 4,
                     warm_up: float = 0.5) -> AroundLoad[T]:
    """Run `clients` threads, each `with client(k) as step:` calling `step(i)` in a loop
    (each call timed), until `action()` has returned; any client error fails the test."""
    stop = threading.Event()
    lock = threading.Lock()
    latencies: list[float] = []
    errors: list[BaseException] = []

    def loop(k: int) -> None:
        try:
            with client(k) as step:
                i = 0
                while not stop.is_set():
                    t0 = time.perf_counter()
                    step(i)
                    with lock:
                        latencies.append(time.perf_counter() - t0)
                    i += 1
        except BaseException as exc:
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    try:
        time.sleep(warm_up)
        with lock:
            before = len(latencies)
            baseline = latencies[before // 3:]
        t0 = time.perf_counter()
        result = action()
        seconds = time.perf_counter() - t0
        with lock:
            during = latencies[before:]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    return AroundLoad(baseline, during, result, seconds)


def steps(step: Callable[[int, int], None]) -> Client:
    """A client that holds nothing: `step(k, i)` for thread k."""
    from contextlib import contextmanager

    @contextmanager
    def client(k: int) -> Iterator[Callable[[int], None]]:
        yield lambda i: step(k, i)
    return client
