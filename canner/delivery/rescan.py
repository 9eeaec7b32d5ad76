"""Receipts on disk -> rows missing from the delivery index, in bounded batches.

``receipts/`` is the source of truth for what was accepted.  :class:`ReceiptRescan` is the one
rescan: canner-deliver runs it every hour, ``canner rebuild-index`` once.  :func:`receipt_batches`
walks the directory lazily, a batch of ids at a time, so a rescan of millions of receipts never
holds them all; the index says which ids of a batch it lacks (``known_among``) and
:func:`read_accepted` reads those: each receipt with its origin record (its file in ``receipts/``;
once the payload was purged, the facts journal; for a receipt whose origin record was never
written, or is torn (a power cut before its writeback, see ``canner.store.recovery``), the
upload's info sidecar, and the record is rewritten from it), for an object whose payload was
purged after delivery its delivery record and, for a released one, its release: both from the
facts journal (or a delivery side file in a data directory of version 0.1).  A damaged
file is reported by path and its object skipped (retried at the next rescan), never fatal.  A
damaged journal line costs only the record it held: its object, when its id is legible there,
comes back flagged for an operator (``needs_operator``, with the segment and line).  A payload
the journal records purged but that is still in ``uploads/`` (a crash between the record and
the unlink) comes back unpurged, so it is purged again; one whose data file is gone but whose
sidecar is left (a crash between the purge's two unlinks) comes back purged, its sidecar
removed.  The functions block (run them in a thread); :class:`ReceiptRescan` sends them through
a :class:`~canner.blocking.BlockingRunner`.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from attrs import define, evolve, field, frozen
from twisted.internet.defer import Deferred
from twisted.logger import Logger

from canner.blocking import BlockingRunner, result_now, run_inline
from canner.delivery.index import (
    AcceptedObject,
    ConnectionIndex,
    Index,
    configure_connection,
    insert_objects,
    known_among,
)
from canner.ids import ObjectIds
from canner.store.journal import RELEASE, Damage, Journal, JournalLookup, released_at_of
from canner.store.receipts import (
    DELIVERY,
    ORIGIN,
    DeliveryRecord,
    Origin,
    ReceiptStore,
    delivery_of,
    origin_of,
)
from canner.store.uploads import CorruptInfo, UploadStore

log = Logger()

BATCH = 500


@define
class Found:
    """What :func:`read_accepted` read: objects to index, and the files it had to skip."""

    objects: list[AcceptedObject] = field(factory=list)
    problems: list[str] = field(factory=list)


def receipt_batches(
    receipts: ReceiptStore, ids: ObjectIds, size: int = BATCH
) -> Iterator[list[str]]:
    """Valid object ids of every receipt on disk, ``size`` at a time (directory order)."""
    return batches_of(receipts.object_ids(), ids, size)


def batches_of(object_ids: Iterable[str], ids: ObjectIds, size: int = BATCH) -> Iterator[list[str]]:
    """The valid ids of ``object_ids``, ``size`` at a time, in their order."""
    batch: list[str] = []
    for object_id in object_ids:
        if ids.is_valid(object_id):
            batch.append(object_id)
            if len(batch) >= size:
                yield batch
                batch = []
    if batch:
        yield batch


def _origin(
    receipts: ReceiptStore, uploads: UploadStore, journal: JournalLookup, object_id: str
) -> Origin | None:
    origin = receipts.read_origin(object_id) or origin_of(journal.get(object_id, ORIGIN))
    if origin is not None:
        return origin
    try:
        info = uploads.read_info(object_id)
    except CorruptInfo:
        info = None
    if info is None:
        return None
    origin = info.origin
    if receipts.origin_torn(object_id):
        # Acceptance writes the record without an fsync of its own; a power cut came before
        # the kernel wrote it back (canner.store.recovery).  The sidecar has the same origin.
        log.info(
            "{object_id}: its origin record was torn by an unclean stop: rewritten from {path}",
            object_id=object_id,
            path=str(uploads.info_path(object_id)),
        )
    receipts.record_origin(object_id, origin)
    return origin


def _after_cut_purge(
    uploads: UploadStore, object_id: str, delivery: DeliveryRecord
) -> DeliveryRecord:
    """The delivery record of an object the journal records purged, as its row should say it,
    given what a crash inside the purge may have left in ``uploads/``.

    The purge unlinks the data file, then the sidecar.  A data file still here (a crash between
    the record and the first unlink) is a payload: the row comes back unpurged, so it is purged
    again, idempotently.  A sidecar alone (a crash between the two unlinks) is no payload: the
    row comes back purged at once and the sidecar is removed, finishing that purge (nothing else
    removes a sidecar whose upload has a receipt).  The origin is durable elsewhere by then: the
    purge journals it first, and :func:`_origin` records one it read from the sidecar."""
    data = uploads.data_path(object_id)
    if data.exists():
        log.warn(
            "{object_id}: the journal records its payload purged, but {path} is still on"
            " disk: it will be purged again",
            object_id=object_id,
            path=str(data),
        )
        return evolve(delivery, purged_at=None)
    info = uploads.info_path(object_id)
    if info.exists():
        log.info(
            "{object_id}: the journal records its payload purged and its data file is gone:"
            " removing {path}, which the cut purge left",
            object_id=object_id,
            path=str(info),
        )
        uploads.remove(object_id)
    return delivery


def read_accepted(
    receipts: ReceiptStore, uploads: UploadStore, journal: JournalLookup, object_ids: list[str]
) -> Found:
    """Read the receipts of ``object_ids`` with their side files and journal records, for
    insertion in the index."""
    found = Found()
    for object_id in object_ids:
        step: Path | str = receipts.receipt_path(object_id)
        damage = None
        try:
            receipt = receipts.read(object_id)
            if receipt is None:
                continue  # vanished since it was listed
            step = receipts.origin_path(object_id)
            origin = _origin(receipts, uploads, journal, object_id)
            step = "the journal"
            delivery = delivery_of(journal.get(object_id, DELIVERY))
            if delivery is None:  # a data directory of version 0.1: a side file
                step = receipts.delivery_path(object_id)
                delivery = receipts.read_delivery(object_id)
            step = "the journal"
            released_at = released_at_of(journal.get(object_id, RELEASE))
            damage = journal.damage_of(object_id)
        except (OSError, ValueError, KeyError, TypeError) as e:
            problem = f"{step}: {e}"
            log.error("rescan skipped {object_id}: {error}", object_id=object_id, error=problem)
            found.problems.append(problem)
            continue
        if origin is None:
            state = "unreadable" if receipts.origin_path(object_id).exists() else "missing"
            problem = (
                f"{receipts.origin_path(object_id)}: {state}, the journal has no origin record"
                " either, and no info sidecar names the project"
                + ("" if damage is None else f" (damaged: {damage.describe()})")
            )
            log.error("rescan skipped {object_id}: {error}", object_id=object_id, error=problem)
            found.problems.append(problem)
            continue
        if delivery is not None and delivery.purged_at is not None:
            delivery = _after_cut_purge(uploads, object_id, delivery)
        flag = None
        if damage is not None:
            flag = (
                f"a journal record of it could not be read ({damage.describe()}): its delivery,"
                " purge or release may be missing from this row"
            )
        found.objects.append(AcceptedObject.of(receipt, origin, delivery, released_at, flag))
    return found


def not_archived(archived: Callable[[str], bool], object_ids: list[str]) -> list[str]:
    """The ids of ``object_ids`` whose records no verified ledger owns (blocking)."""
    return [oid for oid in object_ids if not archived(oid)]


@frozen
class Rescanned:
    """What one :meth:`ReceiptRescan.run` did: rows ``added``, receipts ``read`` for insertion
    (those not added appeared in the index meanwhile), the files it skipped (``problems``, tried
    again at the next rescan) and the damaged journal lines it met."""

    added: int
    read: int
    problems: list[str]
    damage: list[Damage]


def _always() -> bool:
    return True


def rescan_now(
    path: Path,
    *,
    receipts: ReceiptStore,
    uploads: UploadStore,
    journal: Journal,
    skip: Callable[[str], bool],
    object_ids: ObjectIds,
    now: Callable[[], float],
    listed: Iterable[str] | None = None,
) -> Rescanned:
    """One :class:`ReceiptRescan` pass run at once on its own connection to the index at
    ``path``, for a caller without a reactor (blocking); ``skip`` as its ``archived``,
    ``listed`` as its own."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        configure_connection(conn)
        rescan = ReceiptRescan(
            index=ConnectionIndex(conn),
            receipts=receipts,
            uploads=uploads,
            journal=journal,
            archived=skip,
            object_ids=object_ids,
            run=run_inline,
            now=now,
            listed=listed,
        )
        return result_now(rescan.run())
    finally:
        conn.close()


