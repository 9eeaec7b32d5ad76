"""When to try again: exponential backoff with jitter, ``Retry-After``, and a total deadline."""

from __future__ import annotations

import email.utils
import random
import time
from dataclasses import dataclass
from typing import Callable

from canner_client.errors import DeadlineExceeded, NothingListens


@dataclass(frozen=True)
class RetryPolicy:
    """How long to wait between attempts and how long to keep trying in all.

    The n-th consecutive failure waits ``min(maximum, initial * 2**(n-1))`` seconds scaled by a
    random factor in ``[1 - jitter, 1]`` (so workers that failed together do not retry together).
    A server's ``Retry-After`` is honoured, capped at ``max_retry_after``.  ``deadline`` bounds
    one upload from its start to its receipt, retries included (None: no bound).
    ``refused_limit``: give up (:class:`NothingListens`) after this many refused connections in
    a row to a server that has not answered this upload yet (None: retry them like any failure;
    a server that answered before and now refuses is restarting, and is always waited for).
    """

    initial: float = 0.5
    maximum: float = 30.0
    jitter: float = 0.5
    max_retry_after: float = 300.0
    deadline: float | None = 6 * 3600.0
    refused_limit: int | None = None

    def delay(self, failures: int, rng: Callable[[], float] = random.random) -> float:
        base = min(self.maximum, self.initial * 2.0 ** max(0, failures - 1))
        return float(base * (1.0 - self.jitter * rng()))


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or HTTP-date); None if absent
    or unparsable."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    current = time.time() if now is None else now
    return max(0.0, when.timestamp() - current)


class Backoff:
    """The retry bookkeeping of one upload: consecutive failures and the deadline."""

    def __init__(
        self,
        policy: RetryPolicy,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self._sleep = sleep
        self._clock = clock
        self._end = None if policy.deadline is None else clock() + policy.deadline
        self.failures = 0
        self.last_error: str | None = None
        self.refused = 0  # connections refused in a row
        self.answered = False  # the server answered an HTTP request of this upload

    def remaining(self) -> float | None:
        return None if self._end is None else self._end - self._clock()

    def check(self) -> None:
        remaining = self.remaining()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceeded(
                f"gave up after {self.policy.deadline:.0f}s of retrying", self.last_error
            )

    def progressed(self) -> None:
        """The server stored more bytes: the next failure starts the backoff afresh."""
        self.failures = 0

    def wait(
        self, error: str, retry_after: float | None = None, refused_at: str | None = None
    ) -> float:
        """Record a failure and sleep before the next attempt; returns the seconds slept.
        Raises :class:`DeadlineExceeded` instead of sleeping past the deadline.

        ``refused_at``: the failure was a refused connection to that address; past the
        policy's ``refused_limit`` in a row, before any answer, raises :class:`NothingListens`.
        """
        self.failures += 1
        self.last_error = error
        self.refused = self.refused + 1 if refused_at is not None else 0
        limit = self.policy.refused_limit
        if refused_at is not None and limit and not self.answered and self.refused >= limit:
            raise NothingListens(
                f"nothing listens at {refused_at}: the connection was refused {self.refused}"
                " times in a row. Check --url (and the port); --deadline S keeps retrying for"
                " S seconds, for a server that is still starting"
            )
        delay = self.policy.delay(self.failures)
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.policy.max_retry_after))
        remaining = self.remaining()
        if remaining is not None and delay >= remaining:
            # No attempt could start before the deadline: give up now rather than sleep for it.
            raise DeadlineExceeded(
                f"gave up after {self.policy.deadline:.0f}s of retrying", self.last_error
            )
        self._sleep(delay)
        return delay
