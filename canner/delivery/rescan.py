"""Receipts on disk -> rows missing from the delivery index, in bounded batches.

``receipts/`` is the source of truth for what was accepted.  :func:`receipt_batches` walks the
directory lazily, a batch of ids at a time, so a rescan of millions of receipts never holds them
all; the caller asks the index which ids of a batch it lacks (``known_among``) and
:func:`read_accepted` reads those: each receipt with its origin record (its file in ``receipts/``;
once the payload was purged, the facts journal; for a receipt whose origin record was never
written, the upload's info sidecar), for an object whose payload was purged after delivery its
delivery record and, for a released one, its release: both from the facts journal (or a
delivery side file in a data directory of version 0.1).  A damaged
file is reported by path and its object skipped (retried at the next rescan), never fatal.  A
damaged journal line costs only the record it held: its object, when its id is legible there,
comes back flagged for an operator (``needs_operator``, with the segment and line).  A payload
the journal records purged but that is still in ``uploads/`` (a crash between the record and
the unlink) comes back unpurged, so it is purged again.  Blocking; run in a thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from attrs import define, evolve, field
from twisted.logger import Logger

from canner.delivery.index import AcceptedObject
from canner.ids import ObjectIds
from canner.journal import JournalLookup
from canner.receipts import DELIVERY, ORIGIN, Origin, ReceiptStore, delivery_of, origin_of
from canner.releases import RELEASE, released_at_of
from canner.tus.store import CorruptInfo, UploadStore

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
    batch: list[str] = []
    for object_id in receipts.object_ids():
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
    origin = Origin(info.project, info.filename)
    receipts.record_origin(object_id, origin)
    return origin


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
            problem = (
                f"{receipts.origin_path(object_id)}: missing, the journal has no origin record"
                " either, and no info sidecar names the project"
                + ("" if damage is None else f" (damaged: {damage.describe()})")
            )
            log.error("rescan skipped {object_id}: {error}", object_id=object_id, error=problem)
            found.problems.append(problem)
            continue
        if delivery is not None and delivery.purged_at is not None and uploads.present(object_id):
            # A crash between the purge's record and its unlink: the payload is still here, and
            # only a row that says so gets it purged (again, idempotently).
            log.warn(
                "{object_id}: the journal records its payload purged, but {path} is still on"
                " disk: it will be purged again",
                object_id=object_id,
                path=str(uploads.data_path(object_id)),
            )
            delivery = evolve(delivery, purged_at=None)
        flag = None
        if damage is not None:
            flag = (
                f"a journal record of it could not be read ({damage.describe()}): its delivery,"
                " purge or release may be missing from this row"
            )
        found.objects.append(AcceptedObject.of(receipt, origin, delivery, released_at, flag))
    return found