@define(eq=False, kw_only=True)
class ReceiptRescan:
    """Inserts into the index every receipt on disk that it lacks, but for those whose records
    a verified ledger owns (``archived``): they are never indexed again.

    One bounded batch at a time: the directory walk advances through ``run`` (blocking work),
    the index says which ids of the batch it lacks, and only those are read and inserted (one
    transaction per batch).  ``keep_going`` is asked before each batch: once false (the daemon
    stops) the pass ends there, and the next one starts again from the beginning.  Never run it
    while a ledger deletes records: it could insert them again.

    A pass lists every receipt, so with ``pace`` it is paced: after a batch that found nothing
    to add (what is at rest), the pass waits for the Deferred ``pace(seconds)`` returns, given
    the seconds that batch took, before the next one; batches that add rows (a lost index
    being rebuilt: what changed) go on at once.

    ``listed``, when given, stands for the listing of ``receipts/``: the ids to check, from a
    caller that listed the directory already (the receiver's start-up, which checks only the
    objects that have an origin record); an id without a receipt on disk is skipped.
    """

    _index: Index
    _receipts: ReceiptStore
    _uploads: UploadStore
    _journal: Journal
    _archived: Callable[[str], bool]
    _object_ids: ObjectIds
    _run: BlockingRunner
    _now: Callable[[], float]
    _keep_going: Callable[[], bool] = _always
    _batch: int = BATCH
    _pace: Callable[[float], Deferred[None]] | None = None
    _listed: Iterable[str] | None = None

    def run(self) -> Deferred[Rescanned]:
        """One pass over ``receipts/``; logs how many rows it added, when any."""
        return Deferred.fromCoroutine(self._rescan())

    async def _rescan(self) -> Rescanned:
        if self._listed is None:
            batches = receipt_batches(self._receipts, self._object_ids, self._batch)
        else:
            batches = batches_of(self._listed, self._object_ids, self._batch)
        journal = JournalLookup(self._journal)
        added = read = 0
        problems: list[str] = []
        try:
            while self._keep_going():
                started = self._now()
                batch = await self._run(next, batches, None)
                if batch is None:
                    break
                known = await self._index.run(known_among, batch)
                if self._pace is not None and len(known) == len(batch):
                    await self._pace(max(0.0, self._now() - started))
                    continue
                missing = [oid for oid in batch if oid not in known]
                if missing:
                    missing = await self._run(not_archived, self._archived, missing)
                if missing:
                    found = await self._run(
                        read_accepted, self._receipts, self._uploads, journal, missing
                    )
                    problems += found.problems
                    if found.objects:
                        read += len(found.objects)
                        added += await self._index.run(insert_objects, found.objects, self._now())
            damage = list(journal.damage)
        finally:
            await self._run(journal.close)
        if added:
            log.info("rescan added {count} receipts to the delivery index", count=added)
        return Rescanned(added, read, problems, damage)
