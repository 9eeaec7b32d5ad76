"""After a delivery: what the follow-up of a delivered copy records, the same for every owner.

A copy is verified (:func:`report_verified`), or not this time: then
:func:`canner.delivery.queue.judge_unverified` decides and :func:`record_unverified` carries the
decision out on the file's outbound row (look again later, deliver it again, or flag it for an
operator).  Once verified, the owner deletes its local copy when it sees fit
(:func:`report_purged`).  Log lines and metrics are the same whether the file is an object or a
package.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import Protocol

from attrs import frozen
from twisted.logger import Logger

from canner.delivery import outbound
from canner.delivery.index import Index
from canner.delivery.queue import MAX_REDELIVERIES, judge_unverified
from canner.observe import Outbound, OutboundObserver
from canner.sinks.base import RemoteCheck

log = Logger()


@frozen(kw_only=True)
class DeliveredCopy:
    """A delivered file as its follow-up sees it."""

    kind: Outbound
    ref: str  # its outbound row
    subject: str  # how log lines name it: an object id, "package <id>"
    project: str
    identifier: str | None
    delivered_at: float | None
    redeliveries: int
    needs_operator: bool
    retry: str  # the command that sends it again

    @classmethod
    def of(
        cls, row: DeliveredRow, kind: Outbound, ref: str, subject: str, retry: str
    ) -> DeliveredCopy:
        """From an owner's row joined with its outbound row (objects and packages alike)."""
        return cls(
            kind=kind,
            ref=ref,
            subject=subject,
            project=row.project,
            identifier=row.remote_identifier,
            delivered_at=row.delivered_at,
            redeliveries=row.redeliveries,
            needs_operator=bool(row.needs_operator),
            retry=retry,
        )


class DeliveredRow(Protocol):
    """The delivery facts every owner's row shows (``ObjectRow``, ``PackageRow``)."""

    @property
    def project(self) -> str: ...
    @property
    def remote_identifier(self) -> str | None: ...
    @property
    def delivered_at(self) -> float | None: ...
    @property
    def redeliveries(self) -> int: ...
    @property
    def needs_operator(self) -> int: ...


async def record_unverified(
    index: Index,
    observer: OutboundObserver,
    copy: DeliveredCopy,
    check: RemoteCheck,
    *,
    detail: str,
    verify_timeout: float,
    now: float,
    redeliver: Callable[[sqlite3.Cursor, str, float], bool],
) -> bool:
    """Record what ``check`` (not verified) means for ``copy``; True when it goes back to be
    delivered.  ``redeliver(cursor, reason, now)`` is the owner's: it moves the outbound row
    and forgets what the owner planned after the verification (its purge)."""
    verdict = judge_unverified(
        absent=check.absent,
        detail=detail,
        needs_operator=check.needs_operator,
        now=now,
        delivered_at=copy.delivered_at,
        verify_timeout=verify_timeout,
        redeliveries=copy.redeliveries,
        retry=copy.retry,
    )
    if verdict.redeliver:
        if not await index.run(redeliver, verdict.detail, now):
            return False
        observer.redelivered(copy.kind, copy.project)
        log.warn(
            "{subject} is still not listed at its destination {timeout:g}s after its delivery:"
            " delivering it again (re-delivery {count} of {limit})",
            subject=copy.subject,
            project=copy.project,
            identifier=copy.identifier,
            timeout=verify_timeout,
            count=copy.redeliveries + 1,
            limit=MAX_REDELIVERIES,
        )
        return True
    if verdict.needs_operator and not copy.needs_operator:
        log.error(
            "the delivered copy of {subject} needs an operator: {error}",
            subject=copy.subject,
            project=copy.project,
            identifier=copy.identifier,
            error=verdict.detail,
            needs_operator=True,
        )
    await index.run(
        outbound.record_check,
        copy.kind,
        copy.ref,
        verdict.next_check_at,
        verdict.detail,
        verdict.needs_operator,
        now,
        check.bad_copy,
    )
    return False


def report_verified(observer: OutboundObserver, copy: DeliveredCopy) -> None:
    """Tell the metrics and the log that ``copy`` is verified (after the owner recorded it)."""
    observer.verified(copy.kind)
    _log_fact("verified {subject} at {identifier}", copy)


def report_purged(observer: OutboundObserver, copy: DeliveredCopy) -> None:
    """Tell the metrics and the log that the owner deleted its local copy of ``copy``."""
    observer.purged(copy.kind)
    _log_fact("purged the local copy of {subject}", copy)


def _log_fact(text: str, copy: DeliveredCopy) -> None:
    log.info(text, subject=copy.subject, project=copy.project, identifier=copy.identifier)
