"""What the scheduler knows of a sink: the ``Sink`` protocol and the outcome types.

A sink delivers one row's local payload and later verifies the remote copy; the scheduler records
what it says.  :class:`Verdict` and :class:`Outcome` are the sinks' own reading of one attempt,
which they turn into :class:`Delivered` or :class:`DeliveryFailed`.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Protocol

from attrs import frozen
from twisted.internet.defer import Deferred

from canner.config import DeliveryConfig
from canner.delivery.index import QueueRow
from canner.observe import Destination
from canner.sinks.plan import ItemPlan, plan_upload


@frozen
class Delivered:
    """Where a sink put an object."""

    identifier: str
    remote_name: str


class DeliveryFailed(Exception):
    """An attempt failed; ``needs_operator`` when retrying alone will not fix it (403, ...)."""

    def __init__(
        self,
        reason: str,
        *,
        needs_operator: bool = False,
        retry_after: float | None = None,
        kind: str = "other",
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.needs_operator = needs_operator
        self.retry_after = retry_after
        # The reason class operators alert on (forbidden, rate_limited, network, ...).
        self.kind = kind


@frozen
class RemoteCheck:
    """What the sink's metadata lookup says about a delivered object."""

    verified: bool
    detail: str = ""
    needs_operator: bool = False
    # The destination does not list the file at all (not a failed lookup, not a mismatch):
    # once verify_timeout has passed, the object is delivered again.
    absent: bool = False
    # The remote bytes differ although the listing matches (a read-back): the next delivery
    # must upload instead of trusting the listing.
    bad_copy: bool = False


class Sink(Protocol):
    """A delivery destination (the Internet Archive in production)."""

    @property
    def destination(self) -> Destination:
        """What the bytes it reports sending count as (IA uploads or directory copies)."""
        ...

    def deliver(
        self, row: QueueRow, path: Path, progress: Callable[[int], None]
    ) -> Deferred[Delivered]:
        """Upload (or find already uploaded) the object; fail with :class:`DeliveryFailed`.

        ``progress(n)`` is told about payload bytes as they are sent."""
        ...

    def verify(self, row: QueueRow, path: Path) -> Deferred[RemoteCheck]:
        """Check that the remote file exists with the right size and MD5 (and, where the sink
        can, that its bytes equal the local payload at ``path``)."""
        ...


class Verdict(Enum):
    """What an attempt's result means for the delivery row."""

    SUCCESS = "success"  # the remote file is there: record ``delivered``
    TRANSIENT = "transient"  # retry with the normal backoff
    OPERATOR = "operator"  # retry at the 1 h cap and flag the row: a human must act


@frozen
class Outcome:
    """A verdict with a short, secret-free reason (fit for ``last_error``) and IA's retry hint."""

    verdict: Verdict
    reason: str
    retry_after: float | None = None

    @property
    def ok(self) -> bool:
        return self.verdict is Verdict.SUCCESS

    @property
    def needs_operator(self) -> bool:
        return self.verdict is Verdict.OPERATOR


def plan_row(delivery: DeliveryConfig, row: QueueRow) -> ItemPlan:
    """Where ``row`` goes, from its stable values only, so a retry resolves the same place."""
    assert row.content_md5 is not None, "the scheduler computes the MD5 before delivering"
    return plan_upload(
        delivery,
        row.project,
        row.object_id,
        row.filename,
        row.accepted_at,
        row.size_bytes,
        row.content_md5,
    )
