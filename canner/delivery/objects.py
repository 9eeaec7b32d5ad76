"""Objects as the outbound service sees them: one file each, checked against its receipt before
its first attempt, purged once its delivered copy is verified and its retention has passed.

The object owns its payload: only it deletes it (:func:`canner.delivery.purge.delete_payload`),
and only after the service reported the copy verified (DESIGN's claims discipline).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Mapping, Sequence

from attrs import define, evolve
from twisted.internet.defer import CancelledError
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from canner.blocking import BlockingRunner
from canner.checksum import HashCancelled, delivery_digests
from canner.config import DeliveryTable
from canner.delivery import follow_up
from canner.delivery import index as sql
from canner.delivery.index import Index, ObjectRow
from canner.delivery.outbound_service import Copy, Parcel, Shipment, Unshippable
from canner.delivery.purge import delete_payload, purge_is_due
from canner.delivery.queue import DEFAULT_VERIFY_TIMEOUT
from canner.observe import Outbound
from canner.sinks.base import Delivered, DeliveryFailed, Sink
from canner.sinks.plan import ItemPlan, PlanError, plan_upload
from canner.store.journal import JournalLog
from canner.store.receipts import ReceiptStore
from canner.store.uploads import UploadStore

log = Logger()

OBJECT = Outbound.OBJECT
# DeliveryFailed.kind of a local payload that is missing, unreadable or changed.
LOCAL_PAYLOAD = "local_payload"


@define(eq=False, kw_only=True)
class ObjectOwner:
    """The objects delivered one by one (every delivered project's but the megawarc ones')."""

    kind = OBJECT

    _index: Index
    _uploads: UploadStore
    _receipts: ReceiptStore
    _journal: JournalLog
    _sinks: Mapping[str, Sink]
    # Where a row goes (plan_row with its project's delivery table, in the daemon).
    _planner: Callable[[ObjectRow], ItemPlan]
    _retention: Mapping[str, float]
    _run: BlockingRunner
    _hash: BlockingRunner
    _clock: IReactorTime
    # Per project: how long a delivered object may stay unlisted before it is delivered again.
    _verify_timeouts: Mapping[str, float]

    def sink(self, project: str) -> Sink:
        return self._sinks[project]

    def projects(self) -> Sequence[str]:
        return list(self._sinks)

    async def shipment(self, ref: str, stopping: threading.Event) -> Shipment:
        row = await self._index.run(sql.get_row, ref)
        if row is None:
            raise Unshippable(ref, "", DeliveryFailed("the object is gone", needs_operator=True))
        try:
            row = await self._prepare(row, stopping)
            plan = self._planner(row)
        except (DeliveryFailed, PlanError) as e:
            raise Unshippable(ref, row.project, e) from None
        path = self._uploads.data_path(row.object_id)
        return Shipment(
            ref=ref,
            project=row.project,
            subject=ref,
            key=ref,
            files=(Parcel(plan, path, row.filename),),
            overwrite=bool(row.force_upload),
        )

    async def _prepare(self, row: ObjectRow, stopping: threading.Event) -> ObjectRow:
        """Check the local payload against its receipt, once, and store its MD5."""
        if row.content_md5 is not None:
            return row
        path = self._uploads.data_path(row.object_id)
        try:
            blake, md5_hex, size = await self._hash(delivery_digests, path, stopping)
        except FileNotFoundError:
            raise DeliveryFailed(
                "the local payload is missing", needs_operator=True, kind=LOCAL_PAYLOAD
            ) from None
        except HashCancelled:
            raise CancelledError() from None
        except OSError as e:
            raise DeliveryFailed(
                f"reading the local payload failed: {e.strerror}", kind=LOCAL_PAYLOAD
            ) from None
        if size != row.size_bytes or str(blake) != row.checksum:
            raise DeliveryFailed(
                f"the local payload ({size} bytes, {blake}) does not match its receipt",
                needs_operator=True,
                kind=LOCAL_PAYLOAD,
            )
        await self._index.run(sql.set_content_md5, row.object_id, md5_hex)
        return evolve(row, content_md5=md5_hex)

    async def delivered(self, shipment: Shipment, sent: Sequence[Delivered], now: float) -> None:
        (where,) = sent
        await self._index.run(
            sql.record_delivered,
            shipment.ref,
            where.identifier,
            where.remote_name,
            now,
            self._retention[shipment.project],
        )
        log.info(
            "delivered {object_id} as {identifier}/{remote_name}",
            object_id=shipment.ref,
            project=shipment.project,
            identifier=where.identifier,
            remote_name=where.remote_name,
        )

    def record_failure(
        self, cur: sqlite3.Cursor, ref: str, error: str, at: float, needs_operator: bool, now: float
    ) -> bool:
        return sql.record_failure(cur, ref, error, at, needs_operator, now)

    async def copy(self, ref: str) -> Copy | None:
        row = await self._index.run(sql.get_row, ref)
        if row is None or row.state != "delivered":
            return None
        return Copy(
            facts=delivered_copy(row),
            files=(Parcel(located(row), self._uploads.data_path(ref), row.filename),),
            verified=row.verified_at is not None,
            verify_timeout=self._verify_timeouts.get(row.project, DEFAULT_VERIFY_TIMEOUT),
        )

    async def verified(self, copy: Copy, now: float) -> None:
        await self._index.run(sql.record_verified, copy.facts.ref, now)

    def redeliver(self, cur: sqlite3.Cursor, ref: str, reason: str, now: float) -> bool:
        return sql.redeliver(cur, ref, reason, now)

    async def settle(self, copy: Copy, now: float) -> bool:
        """Purge the payload once its retention has passed (an ``OSError`` is the service's)."""
        row = await self._index.run(sql.get_row, copy.facts.ref)
        if row is None or not purge_is_due(row, now):
            return False
        await self._run(delete_payload, self._uploads, self._receipts, self._journal, row, now)
        await self._index.run(sql.record_purged, row.object_id, now)
        return True


def delivered_copy(row: ObjectRow) -> follow_up.DeliveredCopy:
    """A delivered object as its follow-up sees it."""
    return follow_up.DeliveredCopy.of(row, OBJECT, row.object_id, row.object_id, "canner retry")


def plan_row(delivery: DeliveryTable, row: ObjectRow) -> ItemPlan:
    """Where ``row`` goes, from its stable values only, so a retry resolves the same place
    (the MD5 is computed before the first attempt)."""
    assert row.content_md5 is not None, "the owner computes the MD5 before delivering"
    plan = plan_upload(
        delivery,
        row.project,
        row.object_id,
        row.filename,
        row.accepted_at,
        row.size_bytes,
        row.content_md5,
    )
    return evolve(plan, checksum=row.checksum)


def planner(deliveries: Mapping[str, DeliveryTable]) -> Callable[[ObjectRow], ItemPlan]:
    """The daemon's planner: each row by its project's delivery table."""
    return lambda row: plan_row(deliveries[row.project], row)


def located(row: ObjectRow) -> ItemPlan:
    """A delivered row as a plan to verify: where it went (as recorded at its delivery, even if
    the templates changed since) and what must be there."""
    assert row.remote_identifier is not None and row.remote_name is not None
    return ItemPlan(
        project=row.project,
        object_id=row.object_id,
        identifier=row.remote_identifier,
        remote_name=row.remote_name,
        size=row.size_bytes,
        content_md5=row.content_md5 or "",
        size_hint=row.size_bytes,
        headers=(),
        checksum=row.checksum,
    )
