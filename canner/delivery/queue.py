"""Delivery states, the transitions between them, and the retry policy.  Pure.

``pending -> delivering -> delivered``; failures ``delivering -> retry_wait -> delivering``.
A delivered object that is still not listed at its destination ``verify_timeout`` after its
delivery goes back ``delivered -> retry_wait`` to be delivered again (so does one an operator
retries before it is verified).
Every transition in the index is a guarded update (``WHERE state = :expected``) checked against
:data:`ALLOWED`.  Retries go on forever: 1 minute doubling to 1 hour, with a little jitter so a
burst of failures does not retry in lockstep.
"""

from __future__ import annotations

from enum import StrEnum

from attrs import frozen


class State(StrEnum):
    PENDING = "pending"
    DELIVERING = "delivering"
    RETRY_WAIT = "retry_wait"
    DELIVERED = "delivered"


ALLOWED: dict[State, frozenset[State]] = {
    State.PENDING: frozenset({State.DELIVERING}),
    State.DELIVERING: frozenset({State.DELIVERED, State.RETRY_WAIT}),
    State.RETRY_WAIT: frozenset({State.DELIVERING}),
    State.DELIVERED: frozenset({State.RETRY_WAIT}),
}

FIRST_RETRY = 60.0
MAX_RETRY = 3600.0
JITTER = 0.1
# After delivery IA's metadata API may take a while to list a new file: look again after half the
# time since delivery, between these bounds.  A failed local purge is retried after a minute.
VERIFY_MIN = 10.0
VERIFY_MAX = 600.0
PURGE_RETRY = 60.0
# verify_timeout's default: IA's archive tasks can lag for hours when IA is backlogged.
DEFAULT_VERIFY_TIMEOUT = 6 * 3600.0
# Automatic re-deliveries of an object its destination keeps losing; once verify_timeout passes
# again after the last of them, the row is flagged for an operator instead.
MAX_REDELIVERIES = 3


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


def next_verify_at(now: float, delivered_at: float | None, verify_timeout: float) -> float:
    """When to look for a delivered, unverified object again: :func:`verify_delay` from now,
    but no later than the moment ``verify_timeout`` passes (so the timeout acts on time)."""
    again = now + verify_delay(now, delivered_at)
    if delivered_at is not None and now - delivered_at < verify_timeout:
        again = min(again, delivered_at + verify_timeout)
    return again


class Unlisted(StrEnum):
    """What to do about a delivered object its destination does not list (yet)."""

    WAIT = "wait"  # look again later
    REDELIVER = "redeliver"  # verify_timeout passed: deliver it again
    FLAG = "flag"  # passed again after MAX_REDELIVERIES: an operator must look


def unlisted(
    now: float, delivered_at: float | None, verify_timeout: float, redeliveries: int
) -> Unlisted:
    """Decide for an object that the destination's listing does not show."""
    if delivered_at is None or now - delivered_at < verify_timeout:
        return Unlisted.WAIT
    return Unlisted.REDELIVER if redeliveries < MAX_REDELIVERIES else Unlisted.FLAG


@frozen
class Unverified:
    """What to record for a delivered file its destination did not verify this time."""

    redeliver: bool  # verify_timeout passed with the file unlisted: deliver it again now
    detail: str  # the row's last_error (for a re-delivery, why)
    needs_operator: bool
    next_check_at: float  # when to look again (unless it is delivered again)


def judge_unverified(
    *,
    absent: bool,
    detail: str,
    needs_operator: bool,
    now: float,
    delivered_at: float | None,
    verify_timeout: float,
    redeliveries: int,
    retry: str,
) -> Unverified:
    """The one policy for every kind of file (objects, package files): look again later,
    deliver again once ``verify_timeout`` passed with the file still unlisted (``absent``: a
    lookup that failed never counts), and after :data:`MAX_REDELIVERIES` flag it for an
    operator, whose ``retry`` command sends it again."""
    decision = unlisted(now, delivered_at, verify_timeout, redeliveries) if absent else None
    if decision is Unlisted.REDELIVER:
        count = redeliveries + 1
        reason = (
            f"not listed {verify_timeout:g}s after delivery ({detail}): delivering again"
            f" (re-delivery {count} of {MAX_REDELIVERIES})"
        )
        return Unverified(True, reason, False, now)
    if decision is Unlisted.FLAG:
        needs_operator = True
        detail = (
            f"still not listed {verify_timeout:g}s after delivery, after {redeliveries}"
            f" re-deliveries ({detail}); `{retry}` delivers it again"
        )
    return Unverified(
        False, detail, needs_operator, next_verify_at(now, delivered_at, verify_timeout)
    )
