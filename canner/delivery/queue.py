"""Delivery states, the transitions between them, and the retry policy.  Pure.

``pending -> delivering -> delivered``; failures ``delivering -> retry_wait -> delivering``.
Every transition in the index is a guarded update (``WHERE state = :expected``) checked against
:data:`ALLOWED`.  Retries go on forever: 1 minute doubling to 1 hour, with a little jitter so a
burst of failures does not retry in lockstep.
"""

from __future__ import annotations

from enum import StrEnum


class State(StrEnum):
    PENDING = "pending"
    DELIVERING = "delivering"
    RETRY_WAIT = "retry_wait"
    DELIVERED = "delivered"


ALLOWED: dict[State, frozenset[State]] = {
    State.PENDING: frozenset({State.DELIVERING}),
    State.DELIVERING: frozenset({State.DELIVERED, State.RETRY_WAIT}),
    State.RETRY_WAIT: frozenset({State.DELIVERING}),
    State.DELIVERED: frozenset(),
}

FIRST_RETRY = 60.0
MAX_RETRY = 3600.0
JITTER = 0.1
# After delivery IA's metadata API may take a while to list a new file: look again after half the
# time since delivery, between these bounds.  A failed local purge is retried after a minute.
VERIFY_MIN = 10.0
VERIFY_MAX = 600.0
PURGE_RETRY = 60.0


def can_move(old: State, new: State) -> bool:
    return new in ALLOWED[old]


def retry_delay(attempt: int, jitter: float = 0.0, *, needs_operator: bool = False) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1-based).

    ``jitter`` in [0, 1) stretches the delay by up to :data:`JITTER`.  Errors that need an operator
    wait the maximum, so they keep retrying without hammering the sink.
    """
    if needs_operator:
        base = MAX_RETRY
    else:
        base = min(FIRST_RETRY * 2.0 ** min(max(attempt - 1, 0), 16), MAX_RETRY)
    return base * (1.0 + JITTER * jitter)


def verify_delay(now: float, delivered_at: float | None) -> float:
    """Seconds until the next remote verification of an object delivered at ``delivered_at``."""
    waited = 0.0 if delivered_at is None else max(now - delivered_at, 0.0)
    return min(max(waited / 2.0, VERIFY_MIN), VERIFY_MAX)
