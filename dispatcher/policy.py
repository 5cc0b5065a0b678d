"""What happens after a failed attempt: retry when, give up, or park for review.

The policy is assembled from tenacity's primitives (a `wait` strategy, a `retry`
predicate) but never sleeps: the computed wait becomes the row's `available_at`, so a
worker is free for other effects while this one waits (DESIGN.md §5).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from tenacity import Future, RetryCallState, Retrying, retry_if_not_exception_type
from tenacity import retry_base as RetryBase
from tenacity.wait import wait_base, wait_random_exponential

from outbox.errors import AmbiguousOutcome, KeyRetentionPassed, PermanentFailure, RetryAfter


@dataclass(frozen=True, slots=True)
class Decision:
    """The attempt's recorded outcome and the effect's next status."""

    outcome: str      # attempts.outcome
    next_status: str  # effects.status
    delay: float = 0.0


class RetryPolicy:
    """Backoff with full jitter by default: 1 s, 2 s, 4 s ... capped at `max_wait`.

    `wait` and `retry` are tenacity objects, so any of its strategies compose here
    (`wait_exponential(...) + wait_random(...)`, `retry_if_exception_type(...)`).
    """

    def __init__(self, *, wait: wait_base | None = None, retry: RetryBase | None = None,
                 max_wait: float = 3600.0) -> None:
        self.wait = wait or wait_random_exponential(multiplier=1, max=max_wait)
        self.max_wait = max_wait
        self.retry = retry or retry_if_not_exception_type(PermanentFailure)

    def _state(self, attempt: int, error: BaseException) -> RetryCallState:
        state = RetryCallState(Retrying(), None, (), {})
        state.attempt_number = attempt
        state.outcome = Future.construct(attempt, error, True)
        return state

    @staticmethod
    def exhausted(*, attempt: int, max_attempts: int, retry_until: datetime | None = None,
                  now: datetime | None = None) -> bool:
        """The cap: no attempt may follow this one (`attempt` counts from 1).

        Every path that ends an attempt without `decide` (a crashed policy, a release at
        shutdown) asks this too, so no path can send an exhausted effect back to pending.
        """
        return attempt >= max_attempts or (
            retry_until is not None and now is not None and now >= retry_until)

    def decide(self, *, attempt: int, max_attempts: int, error: BaseException,
               retry_safe: bool = True, retry_until: datetime | None = None,
               now: datetime | None = None) -> Decision:
        """Decide for one failed attempt (`attempt` counts from 1)."""
        if isinstance(error, AmbiguousOutcome) and not retry_safe:
            return Decision("ambiguous", "needs_review")
        if isinstance(error, KeyRetentionPassed):  # nothing sent; an earlier one may
            return Decision("failed", "needs_review")  # have been applied: a human looks
        recorded = "ambiguous" if isinstance(error, AmbiguousOutcome) else "retry"
        state = self._state(attempt, error)
        if isinstance(error, PermanentFailure) or not self.retry(state):
            return Decision("failed", "failed")
        if self.exhausted(attempt=attempt, max_attempts=max_attempts,
                          retry_until=retry_until, now=now):
            return Decision("failed", "failed")
        # A receiver's Retry-After is honoured up to `max_wait`: it is receiver input,
        # "1e400" parses to inf and 1e13 s overflows timestamptz, and either made the
        # batch's one record statement fail (every outcome in it dropped).
        delay = (min(error.delay, self.max_wait) if isinstance(error, RetryAfter)
                 else float(self.wait(state)))
        if retry_until is not None and now is not None \
                and now + timedelta(seconds=delay) >= retry_until:
            return Decision("failed", "failed")
        return Decision(recorded, "pending", delay)
