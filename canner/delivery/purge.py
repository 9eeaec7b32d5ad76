"""Local purge after verified delivery: selection (pure), then deletion (blocking I/O).

A delivered object's payload may go once its sink has verified the copy (``verified_at``: IA's
listing shows the file with the right size and MD5 and a read-back of the bytes IA serves matches
the local copy, unless ``readback_bytes = 0``; a directory's copy hashes to the receipt) and its
project's retention has passed since delivery (``purge_after``).  Deleting is
idempotent: a file already gone counts as deleted.  The receipt always stays; the object's origin
and a delivery record are appended to the facts journal first, so a rebuilt index knows the purged
object and that it was delivered, and the origin's file in ``receipts/`` goes with the payload (an
archived object then leaves only its receipt for the ledger to delete).
"""

from __future__ import annotations

from canner import fs
from canner.delivery.index import ObjectRow
from canner.store.journal import JournalLog
from canner.store.receipts import (
    DeliveryRecord,
    Origin,
    ReceiptStore,
    delivery_journal_record,
    origin_journal_record,
)
from canner.store.uploads import UploadStore


def purge_is_due(row: ObjectRow, now: float) -> bool:
    """True when ``row`` may lose its local payload now."""
    return (
        row.state == "delivered"
        and row.verified_at is not None
        and row.purged_at is None
        and row.purge_after is not None
        and row.purge_after <= now
    )


def delivery_record(row: ObjectRow, now: float) -> DeliveryRecord:
    """What the receipts directory keeps about ``row``'s delivery once its payload is gone."""
    assert row.remote_identifier and row.remote_name and row.content_md5
    assert row.delivered_at is not None and row.verified_at is not None
    assert row.purge_after is not None
    return DeliveryRecord(
        row.remote_identifier,
        row.remote_name,
        row.content_md5,
        row.delivered_at,
        row.verified_at,
        row.purge_after,
        now,
    )


def delete_payload(
    uploads: UploadStore, receipts: ReceiptStore, journal: JournalLog, row: ObjectRow, now: float
) -> None:
    """Record the origin and the delivery in the facts journal (durably), then delete the
    artifact and its tus info sidecar, then the origin's file; missing is done.  (A tus temp
    file a crash left is the receiver's sweep's: no purge lists ``uploads/``, which holds every
    upload of the backlog.)"""
    object_id = row.object_id
    journal.append(
        [
            origin_journal_record(object_id, Origin(row.project, row.filename, row.downloader)),
            delivery_journal_record(object_id, delivery_record(row, now)),
        ]
    )
    uploads.remove(object_id)
    fs.fsync_dir(uploads.directory)
    # No fsync of receipts/ for this: a power cut that brings the file back brings back a
    # copy of what the journal holds, and the ledger deletes whatever an archived object left.
    receipts.origin_path(object_id).unlink(missing_ok=True)
