"""What the pipelines know of a sink: the ``Sink`` protocol and the outcome types.

A sink delivers one planned file and later verifies the remote copy; the pipeline that sent it
records what it says.  :class:`Verdict` and :class:`Outcome` are the sinks' own reading of one
attempt, which they turn into :class:`Delivered` or :class:`DeliveryFailed`.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Protocol

from attrs import frozen
from twisted.internet.defer import Deferred

from canner.observe import Destination
from canner.sinks.plan import ItemPlan


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


class PartsProgress(Protocol):
    """What a progress callback may also hear from a sink that sends a file in parts (IA
    multipart): ``done`` of ``total`` parts are at the destination, ``done_bytes`` of the file.
    Told once when an upload (re)starts and after every part; callbacks without a ``parts``
    method hear only bytes."""

    def parts(self, done: int, total: int, done_bytes: int) -> None: ...


def report_parts(progress: object, done: int, total: int, done_bytes: int) -> None:
    """Tell ``progress`` of the parts done, when it listens (see :class:`PartsProgress`)."""
    parts = getattr(progress, "parts", None)
    if callable(parts):
        parts(done, total, done_bytes)


class Sink(Protocol):
    """A destination (the Internet Archive in production, or a directory): it sees a plan and a
    path, never a queue row.  Objects, package files and ledgers are sent through the same
    two calls."""

    @property
    def destination(self) -> Destination:
        """What the bytes it reports sending count as (IA uploads or directory copies)."""
        ...

    def deliver(
        self,
        plan: ItemPlan,
        path: Path,
        progress: Callable[[int], None],
        *,
        overwrite: bool = False,
    ) -> Deferred[Delivered]:
        """Send (or find already sent) the file at ``path`` to ``plan``'s place; fail with
        :class:`DeliveryFailed`.  ``progress(n)`` hears of payload bytes as they go;
        ``overwrite``: a read-back found the destination's bytes wrong, so send even when its
        listing matches."""
        ...

    def verify(self, plan: ItemPlan, path: Path) -> Deferred[RemoteCheck]:
        """Check that the file is at ``plan``'s place with its size and checksum (and, where the
        sink can, that its bytes equal the local copy at ``path``)."""
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
